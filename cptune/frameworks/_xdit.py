"""xDiT (xfuser 0.7.0): ``--ulysses_degree``, ``--ring_degree`` (xfuser/config/args.py), run by
yunchang's ``set_seq_parallel_pg`` with ``use_ulysses_low=True`` (xfuser/core/distributed/
parallel_state.py): Ulysses groups on consecutive ranks while tensor parallelism is 1. Its
attention processors run non-causal attention through ``USP`` (xfuser/model_executor/layers/usp.py,
imported for torch >= 2.5), whose ``ring_attn`` calls torch's ``_templated_ring_attention`` with
``_cp_options.enable_load_balance = False`` and torch's default all-gather rotater: one
all-gather of the ring's K/V, then ``ring_degree`` calls merged by log-sum-exp (``torch_ring``).
"""

from __future__ import annotations

from cptune.config import CPConfig
from cptune.frameworks._framework import Framework, Runs, Spelling, flags, torch_ring, torchrun
from cptune.frameworks._yunchang import usp_refusal
from cptune.workload import AttentionShape

_FLAGS = {"ulysses_degree": "--ulysses_degree", "ring_degree": "--ring_degree"}


class XDiT(Framework):
    name = "xdit"
    pinned = "xfuser 0.7.0"
    form = "flags"

    def context_refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        if shape.causal:
            return ("xDiT runs diffusion transformers' non-causal attention (is_causal=False) with "
                    "yunchang's basic ring; for causal attention use yunchang's zigzag ring directly")
        return usp_refusal("xDiT", shape, config)

    def runs(self, shape: AttentionShape, config: CPConfig, seq_len: int) -> Runs:
        if config.strategy != "ring" or config.context_degree == 1:
            return Runs(config)
        return torch_ring(shape, config, "xDiT's --ring_degree")

    def spell_context(self, shape: AttentionShape, config: CPConfig, seq_len: int | None,
                      per_node: int | None) -> Spelling:
        settings = {"ulysses_degree": config.head_group, "ring_degree": config.context_degree}
        line = flags(settings, _FLAGS)
        return Spelling(settings, line, torchrun(config.ranks, per_node, f"<your xDiT script> {line}"),
                        ("--tensor_parallel_degree 1, and data, CFG and PipeFusion degrees of 1 on these "
                         "ranks (xfuser passes yunchang contiguous sequence-parallel blocks)",))
