"""The fused attention kernels that return the log-sum-exp, and the choice among them.

Every call the torch engine makes is unmasked or square-causal (``cptune.calls``) and its
partial is merged by log-sum-exp, so the kernel must return the log-sum-exp:

- on the CPU, ``_scaled_dot_product_flash_attention_for_cpu`` (what
  ``scaled_dot_product_attention`` itself runs there), which takes fewer KV heads as they are;
- on CUDA, the fastest of cuDNN's attention (``_scaled_dot_product_cudnn_attention`` with
  ``compute_log_sumexp``), FlashAttention-2 (``_scaled_dot_product_flash_attention``) and
  the memory-efficient kernel (``_scaled_dot_product_efficient_attention``), chosen by a short
  probe per GPU, dtype, head_dim, grouped or not, call size and memory layout
  (``KernelChooser``): each candidate is first checked against an explicit float32
  computation (unmasked and causal, with the KV heads as they are, else repeated for it), then
  timed on inputs of the call's shape and layout; the fastest correct one is kept for the life
  of the process;
- elsewhere an explicit float32 computation.

``kernels_used`` says which ran since it was last asked (each measurement records it, with
the cuDNN and NCCL versions: ``software``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch

#: q [batch, heads, rows, head_dim], k and v [batch, kv_heads, keys, head_dim], causal, scale
#: (None: 1 / sqrt(head_dim)) -> (output like q, float32 log-sum-exp [batch, heads, rows]).
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, "float | None"],
                  tuple[torch.Tensor, torch.Tensor]]

HEADS = -3


def _rows(lse: torch.Tensor, rows: int) -> torch.Tensor:
    """A kernel's log-sum-exp as [batch, heads, rows] (cuDNN adds a trailing 1, the
    memory-efficient kernel pads the rows to a multiple of 32)."""
    return lse.flatten(2)[..., :rows]


def _flash_for_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, _rows(lse, q.shape[-2])


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, _rows(lse, q.shape[-2])


def _efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)
    return out, _rows(lse, q.shape[-2])


def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and log-sum-exp in float32 with plain tensor ops (no fused kernel): the
    fallback, and what the probe checks the fused kernels against."""
    groups = q.shape[HEADS] // k.shape[HEADS]
    k, v = k.repeat_interleave(groups, dim=HEADS).float(), v.repeat_interleave(groups, dim=HEADS).float()
    scores = q.float() @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        scores = scores.masked_fill(
            torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse[..., None]) @ v).to(q.dtype), lse


KERNELS: dict[str, Kernel] = {
    "flash_for_cpu": _flash_for_cpu,
    "cuda_cudnn": _cudnn,
    "cuda_flash": _flash,
    "cuda_efficient": _efficient,
    "explicit": explicit,
}
#: The CUDA candidates, in the order a tie goes.
CUDA_KERNELS = ("cuda_cudnn", "cuda_flash", "cuda_efficient")
#: Relative error a candidate may show against the float32 computation (bf16's rounding).
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


class Pick(NamedTuple):
    """The kernel for one class of calls, and whether it needs the KV heads repeated."""

    kernel: str
    repeat_kv: bool

    def describe(self) -> str:
        return self.kernel + (" (KV heads repeated)" if self.repeat_kv else "")


def size_class(rows: int, keys: int) -> int:
    """Calls within a factor of 4 of each other's work per head share a kernel choice."""
    return (rows * keys).bit_length() // 2


def heads_outer(x: torch.Tensor) -> bool:
    """Whether ``x`` [..., heads, seq, head_dim] is laid out heads-major in memory (else
    sequence-major, as a model holds it): kernels may take one layout and not the other."""
    return x.stride(HEADS) >= x.stride(-2)


def _drawn(like: torch.Tensor, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random values of ``shape`` in ``like``'s dtype, device and memory layout (heads- or
    sequence-major, head_dim innermost)."""
    x = torch.randn(shape, generator=generator, device=like.device).to(like.dtype)
    return x if heads_outer(like) else x.transpose(HEADS, -2).contiguous().transpose(HEADS, -2)


class KernelChooser:
    """The kernel each call runs: fixed on the CPU and other devices, chosen on CUDA by a
    probe per (GPU, dtype, head_dim, grouped, call size, memory layout of q and of K/V), kept
    for the life of the process."""

    def __init__(self, repeats: int = 3) -> None:
        self.repeats = repeats
        self.picks: dict[tuple, Pick] = {}
        self.used: set[str] = set()
        self.names: dict[torch.device, str] = {}

    def pick(self, q: torch.Tensor, k: torch.Tensor) -> Pick:
        if q.device.type == "cpu":
            return Pick("flash_for_cpu", False)
        if q.device.type != "cuda":
            return Pick("explicit", False)
        if q.device not in self.names:
            self.names[q.device] = torch.cuda.get_device_name(q.device)
        key = (self.names[q.device], q.dtype, q.shape[-1], q.shape[HEADS] != k.shape[HEADS],
               size_class(q.shape[-2], k.shape[-2]), heads_outer(q), heads_outer(k))
        if key not in self.picks:
            self.picks[key] = self.probe(q, k)
        return self.picks[key]

    def probe(self, q: torch.Tensor, k: torch.Tensor) -> Pick:
        """The fastest CUDA candidate that computes correctly, timed on inputs shaped as
        ``q`` and ``k`` (unmasked: the causal calls are square, and run at the same rate per
        computed pair)."""
        found: list[tuple[float, int, Pick]] = []
        for order, name in enumerate(CUDA_KERNELS):
            for repeat_kv in (False, True) if q.shape[HEADS] != k.shape[HEADS] else (False,):
                pick = Pick(name, repeat_kv)
                if _correct(pick, q, k):
                    found.append((self._seconds(pick, q, k), order, pick))
                    break
        if not found:
            return Pick("explicit", False)
        return min(found)[2]

    def _seconds(self, pick: Pick, q_like: torch.Tensor, k_like: torch.Tensor) -> float:
        generator = torch.Generator(device=q_like.device).manual_seed(0)
        q = _drawn(q_like, tuple(q_like.shape), generator)
        k, v = (_drawn(k_like, tuple(k_like.shape), generator) for _ in range(2))
        run(pick, q, k, v, False, None)  # warm-up
        samples = []
        for _ in range(self.repeats):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run(pick, q, k, v, False, None)
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end))
        return statistics.median(samples)

    def take_used(self) -> str:
        """The kernels that ran since the last call, as one line."""
        used, self.used = self.used, set()
        return ", ".join(sorted(used))


def _correct(pick: Pick, q_like: torch.Tensor, k_like: torch.Tensor) -> bool:
    """Whether ``pick`` runs and matches the float32 computation on small inputs of the
    call's heads, KV heads, head_dim, dtype and memory layout, unmasked and square-causal."""
    generator = torch.Generator(device=q_like.device).manual_seed(1)
    q = _drawn(q_like, (1, q_like.shape[HEADS], 96, q_like.shape[-1]), generator)
    k, v = (_drawn(k_like, (1, k_like.shape[HEADS], 96, k_like.shape[-1]), generator) for _ in range(2))
    for causal in (False, True):
        try:
            out, lse = run(pick, q, k, v, causal, None)
        except RuntimeError:  # this kernel does not take these inputs here
            return False
        expected, expected_lse = explicit(q, k, v, causal)
        error = (out.float() - expected.float()).norm() / expected.float().norm()
        if out.shape != expected.shape or lse.shape != expected_lse.shape or not torch.isfinite(error):
            return False
        if error > PROBE_TOLERANCE[q.dtype] or not torch.allclose(lse, expected_lse, rtol=1e-2, atol=1e-2):
            return False
    return True


def run(pick: Pick, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
        scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``pick``'s kernel on q, k, v, the KV heads repeated where it needs them."""
    groups = q.shape[HEADS] // k.shape[HEADS]
    if pick.repeat_kv and groups > 1:
        k, v = k.repeat_interleave(groups, dim=HEADS), v.repeat_interleave(groups, dim=HEADS)
    return KERNELS[pick.kernel](q, k, v, causal, scale)


#: This process's choices (the engine's ranks and a deployment each keep their own).
CHOOSER = KernelChooser()


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale [+ square causal mask]) v and its float32 log-sum-exp [batch,
    heads, rows] by the kernel chosen for this call; ``k`` and ``v`` may have fewer (KV)
    heads than ``q``. ``scale`` None: 1 / sqrt(head_dim)."""
    pick = CHOOSER.pick(q, k)
    CHOOSER.used.add(pick.describe())
    return run(pick, q, k, v, causal, scale)


def software() -> dict[str, str]:
    """The cuDNN and NCCL versions the kernels and exchanges run with (empty on the CPU)."""
    if not torch.cuda.is_available():
        return {}
    found = {"cudnn": str(torch.backends.cudnn.version())}
    try:
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):
        found["nccl"] = "none"
    return found
