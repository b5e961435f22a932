"""TransformerEngine 2.20.2: ``DotProductAttention.set_context_parallel_group(cp_group,
cp_global_ranks, cp_stream, cp_comm_type)`` (transformer_engine/pytorch/attention/
dot_product_attention/dot_product_attention.py). ``cp_comm_type`` "p2p" is Ring, "all_gather"
AllGather-KV, "a2a" Ulysses, "a2a+p2p" Ulysses x Ring with ``cp_group = [a2a_group, p2p_group]``;
there is no Ulysses x AllGather. ``cp_global_ranks[p2p_rank * a2a_size + a2a_rank]``
(context_parallel.py) puts an a2a group on consecutive ranks, as in cptune. Its
``DUAL_CHUNK_SWAP`` split is cptune's zigzag: 2 x cp chunks, rank i holding i and 2cp - 1 - i;
of packed documents (``qkv_format="thd"`` with ``cu_seqlens`` and ``cu_seqlens_padded``, every
comm type) each document on its own: cptune's doc_zigzag, every document padded to a multiple
of 2 x cp. A sliding window runs with "a2a" and "all_gather" only (context_parallel.py,
``attn_forward_func_with_cp``); its non-vanilla ``softmax_type`` is a learned offset, not sink
tokens.
"""

from __future__ import annotations

from cptune.config import CPConfig
from cptune.frameworks._framework import SET_DEVICE, Framework, Runs, Spelling, heads_refusal, torchrun
from cptune.frameworks._masks import as_layout, packs_documents, thd
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
    utils.py): cptune refuses those rather than export what falls back or fails at run time.
    A sliding window it runs with "a2a" and "all_gather" only; attention sinks (a window's first
    tokens every query sees) it has none of."""
    if shape.sinks:
        return (f"{framework} has no attention sinks: TransformerEngine's softmax_type 'off-by-one' or "
                f"'learnable' adds a softmax offset, not {shape.sinks} tokens every query sees")
    if shape.window and config.strategy == "ring" and config.context_degree > 1:
        return (f"TransformerEngine's cp_comm_type '{comm_type(config)}' refuses a sliding window ('Context "
                f"parallelism does not support sliding window attention with cp_comm_type'): only 'a2a' and "
                f"'all_gather' take one")
    if config.strategy == "allgather_kv" and config.head_group > 1:
        return (f"{framework}'s cp_comm_type has no Ulysses x AllGather-KV ('a2a+p2p', Ulysses x Ring, "
                f"is its one hierarchy)")
    if config.head_group > 1 and (shape.heads % 2 or shape.kv_heads % 2):
        return (f"TransformerEngine disables its fused attention for cp_comm_type '{comm_type(config)}' "
                f"with an odd head count ({shape.heads} heads, {shape.kv_heads} KV heads: both must divide "
                f"by 2)")
    return heads_refusal(shape, config.head_group, framework)


def te_runs(shape: AttentionShape, config: CPConfig, seq_len: int) -> Runs:
    """What TransformerEngine runs for ``config``: its DUAL_CHUNK_SWAP split, cptune's zigzag
    (under a causal mask or a window, where the split matters), of packed documents each
    document zigzagged on its own (THD: cptune's doc_zigzag), joint text sharded with the image
    (TransformerEngine has no replicated text)."""
    if config.context_degree == 1:
        return Runs(config)
    if packs_documents(shape, seq_len):
        return as_layout(shape, config, seq_len, "doc_zigzag",
                         "TransformerEngine's THD format: each document cut into 2 x cp chunks, rank i "
                         "holding chunks i and 2cp - 1 - i of every document (cptune's per-document zigzag)")
    if shape.causal or shape.window:
        return as_layout(shape, config, seq_len, "zigzag",
                         "TransformerEngine's DUAL_CHUNK_SWAP: 2 x cp chunks, rank i holding i and "
                         "2cp - 1 - i (cptune's zigzag)")
    if config.layout == "replicated_text":
        return as_layout(shape, config, seq_len, None,
                         "TransformerEngine attends joint text as any token: sharded with the image")
    return Runs(config)


def length_refusal(framework: str, config: CPConfig, seq_len: int, shape: AttentionShape | None = None
                   ) -> str | None:
    """Why TransformerEngine (and Megatron) cannot take ``seq_len`` tokens on ``config``'s ranks:
    it cuts every sequence into 2 x cp chunks and pads none (Megatron asserts it at start-up);
    packed documents (THD) are padded one by one instead (``thd``), so any length packs."""
    if shape is not None and packs_documents(shape, seq_len):
        return None
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
        return length_refusal("TransformerEngine", config, seq_len, shape)

    def runs(self, shape: AttentionShape, config: CPConfig, seq_len: int) -> Runs:
        return te_runs(shape, config, seq_len)

    def spell_context(self, shape: AttentionShape, config: CPConfig, seq_len: int | None,
                      per_node: int | None) -> Spelling:
        kind = comm_type(config)
        u, c, n = config.head_group, config.context_degree, config.ranks
        documents = seq_len is not None and packs_documents(shape, seq_len)
        mask = ("padding_causal" if shape.causal else "padding") if documents else (
            "causal" if shape.causal else "no_mask")
        qkv_format = "thd" if documents else "bshd"
        window = f", window_size=({shape.window[0]}, {shape.window[1]})" if shape.window else ""
        lines = [
            "import torch, torch.distributed as dist",
            "from transformer_engine.pytorch import DotProductAttention",
            *SET_DEVICE,
            'dist.init_process_group("nccl")',
            "rank = dist.get_rank()",
            f"attention = DotProductAttention(num_attention_heads={shape.heads}, "
            f"kv_channels={shape.head_dim}, "
            f'num_gqa_groups={shape.kv_heads}, attn_mask_type="{mask}", qkv_format="{qkv_format}"{window})',
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
                                       "qkv_format": qkv_format}
        if kind == "a2a+p2p":
            settings["cp_group"] = [f"a2a group of {u}", f"p2p group of {c}"]
        if shape.window:
            settings["window_size"] = tuple(shape.window)
        needs: tuple[str, ...] = (length_need(config), "q, k and v as [batch, sequence, heads, head_dim] "
                                                       "(qkv_format 'bshd'; the default is 'sbhd')")
        if documents and seq_len is not None:
            cu, cu_padded, cost = thd(shape, config, seq_len)
            longest = max(b - a for a, b in zip(cu_padded, cu_padded[1:], strict=False))
            settings |= {"attn_mask_type": mask, "cu_seqlens": cu, "cu_seqlens_padded": cu_padded}
            lines.append(f"cu_seqlens = torch.tensor({cu}, dtype=torch.int32, device='cuda')")
            lines.append(f"cu_seqlens_padded = torch.tensor({cu_padded}, dtype=torch.int32, device='cuda')")
            lines.append("out = attention(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, "
                         "cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded, "
                         f"max_seqlen_q={longest}, max_seqlen_kv={longest})")
            needs = (cost, "q, k and v as [tokens, heads, head_dim] (qkv_format 'thd'), this rank's part of "
                           "every padded document as transformer_engine.pytorch.attention."
                           "dot_product_attention.context_parallel.get_thd_partitioned_indices cuts it "
                           "(its padding tokens zeroed)")
        return Spelling(settings, "\n".join(lines), torchrun(n, per_node, "<your program>"), needs)
