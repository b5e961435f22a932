"""diffusers 0.42.1: ``ContextParallelConfig(ring_degree, ulysses_degree)``.

Its ``ring_degree`` gathers K/V over the ring group in one all-gather (``rotate_method="allgather"``,
the only one it runs; "alltoall" raises NotImplementedError), then attends them block by block:
``ring_degree`` calls, each merged into a float32 output by its log-sum-exp (``convert_to_fp32``;
src/diffusers/models/attention_dispatch.py, ``TemplatedRingAttention``): cptune's AllGather-KV
exchange with c calls where cptune makes one, not Ring's send/recv steps, priced so. The mesh is
``(ring, ulysses)``, row-major: a Ulysses group is consecutive ranks, as in cptune. Joint text is
sharded with the image (FLUX's ``_cp_plan`` splits ``encoder_hidden_states`` as it splits
``hidden_states``): no replicated text. Its context-parallel attention takes no mask beyond
full attention (no window, documents or sinks).
"""

from __future__ import annotations

from cptune.config import CPConfig
from cptune.frameworks._framework import SET_DEVICE, Framework, Runs, Spelling, torchrun
from cptune.frameworks._masks import mask_words
from cptune.workload import AttentionShape


class Diffusers(Framework):
    name = "diffusers"
    pinned = "diffusers 0.42.1"
    form = "python"

    def context_refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        if shape.causal:
            return ("diffusers raises for causal attention under context parallelism ('Causal attention "
                    "is not yet supported for templated attention')")
        if mask_words(shape):
            return (f"diffusers' context-parallel attention takes no {mask_words(shape)} (a ring's attn_mask "
                    f"raises: 'TemplatedRingAnythingAttention does not support non-None attn_mask')")
        if shape.kv_heads != shape.heads:
            return "diffusers raises for grouped-query attention (fewer KV heads) under context parallelism"
        if config.strategy == "ring" and config.context_degree > 1:
            return ("diffusers' ring_degree gathers K/V in one all-gather (rotate_method 'allgather'; "
                    "'alltoall' raises NotImplementedError): it runs AllGather-KV, not Ring")
        return None

    def runs(self, shape: AttentionShape, config: CPConfig, seq_len: int) -> Runs:
        c = config.context_degree
        text = ""
        if config.layout == "replicated_text" and c > 1:
            text = "the joint text sharded with the image (FLUX's _cp_plan splits encoder_hidden_states)"
            config = config.with_layout(None)
        if config.strategy != "allgather_kv" or c == 1:
            return Runs(config, False, f"diffusers runs {text}") if text else Runs(config)
        what = (f"diffusers' ring_degree: one all-gather of the ring's K/V (TemplatedRingAttention), then "
                f"{c} calls merged by log-sum-exp in float32" + (f"; {text}" if text else ""))
        return Runs(config, True, what)

    def placed_refusal(self, shape: AttentionShape, config: CPConfig, seq_len: int,
                       per_node: int | None) -> str | None:
        if seq_len % config.ranks and config.head_group > 1 and config.context_degree > 1:
            return (f"diffusers cuts {seq_len} tokens into {config.ranks} equal pieces (EquipartitionSharder "
                    f"asserts it); ulysses_anything and ring_anything take other lengths only without "
                    f"the other degree")
        return None

    def spell_context(self, shape: AttentionShape, config: CPConfig, seq_len: int | None,
                      per_node: int | None) -> Spelling:
        ring, ulysses = config.context_degree, config.head_group
        settings: dict[str, object] = {"ring_degree": ring, "ulysses_degree": ulysses}
        if seq_len is not None and seq_len % config.ranks:  # its own way round: uneven pieces
            settings["ulysses_anything" if ring == 1 else "ring_anything"] = True
            needs = [f"{seq_len} tokens do not divide into {config.ranks} equal pieces: "
                     f"{'ulysses' if ring == 1 else 'ring'}_anything=True lets diffusers cut them unevenly"]
        else:
            needs = [f"every sequence a multiple of {config.ranks} tokens long (diffusers cuts it into "
                     f"{config.ranks} equal pieces; ulysses_anything or ring_anything, one degree alone, "
                     f"takes any length)"]
        backend = ""
        if ring > 1:
            needs.append("an attention backend that returns the log-sum-exp for ring_degree > 1 (flash, "
                         "_native_cudnn, sage; native raises)")
            backend = 'pipe.transformer.set_attention_backend("flash")\n'
        arguments = ", ".join(f"{k}={v}" for k, v in settings.items())
        code = "\n".join((
            "import torch, torch.distributed as dist", "from diffusers import ContextParallelConfig",
            *SET_DEVICE,
            'dist.init_process_group("nccl")',
            f"{backend}pipe.transformer.enable_parallelism(config=ContextParallelConfig({arguments}))"))
        return Spelling(settings, code, torchrun(config.ranks, per_node, "<your program>"), tuple(needs))
