"""The fused attention calls one step of a rank's attention takes.

Queries at some token positions attend to keys at others (causal: each query to the keys at
or before its position; padding keys, at ``seq_len`` or beyond, never count for a real query).
A fused kernel runs a call unmasked, or with its own causal mask; this module cuts a step into
as few such calls as its positions allow, with no mask tensor and no copy of the inputs:

- every call reads one index range of the queries and one of the keys;
- a causal call is square, over queries and keys that hold the same increasing positions, so
  the kernel's alignment of the diagonal (upper-left or lower-right) does not matter;
- the key ranges a query range sees in full are joined where they are adjacent, and query
  ranges that see the same keys are joined where they are adjacent.

So a Ring step is one call (its own block: one square causal call over both zigzag chunks),
Ulysses and local attention one, AllGather-KV's gathered keys in position order (the layout's
``gather_order``) at most two per query chunk (the keys before it, then its square diagonal),
whatever the rank count. Pure and cached: the engine, the prior and the tests read the same plan.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import numpy as np

from cptune.layout import SequenceLayout, position_runs

#: (first index, stop index, first position) of each run of consecutive positions.
Runs = tuple[tuple[int, int, int], ...]


class Call(NamedTuple):
    """One fused kernel call: the queries at index range ``rows`` over the keys at index range
    ``keys``, unmasked or (``causal``) square with the same increasing positions on both sides."""

    rows: slice
    keys: slice
    causal: bool


def runs_of(positions: np.ndarray) -> Runs:
    """``positions`` as its runs of consecutive positions (what the plan depends on)."""
    return tuple((start, stop, int(positions[start])) for start, stop in position_runs(positions))


def attention_calls(q_pos: np.ndarray, k_pos: np.ndarray, causal: bool, seq_len: int) -> tuple[Call, ...]:
    """The calls that attend queries at ``q_pos`` to keys at ``k_pos`` (see the module
    docstring). Rows no call names see no key (their output is 0, their log-sum-exp -inf).
    Padding keys are left out when not causal; when causal only padding queries could see
    them, and those rows' outputs are dropped, so they may."""
    if len(q_pos) == 0 or len(k_pos) == 0:
        return ()
    if q_pos.flags.writeable or k_pos.flags.writeable:
        return _calls(runs_of(q_pos), runs_of(k_pos), causal, seq_len)
    # read-only arrays (a layout's) cannot change: their plan is kept while they live, so a
    # step of a layout already seen costs no pass over its positions
    key = (id(q_pos), id(k_pos), causal, seq_len)
    if key not in _BY_ARRAYS:
        _BY_ARRAYS[key] = _calls(runs_of(q_pos), runs_of(k_pos), causal, seq_len)
        for positions in (q_pos, k_pos):
            weakref.finalize(positions, _BY_ARRAYS.pop, key, None)
    return _BY_ARRAYS[key]


#: Plans of read-only position arrays by the arrays' identity, each dropped with its arrays.
_BY_ARRAYS: dict[tuple[int, int, bool, int], tuple[Call, ...]] = {}


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
