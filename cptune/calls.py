"""The fused attention calls one step of a rank's attention takes.

Queries at some token positions attend to keys at others, under the workload's mask
(``cptune.masks.Mask``: causal, a window, sinks, packed documents; padding keys, at
``seq_len`` or beyond, never count for a real query). A fused kernel runs a call unmasked,
or with its own causal mask; this module cuts a step into as few such calls as its positions
allow, with no mask tensor and no copy of the inputs:

- every call reads one index range of the queries and one of the keys;
- a causal call is square, over queries and keys that hold the same increasing positions, so
  the kernel's alignment of the diagonal (upper-left or lower-right) does not matter;
- the key ranges a query range sees in full are joined where they are adjacent, and query
  ranges that see the same keys are joined where they are adjacent;
- what a mask leaves neither all seen nor all hidden beyond the causal diagonal (a window's
  far edge, sinks the causal mask reaches only in part) is a ``masked`` call: the engine
  applies the mask by position there (``Mask.visible``). A window's query runs are cut
  into tiles (``window_tile``) so those calls stay a small share of the work.

No call holds only keys its queries cannot see. So a Ring step is one call (its own block:
one square causal call over both zigzag chunks), Ulysses and local attention one,
AllGather-KV's gathered keys in position order (the layout's ``gather_order``) at most two
per query chunk (the keys before it, then its square diagonal), whatever the rank count;
documents and windows add calls per document and per tile. Pure and cached: the engine, the
prior and the tests read the same plan.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import numpy as np

from cptune.kernels import even_pieces, rows_per_block
from cptune.layout import SequenceLayout, position_runs
from cptune.masks import Mask, Ranges

#: (first index, stop index, first position) of each run of consecutive positions.
Runs = tuple[tuple[int, int, int], ...]


class Call(NamedTuple):
    """One fused kernel call: the queries at index range ``rows`` over the keys at index range
    ``keys``, unmasked or (``causal``) square with the same increasing positions on both sides,
    or (``masked``) with the mask applied by position (``Mask.visible``)."""

    rows: slice
    keys: slice
    causal: bool
    masked: bool = False


def runs_of(positions: np.ndarray) -> Runs:
    """``positions`` as its runs of consecutive positions (what the plan depends on)."""
    return tuple((start, stop, int(positions[start])) for start, stop in position_runs(positions))


def attention_calls(q_pos: np.ndarray, k_pos: np.ndarray, mask: Mask) -> tuple[Call, ...]:
    """The calls that attend queries at ``q_pos`` to keys at ``k_pos`` under ``mask`` (see
    the module docstring). Rows no call names see no key (their output is 0, their
    log-sum-exp -inf). Padding keys are left out where a mask cuts by position; under a plain
    causal mask only padding queries could see them, and those rows' outputs are dropped, so
    they may."""
    if len(q_pos) == 0 or len(k_pos) == 0:
        return ()
    if q_pos.flags.writeable or k_pos.flags.writeable:
        return _planned(runs_of(q_pos), runs_of(k_pos), mask)
    # read-only arrays (a layout's) cannot change: their plan is kept while they live, so a
    # step of a layout already seen costs no pass over its positions
    key = (id(q_pos), id(k_pos), mask)
    if key not in _BY_ARRAYS:
        _BY_ARRAYS[key] = _planned(runs_of(q_pos), runs_of(k_pos), mask)
        for positions in (q_pos, k_pos):
            weakref.finalize(positions, _BY_ARRAYS.pop, key, None)
    return _BY_ARRAYS[key]


def any_seen(q_pos: np.ndarray, k_pos: np.ndarray, mask: Mask) -> bool:
    """Whether some query at ``q_pos`` sees some key at ``k_pos`` under ``mask``: where none
    does an engine makes no kernel call (a Ring step the mask empties)."""
    if mask.plain:
        real_q, real_k = q_pos[q_pos < mask.seq_len], k_pos[k_pos < mask.seq_len]
        return bool(len(real_q) and len(real_k) and (not mask.causal or real_k.min() <= real_q.max()))
    return bool(attention_calls(q_pos, k_pos, mask))


#: Plans of read-only position arrays by the arrays' identity, each dropped with its arrays.
_BY_ARRAYS: dict[tuple[int, int, Mask], tuple[Call, ...]] = {}


def _planned(q_runs: Runs, k_runs: Runs, mask: Mask) -> tuple[Call, ...]:
    if mask.plain:
        return _calls(q_runs, k_runs, mask.causal, mask.seq_len)
    return _masked_calls(q_runs, k_runs, mask)


def window_tile(mask: Mask) -> int:
    """Query rows per tile under a window: a quarter of its reach, so the calls the mask
    applies by position (each tile's far edge) hold about 1/8 of the work, and a causal tile's
    diagonal square lies inside the window (so it is a plain causal call)."""
    return max(1, (max(mask.window) + 1) // 4) if mask.window else 2**62


@functools.lru_cache(maxsize=1024)
def _masked_calls(q_runs: Runs, k_runs: Runs, mask: Mask) -> tuple[Call, ...]:
    """The calls of a mask with a window or documents: per query piece (a run cut at
    documents' starts and into window tiles), the keys every query of it sees (unmasked
    calls, joined where adjacent), the causal diagonal where its keys hold the same
    positions (a square causal call), and what the mask leaves in between (masked calls)."""
    tile = window_tile(mask)
    pieces: list[tuple[int, int, tuple[tuple[int, int, bool, bool], ...]]] = []
    for q_start, q_stop, q_first in q_runs:
        for a, b in mask.document_runs(q_first, q_first + q_stop - q_start - 1):
            for first in range(a, b + 1, tile):
                last = min(first + tile - 1, b)
                seen = _seen_keys(first, last, k_runs, mask)
                if not seen:
                    continue
                rows = (q_start + first - q_first, q_start + last + 1 - q_first)
                previous = pieces[-1] if pieces else None
                if previous is not None and previous[1] == rows[0] and previous[2] == seen and not any(
                        causal or masked for _, _, causal, masked in seen):
                    pieces[-1] = (previous[0], rows[1], seen)  # the same keys in full: one call
                else:
                    pieces.append((rows[0], rows[1], seen))
    return tuple(Call(slice(start, stop), slice(k_lo, k_hi), causal, masked)
                 for start, stop, seen in pieces for k_lo, k_hi, causal, masked in seen)


def _seen_keys(first: int, last: int, k_runs: Runs, mask: Mask) -> tuple[tuple[int, int, bool, bool], ...]:
    """(key index start, stop, causal, masked) of the calls queries at positions first..last
    (inside one document) take over keys at ``k_runs``: the square causal diagonal where a
    run holds all of its positions, the keys every query sees (unmasked, joined where
    adjacent), and those only some see (masked)."""
    some, every = mask.seen_ranges(first, last)
    calls: list[tuple[int, int, bool, bool]] = []
    full: list[tuple[int, int]] = []
    for k_start, k_stop, k_first in k_runs:
        run = ((k_first, k_first + k_stop - k_start),)
        square: Ranges = ()
        if mask.causal and k_first <= first and last < run[0][1]:
            square = ((first, last + 1),)
            calls.append((k_start + first - k_first, k_start + last + 1 - k_first, True, False))
        seen_all = _minus(_meet(every, run), square)
        full += [(k_start + lo - k_first, k_start + hi - k_first) for lo, hi in seen_all]
        calls += [(k_start + lo - k_first, k_start + hi - k_first, False, True)
                  for lo, hi in _minus(_minus(_meet(some, run), every), square)]
    calls += [(lo, hi, False, False) for lo, hi in _joined(full)]
    return tuple(sorted(calls))


def _meet(ranges: Ranges, other: Ranges) -> Ranges:
    """The positions in both ``ranges`` and ``other`` (each ascending and disjoint)."""
    return tuple((max(a, c), min(b, d)) for a, b in ranges for c, d in other if max(a, c) < min(b, d))


def _minus(ranges: Ranges, cut: Ranges) -> Ranges:
    """The positions of ``ranges`` outside ``cut`` (each ascending and disjoint)."""
    left: list[tuple[int, int]] = []
    for lo, hi in ranges:
        at = lo
        for a, b in cut:
            if b <= at or a >= hi:
                continue
            if a > at:
                left.append((at, a))
            at = max(at, b)
        if at < hi:
            left.append((at, hi))
    return tuple(left)


def _joined(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Index ranges sorted, adjacent ones joined."""
    joined: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if joined and joined[-1][1] == start:
            joined[-1] = (joined[-1][0], stop)
        else:
            joined.append((start, stop))
    return tuple(joined)


def _increasing(runs: Runs) -> bool:
    return all(b[2] > a[2] + (a[1] - a[0]) - 1 for a, b in zip(runs, runs[1:], strict=False))


@functools.lru_cache(maxsize=1024)
def _calls(q_runs: Runs, k_runs: Runs, causal: bool, seq_len: int) -> tuple[Call, ...]:
    rows = q_runs[-1][1]
    if not causal:
        real = [(start, start + min(stop - start, seq_len - first)) for start, stop, first in k_runs
                if first < seq_len]
        return tuple(Call(slice(0, rows), slice(*keys), False) for keys in _joined(real))
    if q_runs == k_runs and _increasing(q_runs):
        return (Call(slice(0, rows), slice(0, rows), True),)
    # (rows, the key ranges those rows see in full, their square diagonal or None)
    segments: list[tuple[tuple[int, int], tuple[tuple[int, int], ...], tuple[int, int] | None]] = []
    for q_start, q_stop, q_first in q_runs:
        q_last = q_first + q_stop - q_start - 1
        cuts = {q_start, q_stop}
        for k_start, k_stop, k_first in k_runs:
            k_last = k_first + k_stop - k_start - 1
            low, high = max(q_first, k_first), min(q_last, k_last)
            if low <= high:  # these keys meet the queries' diagonal: cut the rows where they do
                cuts |= {q_start + low - q_first, q_start + high + 1 - q_first}
        edges = sorted(cuts)
        for start, stop in zip(edges, edges[1:], strict=False):
            first, last = q_first + start - q_start, q_first + stop - 1 - q_start
            full, diagonal = [], None
            for k_start, k_stop, k_first in k_runs:
                before = min(k_stop - k_start, max(0, first - k_first))  # keys before every query here
                if before:
                    full.append((k_start, k_start + before))
                if k_first <= first and last <= k_first + k_stop - k_start - 1:
                    diagonal = (k_start + first - k_first, k_start + last + 1 - k_first)
            segment = ((start, stop), _joined(full), diagonal)
            previous = segments[-1] if segments else None
            if (previous is not None and previous[0][1] == start and previous[1] == segment[1]
                    and previous[2] is None and diagonal is None):
                segments[-1] = ((previous[0][0], stop), segment[1], None)
            else:
                segments.append(segment)
    calls = []
    for (start, stop), seen, square in segments:
        calls += [Call(slice(start, stop), slice(*keys), False) for keys in seen]
        if square is not None:
            calls.append(Call(slice(start, stop), slice(*square), True))
    return tuple(calls)


def busiest_calls(layout: SequenceLayout) -> int:
    """The fused calls the busiest rank of ``layout``'s configuration makes over all its steps,
    as ``attention_calls`` plans them (``tests/test_torch_engine.py`` checks the two agree), in
    closed form so that any size costs the same: the Ring one per step whose block holds a real
    key; AllGather-KV over zigzag blocks two per query chunk, but the first chunk has no keys
    before it (three calls on two blocks, four from three on); one otherwise."""
    workload, c = layout.workload, layout.context_degree
    if layout.config.strategy == "ring" and c > 1:
        return c if workload.causal else min(c, -(-workload.seq_len // (layout.padded_len // c)))
    if layout.config.strategy == "allgather_kv" and layout.zigzag:
        return 3 if c == 2 else 4
    return 1


#: A key segment of a numpy kernel block: key index range [start, stop) and whether the mask
#: must be applied there (some of the block's queries do not see all of it).
Segment = tuple[int, int, bool]


def kernel_blocks(q_pos: np.ndarray, k_pos: np.ndarray, mask: Mask) -> list[tuple[int, int, list[Segment]]]:
    """The numpy kernel's plan (``cptune.engines.mpi``) under a mask with a window or
    documents over all of a call's keys, and what the cost model counts it computing: query
    row blocks of at most ``rows_per_block`` rows (and a window's tile), cut where documents
    begin, and per block the key segments some of its queries see: those every query sees
    unmasked, the rest (a causal diagonal, a window's far edge) masked, so the mask's passes
    cover only what it cuts (8 causal documents of 2,048 on 8,192 queries ran 1.3x faster
    than with each segment masked whole). A block that sees more than ``KEY_CHUNK`` keys is
    cut into blocks of the same rows over equal runs of them (``key_chunk``), so its K, V and
    scores stay in cache as a plain call's chunks do; the keys are not cut into chunks
    first, which split every window tile a chunk's edge crossed into two smaller blocks (a
    rank's windowed call ran 0.95x as long without). Padding queries are in no block."""
    rows = min(rows_per_block(len(k_pos)), window_tile(mask))
    k_runs = runs_of(k_pos) if len(k_pos) else ()
    plan: list[tuple[int, int, list[Segment]]] = []
    for q_start, q_stop, q_first in runs_of(q_pos) if len(q_pos) else ():
        for a, b in mask.document_runs(q_first, q_first + q_stop - q_start - 1):
            for first in range(a, b + 1, rows):
                last = min(first + rows - 1, b)
                some, every = mask.seen_ranges(first, last)
                segments: list[Segment] = []
                for k_start, k_stop, k_first in k_runs:
                    run = _meet(some, ((k_first, k_first + k_stop - k_start),))
                    parts = [(lo, hi, False) for lo, hi in _meet(run, every)]
                    parts += [(lo, hi, True) for lo, hi in _minus(run, every)]
                    segments += [(k_start + lo - k_first, k_start + hi - k_first, masked)
                                 for lo, hi, masked in sorted(parts)]
                i, j = q_start + first - q_first, q_start + last + 1 - q_first
                plan += [(i, j, piece) for piece in even_pieces(segments)]
    return plan
