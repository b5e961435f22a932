"""A plan per batch: the ranks split into CP groups of any sizes the configurations allow, a
configuration per group, and which sequences each group runs, for the lowest predicted makespan
(the slowest group's time) with every sequence within a rank's memory.

A group runs its sequences one after another, each as one attention call of its configuration
(a forward, or a forward and backward in training): its time is their sum, and a rank's memory
holds the largest of them (``MixCosts.shared_max``: all the batch's ranks are busy at once).

The fast solver (``plan_batch``), meant to run every step:
1. each sequence's time on a group of each size, its size's best configuration for it alone;
2. bisection on the makespan T: each sequence takes the size that spends the fewest rank-seconds
   on it within T, each size gets as many groups as its sequences' time fills at T (their sum
   over T, rounded up), and the least T whose groups fit the ranks is kept; ranks left over
   become more groups of the sizes whose groups are fullest;
3. longest sequence first, each into the group (of any size that holds it) where it finishes
   soonest;
4. local search on the real objective (one configuration per group, the one best for the
   group's sequences together): a sequence of the slowest group moved to, or swapped with one
   of, another group while that lowers the makespan.
The one group of all ranks and the equal groups of each size dividing the ranks are solved the
same way from step 3, and the fastest plan of all is kept: never slower than the best single
configuration on all ranks.

The exact solver (``exact_batch_plan``) writes the same problem as a MILP for SciPy's HiGHS:
one slot per configuration and copy, a binary per slot used and per sequence placed there,
the makespan bounded by each slot's sum, the slots' ranks by the ranks. Small batches only.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cptune.config import CPConfig
from cptune.mixes._compiled import (
    best_step,
    best_trade,
    counts_within,
    frontiers,
    group_sums,
    place_longest_first,
)
from cptune.mixes._costs import MixCosts
from cptune.mixes._mix import LengthMix, MixError
from cptune.mixes._policy import policy_costs
from cptune.plans import Plan

#: Local-search steps (a move or a swap out of the slowest group) the fast solver takes at most
#: on each partition it tries, and on the best of them.
TRIAL_STEPS = 16
SEARCH_STEPS = 64
#: How many of the least busy groups the slowest may take ranks from, in the partitions next to a plan.
NEAREST = 4
#: How many of the least busy groups the slowest may swap a sequence with, in one local-search step.
SWAP_GROUPS = 16
#: The most sequences a group may hold for the local search to trade two of them for one.
PAIRED = 24
#: How many of the partitions tried at once (the first ones, then each round's neighbours) the
#: fast solver searches locally: those whose first assignment has the least makespan.
SCREENED = 1
#: How many times at most the fast solver tries the partitions next to its best one.
NEIGHBOUR_ROUNDS = 8
#: On how many of a batch's lengths two configurations of one size are compared first (most
#: differ there), before all of them.
SCREEN_LENGTHS = 64
#: How many sequences a first assignment places before the partitions tried are compared again
#: (the longest set the makespan); each time after, as many as it has placed.
FIRST_CHUNK = 16


@dataclass(frozen=True)
class Group:
    """A CP group: ``config`` (its rank count the group's size), the batch's sequences it runs
    (indices into the batch) and their predicted time in all, ms."""

    config: CPConfig
    sequences: tuple[int, ...]
    ms: float

    def to_dict(self) -> dict[str, object]:
        return {**self.config.to_dict(), "label": self.config.label, "sequences": list(self.sequences),
                "ms": self.ms}


@dataclass(frozen=True)
class BatchPlan:
    """How one batch runs on ``ranks`` ranks: ``groups`` side by side, the batch's predicted
    ``makespan_ms`` the slowest one's; ``solver`` "fast", "exact" or "one group"; ``optimal``
    whether the exact solver proved it (None for the others)."""

    lengths: tuple[int, ...]
    ranks: int
    groups: tuple[Group, ...]
    makespan_ms: float
    solver: str
    optimal: bool | None = None

    @property
    def idle_ranks(self) -> int:
        return self.ranks - sum(g.config.ranks for g in self.groups)

    def describe(self) -> str:
        """E.g. "3 groups (ring on 4, local on 1, local on 1), makespan 12.3 ms"."""
        shown = ", ".join(f"{g.config.label} on {g.config.ranks}" for g in self.groups)
        idle = f", {self.idle_ranks} idle" if self.idle_ranks else ""
        return f"{len(self.groups)} group{'s' if len(self.groups) != 1 else ''} ({shown}{idle}), " \
               f"makespan {self.makespan_ms:.4g} ms"

    def to_dict(self) -> dict[str, object]:
        return {"lengths": list(self.lengths), "ranks": self.ranks, "makespan_ms": self.makespan_ms,
                "solver": self.solver, "optimal": self.optimal, "idle_ranks": self.idle_ranks,
                "groups": [g.to_dict() for g in self.groups]}


class _Problem:
    """One batch's times (``t``: configurations x sequences, ms, inf where it cannot run) on
    ``ranks`` ranks, without the configurations no plan needs: those needing more ranks, those
    that run none of the batch, and those another of their size is never slower than."""

    def __init__(self, costs: MixCosts, lengths: np.ndarray, ranks: int,
                 allowed: Callable[[CPConfig], bool] | None = None) -> None:
        if allowed is None:
            rows = costs.undominated[costs.sizes[costs.undominated] <= ranks]
        else:  # another of its size may beat an allowed one
            rows = np.array([i for i, c in enumerate(costs.configs) if c.ranks <= ranks and allowed(c)],
                            dtype=np.int64)
            if not rows.size:
                raise MixError("no configuration on these ranks is allowed")
        rows = rows[np.argsort(costs.sizes[rows], kind="stable")]  # a size's configurations side by side
        t = costs.times(lengths, rows=rows)
        sizes = costs.sizes[rows]
        n = sizes.size
        # never[j, i]: j, of i's size, never slower than i. Most two of a size cross somewhere:
        # tried first on a few of the lengths, only the pairs that might not are tried on all
        j, i = np.nonzero((sizes[:, None] == sizes[None, :]) & ~np.eye(n, dtype=bool))
        few = t[:, ::max(1, t.shape[1] // SCREEN_LENGTHS)]
        close = np.all(few[j] <= few[i], axis=1)
        j, i = j[close], i[close]
        never = np.zeros((n, n), dtype=bool)
        never[j, i] = [bool((t[a] <= t[b]).all()) for a, b in zip(j.tolist(), i.tolist(), strict=True)]
        # j beats i: never slower, and faster somewhere (i is not never slower than j) or first of equals
        beats = never & (~never.T | np.tri(n, k=-1, dtype=bool).T)
        kept = np.flatnonzero(~beats.any(axis=0) & (t.min(axis=1) < math.inf)).tolist()
        self.configs = [costs.configs[int(rows[i])] for i in kept]
        for place, row in enumerate(kept):  # moved up in place: a copy would be a batch's largest array
            if row != place:
                t[place] = t[row]
        self.t = t[:len(kept)]
        self.sizes = sizes[kept]
        self.ranks = ranks
        self.lengths = lengths
        #: Each size's configurations (rows of ``t``, side by side) and their times, one view per size.
        self.rows: dict[int, np.ndarray] = {}
        self.blocks: dict[int, np.ndarray] = {}
        for g, start, count in zip(*(a.tolist() for a in np.unique(self.sizes, return_index=True,
                                                                  return_counts=True)), strict=True):
            self.rows[g], self.blocks[g] = np.arange(start, start + count), self.t[start:start + count]
        if not (self.t.min(axis=0) < math.inf).all():
            s = int(np.argmax(self.t.min(axis=0) == math.inf))
            raise MixError(f"sequence {s + 1} ({int(lengths[s]):,} tokens) fits no configuration on up to "
                           f"{ranks} ranks within a rank's memory")

    def group_time(self, size: int, members: Sequence[int]) -> tuple[float, int]:
        """The best time of a group of ``size`` ranks running ``members``, and its configuration."""
        rows = self.rows[size]
        columns = np.asarray(members, dtype=np.int64)
        sums = self.blocks[size][:, columns].sum(axis=1) if columns.size else np.zeros(rows.size)
        best = int(np.argmin(sums))
        return float(sums[best]), int(rows[best])

    def plan(self, groups: Sequence[tuple[int, Sequence[int]]], solver: str, optimal: bool | None = None
             ) -> BatchPlan:
        """The plan of ``groups`` (size, members), each in its best configuration; empty groups
        are left out (their ranks idle)."""
        built = []
        for size, members in groups:
            if not len(members):
                continue
            ms, row = self.group_time(size, members)
            built.append(Group(self.configs[row], tuple(sorted(int(m) for m in members)), ms))
        built.sort(key=lambda g: (-g.config.ranks, -g.ms))
        return BatchPlan(tuple(int(x) for x in self.lengths), self.ranks, tuple(built),
                         max(g.ms for g in built), solver, optimal)


def _counts_for(sizes: np.ndarray, best: np.ndarray, ranks: int) -> np.ndarray | None:
    """How many groups of each size, by bisection on the makespan (step 2); None when no
    makespan's groups fit the ranks."""
    sizes = sizes.astype(np.int64)
    front, before, front_size, fastest, cheapest = frontiers(best, sizes)
    # no makespan is below a sequence's fastest time (so each takes a size at every one tried) or
    # below the least rank-time (a faster size's) spread over the ranks
    low = max(float(fastest.max()), float(cheapest.sum()) / ranks)
    counts = counts_within(front, before, front_size, sizes, low, ranks)
    return counts if counts.size else None


class _BySize:
    """Each sequence's time on a group of each size (``best``: sizes x sequences), and what the
    partitions using the same sizes share, read once for them all (neighbours share most)."""

    def __init__(self, problem: _Problem) -> None:
        self.sizes = np.unique(problem.sizes)
        self.best = np.empty((self.sizes.size, problem.t.shape[1]))  # a size's best configuration's
        for i, g in enumerate(self.sizes.tolist()):
            problem.blocks[g].min(axis=0, out=self.best[i])
        self._arranged: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self._orders: list[np.ndarray] = []  # the orders ``longest_first`` has sorted
        self._least: dict[bytes, tuple[float, float]] = {}

    def bound(self, counts: np.ndarray) -> float:
        """A makespan no assignment to ``counts`` groups per size goes below (``_Assignment``'s
        included): the longest of the sequences' least times on the sizes used, and their least
        rank-time spread over all the groups' ranks; inf when a sequence fits none of those sizes."""
        used = np.flatnonzero(counts > 0)
        if not used.size:
            return math.inf
        key = used.tobytes()
        if key not in self._least:
            times = self.best[used]  # (rank-times of the sizes used only: a table of all is a fresh 4 MB)
            self._least[key] = (float(times.min(axis=0).max()),
                                float((self.sizes[used, None] * times).min(axis=0).sum()))
        slowest, work = self._least[key]
        return max(slowest, work / float(self.sizes @ counts))

    def longest_first(self, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sequences longest first on the sizes ``classes`` (each by its longest time there
        that fits) and their times on those sizes in that order (sequences x classes: a
        sequence's row contiguous, as ``_Assignment`` reads them)."""
        key = classes.tobytes()
        if key not in self._arranged:
            rows = self.best[classes]
            keys = -np.where(np.isfinite(rows), rows, -np.inf).max(axis=0)
            # a sequence's longest time grows with its length on most sets of sizes: an order found
            # before that sorts these keys too (ties by index: the stable sort's) is theirs
            order = next((o for o in self._orders if _sorts(keys, o)), None)
            if order is None:
                order = np.argsort(keys, kind="stable")
                self._orders.append(order)
            self._arranged[key] = order, rows.T[order]
        return self._arranged[key]


def _sorts(keys: np.ndarray, order: np.ndarray) -> bool:
    """Whether ``order`` is ``np.argsort(keys, kind="stable")``: the keys it lists never fall,
    and where two are equal the first listed comes first in ``keys``."""
    listed = keys[order]
    before, after = listed[:-1], listed[1:]
    return bool((after >= before).all() and (order[1:][after == before] > order[:-1][after == before]).all())


class _Assignment:
    """Longest sequence first into the group where it finishes soonest (step 3), on ``counts``
    groups per size (each sequence at its size's best configuration for it), in growing chunks
    of sequences: partitions are compared as they go, and the longest sequences set the
    makespan, so one that falls behind is given up early. ``span``: the makespan so far, never
    more than the final one."""

    def __init__(self, by_size: _BySize, counts: np.ndarray) -> None:
        self.classes = np.flatnonzero(counts > 0)
        self.count = counts[self.classes].astype(np.int64)  # each class's groups, numbered in class order
        self.size = np.repeat(by_size.sizes[self.classes], self.count)  # each group's
        self.first = np.cumsum(self.count) - self.count
        self.heap_time = np.zeros(int(self.count.sum()))  # each class's groups: a heap by (time, group)
        self.heap_group = np.arange(self.heap_time.size, dtype=np.int64)
        self.order, self.ordered = by_size.longest_first(self.classes)
        self.placed = np.empty(self.order.size, dtype=np.int64)  # each sequence's group, in ``order``
        self.placed_count = 0
        self.span = 0.0

    @property
    def done(self) -> bool:
        return self.placed_count == self.order.size

    def advance(self) -> bool:
        """Places as many more sequences as are placed (at least ``FIRST_CHUNK``); False when one
        fits no group."""
        stop = min(2 * self.placed_count + FIRST_CHUNK, self.order.size)
        self.span = place_longest_first(self.ordered, self.placed_count, stop, self.heap_time,
                                        self.heap_group, self.first, self.count, self.placed, self.span)
        self.placed_count = stop
        return self.span < math.inf  # (one placed at inf fits no group)

    def groups(self) -> tuple[np.ndarray, np.ndarray]:
        """Each group's size and each sequence's group, once ``done``."""
        group_of = np.empty(self.order.size, dtype=np.int64)
        group_of[self.order] = self.placed
        return self.size, group_of


class _Search:
    """Local search on one configuration per group (step 4). Groups of one size share their
    configurations, so each size's groups hold their per-configuration sums in one table; the
    steps are looked for by compiled loops (``cptune.mixes._compiled``) over those sums."""

    def __init__(self, problem: _Problem, size: np.ndarray, group_of: np.ndarray) -> None:
        """``size``: each group's; ``group_of``: each sequence's group (the search moves them)."""
        self.size = size
        self.group_of = group_of
        self.t = problem.t
        kinds = list(set(size.tolist()))  # (a set's order: the order moves weigh the sizes in)
        self.rows = {g: problem.rows[g] for g in kinds}
        self.blocks = {g: problem.blocks[g] for g in kinds}
        kind_of = np.zeros(max(kinds) + 1, dtype=np.int64)
        kind_of[kinds] = np.arange(len(kinds))
        kind = kind_of[size]
        #: the groups a size at a time, each size's in order, and where each size's begin
        self.by_kind = np.argsort(kind, kind="stable")
        self.kind_start = np.searchsorted(kind[self.by_kind], np.arange(len(kinds) + 1))
        starts = self.kind_start.tolist()
        self.of_size = {g: self.by_kind[starts[i]:starts[i + 1]] for i, g in enumerate(kinds)}
        widths = np.array([problem.rows[g].size for g in kinds], dtype=np.int64)
        #: each group's configurations: rows ``row:row + width`` of the batch's times
        self.width = widths[kind]
        self.row = np.array([problem.rows[g][0] for g in kinds], dtype=np.int64)[kind]
        local = np.empty(size.size, dtype=np.int64)  # each group's row in its size's table
        local[self.by_kind] = np.arange(size.size) - self.kind_start[kind[self.by_kind]]
        table_sizes = np.diff(self.kind_start) * widths
        bases = np.cumsum(table_sizes) - table_sizes
        #: per size: its groups' configurations' sums over their sequences (groups x configurations),
        #: views of one array (``flat``; group k's at ``offset[k]``) that the compiled steps read
        self._tables = [(g, int(bases[i]), starts[i + 1] - starts[i], int(widths[i]))
                        for i, g in enumerate(kinds)]
        self.offset = bases[kind] + local * self.width
        self.count = np.bincount(group_of, minlength=size.size)
        self.time = np.zeros(size.size)  # each group's time (its best configuration's sum)
        self.flat = np.empty(int(table_sizes.sum()))
        group_sums(self.t, group_of, self.row, self.width, self.offset, self.count, self.flat, self.time)
        self.table = self._views(self.flat)
        #: Whether the last look for a move or swap found none and nothing has moved since: the
        #: same groups find the same, so the final search does not look again where a trial's ended.
        self.settled = False

    def _views(self, flat: np.ndarray) -> dict[int, np.ndarray]:
        return {g: flat[base:base + groups * width].reshape(groups, width)
                for g, base, groups, width in self._tables}

    def sums(self, k: int) -> np.ndarray:
        """Group k's configurations' sums over its sequences (a view: read it before a move)."""
        return self.flat[self.offset[k]:self.offset[k] + self.width[k]]

    def copy(self) -> _Search:
        """A search from the same groups, moved apart from this one."""
        twin = copy.copy(self)
        twin.group_of, twin.count, twin.time = self.group_of.copy(), self.count.copy(), self.time.copy()
        twin.flat = self.flat.copy()
        twin.table = twin._views(twin.flat)
        return twin

    def listed(self) -> np.ndarray:
        """The groups holding sequences, as a plan lists them: largest first, then slowest first."""
        held = np.flatnonzero(self.count > 0)
        return held[np.lexsort((-self.time[held], -self.size[held]))]

    def plan(self, problem: _Problem, solver: str) -> BatchPlan:
        """The plan the groups make now, each in the configuration best for its sequences."""
        order = np.argsort(self.group_of, kind="stable")
        bounds = np.searchsorted(self.group_of[order], np.arange(self.size.size + 1)).tolist()
        members = order.tolist()
        row, ms = np.empty(self.size.size, dtype=np.int64), np.empty(self.size.size)
        for g, table in self.table.items():  # each size's groups' best configurations at once
            best = table.argmin(axis=1)
            row[self.of_size[g]] = self.rows[g][best]
            ms[self.of_size[g]] = table[np.arange(best.size), best]
        rows, times = row.tolist(), ms.tolist()
        built = [Group(problem.configs[rows[k]], tuple(members[bounds[k]:bounds[k + 1]]), times[k])
                 for k in self.listed().tolist()]
        return BatchPlan(tuple(problem.lengths.tolist()), problem.ranks, tuple(built),
                         max(g.ms for g in built), solver)

    def times(self) -> np.ndarray:
        return self.time.copy()

    def _move(self, s: int, target: int) -> None:
        source = int(self.group_of[s])
        leaving, joining = self.sums(source), self.sums(target)
        leaving -= self.blocks[int(self.size[source])][:, s]
        joining += self.blocks[int(self.size[target])][:, s]
        self.group_of[s] = target
        self.settled = False
        self.count[source] -= 1
        self.count[target] += 1
        self.time[source] = float(leaving.min()) if self.count[source] else 0.0
        self.time[target] = float(joining.min())

    def improve(self, budget: int, exchanges: bool = True) -> None:
        """Moves and swaps out of the slowest group while one lowers the makespan (then, with
        ``exchanges``, two-for-one trades), at most ``budget``."""
        for _ in range(budget):
            times = self.times()
            k = int(np.argmax(times))
            step = None if self.settled else self._best_step(k, times)
            if step is None:
                self.settled = True
                if exchanges and self.exchange():
                    continue
                return
            s, j, other = step
            self._move(s, j)
            if other >= 0:
                self._move(other, k)

    def _best_step(self, k: int, times: np.ndarray) -> tuple[int, int, int] | None:
        """(sequence of group k, group it goes to, sequence coming back or -1) lowering the
        makespan most, or at the same makespan the sum of the squared group times (a plateau
        where several groups are the slowest); None when none lowers either. (The makespan
        never rises and the squares fall: the search cannot cycle.)"""
        order = np.argsort(-times)
        tops = np.array([*(g for g in order[:3].tolist() if g != k), -1, -1][:2], dtype=np.int64)
        least_busy = order[::-1]
        least_busy = least_busy[(least_busy != k) & (self.count[least_busy] > 0)][:SWAP_GROUPS]
        s, j, other = best_step(k, times, tops, least_busy, self.t, self.row, self.width, self.offset,
                                self.flat, self.size, self.count, self.group_of, self.by_kind,
                                self.kind_start)
        return None if s < 0 else (int(s), int(j), int(other))

    def exchange(self) -> bool:
        """Two sequences of the slowest group for one of another, or one for two, where that
        lowers the makespan (what single moves and swaps cannot reach); only between groups of
        at most ``PAIRED`` sequences. Whether one was made."""
        times = self.times()
        k = int(np.argmax(times))
        current = float(times[k])
        if self.count[k] > PAIRED:
            return False
        order = np.argsort(times)
        slowest = order[::-1][:3].tolist()
        tried = [j for j in order[order != k][:SWAP_GROUPS].tolist() if 0 < self.count[j] <= PAIRED]
        if not tried:
            return False
        rest = np.array([next((float(times[g]) for g in slowest if g not in (k, j)), 0.0) for j in tried])
        j, *moved = best_trade(k, current, np.array(tried, dtype=np.int64), rest, self.t, self.row,
                               self.width, self.offset, self.flat, self.group_of)
        if j < 0:
            return False
        for s in moved[:2]:
            if s >= 0:
                self._move(int(s), int(j))
        for s in moved[2:]:
            if s >= 0:
                self._move(int(s), k)
        return True


def _problem(costs: MixCosts, lengths: Sequence[int] | LengthMix, ranks: int | None,
             allowed: Callable[[CPConfig], bool] | None = None) -> _Problem:
    batch = lengths if isinstance(lengths, LengthMix) else LengthMix.of(lengths)
    top = costs.ranks if ranks is None else ranks
    if not 1 <= top <= costs.ranks:
        raise MixError(f"ranks must be between 1 and the {costs.ranks} these costs were read for, got {top}")
    return _Problem(costs, batch.lengths, top, allowed)


def one_group_plan(costs: MixCosts, lengths: Sequence[int] | LengthMix, ranks: int | None = None
                   ) -> BatchPlan:
    """Every sequence of the batch on one group of all ``ranks`` ranks (default: the costs'),
    in the configuration best for them together: the single configuration users run today."""
    problem = _problem(costs, lengths, ranks)
    top = problem.ranks
    if top not in set(problem.sizes.tolist()):
        raise MixError(f"no configuration on all {top} ranks runs every sequence of the batch")
    ms, _ = problem.group_time(top, range(problem.t.shape[1]))
    if not math.isfinite(ms):
        raise MixError(f"no single configuration on all {top} ranks holds every sequence of the batch")
    return problem.plan([(top, list(range(problem.t.shape[1])))], "one group")


def _neighbours(search: _Search, ranks: int, sizes: np.ndarray) -> list[np.ndarray]:
    """Partitions next to the plan of ``search`` on ``ranks`` ranks (counts per size), each
    changing its slowest group: grown by the idle ranks or by ranks of one of the ``NEAREST``
    least busy other groups (that one shrunk, or merged into it), or split in two."""
    index = {int(g): i for i, g in enumerate(sizes)}
    listed = search.listed()
    have, ms = search.size[listed].tolist(), search.time[listed].tolist()
    slowest = max(range(len(have)), key=ms.__getitem__)
    slow = have[slowest]
    # each partition as its changes (size, +1 or -1) to the other groups' counts: a list of every
    # group per partition costs more than the partitions, on a thousand ranks
    found: list[list[tuple[int, int]]] = []

    def grown(by: int, changes: list[tuple[int, int]]) -> None:
        if slow + by in index:
            found.append([(slow + by, 1), *changes])

    by_load = sorted(range(len(have)), key=ms.__getitem__)
    by_load.remove(slowest)
    others = [have[k] for k in by_load]  # least busy first
    idle = ranks - sum(have)
    for by in range(1, idle + 1):
        grown(by, [])
    for k, size in enumerate(others[:NEAREST]):
        if size in others[:k]:
            continue  # groups of one size give the same partitions
        grown(size, [(size, -1)])  # merged
        for by in range(1, size):
            if size - by in index:
                grown(by, [(size, -1), (size - by, 1)])
    for part in sizes.tolist():
        if part < slow and slow - part in index:
            found.append([(part, 1), (slow - part, 1)])
    base = [0] * sizes.size  # counted in Python: a NumPy count per partition costs more
    for g in others:
        base[index[g]] += 1
    rows = []
    for changes in found:
        row = base.copy()
        for g, change in changes:
            row[index[g]] += change
        rows.append(row)
    return list(np.array(rows, dtype=np.int64).reshape(len(rows), sizes.size))


def plan_batch(costs: MixCosts | Plan, lengths: Sequence[int] | LengthMix, ranks: int | None = None,
               rounds: int = NEIGHBOUR_ROUNDS, allowed: Callable[[CPConfig], bool] | None = None
               ) -> BatchPlan:
    """The fast solver's plan for the batch ``lengths`` on ``ranks`` ranks (default: all the
    costs were read for); see the module docstring. ``costs``: ``mix_costs``'s, or a loaded plan
    carrying a batch policy (a deployment, every step, no database). ``rounds``: how many times at most the
    partitions next to the best one are tried; ``allowed``: only the configurations it accepts
    (a narrower space, e.g. Ulysses on powers of two, FlexSP's). ``MixError`` when a sequence
    fits nowhere."""
    if isinstance(costs, Plan):
        costs = policy_costs(costs)
    problem = _problem(costs, lengths, ranks, allowed)
    by_size = _BySize(problem)
    sizes = by_size.sizes
    top = problem.ranks
    tries = []
    if (counts := _counts_for(sizes, by_size.best, top)) is not None:
        tries.append(counts)
    for i, g in enumerate(sizes):  # equal groups of each size dividing the ranks (one of all ranks too)
        if top % int(g) == 0:
            equal = np.zeros(sizes.size, dtype=np.int64)
            equal[i] = top // int(g)
            tries.append(equal)
    seen: set[bytes] = set()

    def screened(partitions: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The groups (each one's size, each sequence's group) of the ``SCREENED`` new partitions
        whose first assignment (step 3) has the least makespan (of equals, the first listed).
        Best first: the partition of least makespan so far (before it starts, the least it can
        reach, ``_BySize.bound``) takes the next chunk, and one done while least is among
        them; the others stop where they fall behind."""
        queue: list[tuple[float, int, np.ndarray | _Assignment]] = []
        for i, counts in enumerate(partitions):
            if counts.tobytes() not in seen:
                seen.add(counts.tobytes())
                if (bound := by_size.bound(counts)) < math.inf:  # else one fits nowhere
                    queue.append((bound * (1 - 1e-12), i, counts))  # (the bound's rounding)
        heapq.heapify(queue)
        found: list[tuple[np.ndarray, np.ndarray]] = []
        while queue and len(found) < SCREENED:
            least, i, work = heapq.heappop(queue)
            if isinstance(work, np.ndarray):
                work = _Assignment(by_size, work)
            elif work.done:
                found.append(work.groups())
                continue
            if work.advance():
                heapq.heappush(queue, (max(least, work.span), i, work))
        return found

    def polished(groups: tuple[np.ndarray, np.ndarray], steps: int) -> tuple[float, _Search]:
        """The makespan the groups reach after ``steps`` of local search, and the search."""
        search = _Search(problem, *groups)
        search.improve(steps, exchanges=False)
        return float(search.times().max()), search

    polished_first = [polished(groups, TRIAL_STEPS) for groups in screened(tries)]
    if not polished_first:
        raise MixError(f"no plan on {top} ranks holds every sequence of the batch")
    makespan, search = min(polished_first, key=lambda pair: pair[0])
    for _ in range(rounds):
        near = [polished(groups, TRIAL_STEPS) for groups in screened(_neighbours(search, top, sizes))]
        better = min(near, key=lambda pair: pair[0], default=None)
        if better is None or better[0] >= makespan * (1 - 1e-9):
            break
        makespan, search = better
    chosen = search.copy()  # only the plan returned is built
    search.improve(SEARCH_STEPS)
    return (search if search.times().max() < makespan else chosen).plan(problem, "fast")


def exact_batch_plan(costs: MixCosts, lengths: Sequence[int] | LengthMix, ranks: int | None = None,
                     time_limit_s: float = 60.0) -> BatchPlan:
    """The plan of least predicted makespan, proved by a MILP (SciPy's HiGHS), for a small
    batch; ``optimal`` False when ``time_limit_s`` ran out first (the best plan found then)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    problem = _problem(costs, lengths, ranks)
    t, n, top = problem.t, problem.t.shape[1], problem.ranks
    upper = plan_batch(costs, problem.lengths.tolist(), top).makespan_ms  # a bound the MILP starts from
    slots = [(c, copy) for c in range(len(problem.configs))
             for copy in range(min(top // int(problem.sizes[c]), int(np.isfinite(t[c]).sum())))]
    q = len(slots)
    # variables: x[s, slot] (s * q + slot), then y[slot], then the makespan
    nx = n * q
    total = nx + q + 1
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    low: list[float] = []
    high: list[float] = []

    def row(entries: list[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(low)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        low.append(lo)
        high.append(hi)

    for s in range(n):  # each sequence in exactly one slot
        row([(s * q + k, 1.0) for k in range(q)], 1, 1)
    for k, (c, _) in enumerate(slots):
        for s in range(n):  # a sequence only in a slot that is used
            row([(s * q + k, 1.0), (nx + k, -1.0)], -np.inf, 0)
        # the makespan bounds every slot's time
        row([*((s * q + k, float(t[c, s])) for s in range(n) if math.isfinite(t[c, s])), (total - 1, -1.0)],
            -np.inf, 0)
    row([(nx + k, float(problem.sizes[c])) for k, (c, _) in enumerate(slots)], -np.inf, top)
    for k in range(1, q):  # copies of one configuration used in order: no symmetric twins
        if slots[k][0] == slots[k - 1][0]:
            row([(nx + k, 1.0), (nx + k - 1, -1.0)], -np.inf, 0)
    ub = np.ones(total)
    for k, (c, _) in enumerate(slots):
        for s in range(n):
            if not t[c, s] <= upper * (1 + 1e-9):
                ub[s * q + k] = 0
    ub[-1] = upper * (1 + 1e-9)
    lb = np.zeros(total)
    objective = np.zeros(total)
    objective[-1] = 1
    integrality = np.ones(total)
    integrality[-1] = 0
    a = coo_array((vals, (rows, cols)), shape=(len(low), total)).tocsr()
    result = milp(objective, constraints=LinearConstraint(a, low, high), integrality=integrality,
                  bounds=Bounds(lb, ub), options={"time_limit": time_limit_s})
    if result.x is None:
        raise MixError(f"the MILP found no plan within {time_limit_s:g} s ({result.message})")
    x = result.x[:nx].reshape(n, q) > 0.5
    groups = [(int(problem.sizes[c]), [int(s) for s in np.flatnonzero(x[:, k])])
              for k, (c, _) in enumerate(slots)]
    return problem.plan(groups, "exact", optimal=result.status == 0)
