"""SGLang diffusion (sglang 0.5.23): ``--sp-degree``, ``--ulysses-degree``, ``--ring-degree``
and ``--kv-gather-degree`` (sglang/multimodal_gen/runtime/server_args/server_args.py).
K/V-gather is AllGather-KV over the whole sequence-parallel group: non-causal, never with
Ulysses or Ring, its degree the sp degree. Ring needs the fa or sage_attn backend; its
``--ring-degree`` runs torch's ``_templated_ring_attention`` with load balance off
(runtime/layers/usp.py sets ``_cp_options.enable_load_balance = False``) and the all-gather
rotater (``torch_ring``), except on a tail-padded shard (a length the sp degree does not divide)
of non-causal attention on the fa backend, where ``_ring_attention_varlen`` rotates K/V point to
point: cptune's Ring. Groups:
Ulysses ``sp_ranks[i*u:(i+1)*u]``, Ring ``sp_ranks[i::u]`` (consecutive Ulysses, as in cptune).
"""

from __future__ import annotations

from cptune.config import CPConfig
from cptune.frameworks._framework import (
    Framework,
    Runs,
    Spelling,
    flags,
    heads_refusal,
    nodes_of,
    torch_ring,
)
from cptune.frameworks._masks import unread_mask
from cptune.workload import AttentionShape

_FLAGS = {"num_gpus": "--num-gpus", "sp_degree": "--sp-degree", "ulysses_degree": "--ulysses-degree",
          "ring_degree": "--ring-degree", "kv_gather_degree": "--kv-gather-degree",
          "attention_backend": "--attention-backend"}


class SGLang(Framework):
    name = "sglang"
    pinned = "sglang 0.5.23"
    form = "flags"

    def context_refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        if (unread := unread_mask("SGLang", shape)) is not None:
            return unread
        if config.strategy == "allgather_kv" and config.context_degree > 1:
            if config.head_group > 1:
                return "SGLang's --kv-gather-degree does not compose with --ulysses-degree or --ring-degree"
            if shape.causal:
                return "SGLang's K/V-gather does not support causal attention"
            return None
        return heads_refusal(shape, config.head_group, "SGLang")

    def runs(self, shape: AttentionShape, config: CPConfig, seq_len: int) -> Runs:
        if config.strategy != "ring" or config.context_degree == 1:
            return Runs(config)
        if not shape.causal and seq_len % config.ranks:
            what = (f"SGLang pads {seq_len} tokens to a multiple of {config.ranks} and rotates K/V point to "
                    f"point on the padded shard (_ring_attention_varlen)")
            return Runs(config, False, what)
        return torch_ring(shape, config, "SGLang's --ring-degree")

    def spell_context(self, shape: AttentionShape, config: CPConfig, seq_len: int | None,
                      per_node: int | None) -> Spelling:
        n = config.ranks
        settings: dict[str, object] = {"num_gpus": n, "sp_degree": n}
        if config.strategy == "allgather_kv":
            settings["kv_gather_degree"] = n
        else:  # both degrees named: --sp-degree 2 alone picks K/V-gather
            settings.update(ulysses_degree=config.head_group, ring_degree=config.context_degree)
            if config.context_degree > 1:
                settings["attention_backend"] = "fa"
        line = flags(settings, _FLAGS)
        nodes, _ = nodes_of(n, per_node)
        if nodes == 1:
            return Spelling(settings, line, f"sglang generate --model-path <model> {line}")
        # --num-gpus is the total over the nodes; each node runs num_gpus // nnodes workers
        launch = "\n".join(f"sglang generate --model-path <model> {line} --nnodes {nodes} --node-rank {k} "
                           f"--dist-init-addr $MASTER_ADDR:5000" for k in range(nodes))
        return Spelling(settings, line, launch,
                        ("MASTER_ADDR: the first node's address, reachable from every node",))
