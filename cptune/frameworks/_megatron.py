"""Megatron-Core 0.19.2: ``--context-parallel-size``, ``--cp-comm-type`` and
``--hierarchical-context-parallel-sizes`` (megatron/training/arguments.py;
``ModelParallelConfig.context_parallel_size``, ``hierarchical_context_parallel_sizes``,
``TransformerConfig.cp_comm_type``), handed to TransformerEngine unchanged. Its hierarchical
level 0 (the a2a size) is consecutive ranks, level 1 strided by it (parallel_state.py,
``create_hierarchical_groups``), as in cptune. "a2a+p2p" without the sizes silently turns
context parallelism off in a config built from Python: the export always names them. Packed
documents reach TransformerEngine as ``PackedSeqParams(qkv_format="thd", cu_seqlens_q,
cu_seqlens_q_padded, ...)`` (megatron/core/packed_seq_params.py), each document zigzagged on its
own ("Each document length must be divisible by 2 * cp_size", core/utils.py); a window is
``--window-size L,R`` (TransformerConfig.window_size).
"""

from __future__ import annotations

from cptune.config import CPConfig
from cptune.frameworks._framework import Framework, Runs, Spelling, flags, torchrun
from cptune.frameworks._masks import packs_documents, thd
from cptune.frameworks._transformer_engine import comm_type, length_need, length_refusal, te_refusal, te_runs
from cptune.workload import AttentionShape

_FLAGS = {"context_parallel_size": "--context-parallel-size", "cp_comm_type": "--cp-comm-type",
          "hierarchical_context_parallel_sizes": "--hierarchical-context-parallel-sizes",
          "window_size": "--window-size"}


class Megatron(Framework):
    name = "megatron"
    pinned = "megatron-core 0.19.2"
    form = "flags"

    def context_refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        return te_refusal("Megatron", shape, config)

    def placed_refusal(self, shape: AttentionShape, config: CPConfig, seq_len: int,
                       per_node: int | None) -> str | None:
        return length_refusal("Megatron", config, seq_len, shape)

    def runs(self, shape: AttentionShape, config: CPConfig, seq_len: int) -> Runs:
        return te_runs(shape, config, seq_len)

    def spell_context(self, shape: AttentionShape, config: CPConfig, seq_len: int | None,
                      per_node: int | None) -> Spelling:
        kind = comm_type(config)
        settings: dict[str, object] = {"context_parallel_size": config.ranks, "cp_comm_type": kind}
        if kind == "a2a+p2p":
            settings["hierarchical_context_parallel_sizes"] = [config.head_group, config.context_degree]
        if shape.window:
            settings["window_size"] = f"{shape.window[0]},{shape.window[1]}"
        line = flags(settings, _FLAGS)
        tp = ("--tensor-model-parallel-size 1 on these ranks (Megatron's order is tp-cp-ep-dp-pp: "
              "tensor-parallel ranks are innermost and would stride the context groups)")
        needs: tuple[str, ...] = (length_need(config, "--seq-length"), tp)
        if seq_len is not None and packs_documents(shape, seq_len) and config.ranks > 1:
            cu, cu_padded, cost = thd(shape, config, seq_len)
            settings["packed_seq_params"] = {"qkv_format": "thd", "cu_seqlens_q": cu,
                                             "cu_seqlens_q_padded": cu_padded}
            needs = (cost, tp,
                     "each batch's PackedSeqParams(qkv_format='thd', cu_seqlens_q = cu_seqlens_kv and "
                     "cu_seqlens_q_padded = cu_seqlens_kv_padded as settings['packed_seq_params'] gives "
                     "them) and "
                     "get_batch_on_this_cp_rank(batch): each document zigzagged on its own")
        return Spelling(settings, line, torchrun(config.ranks, per_node, f"<pretrain script> {line}"), needs)
