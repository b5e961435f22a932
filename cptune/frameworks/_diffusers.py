"""diffusers 0.42.1: ``ContextParallelConfig(ring_degree, ulysses_degree)``.

Its ``ring_degree`` gathers K/V over the ring group in one all-gather (``rotate_method="allgather"``,
the only one it runs; "alltoall" raises NotImplementedError), then attends them block by block:
``ring_degree`` calls, each merged into a float32 output by its log-sum-exp (``convert_to_fp32``;
src/diffusers/models/attention_dispatch.py, ``TemplatedRingAttention``): cptune's AllGather-KV
exchange with c calls where cptune makes one, not Ring's send/recv steps, priced so. The mesh is
``(ring, ulysses)``, row-major: a Ulysses group is consecutive ranks, as in cptune.
"""

from __future__ import annotations

from cptune.config import CPConfig
from cptune.frameworks._framework import Framework, Runs, Spelling
from cptune.workload import AttentionShape


class Diffusers(Framework):
    name = "diffusers"
    pinned = "diffusers 0.42.1"
    form = "python"

    def context_refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        if shape.causal:
            return ("diffusers raises for causal attention under context parallelism ('Causal attention "
                    "is not yet supported for templated attention')")
        if shape.kv_heads != shape.heads:
            return "diffusers raises for grouped-query attention (fewer KV heads) under context parallelism"
        if config.strategy == "ring" and config.context_degree > 1:
            return ("diffusers' ring_degree gathers K/V in one all-gather (rotate_method 'allgather'; "
                    "'alltoall' raises NotImplementedError): it runs AllGather-KV, not Ring")
        return None

    def runs(self, shape: AttentionShape, config: CPConfig, seq_len: int) -> Runs:
        c = config.context_degree
        if config.strategy != "allgather_kv" or c == 1:
            return Runs(config)
        what = (f"diffusers' ring_degree: one all-gather of the ring's K/V (TemplatedRingAttention), then "
                f"{c} calls merged by log-sum-exp in float32")
        return Runs(config, True, what)

    def spell_context(self, shape: AttentionShape, config: CPConfig) -> Spelling:
        ring, ulysses = config.context_degree, config.head_group
        needs = [f"every sequence a multiple of {config.ranks} tokens long (diffusers cuts it into "
                 f"{config.ranks} equal pieces; it does not pad)"]
        backend = ""
        if ring > 1:
            needs.append("an attention backend that returns the log-sum-exp for ring_degree > 1 (flash, "
                         "_native_cudnn, sage; native raises)")
            backend = 'pipe.transformer.set_attention_backend("flash")\n'
        code = (
            "import torch, torch.distributed as dist\n"
            "from diffusers import ContextParallelConfig\n"
            'dist.init_process_group("nccl")\n'
            "torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())\n"
            f"{backend}"
            f"pipe.transformer.enable_parallelism(config=ContextParallelConfig(ring_degree={ring}, "
            f"ulysses_degree={ulysses}))"
        )
        return Spelling({"ring_degree": ring, "ulysses_degree": ulysses}, code,
                        f"torchrun --nproc-per-node={config.ranks} <your program>", tuple(needs))
