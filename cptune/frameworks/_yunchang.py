"""yunchang 0.6.4: ``set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size,
use_ulysses_low=True)`` and ``LongContextAttention(ring_impl_type=...)`` (yunchang/globals.py,
yunchang/hybrid/attn_layer.py at feifeibear/long-context-attention@8aa888f0). With
``use_ulysses_low=True`` a Ulysses group is consecutive ranks, as in cptune; its "zigzag" ring
cuts the sequence into 2 x ring chunks, ring rank g holding chunks g and 2r - 1 - g split among
its Ulysses members (``zigzag_extract_local``): cptune's causal layout. No AllGather-KV.
"""

from __future__ import annotations

from cptune.config import CPConfig
from cptune.frameworks._framework import SET_DEVICE, Framework, Spelling, heads_refusal, torchrun
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
        return usp_refusal("yunchang", shape, config)

    def spell_context(self, shape: AttentionShape, config: CPConfig, seq_len: int | None,
                      per_node: int | None) -> Spelling:
        ring_impl = "zigzag" if shape.causal else "basic"
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
        if shape.causal:
            needs.append(f"each rank's tokens as yunchang's zigzag_extract_local(x, rank, world_size, "
                         f"rd={config.context_degree}, ud={config.head_group}) cuts them")
        return Spelling(settings, code, torchrun(config.ranks, per_node, "<your program>"),
                        tuple(needs))
