"""What the stored rounds of a configuration say, and how sure that is.

A search measures the candidates of one workload in interleaved rounds: each round visits
every candidate once, in a fresh random order, so drift and other jobs hit all of them
alike. One visit's figure is its median iteration of the slowest rank. This module
combines every clean visit of a configuration (never the newest alone) and judges the
fastest against the rest:

- Each visit is first set on a common footing: a round that two or more configurations
  shared has a level of its own (the host drifted or slowed down while it ran, for all of
  them alike), found by Tukey's median polish of log latency over configurations x rounds,
  and each visit is divided by its round's level relative to the median round's
  (``round_levels``). Without it a configuration whose visits happened to fall in slow
  rounds read slower than its round-mates, even where every shared round said the
  opposite; a visit in a round of its own stays as measured.
- A configuration's latency is the median of its clean visits so adjusted (the geometric
  mean of the middle two for an even count): a visit a burst of load slowed moves it by
  one place, not by its size. Its 95% interval: from six visits on, the sign test's order
  statistics of the visits (distribution-free); with fewer, a Student-t interval on the log
  scale, whose round-to-round spread is pooled over every configuration of the workload with
  two or more visits (one spread per workload and hardware: one visit says nothing about
  its own spread); without any, the spread of the visits' own iterations (p10-p90 read as
  a normal's +-1.28 sigma) stands in for it, and that understates drift, so a search always
  runs two rounds or more.
- The leader against another configuration: their ratio. Where they share rounds it is
  paired round by round (interleaving cancels the drift both saw): from six shared rounds
  on, the Hodges-Lehmann estimate of the log ratio with Wilcoxon's signed-rank interval
  (an order statistic of the pairwise means: one visit a burst of load tripled moves it by
  one rank, where it would widen a t interval for every pair - on the CPU hosts here such
  visits come every few rounds); from three, the mean log ratio with a t interval; below
  that the ratio of the two means with the pooled spread of each. The leader is separated
  from the other when the ratio's 95% interval lies above 1; otherwise the two are tied
  within the noise of this hardware.

Stopping a race once the leader separates re-tests the same interval; the budget on
rounds bounds how often that can flatter a leader.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from cptune.config import CPConfig
from cptune.store import Result
from cptune.workload import Workload

#: Two-sided confidence of every interval here.
CONFIDENCE = 0.95
#: A normal's p90 - p10 in standard deviations: turns an iteration spread into a sigma.
_P10_P90_SIGMAS = 2 * 1.2815515655446004
#: Fewest shared rounds for a paired ratio (below it the ratio of means is used).
MIN_PAIRED_ROUNDS = 3
#: Fewest visits for the sign test's interval of a configuration's median (with five, even
#: the whole range covers only 94%).
MIN_SIGN_TEST_VISITS = 6
#: Fewest shared rounds for the signed-rank interval (with five, no 95% interval exists:
#: even all five differences on one side happen with probability 1/16 under no difference).
MIN_SIGNED_RANK_ROUNDS = 6


def _t(df: float) -> float:
    """The two-sided ``CONFIDENCE`` quantile of Student's t with ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.5 + CONFIDENCE / 2, df)) if math.isfinite(df) else 1.959963984540054


@dataclass(frozen=True)
class Noise:
    """The round-to-round spread of one workload's visits on one hardware (log scale)."""

    sigma: float
    df: float  # degrees of freedom; inf for the iteration-spread stand-in
    source: str  # "rounds" or "iterations"


@dataclass(frozen=True)
class Estimate:
    """One configuration's latency from all its clean visits, with a 95% interval."""

    hardware: str
    workload: Workload
    config: CPConfig
    median_ms: float  # the median visit at its round's level (geometric mean of the middle two when even)
    low_ms: float
    high_ms: float
    rounds: int  # clean visits combined
    noise: Noise
    #: The visits combined, oldest first.
    visits: tuple[Result, ...]

    @property
    def log_median(self) -> float:
        return math.log(self.median_ms)

    @property
    def compute_ms(self) -> float | None:
        """Median over the visits of the slowest rank's compute time."""
        return _median_of(v.compute_ms for v in self.visits)

    @property
    def comm_ms(self) -> float | None:
        """Median over the visits of the slowest rank's unhidden communication time."""
        return _median_of(v.comm_ms for v in self.visits)

    @property
    def peak_bytes(self) -> int | None:
        peaks = [v.peak_bytes for v in self.visits if v.peak_bytes is not None]
        return max(peaks) if peaks else None

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(v.id for v in self.visits)


def _median_of(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return float(np.median(kept)) if kept else None


def _noise(logs_by_config: Sequence[np.ndarray], visits: Sequence[Result]) -> Noise:
    """The pooled within-configuration spread of log latency (one array of visits' logs per
    configuration), or the iterations' spread of ``visits`` where no configuration has two."""
    squares, df = 0.0, 0
    for logs in logs_by_config:
        if len(logs) >= 2:
            squares += float(np.sum((logs - logs.mean()) ** 2))
            df += len(logs) - 1
    if df:
        return Noise(math.sqrt(squares / df), df, "rounds")
    spreads = [math.log(r.p90_ms / r.p10_ms) / _P10_P90_SIGMAS
               for r in visits if r.p10_ms and r.p90_ms and r.p10_ms > 0]
    return Noise(float(np.median(spreads)) if spreads else 0.0, math.inf, "iterations")


#: Sweeps of the median polish: each takes the configurations' medians out, then the rounds'.
_POLISH_SWEEPS = 10


def _log_ms(visit: Result) -> float:
    """The log of a clean visit's median latency (a clean one has a median: ``Result.clean``)."""
    assert visit.median_ms is not None, "only clean visits are combined"
    return math.log(visit.median_ms)


def round_levels(by_config: dict[CPConfig, list[Result]]) -> dict[str, float]:
    """Each round two or more configurations of one workload shared: its level, the log
    factor by which that round ran slower than the median such round (negative: faster).
    Tukey's median polish of log latency = configuration + round over the visits of those
    rounds (missing cells allowed): medians, so one burst in a round moves its level little."""
    cells = [(config, v.round_id, _log_ms(v))
             for config, visits in by_config.items() for v in visits if v.round_id]
    members: dict[str, set[CPConfig]] = defaultdict(set)
    for config, round_id, _ in cells:
        members[round_id].add(config)
    shared = sorted(r for r, configs in members.items() if len(configs) >= 2)
    cells = [cell for cell in cells if len(members[cell[1]]) >= 2]
    if not cells:
        return {}
    configs = {config: i for i, config in enumerate(by_config)}
    rows = np.array([configs[c] for c, _, _ in cells])
    column_of = {r: j for j, r in enumerate(shared)}
    columns = np.array([column_of[r] for _, r, _ in cells])
    residual = np.array([x for _, _, x in cells])
    level = np.zeros(len(shared))
    for _ in range(_POLISH_SWEEPS):
        for i in np.unique(rows):
            residual[rows == i] -= np.median(residual[rows == i])
        for j in range(len(shared)):
            shift = np.median(residual[columns == j])
            residual[columns == j] -= shift
            level[j] += shift
    return dict(zip(shared, (level - np.median(level)).tolist(), strict=True))


def _interval_rank(null_counts: Sequence[int]) -> int:
    """The 1-based rank k of the order statistics bounding a two-sided ``CONFIDENCE``
    interval, from how many of the equally likely outcomes give each value 0, 1, ... of a
    rank statistic under no difference: the largest k with P(statistic < k) <= alpha/2."""
    total, alpha_half, below, k = sum(null_counts), (1 - CONFIDENCE) / 2, 0, 0
    while (below + null_counts[k]) / total <= alpha_half:
        below += null_counts[k]
        k += 1
    return k


def _sign_test_rank(n: int) -> int:
    """The rank k bounding the sign test's interval for the median of ``n`` values (the
    k-th smallest to the k-th largest): its statistic is Binomial(n, 1/2)."""
    return _interval_rank([math.comb(n, successes) for successes in range(n + 1)])


def combine(rows: Iterable[Result]) -> dict[tuple[str, Workload, CPConfig], Estimate]:
    """Every (hardware, workload, configuration) with a clean visit among ``rows``,
    combined, each visit at its round's level (``round_levels``). Failed, disturbed and
    excluded rows are left out; the caller filters anything else (oversubscribed runs,
    other engines)."""
    grouped: dict[tuple[str, Workload], dict[CPConfig, list[Result]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row.clean:
            grouped[(row.hardware, row.workload)][row.config].append(row)
    estimates = {}
    for (hardware, workload), by_config in grouped.items():
        levels = round_levels(by_config)
        logs_by_config = {
            config: np.sort([_log_ms(v) - levels.get(v.round_id or "", 0.0) for v in visits])
            for config, visits in by_config.items()
        }
        noise = _noise(list(logs_by_config.values()), [v for visits in by_config.values() for v in visits])
        for config, visits in by_config.items():
            logs = logs_by_config[config]
            centre = float(np.median(logs))
            if len(logs) >= MIN_SIGN_TEST_VISITS:
                k = _sign_test_rank(len(logs))
                low, high = float(logs[k - 1]), float(logs[-k])
            else:
                half = _t(noise.df) * noise.sigma / math.sqrt(len(logs))
                low, high = centre - half, centre + half
            estimates[(hardware, workload, config)] = Estimate(
                hardware, workload, config, math.exp(centre), math.exp(low), math.exp(high),
                len(logs), noise, tuple(sorted(visits, key=lambda v: v.id)),
            )
    return estimates


@dataclass(frozen=True)
class Comparison:
    """How much slower ``other`` runs than the leader: ``ratio`` with its 95% interval."""

    other: CPConfig
    ratio: float
    low: float
    high: float
    paired_rounds: int  # rounds the ratio was paired over (0: ratio of means)

    @property
    def separated(self) -> bool:
        """The leader is faster beyond the noise: the whole interval lies above 1."""
        return self.low > 1.0


def _signed_rank_rank(n: int) -> int:
    """The 1-based rank k of the Walsh averages bounding Wilcoxon's two-sided ``CONFIDENCE``
    interval for ``n`` pairs (the interval is the k-th smallest to the k-th largest): the
    largest k with P(T < k) <= alpha/2 for the signed-rank statistic T under no difference."""
    counts = [1] + [0] * (n * (n + 1) // 2)  # ways each rank sum arises: exact, small n
    for rank in range(1, n + 1):
        for total in range(len(counts) - 1, rank - 1, -1):
            counts[total] += counts[total - rank]
    return _interval_rank(counts)


def _hodges_lehmann(diffs: Sequence[float]) -> tuple[float, float, float]:
    """The Hodges-Lehmann estimate of ``diffs``' centre and its signed-rank interval."""
    walsh = np.sort([(a + b) / 2 for i, a in enumerate(diffs) for b in diffs[i:]])
    k = _signed_rank_rank(len(diffs))
    return float(np.median(walsh)), float(walsh[k - 1]), float(walsh[-k])


def compare(leader: Estimate, other: Estimate) -> Comparison:
    """``other``'s latency over ``leader``'s, paired by round where they share enough rounds."""
    mine = {v.round_id: _log_ms(v) for v in leader.visits if v.round_id}
    pairs = [_log_ms(v) - mine[v.round_id] for v in other.visits if v.round_id in mine]
    if len(pairs) >= MIN_SIGNED_RANK_ROUNDS:
        diff, low, high = _hodges_lehmann(pairs)
        return Comparison(other.config, math.exp(diff), math.exp(low), math.exp(high), len(pairs))
    if len(pairs) >= MIN_PAIRED_ROUNDS:
        diff = float(np.mean(pairs))
        half = _t(len(pairs) - 1) * float(np.std(pairs, ddof=1)) / math.sqrt(len(pairs))
        paired = len(pairs)
    else:
        diff = other.log_median - leader.log_median
        noise = leader.noise if leader.noise.df <= other.noise.df else other.noise
        half = _t(noise.df) * noise.sigma * math.sqrt(1 / leader.rounds + 1 / other.rounds)
        paired = 0
    return Comparison(other.config, math.exp(diff), math.exp(diff - half), math.exp(diff + half), paired)


def _percent(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.1f}%"


@dataclass(frozen=True)
class Verdict:
    """The fastest configuration of one workload and what the noise lets one say of it."""

    leader: Estimate
    #: Every other configuration against the leader, fastest first.
    comparisons: tuple[Comparison, ...]

    @property
    def tied(self) -> tuple[CPConfig, ...]:
        """The configurations the leader is not separated from, fastest first."""
        return tuple(c.other for c in self.comparisons if not c.separated)

    @property
    def contenders(self) -> tuple[CPConfig, ...]:
        """The leader and the configurations tied with it: any of them is the fastest within
        the noise of the hardware, so a pick among them is as good as the leader."""
        return (self.leader.config, *self.tied)

    @property
    def winner(self) -> CPConfig | None:
        """The leader when it is separated from every other configuration; None for a tie."""
        return None if self.tied else self.leader.config

    @property
    def runner_up(self) -> Comparison | None:
        return self.comparisons[0] if self.comparisons else None

    def describe(self) -> str:
        """The answer in words: "X, faster than Y by p% (interval)", where Y takes p% longer
        than X, or "X and Y tied within the noise of this hardware"."""
        lead = self.leader.config.describe()
        if not self.comparisons:
            return f"{lead} (the only configuration measured)"
        if self.tied:
            names = [lead, *(c.describe() for c in self.tied)]
            listed = ", ".join(names[:-1]) + " and " + names[-1]
            near = next(c for c in self.comparisons if not c.separated)
            return (f"{listed} tied within the noise of this hardware ({near.other.describe()} "
                    f"{_percent(near.ratio)}, 95% interval {_percent(near.low)} to {_percent(near.high)})")
        second = self.comparisons[0]
        return (f"{lead}, faster than {second.other.describe()} by {(second.ratio - 1) * 100:.1f}% "
                f"(95% interval {(second.low - 1) * 100:.1f}% to {(second.high - 1) * 100:.1f}%)")


def judge(estimates: Iterable[Estimate]) -> Verdict | None:
    """The verdict over ``estimates`` of one workload on one hardware (None if empty).

    The leader is the configuration no other runs faster than by their paired ratio: the
    lowest median first, then, while another's ratio to it is below 1 (their shared rounds
    say that one is faster), that one - the lowest ratio - in its place. Paired ratios need
    not be transitive; a leader met again ends the search for one."""
    ranked = sorted(estimates, key=lambda e: e.median_ms)
    if not ranked:
        return None
    leader, seen = ranked[0], set()
    while True:
        seen.add(leader.config)
        comparisons = sorted((compare(leader, other) for other in ranked if other is not leader),
                             key=lambda c: c.ratio)
        if not comparisons or comparisons[0].ratio >= 1.0 or comparisons[0].other in seen:
            return Verdict(leader, tuple(comparisons))
        leader = next(e for e in ranked if e.config == comparisons[0].other)


def judge_each(estimates: Iterable[Estimate]) -> dict[tuple[str, Workload], Verdict]:
    """The verdict of every (hardware, workload) among ``estimates``."""
    by_workload: dict[tuple[str, Workload], list[Estimate]] = defaultdict(list)
    for estimate in estimates:
        by_workload[(estimate.hardware, estimate.workload)].append(estimate)
    found = {key: judge(group) for key, group in by_workload.items()}
    return {key: verdict for key, verdict in found.items() if verdict is not None}


def verdicts(rows: Iterable[Result]) -> dict[tuple[str, Workload], Verdict]:
    """The verdict of every (hardware, workload) among ``rows`` (see ``combine``)."""
    return judge_each(combine(rows).values())
