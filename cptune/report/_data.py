"""What a report shows, read from a database into plain frozen dataclasses.

``gather`` does every query and every prediction; the figures, the HTML page and the
terminal tables only lay out what it returns, so each number they show is traceable to
stored measurements (by id) or to a named prediction source ("model" or "prior"). A measured
configuration's latency is the combined estimate of all its clean rounds
(``cptune.estimate``), never its newest run alone; disturbed, excluded and oversubscribed
runs count for nothing.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise

import numpy as np

from cptune.calibration import Calibration
from cptune.config import LOCAL, CPConfig
from cptune.errors import CPTuneError, InfeasibleConfigError
from cptune.estimate import Estimate, Verdict, combine, judge
from cptune.measurement import format_ms
from cptune.model import TrainingSet, correction_decision_of, held_out_predictions, recommend, training_set
from cptune.store import Result, Store
from cptune.version import __version__
from cptune.workload import AttentionShape, Workload


def rank_count(n: int) -> str:
    """A column header: "1 rank", "4 ranks"."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def family(config: CPConfig) -> str:
    """The strategy family a configuration belongs to across rank counts: its label without
    the context degree ("ring", "ulysses", "ulysses2xring"), or ``LOCAL`` on one rank (every
    strategy is plain attention there: one baseline, not a point on each strategy's line)."""
    if config.ranks == 1:
        return LOCAL
    if config.strategy == "ulysses" or config.head_group == 1:
        return config.strategy
    return f"ulysses{config.head_group}x{config.strategy}"


def slug(shape: AttentionShape) -> str:
    """A file-name part, e.g. "8x64-bf16" or "32-8kvx128-b4-fp16-causal"."""
    kv = "" if shape.kv_heads == shape.heads else f"-{shape.kv_heads}kv"
    batch = "" if shape.batch == 1 else f"-b{shape.batch}"
    mask = "-causal" if shape.causal else ""
    return f"{shape.heads}{kv}x{shape.head_dim}{batch}-{shape.dtype}{mask}"


@dataclass(frozen=True)
class LatencyPoint:
    """One configuration, ``label`` on ``ranks`` ranks: the combined estimate of its clean
    rounds (``rounds`` of them, the stored rows ``measurement_ids``) and its 95% interval."""

    ranks: int
    label: str
    median_ms: float
    low_ms: float
    high_ms: float
    rounds: int
    measurement_ids: tuple[int, ...]


@dataclass(frozen=True)
class Series:
    """One strategy family's measurements at one sequence length, by rank count."""

    family: str
    points: tuple[LatencyPoint, ...]


@dataclass(frozen=True)
class LatencyPanel:
    """Latency against rank count at one sequence length; the ``LOCAL`` series (the
    fastest rank-1 measurement, if any) comes first, the families follow by name."""

    seq_len: int
    series: tuple[Series, ...]


def processors_used(ranks: int, cores: int | None) -> int:
    """The processors ``ranks`` ranks compute on: one GPU each (``cores`` None), or on a CPU
    host of ``cores`` cores, each rank's ``cores // ranks`` threads (at least one), never
    more than the host has (``cptune.measurement.threads_per_rank``)."""
    if cores is None:
        return ranks
    return min(cores, ranks * max(1, cores // ranks))


def baseline_text(cores: int | None) -> str:
    """What a speedup is measured against: "1 rank using all 16 cores" on a CPU host,
    where one rank already computes on every core as threads; "1 rank (1 GPU)" where each
    rank brings its own GPU."""
    if cores is None:
        return "1 rank (1 GPU)"
    return f"1 rank using all {cores} cores" if cores > 1 else "1 rank using the 1 core"


def speedup_caption(cores: int | None) -> str:
    """What a speedup table's numbers are, for a CPU host of ``cores`` cores or (None) GPUs."""
    if cores is None:
        return ("speedup = fastest 1-rank ms / fastest ms on n ranks (combined estimates), each rank on a "
                "GPU of its own: the ideal is n; efficiency = speedup / n")
    return (f"speedup = fastest ms of {baseline_text(cores)} as threads / fastest ms on n ranks (combined "
            f"estimates): every rank count computes on the same {cores} cores, split between its ranks, so "
            "the ideal is 1x, not n; efficiency = speedup / (cores used / cores of 1 rank)")


@dataclass(frozen=True)
class SpeedupPoint:
    """The fastest measured configuration on ``ranks`` ranks against the fastest on one
    (combined estimates). ``processors``: the cores (CPU host) or GPUs its ranks computed
    on; ``efficiency``: the speedup per processor against the baseline's, speedup /
    (processors / the baseline's processors). On a CPU host every rank count computes on
    the same cores (one rank runs them all as threads), so there the ideal speedup is 1x,
    not the rank count, and efficiency is the speedup itself."""

    ranks: int
    label: str
    latency_ms: float
    speedup: float
    efficiency: float
    measurement_ids: tuple[int, ...]
    processors: int = 0


@dataclass(frozen=True)
class SpeedupCurve:
    """Speedup and efficiency at one sequence length that has a rank-1 measurement.
    ``cores``: the CPU host's cores that every rank count shares (its ranks split them as
    threads); None where each rank has a GPU of its own."""

    seq_len: int
    one_rank_ms: float
    points: tuple[SpeedupPoint, ...]
    cores: int | None = None

    @property
    def baseline(self) -> str:
        """What the speedups are against, in words (``baseline_text``)."""
        return baseline_text(self.cores)

    def ideal(self, ranks: int) -> float:
        """The speedup on ``ranks`` ranks if they ran as efficiently as the baseline: the
        ratio of processors (the rank count on GPUs; 1 on a CPU host, whose cores are the
        same for every rank count)."""
        return processors_used(ranks, self.cores) / processors_used(1, self.cores)


@dataclass(frozen=True)
class MapCell:
    """The winner among the configurations on exactly ``ranks`` ranks at ``seq_len``.

    ``status`` is "measured" when every feasible rival was measured, else "predicted";
    ``source`` is where the winner's own latency comes from ("measured", "model", "prior").
    ``runner_up`` is the next fastest configuration there and ``margin`` how much slower it
    is (0.08: 8% slower); None when the winner had no rival. A measured cell is the verdict
    on the combined estimates (``cptune.estimate.judge``): ``margin_interval`` is the
    margin's 95% interval, ``tied`` the configurations the noise cannot tell from the
    leader (then there is no winner, only tied configurations) and ``verdict`` the answer
    in words; a predicted cell has none of these."""

    seq_len: int
    ranks: int
    label: str
    latency_ms: float
    status: str
    source: str
    #: The stored rows behind the leader's latency (measured leaders only).
    measurement_ids: tuple[int, ...] = ()
    runner_up: str | None = None
    margin: float | None = None
    margin_interval: tuple[float, float] | None = None
    tied: tuple[str, ...] = ()
    verdict: str = ""

    @property
    def measured(self) -> bool:
        return self.status == "measured"

    @property
    def labels(self) -> tuple[str, ...]:
        """The winner, or every tied configuration, fastest first."""
        return (self.label, *self.tied)


@dataclass(frozen=True)
class Breakdown:
    """Where one measured configuration's time goes, and its memory: its combined estimate,
    the median over its clean rounds of the slowest rank's compute and exposed
    communication (ms), and the most bytes one rank held."""

    seq_len: int
    label: str
    ranks: int
    median_ms: float
    compute_ms: float | None
    comm_ms: float | None
    peak_bytes: int | None
    measurement_ids: tuple[int, ...]

    @property
    def scaled(self) -> bool:
        """Whether compute + communication, each a median over the rounds of the slowest
        rank's figure (not always the same rank or iteration), add up to more than the
        call's estimate, so the bars show them as shares of it."""
        return (self.compute_ms is not None and self.comm_ms is not None
                and self.compute_ms + self.comm_ms > self.median_ms)

    def bars(self) -> tuple[float, float, float] | None:
        """(compute, exposed communication, rest of the call) in ms, adding up to exactly the
        call's estimate ``median_ms``: compute and communication as measured where they fit
        in it, else scaled down to their shares of it (``scaled``; no rest); None when the
        split is not stored. A bar is never longer than the estimate it breaks down."""
        if self.compute_ms is None or self.comm_ms is None:
            return None
        compute, comm = max(0.0, self.compute_ms), max(0.0, self.comm_ms)
        if compute + comm > self.median_ms:
            compute, comm = (self.median_ms * compute / (compute + comm),
                             self.median_ms * comm / (compute + comm))
            return compute, comm, 0.0
        return compute, comm, self.median_ms - compute - comm

    @property
    def comm_share(self) -> float | None:
        """Communication's share of compute + communication, or None when not stored."""
        if self.compute_ms is None or self.comm_ms is None or self.compute_ms + self.comm_ms <= 0:
            return None
        return self.comm_ms / (self.compute_ms + self.comm_ms)


@dataclass(frozen=True)
class ShapeReport:
    """Everything about one attention shape on one hardware."""

    shape: AttentionShape
    latency: tuple[LatencyPanel, ...]
    speedup: tuple[SpeedupCurve, ...]
    strategy_map: tuple[MapCell, ...]
    #: The sequence lengths that have measurements (the map also holds predicted ones).
    measured_lengths: tuple[int, ...]
    #: Every measured configuration's compute / communication split and memory, by length.
    breakdown: tuple[Breakdown, ...] = ()

    @property
    def map_lengths(self) -> tuple[int, ...]:
        return tuple(sorted({c.seq_len for c in self.strategy_map}))

    @property
    def rank_counts(self) -> tuple[int, ...]:
        """The rank counts measured, as the map's and the tables' columns (only those: a
        sweep of 1, 8 and 64 ranks gets three columns, not 64)."""
        return tuple(sorted({p.ranks for panel in self.latency for s in panel.series for p in s.points}))

    def latency_rows(self) -> list[tuple[int, str, dict[int, LatencyPoint]]]:
        """The latency table's rows: (seq_len, family, its points by rank count)."""
        return [(panel.seq_len, s.family, {p.ranks: p for p in s.points})
                for panel in self.latency for s in panel.series]

    def map_grid(self) -> dict[tuple[int, int], MapCell]:
        """The strategy map's cells by (seq_len, ranks); a missing key is a cell nothing can run."""
        return {(c.seq_len, c.ranks): c for c in self.strategy_map}


@dataclass(frozen=True)
class PredictionPoint:
    """A measurement against the cost model's held-out prediction and the prior's, in ms."""

    measurement_id: int
    workload: Workload
    label: str
    ranks: int
    measured_ms: float
    model_ms: float
    prior_ms: float
    #: The model's held-out interval (ms).
    low_ms: float
    high_ms: float

    @property
    def covered(self) -> bool:
        return self.low_ms <= self.measured_ms <= self.high_ms


@dataclass(frozen=True)
class Accuracy:
    """Predicted against measured on one hardware; MAPE in percent; ``model_coverage`` the
    fraction of measurements inside the model's held-out interval."""

    points: tuple[PredictionPoint, ...]
    model_mape: float
    prior_mape: float
    model_coverage: float
    #: Whether recommend applies the learned correction on this database, and why.
    verdict: str = ""

    def by_seq_len(self) -> list[tuple[int, int, float, float, float]]:
        """(seq_len, measurements, model MAPE, prior MAPE, model coverage) for each sequence length."""
        lengths = sorted({p.workload.seq_len for p in self.points})
        rows = []
        for seq_len in lengths:
            points = [p for p in self.points if p.workload.seq_len == seq_len]
            measured = [p.measured_ms for p in points]
            rows.append((seq_len, len(points), mape((p.model_ms for p in points), measured),
                         mape((p.prior_ms for p in points), measured),
                         float(np.mean([p.covered for p in points]))))
        return rows


@dataclass(frozen=True)
class HardwareReport:
    """One hardware fingerprint's section of the report."""

    fingerprint: str
    #: The hardware and the engine(s) its measurements ran on.
    description: str
    calibrated: bool
    shapes: tuple[ShapeReport, ...]
    accuracy: Accuracy | None
    #: Why something is missing (no calibration, too few lengths to hold one out, ...).
    notes: tuple[str, ...]
    #: The stored calibration the prior stands on (collective fits, attention rates).
    calibration: Calibration | None = None


@dataclass(frozen=True)
class ReportData:
    """A report of the database at ``url``: one ``HardwareReport`` per fingerprint shown."""

    url: str
    generated_at: str
    version: str
    hardware: tuple[HardwareReport, ...]
    #: Whether the database holds measurements of more than one hardware (file names then
    #: start with the fingerprint, so reports of each can share a directory).
    several_hardware: bool


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.0f}%" if abs(fraction) >= 0.095 else f"{fraction * 100:.1f}%"


def margin_text(cell: MapCell, named: bool = True) -> str:
    """How the winner stands against the runner-up: e.g. "+8% (95%: 3% to 12%) vs ring"
    (``named``) or "+8% (3% to 12%)" for a measured winner, "tied with ring, ulysses" or
    "tied: ring, ulysses" for a measured tie, "+8% vs ring" or "+8%" for a predicted cell;
    "" when the winner had no rival."""
    if cell.tied:
        return f"tied with {', '.join(cell.tied)}" if named else f"tied: {', '.join(cell.tied)}"
    if cell.margin is None:
        return ""
    margin = f"+{_percent(cell.margin)}"
    if cell.margin_interval is not None:
        low, high = cell.margin_interval
        margin += f" ({'95%: ' if named else ''}{_percent(low)} to {_percent(high)})"
    return f"{margin} vs {cell.runner_up}" if named else margin


def calibration_rows(calibration: Calibration) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
    """The calibration as table rows: each collective fit (kind, ranks, group, latency us,
    fitted GB/s, bus GB/s), each attention rate (ranks, head_dim, mask, GFLOP per call,
    GFLOP/s per rank) and each timed step of the kernel (step, wire dtype, ranks, ns per
    element; none for a calibration without them)."""
    collectives = [[f.kind, str(f.ranks), str(f.group), f"{f.latency_s * 1e6:.1f}",
                    f"{f.bandwidth / 1e9:.2f}", f"{f.bus_bandwidth / 1e9:.2f}"]
                   for f in sorted(calibration.collectives, key=lambda f: (f.kind, f.ranks, f.group))]
    compute = [[str(r.ranks), str(r.head_dim), "causal" if r.causal else "full", f"{r.flops / 1e9:.2f}",
                f"{r.flops_per_s / 1e9:.1f}"]
               for r in sorted(calibration.compute, key=lambda r: (r.ranks, r.head_dim, r.causal, r.flops))]
    steps = [[s.kind, s.wire, str(s.ranks), f"{s.seconds_per_element * 1e9:.3f}"]
             for s in sorted(calibration.steps, key=lambda s: (s.kind, s.wire, s.ranks))]
    return collectives, compute, steps


COLLECTIVE_COLUMNS = ("collective", "ranks", "group", "latency us", "fit GB/s", "bus GB/s")
COMPUTE_COLUMNS = ("ranks", "head_dim", "mask", "GFLOP per call", "GFLOP/s per rank")
STEP_COLUMNS = ("step", "wire dtype", "ranks", "ns per element")
#: What the kernel's timed steps are, under their table.
STEP_CAPTION = ("the per-element work each Ring step repeats, with that many ranks running it at once: "
                "query, a query block made scaled float32; merge, a block's output merged into the "
                "running one")
BREAKDOWN_COLUMNS = ("seq_len", "config", "ranks", "median", "compute", "comm", "comm %", "peak")


def breakdown_rows(shape: ShapeReport) -> list[list[str]]:
    """The compute / communication split (ms) and peak memory (MiB per rank) of every
    measured configuration."""
    def ms(value: float | None) -> str:
        return "-" if value is None else format_ms(value)

    return [[str(b.seq_len), b.label, str(b.ranks), format_ms(b.median_ms), ms(b.compute_ms), ms(b.comm_ms),
             "-" if b.comm_share is None else f"{b.comm_share:.0%}",
             "-" if b.peak_bytes is None else f"{b.peak_bytes / 2**20:.0f}"]
            for b in shape.breakdown]


def mape(predicted: Iterable[float], measured: Iterable[float]) -> float:
    """Mean absolute percentage error of ``predicted`` against ``measured``."""
    p, m = np.asarray(list(predicted), dtype=float), np.asarray(list(measured), dtype=float)
    return float(np.mean(np.abs(p - m) / m) * 100)


def _point(estimate: Estimate) -> LatencyPoint:
    return LatencyPoint(estimate.config.ranks, estimate.config.label, estimate.median_ms, estimate.low_ms,
                        estimate.high_ms, estimate.rounds, estimate.ids)


def _by_cell(estimates: Iterable[Estimate]) -> dict[tuple[int, int], list[Estimate]]:
    """The estimates at each (seq_len, ranks), fastest first."""
    cells: dict[tuple[int, int], list[Estimate]] = defaultdict(list)
    for e in estimates:
        cells[(e.workload.seq_len, e.config.ranks)].append(e)
    return {key: sorted(es, key=lambda e: e.median_ms) for key, es in cells.items()}


def _breakdown(estimates: Iterable[Estimate]) -> tuple[Breakdown, ...]:
    return tuple(
        Breakdown(e.workload.seq_len, e.config.label, e.config.ranks, e.median_ms, e.compute_ms, e.comm_ms,
                  e.peak_bytes, e.ids)
        for e in sorted(estimates, key=lambda e: (e.workload.seq_len, e.config.ranks, e.median_ms))
    )


def _latency_panels(estimates: list[Estimate]) -> tuple[LatencyPanel, ...]:
    # keyed by (seq_len, family, ranks): configurations sharing one (the rank-1 ones) keep the fastest
    chosen: dict[tuple[int, str, int], LatencyPoint] = {}
    for e in estimates:
        point, key = _point(e), (e.workload.seq_len, family(e.config), e.config.ranks)
        if key not in chosen or point.median_ms < chosen[key].median_ms:
            chosen[key] = point
    by_length: dict[int, dict[str, list[LatencyPoint]]] = defaultdict(lambda: defaultdict(list))
    for (seq_len, name, _), point in chosen.items():
        by_length[seq_len][name].append(point)
    return tuple(
        LatencyPanel(seq_len, tuple(
            Series(name, tuple(sorted(points, key=lambda p: p.ranks)))
            for name, points in sorted(families.items(), key=lambda item: (item[0] != LOCAL, item[0]))
        ))
        for seq_len, families in sorted(by_length.items())
    )


def _speedup_curves(fastest: dict[tuple[int, int], Estimate], cores: int | None) -> tuple[SpeedupCurve, ...]:
    """Against the fastest 1-rank run; ``cores``: the CPU host's cores every rank count
    shares, None on GPUs (``SpeedupCurve.cores``)."""
    curves = []
    for seq_len in sorted({s for s, _ in fastest}):
        if (seq_len, 1) not in fastest:
            continue
        one = fastest[(seq_len, 1)].median_ms
        points = []
        for (length, ranks), estimate in sorted(fastest.items()):
            if length == seq_len:
                ms, used = estimate.median_ms, processors_used(ranks, cores)
                efficiency = one / ms / (used / processors_used(1, cores))
                points.append(SpeedupPoint(ranks, estimate.config.label, ms, one / ms, efficiency,
                                           estimate.ids, used))
        curves.append(SpeedupCurve(seq_len, one, tuple(points), cores))
    return tuple(curves)


def _round_length(value: float) -> int:
    """A length near ``value`` on a grid of 16 steps per octave (1448 -> 1472)."""
    step = 2 ** max(0, math.floor(math.log2(value)) - 4)
    return max(1, round(value / step) * step)


def map_lengths(measured: Iterable[int]) -> tuple[int, ...]:
    """The measured lengths, the geometric midpoints between neighbours, and 2x and 4x the
    longest: where the map shows what the model expects between and beyond the measurements."""
    lengths = sorted(set(measured))
    between = [_round_length(math.sqrt(a * b)) for a, b in pairwise(lengths)]
    return tuple(sorted({*lengths, *between, 2 * lengths[-1], 4 * lengths[-1]}))


def _margin(winner_ms: float, runner_up_ms: float) -> float:
    return runner_up_ms / winner_ms - 1


def _measured_cell(measured: list[Estimate]) -> MapCell:
    """The verdict on one cell's estimates: the leader, and the runner-up's margin with its
    interval, or the configurations tied with the leader."""
    verdict: Verdict | None = judge(measured)
    assert verdict is not None  # a cell exists only where something was measured
    leader, second = verdict.leader, verdict.runner_up
    return MapCell(
        leader.workload.seq_len, leader.config.ranks, leader.config.label, leader.median_ms, "measured",
        "measured", leader.ids, second.other.label if second else None,
        second.ratio - 1 if second else None, (second.low - 1, second.high - 1) if second else None,
        tuple(config.label for config in verdict.tied), verdict.describe(),
    )


def _strategy_map(
    shape: AttentionShape, cells_measured: dict[tuple[int, int], list[Estimate]], ranks: tuple[int, ...],
    fingerprint: str, db: str | None, notes: list[str],
) -> tuple[MapCell, ...]:
    """The map from ``recommend`` at every length and measured rank count: where every
    feasible configuration has a combined estimate, the verdict on them; elsewhere
    ``recommend``'s pick; where it cannot answer, the verdict on what was measured, if
    anything (and why in ``notes``)."""
    cells = []
    for seq_len in map_lengths(s for s, _ in cells_measured):
        for n in ranks:
            measured = cells_measured.get((seq_len, n), [])
            try:
                pick = recommend(shape.at(seq_len), ranks=n, hardware=fingerprint, db=db)
            except InfeasibleConfigError:
                continue  # nothing runs there (e.g. fewer tokens than ranks): the cell stays empty
            except CPTuneError as exc:
                notes.append(f"strategy map: measured cells only where predictions failed ({exc})")
                if measured:
                    cells.append(_measured_cell(measured))
                continue
            if measured and {c.config for c in pick.candidates} <= {e.config for e in measured}:
                cells.append(_measured_cell(measured))
                continue
            # the winner measured, a rival predicted: the winner's own figure is its estimate
            own = next((e for e in measured if e.config == pick.config), None)
            latency = own.median_ms if own else pick.latency_ms
            second = pick.alternatives[0] if pick.alternatives else None
            cells.append(MapCell(seq_len, n, pick.config.label, latency, "predicted", pick.source,
                                 own.ids if own else (), second.config.label if second else None,
                                 _margin(latency, second.latency_ms) if second else None))
    return tuple(cells)


def _accuracy(
    training: TrainingSet, fingerprints: list[str], db: str | None
) -> tuple[dict[str, Accuracy], str | None]:
    """Held-out model predictions (each seq_len left out in turn, over the whole database as
    ``cptune evaluate`` does) and the prior alone, per hardware; or why they are missing.
    ``db`` as the user gave it (the shown URL has no password)."""
    if not any(r.hardware in fingerprints for r in training.results):
        return {}, None
    try:
        _, predicted_s, low_s, high_s = held_out_predictions(training.cases, training.latencies_s,
                                                             by="seq_len")
    except CPTuneError as exc:
        return {}, f"predicted against measured skipped: {exc}"
    points: dict[str, list[PredictionPoint]] = defaultdict(list)
    for case, result, measured_s, model_s, low, high in zip(
        training.cases, training.results, training.latencies_s, predicted_s, low_s, high_s, strict=True
    ):
        points[result.hardware].append(PredictionPoint(
            result.id, result.workload, result.config.label, result.config.ranks, float(measured_s) * 1e3,
            float(model_s) * 1e3, case.prior().total_s * 1e3, float(low) * 1e3, float(high) * 1e3,
        ))
    verdict = correction_decision_of(db)
    use = "applies the learned correction" if verdict.applied else "uses the prior alone"
    return {
        fp: Accuracy(tuple(p), mape((x.model_ms for x in p), (x.measured_ms for x in p)),
                     mape((x.prior_ms for x in p), (x.measured_ms for x in p)),
                     float(np.mean([x.covered for x in p])), f"recommend {use}: {verdict.reason}")
        for fp, p in points.items() if fp in fingerprints
    }, None


def _select(hardware: str, fingerprints: list[str], url: str) -> str:
    matches = [fp for fp in fingerprints if fp.startswith(hardware.lower())]
    if len(hardware) < 4 or len(matches) != 1:
        raise CPTuneError(
            f"hardware {hardware!r} names no single fingerprint with measurements in {url} (give 4 or "
            f"more leading characters of one of: {', '.join(fingerprints)})"
        )
    return matches[0]


def _left_out(rows: list[Result]) -> str | None:
    """A note on the successful runs that count for nothing, or None when there are none."""
    counts = {"disturbed (the contention guard saw other load)": sum(
                  r.status == "ok" and bool(r.disturbed) for r in rows),
              "excluded with cptune results --exclude": sum(r.status == "ok" and r.excluded for r in rows)}
    parts = [f"{n} {why}" for why, n in counts.items() if n]
    if not parts:
        return None
    return f"left out of every figure and table here, though kept in the database: {'; '.join(parts)}"


def gather(db: str | None = None, hardware: str | None = None) -> ReportData:
    """Read the database ``db`` (default as for the CLI) into a ``ReportData``: the combined
    estimate of each (hardware, workload, configuration) over its clean rounds (disturbed,
    excluded and oversubscribed runs left out), grouped by hardware and attention shape,
    with the strategy map (measured cells: the verdict of ``cptune.estimate``) and the
    held-out predictions.

    ``hardware``: a fingerprint or a unique prefix of 4 or more characters; None for every
    hardware with measurements. A ``CPTuneError`` when there is nothing to report."""
    with Store(db, create=False) as store:
        url = store.url  # shown in the report: no password
        rows = store.results(oversubscribed=False)
        described = store.hardware()
        training = training_set(store)
    estimates = list(combine(rows).values())
    if not estimates:
        raise CPTuneError(f"no measurements in {url}: run cptune search first")
    fingerprints = sorted({e.hardware for e in estimates})
    chosen = fingerprints if hardware is None else [_select(hardware, fingerprints, url)]
    accuracy, accuracy_note = _accuracy(training, chosen, db)

    sections = []
    for fp in chosen:
        calibrated = fp in training.profiles
        notes: list[str] = []
        if left_out := _left_out([r for r in rows if r.hardware == fp]):
            notes.append(left_out)
        if not calibrated:
            notes.append(
                f"hardware {fp} has no calibration in {url}: the strategy map shows measured cells only "
                f"and nothing is predicted; run cptune calibrate on that machine with this database"
            )
        elif accuracy_note:
            notes.append(accuracy_note)
        by_shape: dict[AttentionShape, list[Estimate]] = defaultdict(list)
        for e in estimates:
            if e.hardware == fp:
                by_shape[e.workload.shape].append(e)
        # a CPU host's ranks split its cores between them (one rank computes on all of them)
        cores = described[fp].cpu_count if described[fp].gpu_model is None else None
        shapes = []
        for shape, shape_estimates in sorted(by_shape.items(), key=lambda item: item[0]):
            measured = _by_cell(shape_estimates)
            fastest = {key: es[0] for key, es in measured.items()}
            ranks = tuple(sorted({n for _, n in measured}))
            cells = (_strategy_map(shape, measured, ranks, fp, db, notes) if calibrated
                     else tuple(_measured_cell(es) for _, es in sorted(measured.items())))
            shapes.append(ShapeReport(shape, _latency_panels(shape_estimates),
                                      _speedup_curves(fastest, cores), cells,
                                      tuple(sorted({s for s, _ in measured})),
                                      _breakdown(shape_estimates)))
        profile = training.profiles.get(fp)
        engines = ", ".join(sorted({v.engine for e in estimates if e.hardware == fp for v in e.visits}))
        description = f"{described[fp].describe()} (engine: {engines})"
        sections.append(HardwareReport(fp, description, calibrated, tuple(shapes),
                                       accuracy.get(fp), tuple(dict.fromkeys(notes)),
                                       profile.calibration if profile else None))
    return ReportData(url, datetime.now(UTC).isoformat(timespec="seconds"), __version__, tuple(sections),
                      len(fingerprints) > 1)
