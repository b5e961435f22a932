"""yunchang 0.6.4: ``set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size,
use_ulysses_low=True)`` and ``LongContextAttention(ring_impl_type=...)`` (yunchang/globals.py,
yunchang/hybrid/attn_layer.py at feifeibear/long-context-attention@8aa888f0). With
``use_ulysses_low=True`` a Ulysses group is consecutive ranks, as in cptune; its "zigzag" ring
cuts the sequence into 2 x ring chunks, ring rank g holding chunks g and 2r - 1 - g split among
its Ulysses members (``zigzag_extract_local``): cptune's causal layout. No AllGather-KV.
Its ring variants (``RING_IMPL_DICT``, yunchang/hybrid/utils.py) are cptune's layouts under a
causal mask: "basic" contiguous, "zigzag" zigzag, "strip" striped (``stripe_extract_local``
deals tokens round-robin one at a time); "zigzag" and "strip" assert causal attention. Every ring
passes ``window_size`` unchanged into each step's call (ring/ring_flash_attn.py), which attends the
wrong keys for a window once K/V moves, so a window runs on Ulysses alone; ``LongContextAttention``
takes no ``cu_seqlens`` (packed documents) and no joint text (it is sharded with the image).
"""

from __future__ import annotations

from cptune.config import CPConfig
from cptune.frameworks._framework import SET_DEVICE, Framework, Runs, Spelling, heads_refusal, torchrun
from cptune.frameworks._masks import as_layout
from cptune.workload import AttentionShape


def usp_refusal(framework: str, shape: AttentionShape, config: CPConfig) -> str | None:
    """What a framework built on yunchang's Unified Sequence Parallelism (Ulysses x Ring, no
    AllGather-KV) cannot run."""
    if config.strategy == "allgather_kv" and config.context_degree > 1:
        return f"{framework} has no AllGather-KV: its context split is a Ring"
    return heads_refusal(shape, config.head_group, framework)


class Yunchang(Framework):
    name = "yunchang"
    pinned = "yunchang 0.6.4"
    form = "python"

    def context_refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        if shape.documents:
            return "yunchang's LongContextAttention takes no cu_seqlens: no packed documents"
        if shape.sinks:
            return "yunchang's LongContextAttention has no attention sinks (its window_size is flash-attn's)"
        if shape.window and config.context_degree > 1:
            return ("yunchang's rings pass window_size unchanged into every step's call "
                    "(ring_flash_attn.py), which attends the wrong keys once K/V moves: a window runs on "
                    "Ulysses alone")
        return usp_refusal("yunchang", shape, config)

    def runs(self, shape: AttentionShape, config: CPConfig, seq_len: int) -> Runs:
        if config.context_degree > 1 and config.layout == "replicated_text":
            return as_layout(shape, config, seq_len, None,
                             "yunchang's LongContextAttention takes no joint text: it is sharded with the "
                             "image")
        return Runs(config)

    def ring_impl(self, shape: AttentionShape, config: CPConfig) -> str:
        """The ``ring_impl_type`` that deals out ``config``'s layout: under a causal mask
        "zigzag" (the default), "basic" for contiguous blocks, "strip" for stripes; "basic"
        otherwise (every query sees every key: the layout does not matter)."""
        if not shape.causal:
            return "basic"
        return {"contiguous": "basic", "striped": "strip"}.get(config.layout or "zigzag", "zigzag")

    def spell_context(self, shape: AttentionShape, config: CPConfig, seq_len: int | None,
                      per_node: int | None) -> Spelling:
        ring_impl = self.ring_impl(shape, config)
        settings = {"sp_ulysses_degree": config.head_group, "sp_ring_degree": config.context_degree,
                    "use_ulysses_low": True, "ring_impl_type": ring_impl}
        code = (
            "import torch, torch.distributed as dist\n"
            "from yunchang import LongContextAttention, set_seq_parallel_pg\n"
            + "".join(f"{line}\n" for line in SET_DEVICE) +
            'dist.init_process_group("nccl")\n'
            f"set_seq_parallel_pg(sp_ulysses_degree={config.head_group}, "
            f"sp_ring_degree={config.context_degree}, "
            "rank=dist.get_rank(), world_size=dist.get_world_size(), use_ulysses_low=True)\n"
            f'attention = LongContextAttention(ring_impl_type="{ring_impl}")\n'
            f"out = attention(q, k, v, causal={shape.causal})  # q, k, v: this rank's tokens"
        )
        needs = []
        extract = {"zigzag": "zigzag_extract_local", "strip": "stripe_extract_local"}.get(ring_impl)
        if extract is not None:
            needs.append(f"each rank's tokens as yunchang's {extract}(x, rank, world_size, "
                         f"rd={config.context_degree}, ud={config.head_group}) cuts them")
        if ring_impl == "strip":
            needs.append("yunchang's stripes are one token wide; priced as cptune's striped layout, whose "
                         "stripes are up to 256 tokens")
        return Spelling(settings, code, torchrun(config.ranks, per_node, "<your program>"),
                        tuple(needs))
