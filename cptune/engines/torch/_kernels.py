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

The backward of one call (``fused_attention_grad``) is FlashAttention-2's: given the layer's
final output and log-sum-exp over all its keys, P = exp(scale q k^T - lse) and D =
rowsum(dout * out), so a call over a subset of the keys (a Ring step) gets exactly its share of
dQ and the whole dK, dV of its keys. It runs the backward op of the forward kernel the chooser
picked for that call's class (``KernelChooser.grad_pick``): on the CPU
``_scaled_dot_product_flash_attention_for_cpu_backward`` (fewer KV heads as they are); on CUDA
``_scaled_dot_product_{cudnn,flash,efficient}_attention_backward`` with the forward's extra
outputs (sequence offsets, maximum lengths, RNG state) as the dense, dropout-free forward gives
them, the memory-efficient one with the KV heads repeated (its backward takes no fewer) -- each
first checked once per class against ``explicit_grad`` on a call over part of the keys, else
with the KV heads repeated, else ``explicit_grad``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
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


#: The number of dims of the log-sum-exp cuDNN's forward returns: [batch, heads, rows, 1] in
#: the releases this was written against (this install's meta kernel says so), [batch, heads,
#: rows] in a release that drops the 1. Its backward builds its graph from the shape it is given
#: (and caches the graph without it), so it gets the forward's: each cuDNN forward call records it.
_CUDNN_LSE = {"dims": 4}


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    _CUDNN_LSE["dims"] = lse.dim()
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


def _masked(scores: torch.Tensor, causal: bool, visible: torch.Tensor | None) -> torch.Tensor:
    """``scores`` with the square causal mask, or the pairs ``visible`` [rows, keys] hides, at -inf."""
    if visible is not None:
        return scores.masked_fill(~visible, float("-inf"))
    if causal:
        return scores.masked_fill(
            torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1), float("-inf"))
    return scores


def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None,
             visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and log-sum-exp in float32 with plain tensor ops (no fused kernel): the
    fallback, what the probe checks the fused kernels against, and the calls a mask applies
    by position (``visible``: [rows, keys], True where a query sees a key; a row that sees
    none gets output 0 and log-sum-exp -inf)."""
    groups = q.shape[HEADS] // k.shape[HEADS]
    k, v = k.repeat_interleave(groups, dim=HEADS).float(), v.repeat_interleave(groups, dim=HEADS).float()
    scores = q.float() @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    scores = _masked(scores, causal, visible)
    lse = torch.logsumexp(scores, dim=-1)
    shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # a row that sees nothing: all 0
    return (torch.exp(scores - shift[..., None]) @ v).to(q.dtype), lse


#: q, k, v (a call's), out and float32 lse [batch, heads, rows] (the layer's, over all its keys),
#: dout, causal, scale -> (dq like q, dk like k, dv like v), in q's dtype or float32.
GradKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       bool, "float | None"], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _dense(x: torch.Tensor, order: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, dense with its dims laid out outermost first in ``order``: itself
    where it already is, else one copy (the cast included)."""
    if x.dtype == dtype and x.permute(*order).is_contiguous():
        return x
    back = sorted(range(len(order)), key=lambda d: order[d])
    dense = torch.empty([x.shape[d] for d in order], dtype=dtype, device=x.device).permute(*back)
    dense.copy_(x)
    return dense


#: [batch, heads, seq, head_dim] laid out as [batch, seq, heads, head_dim]: how the CUDA
#: FlashAttention and memory-efficient backwards read out and dout (they copy them to it).
SEQUENCE_MAJOR = (0, 2, 1, 3)


def _outer_first(like: torch.Tensor) -> list[int]:
    """``like``'s dims from the largest stride to the smallest (ties in dim order)."""
    strides = like.stride()
    return sorted(range(like.dim()), key=lambda d: -strides[d])


#: The (seed, offset) each CUDA backward takes for the forward's RNG state, per device: read
#: only with dropout, which is 0 here, so placeholders of the forward's shapes and dtypes.
_RNG: dict[tuple[str, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _rng_placeholders(kernel: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if (kernel, device) not in _RNG:
        if kernel == "cuda_flash":  # (rng_state [2], unused []) as uint64
            _RNG[kernel, device] = (torch.empty(2, dtype=torch.uint64, device=device),
                                    torch.empty((), dtype=torch.uint64, device=device))
        else:  # (philox_seed [], philox_offset []) as int64
            _RNG[kernel, device] = (torch.empty((), dtype=torch.int64, device=device),
                                    torch.empty((), dtype=torch.int64, device=device))
    return _RNG[kernel, device]


def _flash_for_cpu_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, dout: torch.Tensor, causal: bool,
                        scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU flash backward: any strides, fewer KV heads as they are; D = rowsum(dout * out)
    from the ``out`` it is given, so the layer's final output and log-sum-exp give a key
    subset's exact share."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad_out=dout.to(q.dtype), query=q, key=k, value=v, out=out.to(q.dtype), logsumexp=lse,
        dropout_p=0.0, is_causal=causal, attn_mask=None, scale=scale)
    return dq, dk, dv


def _flash_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                dout: torch.Tensor, causal: bool,
                scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2's backward (dense: no cumulative sequence lengths; the maximum lengths
    are the call's; it sums dK, dV over a KV head's query heads). It takes out and dout in q's
    dtype, sequence-major (else it copies them there: one copy here does both), and reads the
    log-sum-exp as a dense [batch, heads, rows]: a row range of the layer's is copied to one."""
    rng_state, unused = _rng_placeholders("cuda_flash", q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward.default(
        grad_out=_dense(dout, SEQUENCE_MAJOR, q.dtype), query=q, key=k, value=v,
        out=_dense(out, SEQUENCE_MAJOR, q.dtype),
        logsumexp=lse.contiguous(), cum_seq_q=None, cum_seq_k=None, max_q=q.shape[-2],
        max_k=k.shape[-2], dropout_p=0.0, is_causal=causal, philox_seed=rng_state,
        philox_offset=unused, scale=scale)
    return dq, dk, dv


def _efficient_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, dout: torch.Tensor, causal: bool,
                    scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The memory-efficient backward, which takes as many KV heads as query heads (``run_grad``
    repeats them). It reads ``out`` sequence-major ([batch, rows, heads, head_dim] rows packed:
    its row stride is heads * head_dim) and the log-sum-exp as its forward leaves it, [batch,
    heads, rows rounded up to 32]; the rows past the call's get +inf (probability 0)."""
    rows = q.shape[-2]
    padded = torch.full((*lse.shape[:-1], -(-rows // 32) * 32), math.inf, dtype=torch.float32,
                        device=lse.device)
    padded[..., :rows] = lse
    seed, offset = _rng_placeholders("cuda_efficient", q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default(
        grad_out_=_dense(dout, SEQUENCE_MAJOR, q.dtype), query=q, key=k, value=v, attn_bias=None,
        out=_dense(out, SEQUENCE_MAJOR, q.dtype), logsumexp=padded, philox_seed=seed,
        philox_offset=offset, dropout_p=0.0, grad_input_mask=[True, True, True, False],
        is_causal=causal, scale=scale)
    return dq, dk, dv


def _cudnn_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                dout: torch.Tensor, causal: bool,
                scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cuDNN's backward (dense: no cumulative sequence lengths or bias; the maximum lengths,
    which it takes as the call's, are the call's rows and keys). It caches its graph by q, k
    and v's shapes and strides, not out's, dout's or the log-sum-exp's, so those are given in
    one fixed layout: out and dout dense in q's dim order (the layout its forward gives out;
    cuDNN before 9.5.1 needs dout's strides equal to out's), the log-sum-exp contiguous in the
    forward's shape."""
    seed, offset = _rng_placeholders("cuda_cudnn", q.device)
    order = _outer_first(q)
    stats = lse.unsqueeze(-1) if _CUDNN_LSE["dims"] == 4 else lse
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default(
        grad_out=_dense(dout, order, q.dtype), query=q, key=k, value=v, out=_dense(out, order, q.dtype),
        logsumexp=stats.contiguous(), philox_seed=seed, philox_offset=offset, attn_bias=None,
        cum_seq_q=None, cum_seq_k=None, max_q=q.shape[-2], max_k=k.shape[-2], dropout_p=0.0,
        is_causal=causal, scale=scale)
    return dq, dk, dv


def _by_kv_head(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient over repeated KV heads [..., heads, keys, head_dim] summed (in float32) over
    each KV head's repeats."""
    return grad.unflatten(HEADS, (kv_heads, -1)).sum(HEADS, dtype=torch.float32)


def explicit_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dout: torch.Tensor, causal: bool, scale: float | None = None,
                  visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of one call in float32 with plain tensor ops: P = exp(scale q k^T [square
    causal mask] - lse), D = rowsum(dout * out), dV = P^T dout, dS = P (dout V^T - D),
    dQ = scale dS K, dK = scale dS^T q, a KV head's dK and dV summed over its query heads. With
    the layer's ``out`` and ``lse`` (over all its keys) and a subset of the keys: that subset's
    share of dQ and its own dK, dV. The fallback, and what the fused backwards are checked
    against."""
    kv_heads = k.shape[HEADS]
    groups = q.shape[HEADS] // kv_heads
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    q32, dout32 = q.float(), dout.float()
    k32 = k.float().repeat_interleave(groups, dim=HEADS)
    v32 = v.float().repeat_interleave(groups, dim=HEADS)
    scores = _masked(q32 @ k32.transpose(-1, -2) * scale, causal, visible)
    lse = lse.float()
    p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    delta = (dout32 * out.float()).sum(-1, keepdim=True)
    dv = p.transpose(-1, -2) @ dout32
    ds = p * (dout32 @ v32.transpose(-1, -2) - delta)
    dq = ds @ k32 * scale
    dk = ds.transpose(-1, -2) @ q32 * scale
    if groups > 1:
        dk, dv = _by_kv_head(dk, kv_heads), _by_kv_head(dv, kv_heads)
    return dq, dk, dv


KERNELS: dict[str, Kernel] = {
    "flash_for_cpu": _flash_for_cpu,
    "cuda_cudnn": _cudnn,
    "cuda_flash": _flash,
    "cuda_efficient": _efficient,
    "explicit": explicit,
}
#: The backward of each forward kernel.
GRAD_KERNELS: dict[str, GradKernel] = {
    "flash_for_cpu": _flash_for_cpu_grad,
    "cuda_cudnn": _cudnn_grad,
    "cuda_flash": _flash_grad,
    "cuda_efficient": _efficient_grad,
    "explicit": explicit_grad,
}
#: Backwards that take no fewer KV heads than query heads (the memory-efficient one checks).
SAME_HEADS_GRAD = frozenset({"cuda_efficient"})
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
        #: The backward each class of calls runs: its forward pick's, checked (``grad_pick``).
        self.grad_picks: dict[tuple, Pick] = {}
        self.used: set[str] = set()
        self.names: dict[torch.device, str] = {}

    def _key(self, q: torch.Tensor, k: torch.Tensor) -> tuple:
        """The class of a CUDA call: GPU, dtype, head_dim, grouped or not, size, layouts."""
        if q.device not in self.names:
            self.names[q.device] = torch.cuda.get_device_name(q.device)
        return (self.names[q.device], q.dtype, q.shape[-1], q.shape[HEADS] != k.shape[HEADS],
                size_class(q.shape[-2], k.shape[-2]), heads_outer(q), heads_outer(k))

    def pick(self, q: torch.Tensor, k: torch.Tensor) -> Pick:
        if q.device.type == "cpu":
            return Pick("flash_for_cpu", False)
        if q.device.type != "cuda":
            return Pick("explicit", False)
        key = self._key(q, k)
        if key not in self.picks:
            self.picks[key] = self.probe(q, k)
        return self.picks[key]

    def grad_pick(self, q: torch.Tensor, k: torch.Tensor) -> Pick:
        """The backward for a call shaped as ``q`` and ``k``: that of the forward kernel
        ``pick`` chose for its class (choosing it first where none was), on CUDA checked once
        per class (``probe_grad``)."""
        pick = self.pick(q, k)
        if q.device.type != "cuda" or pick.kernel == "explicit":
            return pick
        key = self._key(q, k)
        if key not in self.grad_picks:
            self.grad_picks[key] = self.probe_grad(pick, q, k)
        return self.grad_picks[key]

    def probe_grad(self, pick: Pick, q: torch.Tensor, k: torch.Tensor) -> Pick:
        """``pick``'s backward where it computes correctly on a call over part of the keys
        (``_grad_correct``), else with the KV heads repeated, else the explicit one."""
        candidates = [pick]
        if q.shape[HEADS] != k.shape[HEADS] and not pick.repeat_kv:
            candidates.append(Pick(pick.kernel, True))
        for candidate in candidates:
            if _grad_correct(candidate, q, k):
                return candidate
        return Pick("explicit", False)

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


def _grad_correct(pick: Pick, q_like: torch.Tensor, k_like: torch.Tensor) -> bool:
    """Whether ``pick``'s backward runs and matches ``explicit_grad`` on small inputs of the
    call's heads, KV heads, head_dim, dtype and memory layout, unmasked and square-causal, as a
    Ring step uses it: the call sees 96 of the layer's 128 keys (32 before them), and gets the
    layer's output and log-sum-exp over all 128."""
    generator = torch.Generator(device=q_like.device).manual_seed(2)
    heads, kv_heads, head_dim = q_like.shape[HEADS], k_like.shape[HEADS], q_like.shape[-1]
    q, dout = (_drawn(q_like, (1, heads, 96, head_dim), generator) for _ in range(2))
    k, v = (_drawn(k_like, (1, kv_heads, 128, head_dim), generator) for _ in range(2))
    for causal in (False, True):
        before_out, before_lse = explicit(q, k[..., :32, :], v[..., :32, :], False)
        call_out, call_lse = explicit(q, k[..., 32:, :], v[..., 32:, :], causal)
        lse = torch.logaddexp(before_lse, call_lse)
        out = (before_out.float() * torch.exp(before_lse - lse).unsqueeze(-1)
               + call_out.float() * torch.exp(call_lse - lse).unsqueeze(-1)).to(q.dtype)
        expected = explicit_grad(q, k[..., 32:, :], v[..., 32:, :], out, lse, dout, causal)
        try:
            got = run_grad(pick, q, k[..., 32:, :], v[..., 32:, :], out, lse, dout, causal, None)
        except RuntimeError:  # this backward does not take these inputs here
            return False
        for grad, reference in zip(got, expected, strict=True):
            if grad.shape != reference.shape:
                return False
            error = (grad.float() - reference).norm() / reference.norm()
            if not torch.isfinite(error) or error > PROBE_TOLERANCE[q.dtype]:
                return False
    return True


def run_grad(pick: Pick, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, dout: torch.Tensor, causal: bool,
             scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pick``'s backward on one call, the KV heads repeated where it needs them and dK, dV
    summed back over the repeats."""
    kv_heads = k.shape[HEADS]
    groups = q.shape[HEADS] // kv_heads
    repeat = groups > 1 and (pick.repeat_kv or pick.kernel in SAME_HEADS_GRAD)
    if repeat:
        k, v = k.repeat_interleave(groups, dim=HEADS), v.repeat_interleave(groups, dim=HEADS)
    dq, dk, dv = GRAD_KERNELS[pick.kernel](q, k, v, out, lse, dout, causal, scale)
    if repeat:
        dk, dv = _by_kv_head(dk, kv_heads), _by_kv_head(dv, kv_heads)
    return dq, dk, dv


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


def fused_attention_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, dout: torch.Tensor, causal: bool,
                         scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq like q, dk like k, dv like v; in q's dtype or float32) of one call of
    ``fused_attention`` -- q [batch, heads, rows, head_dim] over k, v [batch, kv_heads, keys,
    head_dim], unmasked or square-causal -- given ``out`` [batch, heads, rows, head_dim] and the
    float32 ``lse`` [batch, heads, rows] of the layer over ALL its keys, of which this call
    sees a subset, and ``dout`` = dL/dout: this call's share of dQ and its keys' dK, dV (a KV
    head's summed over its query heads), by the backward of the kernel chosen for the call."""
    pick = CHOOSER.grad_pick(q, k)
    CHOOSER.used.add(pick.describe() + " backward")
    return run_grad(pick, q, k, v, out, lse, dout, causal, scale)


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
