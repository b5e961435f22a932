"""The single-process float64 attention every configuration's output is checked against.

Written plainly and independently of the strategies and the engine kernels, so that a bug
there cannot hide in here.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from cptune.workload import Workload

#: Largest relative error (max |out - ref| / max |ref|) accepted per wire dtype: float32
#: round-off for fp32; for 16-bit dtypes the output is rounded once to the wire dtype
#: (2^-11 relative), plus float32 compute error.
TOLERANCE: dict[str, float] = {"fp32": 2e-5, "fp16": 2e-3, "bf16": 2e-3}
#: The same, where bf16 is real bfloat16 throughout (inputs rounded to its 8 significant
#: bits alone are off by up to 2^-9, and every step rounds again), not the MPI engine's
#: float16 wire: the TensorRT and torch engines. A wrong lowering is off by far more (of
#: order one).
REAL_BF16_TOLERANCE: dict[str, float] = TOLERANCE | {"bf16": 3e-2}

_QUERY_BLOCK = 256


def make_inputs(workload: Workload, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random Q, K, V of ``workload``'s shapes ([batch, seq, heads, head_dim]) in its wire
    dtype: the values the ranks hold, so rounding to the wire adds no error."""
    rng = np.random.default_rng(seed)
    wl = workload

    def draw(heads: int) -> np.ndarray:
        shape = (wl.batch, wl.seq_len, heads, wl.head_dim)
        return rng.standard_normal(shape, dtype=np.float32).astype(wl.wire_dtype)

    return draw(wl.heads), draw(wl.kv_heads), draw(wl.kv_heads)


def make_output_gradient(workload: Workload, seed: int = 0) -> np.ndarray:
    """A random gradient of the output ([batch, seq, heads, head_dim], wire dtype), drawn
    apart from ``make_inputs``' values: what a training run's backward starts from."""
    rng = np.random.default_rng([seed, 1])
    shape = (workload.batch, workload.seq_len, workload.heads, workload.head_dim)
    return rng.standard_normal(shape, dtype=np.float32).astype(workload.wire_dtype)


def _score_blocks(workload: Workload, q: np.ndarray, k: np.ndarray, v: np.ndarray
                  ) -> Iterator[tuple[int, int, slice, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Every (batch b, query head h, query rows) block in float64: its Q rows, K and V of the
    head's KV head and softmax(Q K^T / sqrt(d) [+ the workload's mask]) over whole rows."""
    wl = workload
    scale = 1.0 / np.sqrt(wl.head_dim)
    keys = np.arange(wl.seq_len)
    for b in range(wl.batch):
        for h in range(wl.heads):
            kh = k[b, :, h // wl.group_size].astype(np.float64)
            vh = v[b, :, h // wl.group_size].astype(np.float64)
            for start in range(0, wl.seq_len, _QUERY_BLOCK):
                rows = slice(start, min(start + _QUERY_BLOCK, wl.seq_len))
                qh = q[b, rows, h].astype(np.float64)
                scores = (qh @ kh.T) * scale
                if wl.masked:  # the mask's rule, checked apart against its definitions (tests/test_masks.py)
                    queries = np.arange(rows.start, rows.stop)
                    scores[~wl.mask.visible(queries[:, None], keys[None, :])] = -np.inf
                elif wl.causal:
                    scores[keys[None, :] > np.arange(rows.start, rows.stop)[:, None]] = -np.inf
                p = np.exp(scores - scores.max(axis=1, keepdims=True))
                yield b, h, rows, qh, kh, vh, p / p.sum(axis=1, keepdims=True)


def reference_attention(workload: Workload, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(Q K^T / sqrt(d) [+ causal mask]) V in float64, [batch, seq, heads, head_dim]."""
    wl = workload
    out = np.empty((wl.batch, wl.seq_len, wl.heads, wl.head_dim), dtype=np.float64)
    for b, h, rows, _, _, vh, p in _score_blocks(workload, q, k, v):
        out[b, rows, h] = p @ vh
    return out


def reference_gradients(workload: Workload, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                        dout: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dQ, dK, dV in float64 of the attention ``reference_attention`` computes, given the
    output's gradient ``dout`` (all [batch, seq, heads or kv_heads, head_dim]): from the
    softmax's Jacobian, whole score rows at a time; a KV head's gradients sum over the
    query heads that read it."""
    wl = workload
    dq = np.zeros((wl.batch, wl.seq_len, wl.heads, wl.head_dim), dtype=np.float64)
    dk = np.zeros((wl.batch, wl.seq_len, wl.kv_heads, wl.head_dim), dtype=np.float64)
    dv = np.zeros_like(dk)
    scale = 1.0 / np.sqrt(wl.head_dim)
    for b, h, rows, qh, kh, vh, p in _score_blocks(workload, q, k, v):
        do = dout[b, rows, h].astype(np.float64)
        dp = do @ vh.T
        ds = p * (dp - (dp * p).sum(axis=1, keepdims=True))  # the softmax's Jacobian, row by row
        dq[b, rows, h] = ds @ kh * scale
        dk[b, :, h // wl.group_size] += ds.T @ qh * scale
        dv[b, :, h // wl.group_size] += p.T @ do
    return dq, dk, dv


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref|: an error relative to the output's scale, which does not
    blow up on outputs that happen to be near zero."""
    scale = float(np.max(np.abs(ref)))
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out.astype(np.float64) - ref))) / (scale if scale > 0 else 1.0)
