"""vLLM-Omni 0.20.0: ``DiffusionParallelConfig(ulysses_degree, ring_degree)``, on the command
line ``--ulysses-degree`` and ``--ring-degree`` (vllm_omni/diffusion/data.py,
vllm_omni/entrypoints/cli/serve.py). It has no AllGather-KV. Its ring (diffusion/attention/
backends/ring_flash_attn.py) rotates K/V point to point over contiguous shards with no load
balance: under a causal mask a step runs only where ``step <= rank``, so rank r computes r + 1
of c blocks (cptune's Ring with contiguous blocks, priced so). Groups: Ulysses
``group_ranks[i*u:(i+1)*u]``, Ring ``group_ranks[i::u]`` (consecutive Ulysses, as in cptune).
"""

from __future__ import annotations

from cptune.config import CPConfig
from cptune.frameworks._framework import Framework, Runs, Spelling, flags, nodes_of
from cptune.frameworks._masks import unread_mask
from cptune.frameworks._yunchang import usp_refusal
from cptune.workload import AttentionShape

_FLAGS = {"ulysses_degree": "--ulysses-degree", "ring_degree": "--ring-degree"}


class VLLMOmni(Framework):
    name = "vllm-omni"
    pinned = "vllm-omni 0.20.0"
    form = "flags"

    def context_refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        if (unread := unread_mask("vLLM-Omni", shape)) is not None:
            return unread
        return usp_refusal("vLLM-Omni", shape, config)

    def runs(self, shape: AttentionShape, config: CPConfig, seq_len: int) -> Runs:
        if config.strategy != "ring" or config.context_degree == 1 or not shape.causal:
            return Runs(config)
        return Runs(config.with_layout("contiguous"), False,
                    f"vLLM-Omni's ring_flash_attn: contiguous shards without load balance, rank r computing "
                    f"r + 1 of {config.context_degree} blocks")

    def placed_refusal(self, shape: AttentionShape, config: CPConfig, seq_len: int,
                       per_node: int | None) -> str | None:
        if nodes_of(config.ranks, per_node)[0] > 1:
            return (f"vLLM-Omni 0.20.0 has no multi-node launch for diffusion: its DiffusionWorker starts "
                    f"all {config.ranks} ranks on one node of {per_node} (init_distributed_environment, env://)")
        return None

    def spell_context(self, shape: AttentionShape, config: CPConfig, seq_len: int | None,
                      per_node: int | None) -> Spelling:
        settings = {"ulysses_degree": config.head_group, "ring_degree": config.context_degree}
        line = flags(settings, _FLAGS)
        return Spelling(settings, line, f"vllm serve <model> --omni {line}")
