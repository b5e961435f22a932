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

import heapq
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cptune.config import CPConfig
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
        t = costs.times(lengths, rows=rows)
        sizes = costs.sizes[rows]
        kept: list[int] = []
        for g in np.unique(sizes).tolist():
            same = np.flatnonzero(sizes == g)
            block = t[same]
            # j beats i: never slower, and faster somewhere or first of equals
            never = np.all(block[:, None, :] <= block[None, :, :], axis=2)
            faster = np.any(block[:, None, :] < block[None, :, :], axis=2)
            beats = never & (faster | np.tri(same.size, k=-1, dtype=bool).T)
            np.fill_diagonal(beats, False)
            kept += [int(same[i]) for i in range(same.size)
                     if not beats[:, i].any() and np.isfinite(block[i]).any()]
        kept.sort()
        self.configs = [costs.configs[int(rows[i])] for i in kept]
        self.t = t[kept]
        self.sizes = sizes[kept]
        self.ranks = ranks
        self.lengths = lengths
        #: Each size's configurations (rows of ``t``) and their times, one table per size, cut once.
        self.rows = {g: np.flatnonzero(self.sizes == g) for g in np.unique(self.sizes).tolist()}
        self.blocks = {g: self.t[rows] for g, rows in self.rows.items()}
        if not np.isfinite(self.t).any(axis=0).all():
            s = int(np.argmin(np.isfinite(self.t).any(axis=0)))
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


def _best_by_size(problem: _Problem) -> tuple[np.ndarray, np.ndarray]:
    """The group sizes, and each sequence's time on a group of each (its best configuration there)."""
    sizes = np.unique(problem.sizes)
    best = np.stack([problem.blocks[int(g)].min(axis=0) for g in sizes])
    return sizes, best


def _counts_for(sizes: np.ndarray, best: np.ndarray, ranks: int) -> np.ndarray | None:
    """How many groups of each size, by bisection on the makespan (step 2); None when no
    makespan's groups fit the ranks."""
    weighted = sizes[:, None] * best
    # Each sequence takes, of the sizes within the makespan, the one of least rank-time (of
    # equals, the first). Only its frontier can be that: the sizes in order of rank-time, each
    # kept if faster than all before it; the first within the makespan is then the first of
    # the frontier within it, and the frontier's times fall, so it is found by counting.
    order = np.argsort(weighted.T, axis=1, kind="stable")  # (sequences, sizes): rows contiguous
    ordered = np.take_along_axis(best.T, order, axis=1)
    least = np.minimum.accumulate(ordered, axis=1)
    kept = np.empty(ordered.shape, dtype=bool)
    kept[:, 0] = np.isfinite(ordered[:, 0])
    kept[:, 1:] = ordered[:, 1:] < least[:, :-1]
    per = kept.sum(axis=1)  # each sequence's frontier's length
    seq, place = np.nonzero(kept)  # by sequence, then in order of rank-time
    depth = np.arange(seq.size) - np.repeat(np.cumsum(per) - per, per)
    front = np.full((int(per.max()), best.shape[1]), -np.inf)  # padding: within any makespan...
    front[depth, seq] = ordered[seq, place]
    front_size = np.zeros(front.shape, dtype=np.int64)
    front_size[depth, seq] = order[seq, place]
    lengths = per  # ...but a place past a sequence's frontier holds none

    def needed(limit: float) -> tuple[int, np.ndarray, np.ndarray]:
        at = (front > limit).sum(axis=0)
        if (at >= lengths).any():
            return ranks + 1, np.zeros(sizes.size, dtype=np.int64), np.zeros(sizes.size)
        columns = np.arange(at.size)
        loads = np.bincount(front_size[at, columns], weights=front[at, columns], minlength=sizes.size)
        counts = np.ceil(loads / limit - 1e-9).astype(np.int64)
        return int(sizes @ counts), counts, loads

    low = max(float(best.min(axis=0).max()), float(weighted.min(axis=0).sum()) / ranks)
    high = low
    for _ in range(60):
        if needed(high)[0] <= ranks:
            break
        high *= 2
    else:
        return None
    for _ in range(40):  # to within 0.1%: the groups are whole, a finer makespan moves none
        if high / low < 1 + 1e-3:
            break
        middle = math.sqrt(low * high)
        if needed(middle)[0] <= ranks:
            high = middle
        else:
            low = middle
    used, counts, loads = needed(high)
    # the ranks left over: more groups of the sizes whose groups are fullest
    spare = ranks - used
    while True:
        fits = np.flatnonzero((sizes <= spare) & (loads > 0))
        if not fits.size:
            break
        fullest = fits[np.argmax(loads[fits] / np.maximum(counts[fits], 1))]
        counts[fullest] += 1
        spare -= int(sizes[fullest])
    return counts


def _assignment_bound(sizes: np.ndarray, best: np.ndarray, counts: np.ndarray) -> float:
    """A makespan no assignment to ``counts`` groups per size goes below (``_assign``'s
    included): the longest of the sequences' least times on the sizes used, and their least
    rank-time spread over all the groups' ranks; inf when a sequence fits none of those sizes."""
    used = counts > 0
    if not used.any():
        return math.inf
    sub = best[used]
    fastest = sub.min(axis=0)
    area = (sizes[used][:, None] * sub).min(axis=0).sum() / float(sizes @ counts)
    return float(max(fastest.max(), area))


def _assign(sizes: np.ndarray, best: np.ndarray, counts: np.ndarray, cutoff: float = math.inf,
            at_cutoff: bool = False) -> tuple[float, list[tuple[int, list[int]]]] | None:
    """Longest sequence first into the group where it finishes soonest (step 3): the makespan
    so reached (each sequence at its size's best configuration for it) and (size, members) per
    group; None when some sequence fits no group, or once the makespan so far (never more than
    the final one) is above ``cutoff`` (``at_cutoff``: or at it)."""
    classes = [i for i in range(sizes.size) if counts[i] > 0]
    if not classes:
        return None
    groups: list[tuple[int, list[int]]] = []
    heaps: list[list[tuple[float, int]]] = []
    for i in classes:
        heaps.append([(0.0, len(groups) + c) for c in range(int(counts[i]))])
        groups += [(int(sizes[i]), []) for _ in range(int(counts[i]))]
    sub = best[classes]
    order = np.argsort(-np.where(np.isfinite(sub), sub, -np.inf).max(axis=0), kind="stable")
    rows = [row.tolist() for row in sub[:, order]]  # floats, not a list per sequence for the GC to scan
    tops = [0.0] * len(classes)  # each class's least busy group's time so far
    span = 0.0
    add, replace = operator.add, heapq.heapreplace
    members = [listed for _, listed in groups]
    for s, column in zip(order.tolist(), zip(*rows, strict=True), strict=True):
        ends = list(map(add, tops, column))
        finish = min(ends)
        if finish == math.inf:
            return None
        k = ends.index(finish)  # of equals, the first class
        heap = heaps[k]
        g = heap[0][1]
        replace(heap, (finish, g))
        tops[k] = heap[0][0]
        members[g].append(s)
        if finish > span:
            span = finish
            if span > cutoff or (at_cutoff and span >= cutoff):
                return None
    return span, groups


class _Search:
    """Local search on one configuration per group (step 4). Groups of one size share their
    configurations, so each size's groups hold their per-configuration sums in one array."""

    def __init__(self, problem: _Problem, groups: list[tuple[int, list[int]]]) -> None:
        self.t = problem.t
        self.size = np.array([g for g, _ in groups], dtype=np.int64)
        self.rows = {g: problem.rows[g] for g in set(self.size.tolist())}
        self.blocks = {g: problem.blocks[g] for g in self.rows}
        self.group_of = np.empty(problem.t.shape[1], dtype=np.int64)
        for k, (_, members) in enumerate(groups):
            self.group_of[members] = k
        # per group: its configurations' sums over its sequences, a size's groups at once
        self.sums: list[np.ndarray] = [np.empty(0)] * len(groups)
        for g, rows in self.rows.items():
            mine = np.flatnonzero(self.size == g)
            local = np.full(len(groups), -1, dtype=np.int64)
            local[mine] = np.arange(mine.size)
            placed = np.flatnonzero(local[self.group_of] >= 0)
            table = np.stack([np.bincount(local[self.group_of[placed]], weights=self.t[r, placed],
                                          minlength=mine.size) for r in rows], axis=1)
            for a, group in enumerate(mine.tolist()):
                self.sums[group] = table[a]
        self.of_size = {g: np.flatnonzero(self.size == g) for g in self.rows}
        # each group's sequences and time (its best configuration's sum), kept as moves change them
        self.count = np.bincount(self.group_of, minlength=len(groups))
        self.time = np.array([float(sums.min()) if c else 0.0
                              for sums, c in zip(self.sums, self.count, strict=True)])

    def plan(self, problem: _Problem, solver: str) -> BatchPlan:
        """The plan the groups make now, each in the configuration best for its sequences."""
        order = np.argsort(self.group_of, kind="stable")
        bounds = np.searchsorted(self.group_of[order], np.arange(len(self.sums) + 1))
        built = []
        for k, sums in enumerate(self.sums):
            members = order[bounds[k]:bounds[k + 1]]
            if members.size:
                best = int(np.argmin(sums))
                built.append(Group(problem.configs[int(self.rows[int(self.size[k])][best])],
                                   tuple(members.tolist()), float(sums[best])))
        built.sort(key=lambda g: (-g.config.ranks, -g.ms))
        return BatchPlan(tuple(problem.lengths.tolist()), problem.ranks, tuple(built),
                         max(g.ms for g in built), solver)

    def members(self, k: int) -> np.ndarray:
        return np.flatnonzero(self.group_of == k)

    def times(self) -> np.ndarray:
        return self.time.copy()

    def _move(self, s: int, target: int) -> None:
        source = int(self.group_of[s])
        self.sums[source] = self.sums[source] - self.blocks[int(self.size[source])][:, s]
        self.sums[target] = self.sums[target] + self.blocks[int(self.size[target])][:, s]
        self.group_of[s] = target
        self.count[source] -= 1
        self.count[target] += 1
        self.time[source] = float(self.sums[source].min()) if self.count[source] else 0.0
        self.time[target] = float(self.sums[target].min())

    def improve(self, budget: int, exchanges: bool = True) -> None:
        """Moves and swaps out of the slowest group while one lowers the makespan (then, with
        ``exchanges``, two-for-one trades), at most ``budget``."""
        for _ in range(budget):
            times = self.times()
            k = int(np.argmax(times))
            step = self._best_step(k, times)
            if step is None:
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
        without = self.sums[k][:, None] - block_k[:, mine]
        left = without.min(axis=0) if mine.size > 1 else np.zeros(mine.size)
        order = np.argsort(-times)
        top = [int(g) for g in order[:3]]
        current = float(times[k])

        def rest(excluded: set[int]) -> float:
            return next((float(times[g]) for g in top if g not in excluded), 0.0)

        # rest({k, j}) for many j at once: the slowest group but k, or j is it, the next
        others_top = [g for g in top if g != k] + [-1, -1]
        first, second = (float(times[g]) if g >= 0 else 0.0 for g in others_top[:2])

        best_key: tuple[float, float] = (current * (1 + 1e-12), -current * current * 1e-9)
        best: tuple[int, int, int] | None = None

        def consider(value: np.ndarray, squares: np.ndarray) -> tuple[int, ...] | None:
            """The entry of least (makespan, change in squares) if it beats ``best_key``."""
            nonlocal best_key
            values, changes = value.ravel(), squares.ravel()
            least = np.flatnonzero(values <= values.min())
            flat = int(least[np.argmin(changes[least])])
            key = (float(values[flat]), float(changes[flat]))
            if key[0] < best_key[0] * (1 - 1e-9) or (key[0] <= best_key[0] and key[1] < best_key[1]):
                best_key = key
                return tuple(int(i) for i in np.unravel_index(int(flat), value.shape))
            return None

        for g, block in self.blocks.items():  # moves, a size's groups at once
            targets = self.of_size[g][self.of_size[g] != k]
            if not targets.size:
                continue
            stacked = np.stack([self.sums[j] for j in targets.tolist()])  # (targets, configurations)
            joined = (stacked[:, :, None] + block[:, mine][None]).min(axis=1)  # (targets, mine)
            others = np.where(targets == others_top[0], second, first)
            value = np.maximum(np.maximum(left[None, :], joined), others[:, None])
            before = current ** 2 + times[targets] ** 2
            if (at := consider(value, left[None, :] ** 2 + joined ** 2 - before[:, None])) is not None:
                best = (int(mine[at[1]]), int(targets[at[0]]), -1)
        if best is not None and best_key[0] < current * (1 - 1e-9):
            return best
        # swaps with the least busy other groups holding sequences
        least_busy = order[::-1]
        least_busy = least_busy[(least_busy != k) & (self.count[least_busy] > 0)][:SWAP_GROUPS]
        for j in least_busy.tolist():
            theirs = self.members(j)
            block_j = self.blocks[int(self.size[j])]
            # group k's time with s out and o in, group j's with o out and s in: (mine, theirs)
            into = (without[:, :, None] + block_k[:, theirs][:, None, :]).min(axis=0)
            back = ((self.sums[j][:, None, None] + block_j[:, mine][:, :, None])
                    - block_j[:, theirs][:, None, :]).min(axis=0)
            value = np.maximum(np.maximum(into, back), rest({k, j}))
            if (at := consider(value, into ** 2 + back ** 2 - current ** 2 - times[j] ** 2)) is not None:
                best = (int(mine[at[0]]), j, int(theirs[at[1]]))
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
        best: tuple[float, int, list[int], list[int]] | None = None
        for j in [int(g) for g in order if g != k][:SWAP_GROUPS]:
            theirs = self.members(j)
            if not theirs.size or theirs.size > PAIRED:
                continue
            rest = max((float(times[g]) for g in range(len(times)) if g not in (k, j)), default=0.0)
            for out_k, in_k in ((_pairs(mine), _singles(theirs)), (_singles(mine), _pairs(theirs))):
                if not out_k or not in_k:
                    continue
                new_k = self._after(k, out_k, in_k)
                new_j = self._after(j, in_k, out_k).T
                value = np.maximum(np.maximum(new_k, new_j), rest)
                a, b = np.unravel_index(int(np.argmin(value)), value.shape)
                if value[a, b] < current * (1 - 1e-9) and (best is None or value[a, b] < best[0]):
                    best = (float(value[a, b]), j, list(out_k[a]), list(in_k[b]))
        if best is None:
            return False
        _, j, leaving, coming = best
        for s in leaving:
            self._move(s, j)
        for s in coming:
            self._move(s, k)
        return True

    def _after(self, k: int, leaving: list[tuple[int, ...]], coming: list[tuple[int, ...]]) -> np.ndarray:
        """Group k's time with each bundle of ``leaving`` gone and each of ``coming`` in: (leaving,
        coming)."""
        t = self.blocks[int(self.size[k])]
        out = t[:, np.array(leaving)].sum(axis=2)  # (configurations, leaving)
        into = t[:, np.array(coming)].sum(axis=2)
        return (self.sums[k][:, None, None] - out[:, :, None] + into[:, None, :]).min(axis=0)


def _singles(members: np.ndarray) -> list[tuple[int, ...]]:
    return [(int(s),) for s in members]


def _pairs(members: np.ndarray) -> list[tuple[int, ...]]:
    listed = members.tolist()
    return [(a, b) for i, a in enumerate(listed) for b in listed[i + 1:]]


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


def _neighbours(plan: BatchPlan, sizes: np.ndarray) -> list[np.ndarray]:
    """Partitions next to ``plan``'s (counts per size), each changing its slowest group: grown
    by the idle ranks or by ranks of one of the ``NEAREST`` least busy other groups (that one
    shrunk, or merged into it), or split in two."""
    index = {int(g): i for i, g in enumerate(sizes)}
    have = [g.config.ranks for g in plan.groups]
    slow = have[max(range(len(have)), key=lambda k: plan.groups[k].ms)]
    found: list[list[int]] = []

    def grown(by: int, rest: list[int]) -> None:
        if slow + by in index:
            found.append([slow + by, *rest])

    by_load = sorted(range(len(have)), key=lambda k: plan.groups[k].ms)
    by_load.remove(max(range(len(have)), key=lambda k: plan.groups[k].ms))
    others = [have[k] for k in by_load]  # least busy first
    idle = plan.idle_ranks
    for by in range(1, idle + 1):
        grown(by, others)
    for k, size in enumerate(others[:NEAREST]):
        if size in others[:k]:
            continue  # groups of one size give the same partitions
        rest = others[:k] + others[k + 1:]
        grown(size, rest)  # merged
        for by in range(1, size):
            if size - by in index:
                grown(by, [*rest, size - by])
    for part in sizes.tolist():
        if part < slow and slow - part in index:
            found.append([part, slow - part, *others])
    out = []
    for partition in found:
        counts = np.zeros(sizes.size, dtype=np.int64)
        for g in partition:
            counts[index[g]] += 1
        out.append(counts)
    return out


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
    sizes, best = _best_by_size(problem)
    top = problem.ranks
    tries = []
    if (counts := _counts_for(sizes, best, top)) is not None:
        tries.append(counts)
    for i, g in enumerate(sizes):  # equal groups of each size dividing the ranks (one of all ranks too)
        if top % int(g) == 0:
            equal = np.zeros(sizes.size, dtype=np.int64)
            equal[i] = top // int(g)
            tries.append(equal)
    seen: set[bytes] = set()

    def screened(partitions: list[np.ndarray]) -> list[list[tuple[int, list[int]]]]:
        """The groups of the ``SCREENED`` new partitions whose first assignment (step 3) has the
        least makespan (of equals, the first listed). A partition whose makespan cannot be below
        the ``SCREENED``-th found so far (``_assignment_bound``) is not assigned, and one is given
        up as soon as its makespan so far passes it: it could not be among them."""
        fresh = []
        for i, counts in enumerate(partitions):
            if counts.tobytes() not in seen:
                seen.add(counts.tobytes())
                fresh.append((_assignment_bound(sizes, best, counts), i, counts))
        fresh.sort(key=lambda entry: (entry[0], entry[1]))
        found: list[tuple[float, int, list[tuple[int, list[int]]]]] = []
        for bound, i, counts in fresh:
            if len(found) >= SCREENED and bound > found[SCREENED - 1][0] * (1 + 1e-12):
                break
            cutoff, at_cutoff = math.inf, False
            if len(found) >= SCREENED:  # worse than the SCREENED-th, or as good but listed after it
                cutoff, at_cutoff = found[SCREENED - 1][0], i > found[SCREENED - 1][1]
            if (assigned := _assign(sizes, best, counts, cutoff, at_cutoff)) is not None:
                found.append((assigned[0], i, assigned[1]))
                found.sort(key=lambda entry: (entry[0], entry[1]))
        return [groups for _, _, groups in found[:SCREENED]]

    def polished(groups: list[tuple[int, list[int]]], steps: int) -> tuple[float, _Search]:
        """The makespan the groups reach after ``steps`` of local search, and the search."""
        search = _Search(problem, groups)
        search.improve(steps, exchanges=False)
        return float(search.times().max()), search

    polished_first = [polished(groups, TRIAL_STEPS) for groups in screened(tries)]
    if not polished_first:
        raise MixError(f"no plan on {top} ranks holds every sequence of the batch")
    search = min(polished_first, key=lambda pair: pair[0])[1]
    chosen = search.plan(problem, "fast")  # only the partitions kept are built as plans
    for _ in range(rounds):
        near = [polished(groups, TRIAL_STEPS) for groups in screened(_neighbours(chosen, sizes))]
        better = min(near, key=lambda pair: pair[0], default=None)
        if better is None or better[0] >= chosen.makespan_ms * (1 - 1e-9):
            break
        search = better[1]
        chosen = search.plan(problem, "fast")
    search.improve(SEARCH_STEPS)
    final = search.plan(problem, "fast")
    return final if final.makespan_ms < chosen.makespan_ms else chosen


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
