"""Megatron-Core 0.19.2: ``--context-parallel-size``, ``--cp-comm-type`` and
``--hierarchical-context-parallel-sizes`` (megatron/training/arguments.py;
``ModelParallelConfig.context_parallel_size``, ``hierarchical_context_parallel_sizes``,
``TransformerConfig.cp_comm_type``), handed to TransformerEngine unchanged. Its hierarchical
level 0 (the a2a size) is consecutive ranks, level 1 strided by it (parallel_state.py,
``create_hierarchical_groups``), as in cptune. "a2a+p2p" without the sizes silently turns
context parallelism off in a config built from Python: the export always names them.
"""

from __future__ import annotations

from cptune.config import CPConfig
from cptune.frameworks._framework import Framework, Spelling, flags, torchrun
from cptune.frameworks._transformer_engine import comm_type, length_need, length_refusal, te_refusal
from cptune.workload import AttentionShape

_FLAGS = {"context_parallel_size": "--context-parallel-size", "cp_comm_type": "--cp-comm-type",
          "hierarchical_context_parallel_sizes": "--hierarchical-context-parallel-sizes"}


class Megatron(Framework):
    name = "megatron"
    pinned = "megatron-core 0.19.2"
    form = "flags"

    def context_refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        return te_refusal("Megatron", shape, config)

    def placed_refusal(self, shape: AttentionShape, config: CPConfig, seq_len: int,
                       per_node: int | None) -> str | None:
        return length_refusal("Megatron", config, seq_len)

    def spell_context(self, shape: AttentionShape, config: CPConfig, seq_len: int | None,
                      per_node: int | None) -> Spelling:
        kind = comm_type(config)
        settings: dict[str, object] = {"context_parallel_size": config.ranks, "cp_comm_type": kind}
        if kind == "a2a+p2p":
            settings["hierarchical_context_parallel_sizes"] = [config.head_group, config.context_degree]
        line = flags(settings, _FLAGS)
        return Spelling(settings, line, torchrun(config.ranks, per_node, f"<pretrain script> {line}"),
                        (length_need(config, "--seq-length"),
                         "--tensor-model-parallel-size 1 on these ranks (Megatron's order is tp-cp-ep-dp-pp: "
                         "tensor-parallel ranks are innermost and would stride the context groups)"))
