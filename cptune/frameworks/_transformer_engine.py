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
from cptune.frameworks._framework import Framework, Spelling, heads_refusal
from cptune.workload import AttentionShape


def comm_type(config: CPConfig) -> str:
    """TransformerEngine's ``cp_comm_type`` for ``config`` (over more than one rank)."""
    if config.strategy == "ulysses":
        return "a2a"
    if config.head_group > 1:
        return "a2a+p2p"
    return "p2p" if config.strategy == "ring" else "all_gather"


def te_refusal(framework: str, shape: AttentionShape, config: CPConfig) -> str | None:
    """What TransformerEngine's context parallelism (and so Megatron's) cannot run."""
    if config.strategy == "allgather_kv" and config.head_group > 1:
        return (f"{framework}'s cp_comm_type has no Ulysses x AllGather-KV ('a2a+p2p', Ulysses x Ring, "
                f"is its one hierarchy)")
    return heads_refusal(shape, config.head_group, framework)


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

    def spell_context(self, shape: AttentionShape, config: CPConfig) -> Spelling:
        kind = comm_type(config)
        u, c, n = config.head_group, config.context_degree, config.ranks
        mask = "causal" if shape.causal else "no_mask"
        lines = [
            "import torch, torch.distributed as dist",
            "from transformer_engine.pytorch import DotProductAttention",
            'dist.init_process_group("nccl")',
            "rank = dist.get_rank()",
            f"attention = DotProductAttention(num_attention_heads={shape.heads}, "
            f"kv_channels={shape.head_dim}, "
            f'num_gqa_groups={shape.kv_heads}, attn_mask_type="{mask}")',
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
        settings: dict[str, object] = {"cp_comm_type": kind, "cp_global_ranks": list(range(n))}
        if kind == "a2a+p2p":
            settings["cp_group"] = [f"a2a group of {u}", f"p2p group of {c}"]
        return Spelling(settings, "\n".join(lines), f"torchrun --nproc-per-node={n} <your program>",
                        (length_need(config),))
