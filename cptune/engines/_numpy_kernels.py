"""Attention on a block with its log-sum-exp, and the online-softmax merge, in numpy.

float32 compute whatever the wire dtype. Blocked over query rows so the score matrix of a
block stays small, and worked in place (one reused score buffer: scale folded into Q,
max-subtract, exp and sum on the buffer, normalisation applied to the [rows, head_dim]
output instead of the [rows, keys] scores). Masks go by token position, segment by
segment: a key segment entirely in a query block's past needs no mask, one entirely in
its future is skipped, and only segments that straddle the diagonal are masked.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Segment = tuple[int, int, bool]  # key index range [start, stop) and whether it needs a mask


def position_runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Index ranges [start, stop) over which positions increase by exactly one."""
    breaks = (np.flatnonzero(np.diff(positions) != 1) + 1).tolist()
    edges = [0, *breaks, len(positions)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def rows_per_block(keys: int) -> int:
    """Query rows per block: about 2 MiB of float32 scores, between 128 and 1024 rows (fewer
    rows make the two GEMMs inefficient; more spill the scores out of cache)."""
    return int(np.clip(2**19 // max(keys, 1), 128, 1024))


def _plan(
    q_pos: np.ndarray, k_pos: np.ndarray, causal: bool, seq_len: int
) -> list[tuple[int, int, list[Segment]]]:
    """For each query row block: the key segments it must attend to."""
    key_runs = []
    for start, stop in position_runs(k_pos):
        first = int(k_pos[start])
        real = min(stop - start, seq_len - first)  # padding sits at the end of a run
        if real > 0:
            key_runs.append((start, start + real, first))
    rows = rows_per_block(len(k_pos))
    plan = []
    for q_start, q_stop in position_runs(q_pos):
        for i in range(q_start, q_stop, rows):
            j = min(i + rows, q_stop)
            first_q, last_q = int(q_pos[i]), int(q_pos[j - 1])
            segments: list[Segment] = []
            for k_start, k_stop, first_k in key_runs:
                if not causal:
                    segments.append((k_start, k_stop, False))
                elif first_k <= last_q:
                    stop = k_start + min(k_stop - k_start, last_q - first_k + 1)
                    segments.append((k_start, stop, first_k + (stop - k_start) - 1 > first_q))
            plan.append((i, j, segments))
    return plan


def attention(
    q: np.ndarray,
    kv: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    *,
    causal: bool,
    seq_len: int,
    poll: Callable[[], object] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention of ``q`` [B, H, sq, D] over ``kv`` [2, B, K, sk, D] -> (out [B, H, sq, D],
    lse [B, H, sq]), both float32. Keys at positions >= ``seq_len`` are padding and masked;
    rows that see no key get out 0 and lse -inf. ``poll`` is called between blocks (the MPI
    engine progresses in-flight transfers there)."""
    batch, heads, sq, dim = q.shape
    kv_heads = kv.shape[2]
    group = heads // kv_heads
    scale = np.float32(1.0 / np.sqrt(dim))
    out = np.zeros((batch, heads, sq, dim), dtype=np.float32)
    lse = np.full((batch, heads, sq), -np.inf, dtype=np.float32)
    plan = _plan(q_pos, k_pos, causal, seq_len)
    widest = max((sum(b - a for a, b, _ in segs) * (j - i) for i, j, segs in plan), default=0)
    buffer = np.empty(widest, dtype=np.float32)
    for b in range(batch):
        for kv_head in range(kv_heads):
            keys = kv[0, b, kv_head].astype(np.float32, copy=False)
            values = kv[1, b, kv_head].astype(np.float32, copy=False)
            for head in range(kv_head * group, (kv_head + 1) * group):
                scaled_q = q[b, head].astype(np.float32) * scale
                for i, j, segments in plan:
                    if segments:
                        _attend_block(
                            scaled_q[i:j], keys, values, q_pos[i:j], k_pos, segments, buffer,
                            out[b, head, i:j], lse[b, head, i:j],
                        )
                    if poll is not None:
                        poll()
    return out, lse


def _attend_block(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    segments: list[Segment],
    buffer: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
) -> None:
    """One query block over its key segments, writing ``out`` and ``lse`` in place."""
    rows = q.shape[0]
    scores = []
    offset = 0
    for start, stop, masked in segments:
        s = buffer[offset : offset + rows * (stop - start)].reshape(rows, stop - start)
        offset += s.size
        np.matmul(q, keys[start:stop].T, out=s)
        if masked:
            np.putmask(s, k_pos[None, start:stop] > q_pos[:, None], -np.inf)
        scores.append(s)
    row_max = scores[0].max(axis=1)
    for s in scores[1:]:
        np.maximum(row_max, s.max(axis=1), out=row_max)
    seen = np.isfinite(row_max)
    if not seen.all():
        row_max[~seen] = 0.0  # rows with no visible key: exp(-inf - 0) = 0 below
    total = np.zeros(rows, dtype=np.float32)
    for n, (s, (start, stop, _)) in enumerate(zip(scores, segments, strict=True)):
        np.subtract(s, row_max[:, None], out=s)
        np.exp(s, out=s)
        total += s.sum(axis=1)
        if n == 0:
            np.matmul(s, values[start:stop], out=out)
        else:
            out += s @ values[start:stop]
    with np.errstate(divide="ignore"):
        np.add(row_max, np.log(total), out=lse)
    total[total == 0] = 1.0
    out /= total[:, None]


def merge(
    acc: tuple[np.ndarray, np.ndarray] | None, part: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Combine two partials over disjoint keys: lse = log(e^lse_a + e^lse_b) and each output
    weighted by e^(its lse - lse). Reuses ``acc``'s arrays."""
    if acc is None:
        return part
    acc_out, acc_lse = acc
    part_out, part_lse = part
    lse = np.logaddexp(acc_lse, part_lse)
    none_seen = np.isneginf(lse)
    with np.errstate(invalid="ignore"):
        w_acc = np.where(none_seen, 0.0, np.exp(acc_lse - lse)).astype(np.float32)
        w_part = np.where(none_seen, 0.0, np.exp(part_lse - lse)).astype(np.float32)
    acc_out *= w_acc[..., None]
    acc_out += part_out * w_part[..., None]
    return acc_out, lse
