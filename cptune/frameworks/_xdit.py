"""xDiT (xfuser 0.7.0): ``--ulysses_degree``, ``--ring_degree`` (xfuser/config/args.py), run by
yunchang's ``set_seq_parallel_pg`` with ``use_ulysses_low=True`` (xfuser/core/distributed/
parallel_state.py): Ulysses groups on consecutive ranks while tensor parallelism is 1. Its
attention processors run non-causal attention through ``USP`` (xfuser/model_executor/layers/usp.py,
imported for torch >= 2.5), whose ``ring_attn`` calls torch's ``_templated_ring_attention`` with
``_cp_options.enable_load_balance = False`` and torch's default all-gather rotater: one
all-gather of the ring's K/V, then ``ring_degree`` calls merged by log-sum-exp (``torch_ring``).
Joint text: ``USP(..., joint_query, joint_key, joint_value, joint_strategy="front" | "rear")``
puts the text's queries on every rank and joins its K/V at the ring's first or last step
(cptune's replicated_text; under Ulysses its K/V split by head); FLUX's pipeline shards the
text with the image instead (``split_text_embed_in_sp``) where the sp degree divides it, and
falls back to "front" where it does not. No mask beyond full attention.
"""

from __future__ import annotations

from cptune.config import CPConfig
from cptune.frameworks._framework import Framework, Runs, Spelling, flags, torch_ring, torchrun
from cptune.frameworks._masks import as_layout, mask_words
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
        if mask_words(shape):
            return (f"xDiT's attention processors call USP(..., is_causal=False) with no mask: no "
                    f"{mask_words(shape)}")
        return usp_refusal("xDiT", shape, config)

    def text_layout(self, shape: AttentionShape, config: CPConfig) -> str | None:
        """How xDiT deals joint text out: replicated ("front") where cptune's configuration
        replicates it or the ranks do not divide it (FLUX's pipeline then falls back to
        "front"), else sharded with the image; None without joint text or a context split."""
        if not shape.text or config.context_degree == 1:
            return None
        replicated = config.layout == "replicated_text" or shape.text % config.ranks
        return "replicated_text" if replicated else "contiguous"

    def runs(self, shape: AttentionShape, config: CPConfig, seq_len: int) -> Runs:
        layout = self.text_layout(shape, config)
        if layout is not None and layout != (config.layout or "contiguous") and config.strategy != "ring":
            return as_layout(shape, config, seq_len, layout,
                             f"xDiT's FLUX pipeline cannot shard {shape.text} text tokens over "
                             f"{config.ranks} ranks (split_text_embed_in_sp needs them to divide): "
                             f"joint_strategy 'front', the text on every rank")
        if config.strategy != "ring" or config.context_degree == 1:
            return Runs(config)
        return torch_ring(shape, config, "xDiT's --ring_degree", None if layout == "contiguous" else layout)

    def spell_context(self, shape: AttentionShape, config: CPConfig, seq_len: int | None,
                      per_node: int | None) -> Spelling:
        settings = {"ulysses_degree": config.head_group, "ring_degree": config.context_degree}
        line = flags(settings, _FLAGS)
        needs = ["--tensor_parallel_degree 1, and data, CFG and PipeFusion degrees of 1 on these "
                 "ranks (xfuser passes yunchang contiguous sequence-parallel blocks)"]
        layout = self.text_layout(shape, config)
        if layout == "replicated_text":
            needs.append(f"the {shape.text} text tokens on every rank: USP(query, key, value, "
                         f"joint_query=..., joint_key=..., joint_value=..., joint_strategy='front') with "
                         f"the text as the joint tensors (FLUX's pipeline does so where the ranks do not "
                         f"divide the text)")
        elif layout == "contiguous":
            needs.append(f"the {shape.text} text tokens sharded with the image (FLUX's pipeline: "
                         f"split_text_embed_in_sp, {shape.text // config.ranks} text tokens a rank)")
        return Spelling(settings, line, torchrun(config.ranks, per_node, f"<your xDiT script> {line}"),
                        tuple(needs))
