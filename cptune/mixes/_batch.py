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
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cptune.config import CPConfig
from cptune.mixes._costs import MixCosts
from cptune.mixes._mix import LengthMix, MixError
from cptune.mixes._placement import counts_within, frontiers, place_longest_first
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
    configurations, so each size's groups hold their per-configuration sums in one table."""

    def __init__(self, problem: _Problem, size: np.ndarray, group_of: np.ndarray) -> None:
        """``size``: each group's; ``group_of``: each sequence's group (the search moves them)."""
        self.size = size
        self.group_of = group_of
        self.rows = {g: problem.rows[g] for g in set(size.tolist())}
        self.blocks = {g: problem.blocks[g] for g in self.rows}
        self.of_size = {g: np.flatnonzero(size == g) for g in self.rows}
        self.local = np.empty(size.size, dtype=np.int64)  # each group's row in its size's table
        self.count = np.bincount(group_of, minlength=size.size)
        self.time = np.zeros(size.size)  # each group's time (its best configuration's sum)
        #: Whether the last look for a move or swap found none and nothing has moved since: the
        #: same groups find the same, so the final search does not look again where a trial's ended.
        self.settled = False
        #: per size: its groups' configurations' sums over their sequences (groups x configurations)
        self.table: dict[int, np.ndarray] = {}
        placed_size = size[group_of]
        for g, rows in self.rows.items():
            mine = self.of_size[g]
            self.local[mine] = np.arange(mine.size)
            placed = np.flatnonzero(placed_size == g)
            # one count for all its configurations: bin (group, configuration), summed in sequence order
            bins = self.local[group_of[placed]][:, None] * rows.size + np.arange(rows.size)
            self.table[g] = np.bincount(bins.ravel(), weights=self.blocks[g][:, placed].T.ravel(),
                                        minlength=mine.size * rows.size).reshape(mine.size, rows.size)
            held = self.count[mine] > 0
            self.time[mine[held]] = self.table[g][held].min(axis=1)

    def sums(self, k: int) -> np.ndarray:
        """Group k's configurations' sums over its sequences (a view: read it before a move)."""
        return self.table[int(self.size[k])][self.local[k]]

    def copy(self) -> _Search:
        """A search from the same groups, moved apart from this one."""
        twin = copy.copy(self)
        twin.group_of, twin.count, twin.time = self.group_of.copy(), self.count.copy(), self.time.copy()
        twin.table = {g: table.copy() for g, table in self.table.items()}
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

    def members(self, k: int) -> np.ndarray:
        return np.flatnonzero(self.group_of == k)

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
        mine = self.members(k)
        block_k = self.blocks[int(self.size[k])]
        # group k's time with each of its sequences gone: (configurations, mine) -> mine
        without = self.sums(k)[:, None] - block_k[:, mine]
        left = without.min(axis=0) if mine.size > 1 else np.zeros(mine.size)
        order = np.argsort(-times)
        current = float(times[k])
        # the slowest group but k and j, for many j at once: the slowest but k, or if j is it, the next
        others_top = [int(g) for g in order[:3] if g != k] + [-1, -1]
        first, second = (float(times[g]) if g >= 0 else 0.0 for g in others_top[:2])

        best_key: tuple[float, float] = (current * (1 + 1e-12), -current * current * 1e-9)
        best: tuple[int, int, int] | None = None

        def beats(value: float, change: float) -> bool:
            """Whether (makespan, change in squares) beats ``best_key``, which it then becomes."""
            nonlocal best_key
            if value < best_key[0] * (1 - 1e-9) or (value <= best_key[0] and change < best_key[1]):
                best_key = (value, change)
                return True
            return False

        def least(value: np.ndarray, squares: np.ndarray) -> np.ndarray:
            """Per row of (rows, ...): the first entry of least makespan and, of those, of least
            change in squares (flat index)."""
            rows = value.reshape(value.shape[0], -1)
            tied = rows <= rows.min(axis=1, keepdims=True)
            return np.where(tied, squares.reshape(rows.shape), np.inf).argmin(axis=1)

        # No step is taken whose makespan is above best_key's, and a move's is at least its target's
        # time with one of mine in: at least (rounding keeps order) the least sum of any other
        # group's configurations plus the least time of one of mine on any. Above it, none is tried.
        elsewhere = np.flatnonzero(self.count > 0)
        elsewhere = elsewhere[elsewhere != k]
        lowest = float(self.time[elsewhere].min()) if elsewhere.size else math.inf
        for j in np.flatnonzero(self.count == 0).tolist():  # (an empty group's sums: what rounding left)
            lowest = min(lowest, float(self.sums(j).min()))
        fastest = min(float(block[:, mine].min()) for block in self.blocks.values())
        movable = lowest + fastest <= best_key[0]
        # moves to every other group, all at once; each size's best weighed in turn, as one by one
        by_size, joined_by_size = [], []
        for g, block in self.blocks.items() if movable else ():
            targets = self.of_size[g][self.of_size[g] != k]
            if targets.size:
                stacked = self.table[g][self.local[targets]]  # (targets, configurations)
                by_size.append(targets)  # and each one's time with each of mine in: (targets, mine)
                joined_by_size.append((stacked[:, :, None] + block[:, mine][None]).min(axis=1))
        if by_size:
            targets, joined = np.concatenate(by_size), np.concatenate(joined_by_size)
            others = np.where(targets == others_top[0], second, first)
            value = np.maximum(np.maximum(left[None, :], joined), others[:, None])
            before = current ** 2 + times[targets] ** 2
            squares = left[None, :] ** 2 + joined ** 2 - before[:, None]
            counts = [t.size for t in by_size]
            shape = (len(counts), max(counts), mine.size)
            sized = np.repeat(np.arange(shape[0]), counts)  # each target's place among the sizes
            within = np.arange(targets.size) - np.repeat(list(itertools.accumulate(counts[:-1], initial=0)),
                                                         counts)
            padded_value, padded_squares = np.full(shape, np.inf), np.full(shape, np.inf)
            padded_value[sized, within], padded_squares[sized, within] = value, squares
            for j, flat in enumerate(least(padded_value, padded_squares).tolist()):
                t, s = divmod(flat, mine.size)
                if beats(float(padded_value[j, t, s]), float(padded_squares[j, t, s])):
                    best = (int(mine[s]), int(by_size[j][t]), -1)
        if best is not None and best_key[0] < current * (1 - 1e-9):
            return best
        # swaps with the least busy other groups holding sequences, all at once: (groups, mine, theirs)
        least_busy = order[::-1]
        least_busy = least_busy[(least_busy != k) & (self.count[least_busy] > 0)][:SWAP_GROUPS]
        if not least_busy.size:
            return best
        place = np.full(self.size.size, -1)
        place[least_busy] = np.arange(least_busy.size)
        theirs = np.flatnonzero(place[self.group_of] >= 0)
        theirs = theirs[np.argsort(place[self.group_of[theirs]], kind="stable")]  # by group, each in order
        at = place[self.group_of[theirs]]
        within = np.arange(theirs.size) - np.searchsorted(at, at)
        owner = least_busy[at]
        # likewise a swap's makespan is at least o's group's time with o out and s in: at least its
        # time plus s's least time on its size, less o's most
        for g in np.unique(self.size[owner]).tolist():
            cols = np.flatnonzero(self.size[owner] == g)
            block_g = self.blocks[g]
            floor = (times[owner[cols]][None, :] + block_g[:, mine].min(axis=0)[:, None]) \
                - block_g[:, theirs[cols]].max(axis=0)[None, :]
            if not (floor > best_key[0]).all():
                break
        else:
            return best
        # group k's time with s out and o in, o's group's with o out and s in: (mine, theirs)
        into = (without[:, :, None] + block_k[:, theirs][:, None, :]).min(axis=0)
        back = np.empty_like(into)
        for g in np.unique(self.size[owner]).tolist():
            cols = np.flatnonzero(self.size[owner] == g)
            block_g = self.blocks[g]
            sums = self.table[g][self.local[owner[cols]]].T  # (configurations, cols)
            back[:, cols] = ((sums[:, None, :] + block_g[:, mine][:, :, None])
                             - block_g[:, theirs[cols]][:, None, :]).min(axis=0)
        value = np.maximum(np.maximum(into, back), np.where(owner == others_top[0], second, first))
        squares = into ** 2 + back ** 2 - current ** 2 - times[owner] ** 2
        shape = (least_busy.size, mine.size, int(within.max()) + 1)
        padded_value, padded_squares = np.full(shape, np.inf), np.full(shape, np.inf)
        padded_value[at, :, within], padded_squares[at, :, within] = value.T, squares.T
        padded_theirs = np.zeros((shape[0], shape[2]), dtype=np.int64)
        padded_theirs[at, within] = theirs
        for j, flat in enumerate(least(padded_value, padded_squares).tolist()):  # in order, as one by one
            s, o = divmod(flat, shape[2])
            if beats(float(padded_value[j, s, o]), float(padded_squares[j, s, o])):
                best = (int(mine[s]), int(least_busy[j]), int(padded_theirs[j, o]))
        return best

    def exchange(self) -> bool:
        """Two sequences of the slowest group for one of another, or one for two, where that
        lowers the makespan (what single moves and swaps cannot reach); only between groups of
        at most ``PAIRED`` sequences. Whether one was made."""
        times = self.times()
        k = int(np.argmax(times))
        current = float(times[k])
        mine = self.members(k)
        if mine.size > PAIRED:
            return False
        order = np.argsort(times)
        slowest = order[::-1][:3].tolist()
        by_group = np.argsort(self.group_of, kind="stable")  # every group's members at once
        bounds = np.searchsorted(self.group_of[by_group], np.arange(self.size.size + 1)).tolist()
        tried = [j for j in order[order != k][:SWAP_GROUPS].tolist()
                 if 0 < bounds[j + 1] - bounds[j] <= PAIRED]
        if not tried:
            return False
        rest = np.array([next((float(times[g]) for g in slowest if g not in (k, j)), 0.0) for j in tried])
        theirs = [_bundles(by_group[bounds[j]:bounds[j + 1]]) for j in tried]
        mine_ids = _bundles(mine)
        # per direction (two of k's for one of j's, one of k's for two of j's): each group's least
        # makespan after the trade, and the bundles making it
        found = [self._traded(k, mine_ids[out], [t[into] for t in theirs], tried, rest) if mine_ids[out].size
                 else None for out, into in ((1, 0), (0, 1))]
        best: tuple[float, int, list[int], list[int]] | None = None
        for place, j in enumerate(tried):  # in order, as one group after another
            for trades in found:
                if trades is None:
                    continue
                value, leaving, coming = trades[0][place], trades[1][place], trades[2][place]
                if value < current * (1 - 1e-9) and (best is None or value < best[0]):
                    best = (value, j, leaving, coming)
        if best is None:
            return False
        _, j, leaving, coming = best
        for s in leaving:
            self._move(s, j)
        for s in coming:
            self._move(s, k)
        return True

    def _traded(self, k: int, leaving: np.ndarray, coming: list[np.ndarray], groups: list[int],
                rest: np.ndarray) -> tuple[list[float], list[list[int]], list[list[int]]]:
        """For each of ``groups`` (``coming``: its bundles, ``rest``: the slowest time of the
        groups but k and it), the least makespan trading one of group k's bundles ``leaving``
        for one of its own (of equals, the first), and those two bundles' sequences."""
        counts = [c.shape[0] for c in coming]
        bundles = np.concatenate(coming)
        owner = np.repeat(np.arange(len(groups)), counts)
        owner_group = np.asarray(groups, dtype=np.int64)[owner]
        block_k = self.blocks[int(self.size[k])]
        into_k = _after(self.sums(k), _bundle_times(block_k, leaving), _bundle_times(block_k, bundles))
        into_j = np.empty_like(into_k)
        owner_size = self.size[owner_group]
        for g in np.unique(owner_size).tolist():  # each size's groups at once: (configurations, bundles)
            cols = np.flatnonzero(owner_size == g)
            block_g = self.blocks[g]
            sums = self.table[g][self.local[owner_group[cols]]].T
            into_j[:, cols] = ((sums[:, None, :] - _bundle_times(block_g, bundles[cols])[:, None, :])
                               + _bundle_times(block_g, leaving)[:, :, None]).min(axis=0)
        value = np.maximum(np.maximum(into_k, into_j), rest[owner])
        starts = list(itertools.accumulate(counts[:-1], initial=0))
        width = max(max(counts), 1)
        padded = np.full((len(groups), leaving.shape[0], width), np.inf)
        padded[owner, :, np.arange(bundles.shape[0]) - np.repeat(starts, counts)] = value.T
        flat = padded.reshape(len(groups), -1).argmin(axis=1).tolist()
        places = [divmod(f, width) for f in flat]
        return ([float(padded[j, a, b]) for j, (a, b) in enumerate(places)],
                [leaving[a].tolist() for a, _ in places],
                [bundles[starts[j] + b].tolist() if counts[j] else [] for j, (_, b) in enumerate(places)])


def _bundles(members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``members`` one by one and two by two: (bundles x 1, bundles x 2)."""
    return members[:, None], members[_pair_places(members.size)]


def _bundle_times(block: np.ndarray, bundles: np.ndarray) -> np.ndarray:
    """Each bundle's (rows of sequences, as ``_bundles`` lists them) time on each configuration
    of ``block``: (configurations x bundles)."""
    times = block[:, bundles[:, 0]]
    for column in range(1, bundles.shape[1]):
        times += block[:, bundles[:, column]]
    return times


@functools.cache
def _pair_places(n: int) -> np.ndarray:
    """Every two of n places (i < j), in order (pairs x 2): asked for every group an exchange tries."""
    return np.stack(np.triu_indices(n, k=1), axis=1)


def _after(sums: np.ndarray, leaving: np.ndarray, coming: np.ndarray) -> np.ndarray:
    """A group's time (its configurations' ``sums``) with each bundle gone (``leaving``:
    configurations x bundles) and each other one in (``coming``): (leaving, coming)."""
    return (sums[:, None, None] - leaving[:, :, None] + coming[:, None, :]).min(axis=0)


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
