"""Calibration: how fast this hardware moves bytes and computes attention, measured.

The cost model's prior turns the analytic terms of a configuration (FLOPs, bytes per
collective, steps) into time. It needs, per rank count, each collective's latency and
bandwidth and the attention compute rate; ``calibrate`` measures them on real ranks in
about a minute:

- each collective the strategies use (all-to-all, all-gather, the Ring's stream step) in
  groups of every size a configuration can form, over a sweep of message sizes, fitted to
  ``time = latency + bytes sent per rank / bandwidth``. The mpi engine times its all-to-all
  and all-gather as a strategy runs them, with the copies into send order and out of
  receive order (at fp32 they took 2.7-5.8x the bare collective). The bandwidth reported next
  to the fit is nccl-tests' bus bandwidth at the largest message: bytes each rank sends to its
  peers per second, which for all-gather and all-to-all is algbw * (n - 1) / n and for
  send/recv is algbw;
- the attention kernel on a few shapes, every rank computing at once on its share of the
  cores, so a rank count's rate includes the contention between its ranks. The rate
  depends on the work per call (small blocks pay fixed costs), the head_dim (the GEMMs'
  inner dimension) and the mask, so each is timed at three sizes, both head_dims and with
  and without a causal mask; the prior interpolates between them, each rank count's rate
  against one rank's read as one line in log work per call over all shapes
  (``Calibration.pooled_compute``: shape by shape that ratio is noisy);
- for the numpy kernel (the mpi engine, a ``StepTimer``), the work over
  a query block that a Ring step repeats beyond one call over all keys: preparing the query
  block (cast from each wire dtype, scaled, row norms) and merging the block's output into
  the running one, per element, every rank at once. Both are passes over memory whose cost
  grows with the sequence, not its square, so Ring's excess over the others falls as 1/S.

Every step is timed in rounds, rank counts in turn, and a point's time is the median of its
rounds: a burst of load the contention guard cannot see slows one round, not the median.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable

import numpy as np
from scipy.optimize import nnls

from cptune.cost import STREAM_KINDS, engine_collectives
from cptune.engines import Engine, attention_kernel, get_engine, untimed
from cptune.engines.mpi import computed_pairs
from cptune.errors import CPTuneError
from cptune.guard import Watch
from cptune.guard import enabled as guard_enabled

#: Bytes each rank sends per collective call: 1 KiB to 16 MiB in steps of 4x.
MESSAGE_SIZES: tuple[int, ...] = tuple(2**e for e in range(10, 25, 2))
#: Attention shapes timed per rank count: a few heads' query block against its keys, at three
#: sizes (factors 4 of work apart), head_dim 64 and 128, without and with a causal mask. The
#: largest (about 30 GFLOP) reaches the work of a whole layer on one rank at a few thousand
#: tokens: beyond the largest shape the rate is held, and two sizes held it from 2048 tokens
#: on one rank but 3072 on two, which skewed one rank against two between those lengths.
ATTENTION_SHAPES: tuple[dict[str, int], ...] = tuple(
    {"heads": 4, "seq_q": seq_q, "seq_k": 4 * seq_q, "head_dim": head_dim, "causal": causal}
    for head_dim in (64, 128)
    for causal in (0, 1)
    for seq_q in (512, 1024, 2048)
)
#: Memory-bound steps timed per rank count (``StepTimer``) on a 4-head x 1024-row x d128 block
#: (half a million elements): preparing a query block from each wire dtype, merging an output.
STEP_SHAPES: tuple[dict[str, object], ...] = (
    *({"kind": "query", "wire": wire, "heads": 4, "rows": 1024, "head_dim": 128}
      for wire in ("float16", "float32")),
    {"kind": "merge", "wire": "float32", "heads": 4, "rows": 1024, "head_dim": 128},
)
_TIMEOUT_S = 120.0
#: Times a calibration step the contention guard saw disturbed is timed again before
#: calibrate gives up.
GUARD_RETRIES = 3
#: How a progress message about a step timed again begins after the step's name: the CLI
#: shows those beyond its spinner.
RETIMED = "disturbed by other load"
#: Rounds a calibration is timed in, and timed calls per step in each round (``calibrate``).
ROUNDS = 3
REPEATS = 5

Progress = Callable[[str], None]


@dataclass(frozen=True)
class CollectiveFit:
    """One collective on ``ranks`` ranks in groups of ``group``: ``latency_s`` + bytes sent
    per rank / ``bandwidth`` (B/s) fits its ``times_s`` at ``sizes`` (bytes sent per rank);
    ``bus_bandwidth`` is measured at the largest size, as nccl-tests reports it."""

    kind: str
    ranks: int
    group: int
    latency_s: float
    bandwidth: float
    bus_bandwidth: float
    sizes: tuple[int, ...]
    times_s: tuple[float, ...]

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

    def computed_flops(self, kernel: str) -> int:
        """FLOPs ``kernel`` executes on this shape (``cptune.model.computed_flops``): the
        useful ones, and for the numpy kernel the masked pairs of its diagonal row blocks."""
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


@runtime_checkable
class StepTimer(Protocol):
    """An engine that can time the numpy kernel's memory-bound steps (``STEP_SHAPES``)."""

    def time_steps(
        self, ranks: int, steps: Sequence[dict[str, object]], warmup: int, repeats: int, timeout: float
    ) -> np.ndarray: ...


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

    @property
    def max_ranks(self) -> int:
        return max(rate.ranks for rate in self.compute)

    @property
    def kernel(self) -> str:
        """The attention kernel the calibrated engine runs (``cptune.engines.ATTENTION_KERNELS``)."""
        return attention_kernel(self.engine)

    def collective(self, kind: str, ranks: int, group: int) -> CollectiveFit:
        """The fit for ``kind`` in groups of ``group`` among ``ranks`` ranks; the nearest
        calibrated rank count with that group size when ``ranks`` was not calibrated."""
        fits = [f for f in self.collectives if f.kind == kind]
        if not fits:
            raise ValueError(f"the calibration has no {kind} measurements")
        return min(fits, key=lambda f: (f.group != group, abs(f.group - group), abs(f.ranks - ranks)))

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
        call ``flops`` (held constant beyond the calibrated sizes), or their geometric mean
        when ``flops`` is None. FLOPs here are the ones the engine's kernel executes
        (``ComputeRate.computed_flops``), masked pairs it computes included, so the rate
        carries over to shapes that waste more or less."""
        nearest_ranks = min({r.ranks for r in self.compute}, key=lambda n: (abs(n - ranks), n))
        at_ranks = [r for r in self.pooled_compute if r.ranks == nearest_ranks]
        nearest = min({abs(np.log(r.head_dim / head_dim)) for r in at_ranks})
        points = [r for r in at_ranks if abs(np.log(r.head_dim / head_dim)) == nearest]
        points = [r for r in points if r.causal == causal] or points
        work = np.array([r.computed_flops(self.kernel) for r in points], dtype=float)
        log_rates = np.log(work / [r.seconds for r in points])
        if flops is None:
            return float(np.exp(np.mean(log_rates)))
        order = np.argsort(work)
        log_flops = np.log(work[order])
        return float(np.exp(np.interp(np.log(flops), log_flops, log_rates[order])))

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
        )


def fit_latency_bandwidth(sizes: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    """Non-negative (latency, bandwidth) minimising the relative error of
    ``latency + size / bandwidth`` against ``times``: small messages weigh as much as large.
    Timings that do not grow with size give the bandwidth seen at the largest size."""
    weights = 1.0 / times
    (latency, inverse_bandwidth), _ = nnls(np.column_stack([weights, sizes * weights]), np.ones_like(times))
    if inverse_bandwidth <= 0:
        return float(latency), float(sizes[-1] / times[-1])
    return float(latency), float(1.0 / inverse_bandwidth)


def group_sizes(ranks: int) -> list[int]:
    """Every group a configuration on ``ranks`` ranks communicates in: the divisors > 1
    (head groups of u ranks, context groups of ranks / u)."""
    return [g for g in range(2, ranks + 1) if ranks % g == 0]


def _per_peer(kind: str, group: int, sent: int) -> int:
    return sent if kind in STREAM_KINDS else max(1, sent // (group - 1))


class CalibrationDisturbedError(CPTuneError):
    """Other load on the host disturbed a calibration step every time it was timed."""


def _guarded(
    engine: Engine, ranks: int, what: str, time_it: Callable[[], np.ndarray], guarded: bool, report: Progress
) -> np.ndarray:
    """``time_it()``'s timings of ``what`` on ``ranks`` ranks, timed again (up to
    ``GUARD_RETRIES`` times) while the contention guard (``cptune.guard``, the host's
    evidence: foreign load, the reference kernel) says other load disturbed them: a rate
    measured under someone else's job misleads every prior read from it (one that ran beside
    other jobs here read 9 of its 24 attention rates at 0.52-0.84x this host's usual)."""
    for _ in range(GUARD_RETRIES + 1):
        watch = Watch(engine.process_ids) if guarded else None
        timings = time_it()
        reason = watch.host_verdict(ranks) if watch else None
        if reason is None:
            return timings
        report(f"{what} {RETIMED} ({reason}): timing it again")
    raise CalibrationDisturbedError(
        f"{what} was disturbed by other load {GUARD_RETRIES + 1} times ({reason}): calibrate when the "
        f"host is quieter, or set CPTUNE_GUARD=off to keep such timings"
    )


def _chunks(kind: str, group: int) -> list[int]:
    """Bytes per peer of each of ``MESSAGE_SIZES`` for ``kind`` in groups of ``group``."""
    return [_per_peer(kind, group, size) for size in MESSAGE_SIZES]


def _collective_times(
    engine: Engine, kind: str, ranks: int, group: int, warmup: int, repeats: int, guarded: bool,
    report: Progress,
) -> np.ndarray:
    """Median seconds per call of ``kind`` at each of ``MESSAGE_SIZES`` (one round's timing)."""
    chunks = _chunks(kind, group)
    time_it = functools.partial(engine.time_collective, kind, ranks, group, chunks, warmup, repeats,
                                _TIMEOUT_S)
    timings = _guarded(engine, ranks, f"{kind} on {ranks} ranks in groups of {group}", time_it, guarded,
                       report)
    return np.median(timings, axis=1)


def _collective_fit(kind: str, ranks: int, group: int, seconds: np.ndarray) -> CollectiveFit:
    """``latency + bytes / bandwidth`` through the times of ``kind`` at ``MESSAGE_SIZES``."""
    sizes = np.array([c if kind in STREAM_KINDS else c * (group - 1) for c in _chunks(kind, group)],
                     dtype=float)
    latency, bandwidth = fit_latency_bandwidth(sizes, seconds)
    return CollectiveFit(
        kind=kind, ranks=ranks, group=group, latency_s=latency, bandwidth=bandwidth,
        bus_bandwidth=float(sizes[-1] / seconds[-1]),
        sizes=tuple(int(s) for s in sizes), times_s=tuple(float(t) for t in seconds),
    )


def _round_order(max_ranks: int, round_index: int) -> list[int]:
    """The rank counts in the order round ``round_index`` times them: ascending, then
    descending, and so on, so that neither end always goes first."""
    counts = list(range(1, max_ranks + 1))
    return counts if round_index % 2 == 0 else counts[::-1]


def calibrate(
    max_ranks: int,
    backend: str | Engine = "mpi",
    warmup: int = 2,
    repeats: int = REPEATS,
    progress: Progress | None = None,
    guard: bool | None = None,
    rounds: int = ROUNDS,
) -> Calibration:
    """Measure the collectives and the attention rate on 1..``max_ranks`` ranks, in
    ``rounds`` rounds that each time every step once (``repeats`` timed calls after
    ``warmup``); a step's time is the median of its rounds. A burst of other load the guard
    cannot see (a neighbour on the hypervisor's memory) slows one round, not the median: one
    calibration timed in a single pass read four of its 2-rank d64 attention rates at
    0.53-0.59x those of three others that hour, and the guard saw nothing. With ``guard``
    (None: on unless ``$CPTUNE_GUARD`` is "off") a step the contention guard saw disturbed is
    timed again; ``CalibrationDisturbedError`` when it stays disturbed."""
    if max_ranks < 1:
        raise ValueError(f"max_ranks must be at least 1, got {max_ranks}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    engine = get_engine(backend)
    if not engine.timed:
        raise untimed(engine.name)
    report = progress or (lambda _: None)
    guarded = guard_enabled() if guard is None else guard
    numpy_steps = attention_kernel(engine.name) == "numpy" and isinstance(engine, StepTimer)
    attention: dict[int, list[np.ndarray]] = {ranks: [] for ranks in range(1, max_ranks + 1)}
    step_times: dict[int, list[np.ndarray]] = {ranks: [] for ranks in range(1, max_ranks + 1)}
    collective_times: dict[tuple[str, int, int], list[np.ndarray]] = {
        (kind, ranks, group): []
        for ranks in range(1, max_ranks + 1) for group in group_sizes(ranks)
        for kind in engine_collectives(engine.name)
    }
    for round_index in range(rounds):
        prefix = f"round {round_index + 1} of {rounds}: " if rounds > 1 else ""
        for ranks in _round_order(max_ranks, round_index):
            report(f"{prefix}attention on {ranks} rank(s)")
            time_it = functools.partial(engine.time_attention, ranks, ATTENTION_SHAPES, warmup, repeats,
                                        _TIMEOUT_S)
            timings = _guarded(engine, ranks, f"attention on {ranks} rank(s)", time_it, guarded, report)
            attention[ranks].append(np.median(timings, axis=1))
            if numpy_steps:
                report(f"{prefix}the kernel's memory-bound steps on {ranks} rank(s)")
                time_it = functools.partial(engine.time_steps, ranks, STEP_SHAPES, warmup, repeats,
                                            _TIMEOUT_S)
                timings = _guarded(engine, ranks, f"the kernel's memory-bound steps on {ranks} rank(s)",
                                   time_it, guarded, report)
                step_times[ranks].append(np.median(timings, axis=1))
            for group in group_sizes(ranks):
                for kind in engine_collectives(engine.name):
                    report(f"{prefix}{kind} on {ranks} ranks in groups of {group}")
                    collective_times[(kind, ranks, group)].append(
                        _collective_times(engine, kind, ranks, group, warmup, repeats, guarded, report))
    compute = [
        ComputeRate(ranks=ranks, heads=s["heads"], seq_q=s["seq_q"], seq_k=s["seq_k"],
                    head_dim=s["head_dim"], seconds=float(t), causal=bool(s["causal"]))
        for ranks, times in attention.items()
        for s, t in zip(ATTENTION_SHAPES, np.median(times, axis=0), strict=True)
    ]
    steps = [
        StepCost(ranks=ranks, kind=str(s["kind"]), wire=str(s["wire"]), seconds=float(t),
                 elements=int(s["heads"]) * int(s["rows"]) * int(s["head_dim"]))
        for ranks, times in step_times.items() if times
        for s, t in zip(STEP_SHAPES, np.median(times, axis=0), strict=True)
    ]
    collectives = [_collective_fit(kind, ranks, group, np.median(times, axis=0))
                   for (kind, ranks, group), times in collective_times.items()]
    return Calibration(
        engine=engine.name,
        collectives=tuple(collectives),
        compute=tuple(compute),
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        steps=tuple(steps),
    )
