"""TransformerEngine 2.20.2: ``DotProductAttention.set_context_parallel_group(cp_group,
cp_global_ranks, cp_stream, cp_comm_type)`` (transformer_engine/pytorch/attention/
dot_product_attention/dot_product_attention.py). ``cp_comm_type`` "p2p" is Ring, "all_gather"
AllGather-KV, "a2a" Ulysses, "a2a+p2p" Ulysses x Ring with ``cp_group = [a2a_group, p2p_group]``;
there is no Ulysses x AllGather. ``cp_global_ranks[p2p_rank * a2a_size + a2a_rank]``
(context_parallel.py) puts an a2a group on consecutive ranks, as in cptune. Its
``DUAL_CHUNK_SWAP`` split is cptune's zigzag: 2 x cp chunks, rank i holding i and 2cp - 1 - i.
"""

from __future__ import annotations

from cptune.config import CPConfig
from cptune.frameworks._framework import SET_DEVICE, Framework, Spelling, heads_refusal, torchrun
from cptune.workload import AttentionShape


def comm_type(config: CPConfig) -> str:
    """TransformerEngine's ``cp_comm_type`` for ``config`` (over more than one rank)."""
    if config.strategy == "ulysses":
        return "a2a"
    if config.head_group > 1:
        return "a2a+p2p"
    return "p2p" if config.strategy == "ring" else "all_gather"


def te_refusal(framework: str, shape: AttentionShape, config: CPConfig) -> str | None:
    """What TransformerEngine's context parallelism (and so Megatron's) cannot run. Its fused
    backend, which qkv_format "bshd"/"sbhd" with context parallelism runs on, is disabled for
    "a2a" and "a2a+p2p" where the head or KV head count is odd (attention/dot_product_attention/
    utils.py): cptune refuses those rather than export what falls back or fails at run time."""
    if config.strategy == "allgather_kv" and config.head_group > 1:
        return (f"{framework}'s cp_comm_type has no Ulysses x AllGather-KV ('a2a+p2p', Ulysses x Ring, "
                f"is its one hierarchy)")
    if config.head_group > 1 and (shape.heads % 2 or shape.kv_heads % 2):
        return (f"TransformerEngine disables its fused attention for cp_comm_type '{comm_type(config)}' "
                f"with an odd head count ({shape.heads} heads, {shape.kv_heads} KV heads: both must divide "
                f"by 2)")
    return heads_refusal(shape, config.head_group, framework)


def length_refusal(framework: str, config: CPConfig, seq_len: int) -> str | None:
    """Why TransformerEngine (and Megatron) cannot take ``seq_len`` tokens on ``config``'s ranks:
    it cuts every sequence into 2 x cp chunks and pads none (Megatron asserts it at start-up)."""
    chunks = 2 * config.ranks
    if seq_len % chunks:
        return (f"{framework} cuts a sequence into 2 x {config.ranks} chunks: {seq_len} tokens is not a "
                f"multiple of {chunks} (pad it to {-(-seq_len // chunks) * chunks} yourself with a padding "
                f"mask, or tune that length)")
    return None


def length_need(config: CPConfig, what: str = "every sequence") -> str:
    """The length ``what`` must have: TransformerEngine cuts it into 2 x cp chunks."""
    return (f"{what} a multiple of {2 * config.ranks} tokens long (2 x {config.ranks} chunks, "
            f"rank i holding chunks i and {2 * config.ranks - 1} - i)")


class TransformerEngine(Framework):
    name = "transformer-engine"
    pinned = "transformer-engine 2.20.2"
    form = "python"

    def context_refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        return te_refusal("TransformerEngine", shape, config)

    def placed_refusal(self, shape: AttentionShape, config: CPConfig, seq_len: int,
                       per_node: int | None) -> str | None:
        return length_refusal("TransformerEngine", config, seq_len)

    def spell_context(self, shape: AttentionShape, config: CPConfig, seq_len: int | None,
                      per_node: int | None) -> Spelling:
        kind = comm_type(config)
        u, c, n = config.head_group, config.context_degree, config.ranks
        mask = "causal" if shape.causal else "no_mask"
        lines = [
            "import torch, torch.distributed as dist",
            "from transformer_engine.pytorch import DotProductAttention",
            *SET_DEVICE,
            'dist.init_process_group("nccl")',
            "rank = dist.get_rank()",
            f"attention = DotProductAttention(num_attention_heads={shape.heads}, "
            f"kv_channels={shape.head_dim}, "
            f'num_gqa_groups={shape.kv_heads}, attn_mask_type="{mask}", qkv_format="bshd")',
        ]
        if kind == "a2a+p2p":  # every rank creates every group, in the same order
            lines += [
                f"a2a = [dist.new_group([g * {u} + j for j in range({u})]) for g in range({c})]",
                f"p2p = [dist.new_group([g * {u} + j for g in range({c})]) for j in range({u})]",
                f"cp_group = [a2a[rank // {u}], p2p[rank % {u}]]",
            ]
        else:
            lines.append(f"cp_group = dist.new_group(list(range({n})))")
        lines.append(f"attention.set_context_parallel_group(cp_group, list(range({n})), torch.cuda.Stream(), "
                     f'cp_comm_type="{kind}")')
        settings: dict[str, object] = {"cp_comm_type": kind, "cp_global_ranks": list(range(n)),
                                       "qkv_format": "bshd"}
        if kind == "a2a+p2p":
            settings["cp_group"] = [f"a2a group of {u}", f"p2p group of {c}"]
        return Spelling(settings, "\n".join(lines), torchrun(n, per_node, "<your program>"),
                        (length_need(config), "q, k and v as [batch, sequence, heads, head_dim] (qkv_format "
                                              "'bshd'; the default is 'sbhd')"))
