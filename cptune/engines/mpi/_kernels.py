"""Attention on a block with its log-sum-exp, and the online-softmax merge, in numpy.

float32 compute whatever the wire dtype. Keys are processed in equal chunks
(``chunk_slices``; so K and V stay in cache), queries in row blocks (``rows_per_block``);
under a window or documents each block reads at most a chunk's worth of keys, wherever
they lie (``_chunks``);
both sizes are defined in ``cptune.kernels``, where the cost model counts this kernel's
work with them. Each block is worked in place: one reused score buffer, scale folded into
Q, exp and sum on the buffer in one compiled pass per row (``_compiled.exp_rows``: NumPy's
exp took a third of a call's time), and its sum_k p v and sum_k p added to its rows' running
sums; each row is normalised once per call, after its head's last chunk, rather than each
chunk's partial being normalised and merged by log-sum-exp over every row (per-row passes
that did not shrink with a mask: under 8 packed documents most rows see one chunk of eight).
Only the keys some block reads are cast to float32, from float16 by bits in one compiled pass
that also takes each row's norm (``_compiled.widen_rows``: a masked call's casts are a pass
over as many elements as a plain one's, for an eighth of its attention).

Softmax usually subtracts each row's max before exp, which costs two passes over the
scores. By Cauchy-Schwarz a score never exceeds |q| * max|k|; when that bound is small
enough that exp cannot overflow, the max is skipped (the result is the same up to
rounding). Blocks where the bound is too loose, or where a row's sum underflows, take the
exact max-subtracted path; a row's running sums then carry that shift, and sums of
different shifts are brought to the larger before they are added.

Masks go by token position, segment by segment: a key segment entirely in a query block's
past needs no mask, one entirely in its future is skipped, and only segments that straddle
the diagonal are masked. A block's adjacent segments are computed as one span of keys (one
GEMM, exp and P V), the mask applied to the masked columns only, its hidden pairs worked out
once per call, not per head (``_spans``). Where each row sees one run of a span's keys (a
causal diagonal, a window's edges) the exp pass takes only that run and zeroes the rest
(``_compiled.exp_rows_within``): no pass of the mask's own, no exp of what it hides.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

from cptune.calls import Segment, kernel_blocks
from cptune.engines.mpi._compiled import exp_rows, exp_rows_within, narrow, widen_rows
from cptune.kernels import chunk_slices, rows_per_block
from cptune.layout import position_runs
from cptune.masks import Mask

#: Largest score bound for which exp is taken without subtracting the row max: e^50 times
#: a million keys times |v| <= 1e6 stays far below float32's 3.4e38.
_UNSHIFTED_EXP_LIMIT = 50.0
_LARGEST_UNSHIFTED_VALUE = 1e6
#: A row sum below this may have lost precision to underflow: recompute the block exactly.
_SMALLEST_UNSHIFTED_SUM = 1e-30


#: Query row blocks [start, stop) and the key segments each attends (``_plan``).
Plan = list[tuple[int, int, list[Segment]]]

#: Adjacent key segments of a block joined: key index range [start, stop), for each masked
#: segment inside it its range and the pairs the mask hides there, and the keys [first,
#: stop) each row sees within the span where those are one run (``_spans``, ``_row_runs``).
Cut = tuple[int, int, np.ndarray]
RowRuns = tuple[np.ndarray, np.ndarray]
Span = tuple[int, int, tuple[Cut, ...], RowRuns | None]
#: A backward block's key segment: its range and, if masked, its hidden pairs and each row's
#: run where known (``_masking``).
GradSegment = tuple[int, int, tuple[np.ndarray, RowRuns | None] | None]


def _spans(segments: list[Segment], q_pos: np.ndarray, k_pos: np.ndarray, mask: Mask) -> list[Span]:
    """``segments`` of the block of queries at ``q_pos`` over keys at ``k_pos`` with
    adjacent ones joined, each masked one kept with its hidden pairs (``_hidden``): a block
    then takes one GEMM, exp and P V per run of keys, not per segment (a window tile's far
    edge, middle and diagonal are one run), the mask still covers only what it cuts, and
    it is worked out once per call rather than once per head."""
    joined: list[tuple[int, int, tuple[Cut, ...], list[tuple[int, int, RowRuns | None]]]] = []
    for start, stop, masked in segments:
        cut: tuple[Cut, ...] = ()
        runs: list[tuple[int, int, RowRuns | None]] = []
        if masked:
            hidden, run = _masking(mask, q_pos, k_pos[start:stop])
            cut, runs = ((start, stop, hidden),), [(start, stop, run)]
        if joined and joined[-1][1] == start:
            joined[-1] = (joined[-1][0], stop, joined[-1][2] + cut, joined[-1][3] + runs)
        else:
            joined.append((start, stop, cut, runs))
    return [(start, stop, cuts, _row_runs(start, stop, runs)) for start, stop, cuts, runs in joined]


def _masking(mask: Mask, q_pos: np.ndarray, k_pos: np.ndarray) -> tuple[np.ndarray, RowRuns | None]:
    """A masked segment's hidden pairs ([rows, keys]) and, where the segment is ``_banded``
    and the mask has no sinks, the run of its keys each query sees (``_seen_run``)."""
    if not _banded(mask, q_pos, k_pos):
        return _hidden(mask, q_pos, k_pos), None
    return _band(mask, q_pos, k_pos), None if mask.sinks else _seen_run(mask, q_pos, k_pos)


def _seen_run(mask: Mask, q_pos: np.ndarray, k_pos: np.ndarray) -> RowRuns:
    """The keys [first, stop) of a ``_banded`` segment each query sees under a mask without
    sinks: those whose offset from it lies in the causal or windowed band, one run."""
    rows, width = len(q_pos), len(k_pos)
    own = int(q_pos[0]) - int(k_pos[0])  # the column of the first query's own position
    beyond = abs(own) + rows + width  # an offset no pair of the segment reaches
    left, right = mask.window if mask.window else (beyond, beyond)
    if mask.causal:
        right = min(right, 0)
    first = np.arange(own - left, own - left + rows)
    np.minimum(np.maximum(first, 0, out=first), width, out=first)
    stop = np.arange(own + right + 1, own + right + 1 + rows)
    np.minimum(np.maximum(stop, first, out=stop), width, out=stop)
    return first, stop


def _row_runs(start: int, stop: int, runs: list[tuple[int, int, RowRuns | None]]) -> RowRuns | None:
    """The keys [first, stop) of the span [``start``, ``stop``) each row sees, relative to its
    start, where each row sees one run of them: its masked segments at most one at each end,
    the one at the start seen as a suffix by every row, the one at the end as a prefix (a
    causal diagonal; a window's far edge and diagonal), or a lone one seen as any run, each
    with its run known (``_seen_run``). None where there is no masked segment or a row may
    see keys apart; the scores are then masked pair by pair (``_scores``)."""
    known = [(lo, hi, run) for lo, hi, run in runs if run is not None]
    if not runs or len(runs) > 2 or len(known) < len(runs):
        return None
    width = stop - start
    first: np.ndarray | None = None
    last: np.ndarray | None = None
    for lo, hi, (head, tail) in known:
        lo, hi = lo - start, hi - start
        none = head == tail
        if lo == 0 and hi == width and len(runs) == 1:
            first, last = head, tail
        elif lo == 0 and (none | (tail == hi)).all():  # at the start: a suffix of it, or nothing
            first = np.where(none, hi, head)
        elif hi == width and (none | (head == 0)).all():  # at the end: a prefix of it, or nothing
            last = lo + tail
        else:
            return None
    first = np.zeros(len(known[0][2][0]), np.int64) if first is None else first
    last = np.full(len(first), width, np.int64) if last is None else last
    return first, np.maximum(first, last)


def _chunks(q_pos: np.ndarray, k_pos: np.ndarray, mask: Mask) -> list[tuple[slice, np.ndarray, Plan]]:
    """The key chunks a call reads in turn, each with its keys' positions and its plan (its
    segments index the chunk): a plain mask's keys in ``chunk_slices``, planned chunk by
    chunk (``_plan``); a window's or documents' keys as one chunk, whose blocks
    ``cptune.calls.kernel_blocks`` keeps to at most ``KEY_CHUNK`` keys each."""
    if not mask.plain:
        return [(slice(0, len(k_pos)), k_pos, kernel_blocks(q_pos, k_pos, mask))]
    return [(chunk, k_pos[chunk], _plan(q_pos, k_pos[chunk], mask)) for chunk in chunk_slices(len(k_pos))]


def _plan(q_pos: np.ndarray, k_pos: np.ndarray, mask: Mask) -> Plan:
    """For each query row block of a plain mask: the key segments it must attend to."""
    causal, seq_len = mask.causal, mask.seq_len
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
    mask: Mask,
    threads: int = 1,
    poll: Callable[[], object] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention of ``q`` [B, H, sq, D] over ``kv`` [2, B, K, sk, D] -> (out [B, H, sq, D],
    lse [B, H, sq]), both float32, under ``mask``. Keys at positions >= its ``seq_len`` are
    padding and masked; rows that see no key get out 0 and lse -inf.

    ``threads`` > 1 spreads the heads over that many threads, each running single-threaded
    BLAS (the caller limits BLAS to one thread): softmax passes then use every core too,
    which a multi-threaded GEMM alone does not, and so do the casts and norms around them
    (``for_each_slice``). ``poll`` is called between blocks by one thread (the MPI engine
    progresses in-flight transfers there)."""
    scaled_q, query_norms = prepare_query(q, threads)
    batch, heads, sq, dim = q.shape
    group = heads // kv.shape[2]
    chunks = _chunks(q_pos, k_pos, mask)
    keys, values, key_norms, values_small = _prepare_keys(kv, threads, _seen_keys(chunks))
    spans = [[(i, j, _spans(segments, q_pos[i:j], chunk_pos, mask)) for i, j, segments in plan if segments]
             for _, chunk_pos, plan in chunks]
    blocks = [(j - i, sum(b - a for a, b, _ in segs)) for _, _, plan in chunks for i, j, segs in plan]
    widest = max((rows * width for rows, width in blocks), default=0)
    most_rows = max((rows for rows, _ in blocks), default=0)
    out = np.zeros((batch, heads, sq, dim), np.float32)  # sum_k e^(score - shift) v, then normalised
    total = np.zeros((batch, heads, sq), np.float32)  # sum_k e^(score - shift)
    shift = np.zeros((batch, heads, sq), np.float32)  # 0 unless a block took the max-shifted path
    lse = np.empty((batch, heads, sq), np.float32)

    def attend_heads(items: list[tuple[int, int]], poll: Callable[[], object] | None) -> None:
        scratch = _Scratch(np.empty(widest, np.float32), np.empty((most_rows, dim), np.float32),
                           np.empty((most_rows, dim), np.float32))
        for b, head in items:
            head_q, q_norms = scaled_q[b, head], query_norms[b, head]
            for (chunk, _, _), chunk_spans in zip(chunks, spans, strict=True):
                head_keys, head_values = keys[b, head // group, chunk], values[b, head // group, chunk]
                k_norms = key_norms[b, head // group, chunk]
                for i, j, block_spans in chunk_spans:
                    rows = (b, head, slice(i, j))
                    block = Block(head_q[i:j], head_keys, head_values, block_spans, scratch, out[rows],
                                  total[rows], shift[rows])
                    bound = q_norms[i:j].max() * max(k_norms[a:z].max() for a, z, _, _ in block_spans)
                    unshifted_safe = values_small and bound <= _UNSHIFTED_EXP_LIMIT
                    if not (unshifted_safe and _attend_unshifted(block)):
                        _attend_shifted(block)
                    if poll is not None:
                        poll()
            _normalise(out[b, head], total[b, head], shift[b, head], lse[b, head])

    items = [(b, head) for b in range(batch) for head in range(heads)]
    workers = min(threads, len(items))
    if workers <= 1:
        attend_heads(items, poll)
    else:
        shares = [items[n::workers] for n in range(workers)]
        jobs = [_executor(threads).submit(attend_heads, share, poll if n == 0 else None)
                for n, share in enumerate(shares)]
        for job in jobs:
            job.result()
    return out, lse


def _normalise(out: np.ndarray, total: np.ndarray, shift: np.ndarray, lse: np.ndarray) -> None:
    """One head's rows, once per call: ``out`` divided by its softmax sum and lse = shift +
    log(sum); a row that saw no key keeps out 0 and gets lse -inf."""
    with np.errstate(divide="ignore"):
        np.log(total, out=lse)
    np.add(lse, shift, out=lse)
    np.putmask(total, total == 0, 1.0)
    np.divide(out, total[:, None], out=out)


def _to_float32(src: np.ndarray, dst: np.ndarray, scale: float | np.floating | None = None,
                norms: np.ndarray | None = None) -> np.floating | None:
    """``src`` [rows, D] as float32 (times ``scale``, in float32, if given) into ``dst``, each
    row's norm into ``norms`` if given. From float16 by bits in one compiled pass
    (``widen_rows``), which also returns the largest magnitude (inf where a NaN or inf is
    held); by numpy otherwise, returning None (no pass that only a caller of values needs)."""
    if src.dtype == np.float16 and dst.flags.c_contiguous:
        halves = np.ascontiguousarray(src).view(np.uint16)
        return widen_rows(halves, dst, np.float32(1.0 if scale is None else scale),
                          np.empty(len(src), np.float32) if norms is None else norms)
    if scale is None:
        np.copyto(dst, src, casting="unsafe")
    else:
        np.multiply(src, np.float32(scale), out=dst, dtype=np.float32)
    if norms is not None:
        np.sqrt(np.einsum("sd,sd->s", dst, dst), out=norms)
    return None


def prepare_query(q: np.ndarray, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``q`` [B, H, sq, D] as float32 scaled by 1/sqrt(head_dim), and each row's norm: the
    per-call work over the query block (a Ring step repeats it for every block it attends).
    Each (batch, head) slice is cast and normed while in cache, the slices shared between
    ``threads``."""
    scaled_q = np.empty(q.shape, np.float32)
    norms = np.empty(q.shape[:-1], np.float32)
    scale = np.float32(1.0 / np.sqrt(q.shape[-1]))

    def prepare(i: tuple[int, ...]) -> None:
        _to_float32(q[i], scaled_q[i], scale, norms[i])

    for_each_slice(q.shape[:-2], threads, prepare)
    return scaled_q, norms


@functools.cache
def _executor(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="cptune-attention")


def for_each_slice(leading: tuple[int, ...], threads: int, work: Callable[[tuple[int, ...]], object]) -> None:
    """``work`` on every index of the ``leading`` (batch, head) axes, the indices shared
    between ``threads`` threads: the passes over memory around the GEMMs then use every core
    a rank has, as the attention itself does."""
    slices = list(np.ndindex(leading))

    def run(share: list[tuple[int, ...]]) -> None:
        for i in share:
            work(i)

    workers = min(threads, len(slices))
    if workers <= 1:
        run(slices)
    else:
        list(_executor(threads).map(run, [slices[n::workers] for n in range(workers)]))


def cast(x: np.ndarray, dtype: np.dtype, threads: int = 1) -> np.ndarray:
    """``x`` in ``dtype``: ``x`` itself when that changes nothing, else a new array, its
    leading (batch, head) slices shared between ``threads``: a cast is a pass over every
    element, and on one thread of a two-thread rank Q's, K's and V's took 10.5 ms of the
    kernel's 72 at 1024 x 12 x d128 (6.3 split). float32 to float16 goes by bits in one
    compiled pass (``narrow``: NumPy's cast took 2 ns an element, 0.7 there)."""
    if x.dtype == dtype:
        return x
    out = np.empty(x.shape, dtype)
    if dtype == np.float32:
        for_each_slice(x.shape[:-2], threads, lambda i: _to_float32(x[i], out[i]))
    elif dtype == np.float16 and x.dtype == np.float32 and x.flags.c_contiguous:
        for_each_slice(x.shape[:-2], threads,
                       lambda i: narrow(x[i].reshape(-1), out[i].reshape(-1).view(np.uint16)))
    else:
        for_each_slice(x.shape[:-2], threads, lambda i: np.copyto(out[i], x[i], casting="unsafe"))
    return out


def _prepare_keys(
    kv: np.ndarray, threads: int, seen: list[tuple[int, int]] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """K and V of ``kv`` [2, B, K, sk, D] as float32, each key's norm, and whether every
    value is small enough for the unshifted softmax, over the key index ranges ``seen`` (all
    keys if None; others are left unset): one pass per (batch, KV head) slice, the slices
    shared between ``threads``. The ranges spare keys no query of the call sees (half of a
    zigzag rank's gathered keys under 8 packed documents: 25 of the 50 ms its cast took)."""
    as_is = kv.dtype == np.float32
    keys = kv[0] if as_is else np.empty(kv.shape[1:], np.float32)
    values = kv[1] if as_is else np.empty(kv.shape[1:], np.float32)
    norms = np.empty(kv.shape[1:-1], np.float32)
    largest = np.zeros(kv.shape[1:-2], np.float32)
    ranges = [slice(start, stop) for start, stop in seen] if seen is not None else [slice(None)]

    def prepare(i: tuple[int, ...]) -> None:
        for r in ranges:
            if as_is:
                np.sqrt(np.einsum("sd,sd->s", keys[i][r], keys[i][r]), out=norms[i][r])
                held = None
            else:
                _to_float32(kv[0][i][r], keys[i][r], norms=norms[i][r])
                held = _to_float32(kv[1][i][r], values[i][r])
            if held is None:  # a NaN makes the largest NaN: the exact path
                held = np.abs(values[i][r]).max(initial=0.0)
            largest[i] = np.maximum(largest[i], held)

    for_each_slice(kv.shape[1:-2], threads, prepare)
    return keys, values, norms, bool(largest.max(initial=0.0) <= _LARGEST_UNSHIFTED_VALUE)


def _seen_keys(chunks: list[tuple[slice, np.ndarray, Plan]]) -> list[tuple[int, int]]:
    """The key index ranges some block of the chunks' plans reads, sorted and joined."""
    ranges = sorted((chunk.start + a, chunk.start + b) for chunk, _, plan in chunks
                    for _, _, segments in plan for a, b, _ in segments)
    joined: list[tuple[int, int]] = []
    for start, stop in ranges:
        if joined and start <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(joined[-1][1], stop))
        else:
            joined.append((start, stop))
    return joined


class _Scratch(NamedTuple):
    """A thread's reused buffers: the scores (the widest block's [rows, keys]), one segment's
    P V and a max-shifted block's output ([rows, D] each)."""

    scores: np.ndarray
    product: np.ndarray
    shifted: np.ndarray


class Block(NamedTuple):
    """One query row block of one head against one key chunk, and the running sums of its
    rows over the call's key chunks, which it adds to."""

    q: np.ndarray  # [rows, D], scaled
    keys: np.ndarray  # [keys, D] of the head's KV head, this chunk's
    values: np.ndarray
    spans: list[Span]  # with the mask's hidden pairs
    scratch: _Scratch
    out: np.ndarray  # [rows, D], sum of e^(score - shift) v, added to
    total: np.ndarray  # [rows], sum of e^(score - shift), added to
    shift: np.ndarray  # [rows], the rows' shift so far (0: unshifted)


def _hidden(mask: Mask, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """Which (query, key) pairs of a masked segment the mask hides ([rows, keys])."""
    if mask.plain:  # causal: a key after the query (padding queries see every real key before them)
        if _consecutive(q_pos) and _consecutive(k_pos):
            return _toeplitz(_offsets(q_pos, k_pos) > 0, len(q_pos), len(k_pos))
        return k_pos[None, :] > q_pos[:, None]
    if _banded(mask, q_pos, k_pos):
        return _band(mask, q_pos, k_pos)
    return ~mask.visible(q_pos[:, None], k_pos[None, :])


def _consecutive(positions: np.ndarray) -> bool:
    return int(positions[-1]) - int(positions[0]) == len(positions) - 1


def _banded(mask: Mask, q_pos: np.ndarray, k_pos: np.ndarray) -> bool:
    """Whether queries and keys are consecutive real positions of one document, where the
    causal mask and a window depend only on key - query (``_band``). The kernel's masked
    segments are (``cptune.calls.kernel_blocks`` cuts its blocks at documents' starts)."""
    if not (_consecutive(q_pos) and _consecutive(k_pos)):
        return False
    q_first, q_last, k_first, k_last = int(q_pos[0]), int(q_pos[-1]), int(k_pos[0]), int(k_pos[-1])
    if max(q_last, k_last) >= mask.seq_len:
        return False
    doc = np.searchsorted(mask.starts, [q_first, q_last, k_first, k_last], side="right")
    return bool((doc == doc[0]).all())


def _offsets(q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """Every key - query offset of consecutive ``q_pos`` and ``k_pos``, ascending."""
    return np.arange(int(k_pos[0]) - int(q_pos[-1]), int(k_pos[-1]) - int(q_pos[0]) + 1)


def _toeplitz(verdicts: np.ndarray, rows: int, keys: int) -> np.ndarray:
    """[rows, keys] view of the verdicts of ``_offsets``: pair (i, j) reads that of offset
    k_pos[j] - q_pos[i], so a mask that depends only on the offset costs one pass over the
    offsets, not the pairs."""
    step = verdicts.strides[0]
    return as_strided(verdicts[rows - 1:], (rows, keys), (-step, step), writeable=False)


def _band(mask: Mask, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """``_hidden`` for a ``_banded`` segment through ``_toeplitz`` views (a band's mask took 9
    passes over the pairs as ``Mask.visible``)."""
    rows, keys = len(q_pos), len(k_pos)
    offsets = _offsets(q_pos, k_pos)
    after = offsets > 0 if mask.causal else np.zeros(len(offsets), bool)
    if not mask.window:
        return _toeplitz(after, rows, keys)
    left, right = mask.window
    outside = (offsets < -left) | (offsets > right)
    if not mask.sinks:
        return _toeplitz(after | outside, rows, keys)
    start = int(mask.starts[np.searchsorted(mask.starts, int(k_pos[0]), side="right") - 1])
    sink = (k_pos - start < mask.sinks)[None, :]  # seen beside the window, never after the query
    return _toeplitz(after, rows, keys) | (_toeplitz(outside, rows, keys) & ~sink)


def _scores(block: Block, by_runs: bool = False) -> list[np.ndarray]:
    """Q K^T for each span of keys, in slices of the scores buffer, masked where needed; with
    ``by_runs`` a span whose rows each see one run of it is left to ``_exp`` to mask."""
    rows = block.q.shape[0]
    scores = []
    offset = 0
    for start, stop, masked, runs in block.spans:
        s = block.scratch.scores[offset : offset + rows * (stop - start)].reshape(rows, stop - start)
        offset += s.size
        np.matmul(block.q, block.keys[start:stop].T, out=s)
        if not (by_runs and runs is not None):
            for lo, hi, hidden in masked:
                np.copyto(s[:, lo - start : hi - start], -np.inf, where=hidden)
        scores.append(s)
    return scores


def _exp(scores: list[np.ndarray], shift: np.ndarray, spans: list[Span] | None = None) -> np.ndarray:
    """exp(scores - ``shift`` [rows]) in place (``exp_rows``, compiled), with the ``spans``
    whose rows each see one run masked by it (``exp_rows_within``, from ``_scores(by_runs=True)``);
    returns the row sums."""
    total = np.zeros(scores[0].shape[0], dtype=np.float32)
    for n, s in enumerate(scores):
        runs = None if spans is None else spans[n][3]
        if runs is None:
            exp_rows(s, shift, total)
        else:
            exp_rows_within(s, shift, total, *runs)
    return total


def _combine(block: Block, scores: list[np.ndarray], out: np.ndarray) -> None:
    """Add sum_k p V of every span to ``out`` [rows, D]."""
    product = block.scratch.product[: out.shape[0]]
    for s, (start, stop, _, _) in zip(scores, block.spans, strict=True):
        np.matmul(s, block.values[start:stop], out=product)
        np.add(out, product, out=out)


def _attend_shifted(block: Block) -> None:
    """The block with the exact max-shifted softmax, merged into the rows' sums: both are
    brought to the larger of the two shifts."""
    scores = _scores(block)
    row_max = scores[0].max(axis=1)
    for s in scores[1:]:
        np.maximum(row_max, s.max(axis=1), out=row_max)
    seen = np.isfinite(row_max)
    if not seen.all():
        row_max[~seen] = 0.0  # rows with no visible key: exp(-inf - 0) = 0 below
    total = _exp(scores, row_max)
    out = block.scratch.shifted[: len(total)]
    out.fill(0.0)
    _combine(block, scores, out)
    new = np.maximum(block.shift, row_max)
    old_weight, weight = np.exp(block.shift - new), np.exp(row_max - new)
    np.multiply(block.out, old_weight[:, None], out=block.out)
    np.multiply(out, weight[:, None], out=out)
    np.add(block.out, out, out=block.out)
    np.copyto(block.total, block.total * old_weight + total * weight)
    np.copyto(block.shift, new)


def _attend_unshifted(block: Block) -> bool:
    """The block without the max shift (the caller checked exp cannot overflow), added to
    the rows' sums. Returns False, adding nothing, if some row's sum is too small to trust;
    a row that sees none of the block's keys (sum 0: a seen key's exp is at least e^-50)
    adds nothing, where it used to send the block down the exact path."""
    scores = _scores(block, by_runs=True)
    total = _exp(scores, np.zeros(block.q.shape[0], np.float32), block.spans)
    if ((total > 0) & (total < _SMALLEST_UNSHIFTED_SUM)).any():
        return False
    if block.shift.any():  # a row already shifted: bring both to the larger shift (weights <= 1)
        new = np.maximum(block.shift, 0.0)
        old_weight, weight = np.exp(block.shift - new), np.exp(-new)
        np.multiply(block.out, old_weight[:, None], out=block.out)
        np.multiply(block.total, old_weight, out=block.total)
        np.copyto(block.shift, new)
        for s in scores:
            s *= weight[:, None]
        total *= weight
    _combine(block, scores, block.out)
    np.add(block.total, total, out=block.total)
    return True


def merge(
    acc: tuple[np.ndarray, np.ndarray] | None, part: tuple[np.ndarray, np.ndarray], threads: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Combine two partials over disjoint keys: lse = log(e^lse_a + e^lse_b) and each output
    weighted by e^(its lse - lse). Reuses ``acc``'s arrays; the outputs' (batch, head) slices
    are shared between ``threads``."""
    if acc is None:
        return part
    acc_out, acc_lse = acc
    part_out, part_lse = part
    lse = np.logaddexp(acc_lse, part_lse)
    none_seen = np.isneginf(lse)
    with np.errstate(invalid="ignore"):
        w_acc = np.where(none_seen, 0.0, np.exp(acc_lse - lse)).astype(np.float32)
        w_part = np.where(none_seen, 0.0, np.exp(part_lse - lse)).astype(np.float32)

    def weigh(i: tuple[int, ...]) -> None:
        acc_out[i] *= w_acc[i][:, None]
        acc_out[i] += part_out[i] * w_part[i][:, None]

    for_each_slice(acc_out.shape[:-2], threads, weigh)
    return acc_out, lse


def attention_grad(
    q: np.ndarray,
    kv: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    dout: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    *,
    mask: Mask,
    threads: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of attention of ``q`` [B, H, sq, D] over the keys of ``kv`` [2, B, K, sk, D]
    -> (dq [B, H, sq, D], dkv [2, B, K, sk, D]), both float32: FlashAttention-2's backward.

    ``out`` and ``lse`` are the layer's final output and log-sum-exp over all its keys, of
    which these may be a subset (a Ring step, one rank's share), and ``dout`` is dL/d(out).
    Each key's probability is then exp(score - lse), final and at most 1 (no max shift),
    so subsets are independent: dq is this subset's share of dQ (shares over disjoint
    subsets sum to it), dkv holds dK and dV of these keys from these queries. Masks and
    blocks are the forward's (``_chunks``); rows with lse -inf see no key.

    ``threads`` > 1 splits the (batch, head) items into contiguous runs, one per thread;
    under GQA/MQA a KV head whose query heads fall in two runs is accumulated by each
    thread apart and summed after, so no two threads write one array."""
    batch, heads, sq, dim = q.shape
    kv_heads, sk = kv.shape[2], kv.shape[3]
    group = heads // max(kv_heads, 1)
    scaled_q, grad_out, delta, safe_lse = _prepare_grad_rows(q, out, lse, dout, threads)
    kv32 = cast(kv, np.dtype(np.float32), threads)
    chunks = _chunks(q_pos, k_pos, mask)
    masked = [[[(a, z, _masking(mask, q_pos[i:j], chunk_pos[a:z]) if cut else None) for a, z, cut in segments]
               for i, j, segments in plan] for _, chunk_pos, plan in chunks]
    blocks = [(j - i, b - a) for _, _, plan in chunks for i, j, segments in plan for a, b, _ in segments]
    widest = max((rows * keys for rows, keys in blocks), default=0)
    most_rows = max((rows for rows, _ in blocks), default=0)
    most_keys = max((keys for _, keys in blocks), default=0)
    dq = np.zeros((batch, heads, sq, dim), np.float32)
    dkv = np.zeros((2, batch, kv_heads, sk, dim), np.float32)
    scale = np.float32(1.0 / np.sqrt(dim))

    items = [(b, head) for b in range(batch) for head in range(heads)]
    workers = max(1, min(threads, len(items)))
    shares = [items[len(items) * n // workers : len(items) * (n + 1) // workers] for n in range(workers)]
    owners: dict[tuple[int, int], set[int]] = {}
    for n, share in enumerate(shares):
        for b, head in share:
            owners.setdefault((b, head // group), set()).add(n)
    split = {kv_head for kv_head, who in owners.items() if len(who) > 1}

    def grad_heads(share: list[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
        scratch = _GradScratch(
            np.empty(widest, np.float32), np.empty(widest, np.float32),
            np.empty((most_keys, dim), np.float32), np.empty((most_rows, dim), np.float32),
            np.zeros(most_rows, np.float32),
        )
        partial: dict[tuple[int, int], np.ndarray] = {}
        for b, head in share:
            kv_head = (b, head // group)
            if kv_head in split:
                target = partial.setdefault(kv_head, np.zeros((2, sk, dim), np.float32))
            else:
                target = dkv[:, b, head // group]
            for (chunk, _, plan), chunk_masked in zip(chunks, masked, strict=True):
                keys, values = kv32[0, b, head // group, chunk], kv32[1, b, head // group, chunk]
                for (i, j, segments), segments_masked in zip(plan, chunk_masked, strict=True):
                    if segments:
                        _grad_block(
                            _GradBlock(scaled_q[b, head, i:j], grad_out[b, head, i:j], safe_lse[b, head, i:j],
                                       delta[b, head, i:j], keys, values, segments_masked,
                                       dq[b, head, i:j], target[0, chunk], target[1, chunk]),
                            scratch,
                        )
            dq[b, head] *= scale
        return partial

    partials = [grad_heads(shares[0])] if workers <= 1 else list(_executor(threads).map(grad_heads, shares))
    for partial in partials:
        for (b, kv_head), grads in partial.items():
            dkv[:, b, kv_head] += grads
    return dq, dkv


def _prepare_grad_rows(
    q: np.ndarray, out: np.ndarray, lse: np.ndarray, dout: np.ndarray, threads: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-call work over the query rows, once per (batch, head) slice while it is in cache:
    Q as float32 scaled by 1/sqrt(head_dim) (dK = scale dS^T Q takes it as is), dout as
    float32, D = rowsum(dout * out), and lse with -inf made +inf so that exp(score - lse)
    is 0 on rows that see no key rather than NaN."""
    scaled_q = np.empty(q.shape, np.float32)
    grad_out = np.empty(dout.shape, np.float32)
    delta = np.empty(q.shape[:-1], np.float32)
    safe_lse = np.empty(q.shape[:-1], np.float32)
    scale = np.float32(1.0 / np.sqrt(q.shape[-1]))

    def prepare(i: tuple[int, ...]) -> None:
        _to_float32(q[i], scaled_q[i], scale)
        _to_float32(dout[i], grad_out[i])
        final = out[i]
        if final.dtype != np.float32:
            final = np.empty(final.shape, np.float32)
            _to_float32(out[i], final)
        np.einsum("qd,qd->q", grad_out[i], final, out=delta[i])
        np.copyto(safe_lse[i], lse[i], casting="unsafe")
        np.putmask(safe_lse[i], np.isneginf(safe_lse[i]), np.inf)

    for_each_slice(q.shape[:-2], threads, prepare)
    return scaled_q, grad_out, delta, safe_lse


class _GradBlock(NamedTuple):
    """One query row block of one head against one key chunk, for the backward."""

    q: np.ndarray  # [rows, D], scaled
    dout: np.ndarray  # [rows, D], float32
    lse: np.ndarray  # [rows], +inf where the row sees no key
    delta: np.ndarray  # [rows], rowsum(dout * out)
    keys: np.ndarray  # [keys, D] of the chunk
    values: np.ndarray
    segments: list[GradSegment]  # with the mask's hidden pairs or each row's run (``_masking``)
    dq: np.ndarray  # [rows, D], accumulated (unscaled)
    dk: np.ndarray  # [keys, D], accumulated
    dv: np.ndarray  # [keys, D], accumulated


class _GradScratch(NamedTuple):
    """A thread's reused buffers: probabilities and their gradients (the widest segment's
    [rows, keys] each), the [keys, D] and [rows, D] products before they are added, and the
    probabilities' row sums ``exp_rows`` adds to (unused: the final lse normalises them)."""

    probs: np.ndarray
    grads: np.ndarray
    key_part: np.ndarray
    row_part: np.ndarray
    sums: np.ndarray


def _grad_block(block: _GradBlock, scratch: _GradScratch) -> None:
    """Add one block's share to dQ, dK and dV, segment by segment: with the final lse no
    segment needs another's scores, so each reuses the same buffers."""
    rows = block.q.shape[0]
    for start, stop, masking in block.segments:
        keys, values = block.keys[start:stop], block.values[start:stop]
        p = scratch.probs[: rows * (stop - start)].reshape(rows, stop - start)
        ds = scratch.grads[: p.size].reshape(p.shape)
        key_part, row_part = scratch.key_part[: stop - start], scratch.row_part[:rows]
        np.matmul(block.q, keys.T, out=p)
        hidden, run = masking if masking is not None else (None, None)
        if run is not None:  # P = exp(S - lse) <= 1, on each row's run only
            exp_rows_within(p, block.lse, scratch.sums[:rows], *run)
        else:
            if hidden is not None:
                np.copyto(p, -np.inf, where=hidden)
            exp_rows(p, block.lse, scratch.sums[:rows])
        np.matmul(p.T, block.dout, out=key_part)  # dV += P^T dout
        np.add(block.dv[start:stop], key_part, out=block.dv[start:stop])
        np.matmul(block.dout, values.T, out=ds)  # dP = dout V^T
        np.subtract(ds, block.delta[:, None], out=ds)
        np.multiply(ds, p, out=ds)  # dS = P (dP - D)
        np.matmul(ds, keys, out=row_part)  # dQ += dS K (scaled at the end)
        np.add(block.dq, row_part, out=block.dq)
        np.matmul(ds.T, block.q, out=key_part)  # dK += dS^T (scale Q)
        np.add(block.dk[start:stop], key_part, out=block.dk[start:stop])
