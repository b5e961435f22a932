"""The fast solver's loops over sequences, compiled (Numba): the frontier of sizes each
sequence can take, the bisection on the makespan over them (step 2) and each sequence, longest
first, into the group where it finishes soonest (step 3). They run per sequence (the placement
per sequence per partition tried: thousands of times a solve), where the interpreter's cost per
step was most of the solve's time. Each returns exactly what the NumPy and ``heapq`` code before
it did: the same comparisons, ties and sums in the same order."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit


def _compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` compiled on first call, its machine code cached beside this file or in the
    user's cache directory, whichever is writable; where neither is, compiled in each process."""
    try:
        return njit(cache=True)(function)
    except RuntimeError:  # Numba found no writable cache directory
        return njit(function)


@_compiled
def place_longest_first(ordered: np.ndarray, start: int, stop: int, heap_time: np.ndarray,
                        heap_group: np.ndarray, first: np.ndarray, count: np.ndarray,
                        placed: np.ndarray, span: float) -> float:
    """Places the sequences ``start:stop`` of ``ordered`` (sequences x classes: each one's time
    on each class of groups) and returns the makespan so far, from ``span``. A class's groups are
    a binary heap by (time, group) in ``heap_time``/``heap_group[first[c]:first[c] + count[c]]``;
    a sequence goes to the class where it ends soonest (of equals, the first), onto its least
    busy group (of equals, the lowest numbered), whose number goes into ``placed``. inf when
    one fits no class."""
    for s in range(start, stop):
        finish = math.inf
        k = 0
        for c in range(first.size):
            end = heap_time[first[c]] + ordered[s, c]
            if end < finish:
                finish = end
                k = c
        low, n = first[k], count[k]
        group = heap_group[low]
        i = 0  # the heap's top replaced by (finish, group), sifted down
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            right = child + 1
            if right < n and (heap_time[low + right] < heap_time[low + child] or (
                    heap_time[low + right] == heap_time[low + child]
                    and heap_group[low + right] < heap_group[low + child])):
                child = right
            child_time, child_group = heap_time[low + child], heap_group[low + child]
            if child_time < finish or (child_time == finish and child_group < group):
                heap_time[low + i], heap_group[low + i] = child_time, child_group
                i = child
            else:
                break
        heap_time[low + i], heap_group[low + i] = finish, group
        placed[s] = group
        if finish > span:
            span = finish
    return span


@_compiled
def frontiers(best: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                             np.ndarray]:
    """Each sequence's frontier of sizes (``best``: sizes x sequences, its time on a group of each
    size, in size order): the sizes faster than every smaller one (a smaller one as fast spends
    fewer rank-seconds) and of no more rank-time than any larger such one. In size order the
    frontier's times fall and its rank-times rise, so the size a sequence takes at a makespan is
    the entry within it whose predecessor (inf for the first) is not. Returns the entries, by size
    and each size's by sequence (``front``: the time, ``before``: the predecessor's, and the
    size's place), each sequence's least time and its least rank-time."""
    count, n = best.shape
    frontier = np.empty((count, n), dtype=np.bool_)
    fastest = np.full(n, math.inf)
    for i in range(count):
        for s in range(n):
            frontier[i, s] = best[i, s] < fastest[s]
            fastest[s] = min(fastest[s], best[i, s])
    cheapest = np.full(n, math.inf)  # of the larger faster sizes
    for i in range(count - 1, -1, -1):
        for s in range(n):
            rank_time = best[i, s] * sizes[i]
            if frontier[i, s]:
                within = rank_time <= cheapest[s]
                cheapest[s] = min(cheapest[s], rank_time)
                frontier[i, s] = within
    entries = int(frontier.sum())
    front, before = np.empty(entries), np.empty(entries)
    front_size = np.empty(entries, dtype=np.int64)
    before_so_far = np.full(n, math.inf)
    e = 0
    for i in range(count):
        for s in range(n):
            if frontier[i, s]:
                front[e], before[e], front_size[e] = best[i, s], before_so_far[s], i
                before_so_far[s] = best[i, s]
                e += 1
    return front, before, front_size, fastest, cheapest


@_compiled
def counts_within(front: np.ndarray, before: np.ndarray, front_size: np.ndarray, sizes: np.ndarray,
                  low: float, ranks: int) -> np.ndarray:
    """How many groups of each size (step 2): the least makespan, by bisection from ``low`` to
    within 0.1%, whose groups fit ``ranks`` ranks, then the ranks left over as more groups of
    the sizes whose groups are fullest. Each sequence's frontier entries (``front``: its time on
    a size, ``before``: its previous entry's, ``front_size``: the size's place) are taken where
    the makespan falls between the two. Empty when no makespan's groups fit."""
    loads = np.zeros(sizes.size)
    counts = np.zeros(sizes.size, dtype=np.int64)

    def needed(limit: float) -> int:
        loads[:] = 0.0
        for e in range(front.size):  # summed in entry order, as NumPy's bincount does
            if front[e] <= limit and before[e] > limit:
                loads[front_size[e]] += front[e]
        used = 0
        for i in range(sizes.size):
            counts[i] = np.int64(math.ceil(loads[i] / limit - 1e-9))
            used += sizes[i] * counts[i]
        return used

    high = low
    for _ in range(60):
        if needed(high) <= ranks:
            break
        high *= 2
    else:
        return np.zeros(0, dtype=np.int64)
    for _ in range(40):  # to within 0.1%: the groups are whole, a finer makespan moves none
        if high / low < 1 + 1e-3:
            break
        middle = math.sqrt(low * high)
        if needed(middle) <= ranks:
            high = middle
        else:
            low = middle
    spare = ranks - needed(high)
    while True:  # the ranks left over: one group more of the size whose groups are fullest (first of equals)
        fullest, most = -1, -math.inf
        for i in range(sizes.size):
            if sizes[i] <= spare and loads[i] > 0:
                fill = loads[i] / max(counts[i], 1)
                if fill > most:
                    fullest, most = i, fill
        if fullest < 0:
            return counts
        counts[fullest] += 1
        spare -= sizes[fullest]
