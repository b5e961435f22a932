"""What ``calibrate`` measured on one host: a record the store keeps and the prior reads.

Plain data (``to_dict``/``from_dict`` round-trip through JSON) that imports no engine: the
calibrated engine is known by its name, and what it is - its kernel, its Ring's stream -
by its ``EngineSpec``.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from cptune.cost import BACKWARD_FLOPS_RATIO
from cptune.engines import EngineSpec, engine_spec
from cptune.kernels import computed_pairs


def fit_latency_bandwidth(sizes: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    """Non-negative (latency, bandwidth) minimising the relative error of
    ``latency + size / bandwidth`` against ``times``: small sizes weigh as much as large.
    Timings that do not grow with size give the bandwidth seen at the largest size. Used for
    collectives (bytes) and attention calls (FLOPs) alike."""
    weights = 1.0 / np.asarray(times, dtype=float)
    design = np.column_stack([weights, np.asarray(sizes, dtype=float) * weights])
    target = np.ones_like(weights)
    latency, inverse_bandwidth = _nonnegative_least_squares(design, target)
    if inverse_bandwidth * sizes[-1] <= 1e-9 * times[-1]:  # no size term, up to rounding
        return latency, float(sizes[-1] / times[-1])
    return latency, float(1.0 / inverse_bandwidth)


def _nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> tuple[float, float]:
    """argmin |design @ x - target| over x >= 0, for two columns: the unconstrained solution
    where it is non-negative, else the better of the two one-column fits (the optimum of a
    convex problem lies on a face)."""
    solution, *_ = np.linalg.lstsq(design, target, rcond=None)
    if (solution >= 0).all():
        return float(solution[0]), float(solution[1])
    faces = []
    for column in (0, 1):
        x = np.zeros(2)
        x[column] = max(0.0, float(design[:, column] @ target / (design[:, column] @ design[:, column])))
        faces.append((float(np.sum((design @ x - target) ** 2)), x))
    best = min(faces, key=lambda face: face[0])[1]
    return float(best[0]), float(best[1])


@dataclass(frozen=True)
class CollectiveFit:
    """One collective on ``ranks`` ranks in groups of ``group``: ``latency_s`` + bytes sent
    per rank / ``bandwidth`` (B/s) fits its ``times_s`` at ``sizes`` (bytes sent per rank);
    ``bus_bandwidth`` is measured at the largest size, as nccl-tests reports it. ``tier``:
    the outermost link tier its groups crossed (``cptune.hardware.TIERS``: "network" on a
    cluster where they spanned nodes)."""

    kind: str
    ranks: int
    group: int
    latency_s: float
    bandwidth: float
    bus_bandwidth: float
    sizes: tuple[int, ...]
    times_s: tuple[float, ...]
    tier: str = "node"

    def time(self, nbytes: float, calls: int = 1) -> float:
        """Seconds for ``calls`` calls sending ``nbytes`` per rank in total."""
        return calls * self.latency_s + nbytes / self.bandwidth if nbytes else 0.0


@dataclass(frozen=True)
class ComputeRate:
    """The attention kernel's rate per rank with ``ranks`` ranks computing at once. Causal
    shapes put the queries at the last ``seq_q`` of ``seq_k`` positions (a diagonal block)."""

    ranks: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    seconds: float
    causal: bool = False

    @property
    def flops(self) -> int:
        """Useful FLOPs, counted as ``analytic_cost`` does: 4 * head_dim per visible pair."""
        q, k = self.seq_q, self.seq_k
        pairs = q * (k - q) + q * (q + 1) // 2 if self.causal else q * k
        return 4 * self.heads * self.head_dim * pairs

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds

    @property
    def key_elements(self) -> int:
        """K and V elements the shape's call reads, each made float32 with its norm before any
        score (``cptune.engines.mpi._kernels``): work linear in the keys, not the pairs."""
        return 2 * self.heads * self.seq_k * self.head_dim

    def computed_flops(self, kernel: str) -> int:
        """FLOPs ``kernel`` executes on this shape (as ``cptune.model`` counts a
        configuration's): the useful ones, and for the numpy kernel the masked pairs of its
        diagonal row blocks (``cptune.kernels.computed_pairs``)."""
        if kernel == "fused" or not self.causal:
            return self.flops
        return 4 * self.heads * self.head_dim * _numpy_diagonal_pairs(self.seq_q, self.seq_k)


@dataclass(frozen=True)
class StepCost:
    """One memory-bound step of the kernel (``kind`` "query" or "merge") on ``elements``
    elements in ``wire`` dtype, with ``ranks`` ranks running it at once: ``seconds``."""

    ranks: int
    kind: str
    wire: str
    elements: int
    seconds: float

    @property
    def seconds_per_element(self) -> float:
        return self.seconds / self.elements


@dataclass(frozen=True)
class ExchangeWait:
    """What one blocking exchange in a group of ``group`` ranks costs beyond its own time when
    the other ranks of ``ranks`` compute beside it, on a host whose ranks outnumber its cores:
    ``seconds`` more inside it (after a stretch of compute) than with them idle. It completes
    only once its members run at the same time, and the computing ranks hold the cores for
    their slices; the lockstep timings of the collectives, every rank inside them and none
    computing, hold none of it."""

    ranks: int
    group: int
    seconds: float


def _nearest_dim_and_mask(timed: set[tuple[int, bool]], head_dim: int, causal: bool) -> tuple[int, bool]:
    """Of the (head_dim, mask) pairs ``timed``, the one a shape's rates are read at: the
    head_dim nearest ``head_dim`` in ratio (the smaller on a tie), then ``causal`` where that
    head_dim was timed with it, else the mask it was timed with (unmasked first)."""
    nearest = min({d for d, _ in timed}, key=lambda d: (abs(np.log(d / head_dim)), d))
    masks = {m for d, m in timed if d == nearest}
    return nearest, causal if causal in masks else min(masks)


@functools.lru_cache(maxsize=64)  # a calibration's few shapes, asked on every prior
def _numpy_diagonal_pairs(seq_q: int, seq_k: int) -> int:
    """Pairs per head the numpy kernel computes for ``seq_q`` causal queries on the last
    positions of ``seq_k`` keys (the calibrated causal shape)."""
    return computed_pairs([(seq_k - seq_q, seq_q)], [(0, seq_k)], True, seq_k)


@dataclass(frozen=True)
class Calibration:
    """Everything ``calibrate`` measured on one host."""

    engine: str
    collectives: tuple[CollectiveFit, ...]
    compute: tuple[ComputeRate, ...]
    measured_at: str
    #: Empty for a fused kernel (its steps are not timed yet) and for calibrations stored
    #: before steps were timed: the prior then counts those steps as 0 s.
    steps: tuple[StepCost, ...] = ()
    #: The kernel's backward on some of ``compute``'s shapes (``seconds`` of one backward
    #: call); empty for an engine that does not train and for calibrations stored before.
    backward: tuple[ComputeRate, ...] = ()
    #: What its timings ran with, as a measurement's host facts (``Measurement.host``): the
    #: host, the engine's software, and where the engine reports them the kernel(s) its
    #: attention was timed with (on a GPU, those the torch engine's probe chose), the process
    #: group, cuDNN and NCCL; empty for calibrations stored before they were kept.
    facts: dict[str, str] = field(default_factory=dict, hash=False)
    #: What a blocking exchange costs beside computing ranks, at each rank count that
    #: outnumbers the host's cores and group size (``ExchangeWait``); empty where no count did,
    #: for an engine that does not time it and for calibrations stored before: the prior then
    #: adds none.
    waits: tuple[ExchangeWait, ...] = ()

    @property
    def max_ranks(self) -> int:
        return max(rate.ranks for rate in self.compute)

    @property
    def spec(self) -> EngineSpec:
        """What the calibrated engine is (its kernel, its Ring's stream, its collectives)."""
        return engine_spec(self.engine)

    @property
    def kernel(self) -> str:
        """The attention kernel the calibrated engine runs (``cptune.kernels.ATTENTION_KERNELS``)."""
        return self.spec.kernel

    @property
    def timed_kernels(self) -> str:
        """The kernel(s) its attention rates were timed with, as the engine named them (the
        torch engine's: on a GPU those its probe chose per shape); "" where not recorded. The
        rates describe those kernels: a prior read from them predicts the same ones."""
        return self.facts.get("kernel", "")

    def collective(self, kind: str, ranks: int, group: int, tier: str = "node") -> CollectiveFit:
        """The fit for ``kind`` in groups of ``group`` among ``ranks`` ranks whose traffic
        crosses link tier ``tier``; the nearest calibrated group size and rank count of that
        tier when those were not calibrated (of the nearest tier when none was)."""
        fits = [f for f in self.collectives if f.kind == kind]
        if not fits:
            raise ValueError(f"the calibration has no {kind} measurements")
        return min(fits, key=lambda f: (f.tier != tier, f.group != group, abs(f.group - group),
                                        abs(f.ranks - ranks)))

    @property
    def tiers(self) -> tuple[str, ...]:
        """The link tiers its collectives crossed (a cluster's calibration has both)."""
        return tuple(dict.fromkeys(f.tier for f in self.collectives))

    def measured_rates(self) -> dict[tuple[int, bool, int, int], float]:
        """FLOP/s per (head_dim, causal, seq_q, ranks) as timed, before pooling: what
        benchmarks compare from one calibration to the next."""
        return {(r.head_dim, r.causal, r.seq_q, r.ranks): r.computed_flops(self.kernel) / r.seconds
                for r in self.compute}

    @functools.cached_property
    def pooled_compute(self) -> tuple[ComputeRate, ...]:
        """``compute`` with each rank count's effect on the rate fitted over every shape at
        once: log rate = a term per shape + a_n + b_n log(work per call), a and b 0 on the
        fewest ranks, least squares over all points. What the prior compares across rank
        counts is the ratio of their rates, and measured shape by shape it is noisy: a rate
        ratio of one rank to two varied 2-9% per shape (standard deviation) across 19
        calibrations of a 2-core host, and the prior's ratio of one configuration to another
        moved with it from one length to the next. The ratio does change with the work per
        call (more threads in one call pay its fixed costs differently: 1.75 at the smallest
        d64 shape to 1.91 at the largest, mean of those 19), hence the slope b_n. The
        measured points stay as they are in ``compute``; these are what the prior reads."""
        ranks = sorted({r.ranks for r in self.compute})
        if len(ranks) < 2:
            return self.compute
        shapes = sorted({(r.heads, r.seq_q, r.seq_k, r.head_dim, r.causal) for r in self.compute})
        column = {shape: i for i, shape in enumerate(shapes)}
        log_work = np.log([r.computed_flops(self.kernel) for r in self.compute])
        centred = log_work - log_work.mean()
        design = np.zeros((len(self.compute), len(shapes) + 2 * (len(ranks) - 1)))
        for row, rate in enumerate(self.compute):
            design[row, column[(rate.heads, rate.seq_q, rate.seq_k, rate.head_dim, rate.causal)]] = 1.0
            if rate.ranks != ranks[0]:
                offset = len(shapes) + 2 * (ranks.index(rate.ranks) - 1)
                design[row, offset:offset + 2] = 1.0, centred[row]
        log_rates = log_work - np.log([r.seconds for r in self.compute])
        coefficients, *_ = np.linalg.lstsq(design, log_rates, rcond=None)
        seconds = np.exp(log_work - design @ coefficients)
        return tuple(replace(rate, seconds=float(t)) for rate, t in zip(self.compute, seconds, strict=True))

    def attention_rate(
        self, ranks: int, head_dim: int, causal: bool = False, flops: float | None = None
    ) -> float:
        """FLOP/s one of ``ranks`` ranks executes attention at, from the shapes calibrated
        with the head_dim nearest ``head_dim`` (in ratio) and the same mask (when any), at
        their pooled rates (``pooled_compute``): interpolated in log-log over the work per
        call ``flops`` (held constant beyond the largest calibrated size), or their geometric
        mean when ``flops`` is None. Below the smallest size a call keeps its fixed cost: its
        time falls along the line ``latency + work / rate`` fitted through the sizes
        (``call_seconds``), from the smallest size's time, never below that size's rate (a
        short sequence on several ranks makes calls of a few MFLOP, and held at the smallest
        size's rate their time would fall to nothing with the work). FLOPs here are the ones
        the engine's kernel executes (``ComputeRate.computed_flops``), masked pairs it computes
        included, so the rate carries over to shapes that waste more or less."""
        key = self._nearest_compute_key(ranks, head_dim, causal)
        work, seconds, _ = self._pooled_by_key[key]
        log_rates = np.log(work / seconds)
        if flops is None:
            return float(np.exp(np.mean(log_rates)))
        if flops < work[0] and key in self._call_fits:
            rate = self._call_fits[key][1]
            seconds_then = max(seconds[0] - (work[0] - flops) / rate, seconds[0] * flops / work[0])
            return float(flops / seconds_then)
        return float(np.exp(np.interp(np.log(flops), np.log(work), log_rates)))

    def key_elements_per_flop(self, ranks: int, head_dim: int, causal: bool, flops: float) -> float:
        """K and V elements the kernel's calls on the calibrated shapes prepare per FLOP they
        execute (``ComputeRate.key_elements``), from the shapes ``attention_rate`` reads,
        interpolated in log-log over the work per call ``flops``: the rate read at a call's
        work holds the preparation of that many keys (float32 ones: the shapes are timed in
        float32)."""
        work, _, elements = self._pooled_by_key[self._nearest_compute_key(ranks, head_dim, causal)]
        return float(np.exp(np.interp(np.log(flops), np.log(work), np.log(elements / work))))

    def call_seconds(self, ranks: int, head_dim: int, causal: bool = False) -> float:
        """Seconds one attention call costs however little its work, at the calibrated rank
        count nearest ``ranks``, the head_dim nearest ``head_dim`` and the same mask (when
        any): the latency of ``latency + work / rate`` fitted through the pooled rates' sizes
        (``fit_latency_bandwidth``, each size weighing alike). The rate read at a call's work
        holds one call's; the prior adds this for calls rated together as one (the Ring's on
        a host that charges its steps apart). On this project's 2-core host it fitted 1.3-2.2
        ms a call, about the time of 80 MFLOP of attention."""
        return self._call_seconds[self._nearest_compute_key(ranks, head_dim, causal)]

    def _nearest_compute_key(self, ranks: int, head_dim: int, causal: bool) -> tuple[int, int, bool]:
        """The calibrated (rank count, head_dim, mask) the rates of these are read at: the
        nearest rank count (fewer on a tie), then the head_dim nearest in ratio (smaller on a
        tie), then the same mask where it was timed."""
        keys = self._pooled_by_key.keys()
        nearest_ranks = min({n for n, _, _ in keys}, key=lambda n: (abs(n - ranks), n))
        return (nearest_ranks, *_nearest_dim_and_mask({(d, m) for n, d, m in keys if n == nearest_ranks},
                                                      head_dim, causal))

    @functools.cached_property
    def _pooled_by_key(self) -> dict[tuple[int, int, bool], tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The pooled attention rates by (rank count, head_dim, mask): each size's FLOPs the
        kernel executes, ascending, its seconds and the K and V elements its call prepares
        (``ComputeRate.key_elements``) - worked out once, read on every prior."""
        points: dict[tuple[int, int, bool], list[tuple[float, float, float]]] = {}
        for rate in self.pooled_compute:
            points.setdefault((rate.ranks, rate.head_dim, rate.causal), []).append(
                (float(rate.computed_flops(self.kernel)), rate.seconds, float(rate.key_elements)))
        ordered = {key: sorted(sizes, key=lambda size: size[0]) for key, sizes in points.items()}
        return {key: (np.array([w for w, _, _ in sizes]), np.array([t for _, t, _ in sizes]),
                      np.array([e for _, _, e in sizes]))
                for key, sizes in ordered.items()}

    @functools.cached_property
    def _call_fits(self) -> dict[tuple[int, int, bool], tuple[float, float]]:
        """(latency, rate) of ``latency + work / rate`` through each key's pooled sizes; none
        where one size was timed (it says nothing of how time grows with work)."""
        return {key: fit_latency_bandwidth(work, seconds)
                for key, (work, seconds, _) in self._pooled_by_key.items() if len(set(work)) > 1}

    @functools.cached_property
    def _call_seconds(self) -> dict[tuple[int, int, bool], float]:
        return {key: self._call_fits[key][0] if key in self._call_fits else 0.0
                for key in self._pooled_by_key}

    def backward_speed(self, head_dim: int, causal: bool = False, flops: float | None = None) -> float:
        """The backward kernel's FLOP rate (``BACKWARD_FLOPS_RATIO`` times a shape's forward
        FLOPs) as a share of the forward's on the same shape and rank count, both timed by this
        calibration, from the timed shapes with the head_dim nearest ``head_dim`` and the same
        mask (when any): each size's ratio pooled over every rank count (geometric mean), then
        interpolated in log forward work per call ``flops`` (held beyond the timed sizes), or
        their geometric mean when ``flops`` is None. Pooled, because what ranks computing at
        once cost each other is in the forward's rate at that count already, and one shape's
        ratio on one count is noisy (0.92 to 1.18 for d128 on 1 and 2 ranks of one
        calibration of a 2-core host), which would move every 1-rank against 2-rank comparison
        of a training step by as much. By size, because a call's fixed costs weigh in the
        forward's time and the backward's alike, not 2.5 times as much in the backward's: on
        this project's 2-core host the ratio measured about 1.2 at 512 x 2048 x d64 and 2.1 at
        128 x 512, where those costs are most of the call.
        ``ValueError`` when the backward was not timed (an engine that does not train, a
        calibration stored before)."""
        if not self.backward:
            raise ValueError(f"the calibration of {self.measured_at} did not time the {self.engine} engine's "
                             f"backward: run cptune calibrate again to predict training steps")
        forward = {(r.ranks, r.heads, r.seq_q, r.seq_k, r.head_dim, r.causal): r.seconds
                   for r in self.compute}
        key = _nearest_dim_and_mask({(r.head_dim, r.causal) for r in self.backward}, head_dim, causal)
        points = [r for r in self.backward if (r.head_dim, r.causal) == key]
        log_ratios: dict[float, list[float]] = {}
        for r in points:
            shape = (r.ranks, r.heads, r.seq_q, r.seq_k, r.head_dim, r.causal)
            ratio = forward[shape] * BACKWARD_FLOPS_RATIO / r.seconds
            log_ratios.setdefault(float(r.computed_flops(self.kernel)), []).append(float(np.log(ratio)))
        work = sorted(log_ratios)
        by_size = [float(np.mean(log_ratios[w])) for w in work]
        if flops is None:
            return float(np.exp(np.mean(by_size)))
        return float(np.exp(np.interp(np.log(flops), np.log(work), by_size)))

    def exchange_wait(self, ranks: int, group: int) -> float:
        """Seconds one blocking exchange in a group of ``group`` ranks costs beyond its own time
        with ``ranks`` ranks busy at once (``ExchangeWait``, never below 0: a wait within noise
        of none is none), at the group size timed nearest ``group`` (fewer on a tie) and the
        rank count ``ranks``, or the most timed where ``ranks`` is beyond them; 0 where
        ``ranks`` is below every count timed (its ranks had cores of their own) or none was."""
        counts = [w.ranks for w in self.waits if w.ranks <= ranks]
        if not counts:
            return 0.0
        at = [w for w in self.waits if w.ranks == max(counts)]
        return max(0.0, min(at, key=lambda w: (abs(w.group - group), w.group)).seconds)

    def step_seconds(self, kind: str, ranks: int, wire: str) -> float:
        """Seconds per element of step ``kind`` in ``wire`` dtype at the calibrated rank count
        nearest ``ranks``; 0 when the calibration did not time it."""
        timed = [step for step in self.steps if step.kind == kind and step.wire == wire]
        if not timed:
            return 0.0
        return min(timed, key=lambda step: (abs(step.ranks - ranks), step.ranks)).seconds_per_element

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        """The inverse of ``to_dict`` (plain JSON data, as the store keeps it)."""
        return cls(
            engine=data["engine"],
            collectives=tuple(
                CollectiveFit(**{**c, "sizes": tuple(c["sizes"]), "times_s": tuple(c["times_s"])})
                for c in data["collectives"]
            ),
            compute=tuple(ComputeRate(**c) for c in data["compute"]),
            measured_at=data["measured_at"],
            steps=tuple(StepCost(**step) for step in data.get("steps", ())),
            backward=tuple(ComputeRate(**c) for c in data.get("backward", ())),
            facts=dict(data.get("facts") or {}),
            waits=tuple(ExchangeWait(**wait) for wait in data.get("waits", ())),
        )


