"""The fast solver's inner loops, compiled (Numba): the frontier of sizes each sequence can
take and the bisection on the makespan over them (step 2), each sequence, longest first, into the
group where it finishes soonest (step 3), and the local search's looks for a move, a swap or a
two-for-one trade (step 4). They run per sequence, per partition tried and per search step, where
the interpreter's cost per NumPy call was most of the solve's time. Each makes the comparisons,
breaks the ties and adds in the order the NumPy code it replaced did, so the plans are the same."""

from __future__ import annotations

import math

import numpy as np

from cptune._numba import compiled


@compiled
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


@compiled
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


@compiled
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


@compiled
def group_sums(t: np.ndarray, group_of: np.ndarray, row: np.ndarray, width: np.ndarray, offset: np.ndarray,
               count: np.ndarray, sums: np.ndarray, time: np.ndarray) -> None:
    """Each group's configurations' sums over its sequences (``t``: configurations x sequences;
    group k's configurations are rows ``row[k]:row[k] + width[k]``, its sums
    ``sums[offset[k]:offset[k] + width[k]]``), added in sequence order, and its time, the least
    of them (0 for a group holding none)."""
    sums[:] = 0.0
    for s in range(group_of.size):
        k = group_of[s]
        for c in range(width[k]):
            sums[offset[k] + c] += t[row[k] + c, s]
    for k in range(count.size):
        time[k] = sums[offset[k]:offset[k] + width[k]].min() if count[k] else 0.0


@compiled
def best_step(k: int, times: np.ndarray, tops: np.ndarray, least_busy: np.ndarray, t: np.ndarray,
              row: np.ndarray, width: np.ndarray, offset: np.ndarray, sums: np.ndarray, size: np.ndarray,
              count: np.ndarray, group_of: np.ndarray, by_kind: np.ndarray, kind_start: np.ndarray
              ) -> tuple[int, int, int]:
    """The move or swap out of the slowest group k lowering the makespan most, or at the same
    makespan the sum of the squared group times: (sequence of group k, group it goes to, sequence
    coming back or -1), or (-1, -1, -1) for none (see ``_Search._best_step``). ``tops``: the two
    slowest groups but k (-1 for none), ``least_busy``: the groups a swap is tried with, in order;
    ``by_kind``: the groups, a size at a time (``kind_start``: where each begins) in the order
    sizes are weighed."""
    mine = np.flatnonzero(group_of == k)
    n_mine, wk, rk, ok = mine.size, width[k], row[k], offset[k]
    without = np.empty((wk, n_mine))  # group k's sums with each of its sequences gone
    for c in range(wk):
        for m in range(n_mine):
            without[c, m] = sums[ok + c] - t[rk + c, mine[m]]
    left = np.zeros(n_mine)
    if n_mine > 1:
        for m in range(n_mine):
            left[m] = without[:, m].min()
    current = times[k]
    top = tops[0]
    first = times[tops[0]] if tops[0] >= 0 else 0.0
    second = times[tops[1]] if tops[1] >= 0 else 0.0
    best_value, best_change = current * (1 + 1e-12), -current * current * 1e-9
    best = (-1, -1, -1)

    # moves; none is tried above the least sum of any other group plus the least time of one of mine
    lowest = math.inf
    for g in range(count.size):
        if g != k and count[g] > 0:
            lowest = min(lowest, times[g])
    for g in range(count.size):
        if count[g] == 0:
            lowest = min(lowest, sums[offset[g]:offset[g] + width[g]].min())
    fastest = math.inf
    for kind in range(kind_start.size - 1):
        g = by_kind[kind_start[kind]]
        for c in range(width[g]):
            for m in range(n_mine):
                fastest = min(fastest, t[row[g] + c, mine[m]])
    if lowest + fastest <= best_value:
        for kind in range(kind_start.size - 1):  # each size's best, weighed one size after another
            least_value, least_change, chosen = math.inf, math.inf, (-1, -1)
            for place in range(kind_start[kind], kind_start[kind + 1]):  # the first of least makespan
                j = by_kind[place]  # and, of those, of least change in squares
                if j == k:
                    continue
                others = second if j == top else first
                before = current * current + times[j] * times[j]
                for m in range(n_mine):
                    joined = math.inf
                    for c in range(width[j]):
                        joined = min(joined, sums[offset[j] + c] + t[row[j] + c, mine[m]])
                    value = max(max(left[m], joined), others)
                    change = left[m] * left[m] + joined * joined - before
                    if value < least_value:
                        least_value, least_change, chosen = value, change, (j, m)
                    elif value == least_value and change < least_change:
                        least_change, chosen = change, (j, m)
            if chosen[0] >= 0 and least_value < math.inf and (
                    least_value < best_value * (1 - 1e-9)
                    or (least_value <= best_value and least_change < best_change)):
                best_value, best_change = least_value, least_change
                best = (mine[chosen[1]], chosen[0], -1)
    if best[0] >= 0 and best_value < current * (1 - 1e-9):
        return best

    # swaps with the least busy other groups holding sequences, one such group after another
    if not least_busy.size:
        return best
    # a swap's makespan is at least o's group's time with o out and s in: at least its time plus
    # s's least time on its size, less o's most; none is tried where that is above the best so far
    pruned = True
    for g in np.unique(size[least_busy]):
        probe = -1
        for j in least_busy:
            if size[j] == g:
                probe = j
                break
        least_mine = np.full(n_mine, math.inf)
        for c in range(width[probe]):
            for m in range(n_mine):
                least_mine[m] = min(least_mine[m], t[row[probe] + c, mine[m]])
        for j in least_busy:
            if size[j] != g:
                continue
            for o in np.flatnonzero(group_of == j):
                most = -math.inf
                for c in range(width[j]):
                    most = max(most, t[row[j] + c, o])
                for m in range(n_mine):
                    if not times[j] + least_mine[m] - most > best_value:
                        pruned = False
        if not pruned:
            break
    if pruned:
        return best
    for j in least_busy:  # group k's time with s out and o in, j's with o out and s in
        theirs = np.flatnonzero(group_of == j)
        others = second if j == top else first
        least_value, least_change, chosen = math.inf, math.inf, (-1, -1)
        for m in range(n_mine):
            for i in range(theirs.size):
                o = theirs[i]
                into = math.inf
                for c in range(wk):
                    into = min(into, without[c, m] + t[rk + c, o])
                back = math.inf
                for c in range(width[j]):
                    back = min(back, sums[offset[j] + c] + t[row[j] + c, mine[m]] - t[row[j] + c, o])
                value = max(max(into, back), others)
                change = into * into + back * back - current * current - times[j] * times[j]
                if value < least_value:
                    least_value, least_change, chosen = value, change, (m, i)
                elif value == least_value and change < least_change:
                    least_change, chosen = change, (m, i)
        if chosen[0] >= 0 and least_value < math.inf and (
                least_value < best_value * (1 - 1e-9)
                or (least_value <= best_value and least_change < best_change)):
            best_value, best_change = least_value, least_change
            best = (mine[chosen[0]], j, theirs[chosen[1]])
    return best



@compiled
def _bundles(members: np.ndarray, pairs: bool) -> np.ndarray:
    """``members`` one by one, or two by two (i < j, in order): bundles x 2, -1 where one."""
    n = members.size
    bundles = np.full((n * (n - 1) // 2 if pairs else n, 2), -1, dtype=np.int64)
    b = 0
    for x in range(n):
        if not pairs:
            bundles[b, 0] = members[x]
            b += 1
            continue
        for y in range(x + 1, n):
            bundles[b, 0], bundles[b, 1] = members[x], members[y]
            b += 1
    return bundles


@compiled
def _bundle_time(t: np.ndarray, row: int, bundle: np.ndarray) -> float:
    """A bundle's time on configuration ``row`` (its sequences' times added in order)."""
    return t[row, bundle[0]] if bundle[1] < 0 else t[row, bundle[0]] + t[row, bundle[1]]


@compiled
def best_trade(k: int, current: float, tried: np.ndarray, rest: np.ndarray, t: np.ndarray, row: np.ndarray,
               width: np.ndarray, offset: np.ndarray, sums: np.ndarray, group_of: np.ndarray
               ) -> tuple[int, int, int, int, int]:
    """Two sequences of group k for one of another group, or one for two, lowering the makespan
    below ``current`` most (see ``_Search.exchange``): (the group, k's two or one sequence and -1,
    the group's one or two). The ``tried`` groups in turn (``rest``: the slowest time of the groups
    but k and each), two of k's for one first; of equals the first. (-1, ...) for none."""
    mine = np.flatnonzero(group_of == k)
    wk, rk, ok = width[k], row[k], offset[k]
    best_value, best = math.inf, (-1, -1, -1, -1, -1)
    for place in range(tried.size):
        j = tried[place]
        theirs = np.flatnonzero(group_of == j)
        wj, rj, oj = width[j], row[j], offset[j]
        for two_for_one in (True, False):
            if two_for_one and mine.size < 2:
                continue
            gives, takes = _bundles(mine, two_for_one), _bundles(theirs, not two_for_one)
            value, chosen = math.inf, (-1, -1)
            for a in range(gives.shape[0]):
                for b in range(takes.shape[0]):
                    into_k = math.inf  # group k's time with its bundle out and j's in, and j's
                    for c in range(wk):
                        into_k = min(into_k, sums[ok + c] - _bundle_time(t, rk + c, gives[a])
                                     + _bundle_time(t, rk + c, takes[b]))
                    into_j = math.inf
                    for c in range(wj):
                        into_j = min(into_j, sums[oj + c] - _bundle_time(t, rj + c, takes[b])
                                     + _bundle_time(t, rj + c, gives[a]))
                    trade = max(max(into_k, into_j), rest[place])
                    if trade < value:
                        value, chosen = trade, (a, b)
            if value < current * (1 - 1e-9) and value < best_value:
                a, b = chosen
                best_value = value
                best = (j, gives[a, 0], gives[a, 1], takes[b, 0], takes[b, 1])
    return best
