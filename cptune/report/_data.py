"""What a report shows, as plain frozen dataclasses (``ReportData`` and its parts), and the
table rows and captions that the HTML page and the terminal tables both show.

``gather`` (``_gather``) fills them, doing every query and every prediction; the figures,
the HTML page and the terminal tables only lay out what it returns, so each number they
show is traceable to stored measurements (by id) or to a named prediction source ("model"
or "prior"). A measured configuration's latency is the combined estimate of all its clean
rounds (``cptune.estimate``), never its newest run alone; disturbed, excluded and
oversubscribed runs count for nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cptune.calibration import Calibration
from cptune.config import LOCAL, CPConfig
from cptune.measurement import format_ms, ran_with
from cptune.workload import AttentionShape, Workload


def rank_count(n: int) -> str:
    """A column header: "1 rank", "4 ranks"."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def family(config: CPConfig) -> str:
    """The strategy family a configuration belongs to across rank counts: its label without
    the context degree ("ring", "ulysses", "ulysses2xring", "ring+doc_whole": a layout, and
    padded heads, a line of its own), or ``LOCAL`` on one rank (every strategy is plain attention there: one
    baseline, not a point on each strategy's line)."""
    if config.ranks == 1:
        return LOCAL
    layout = (f"+{config.layout}" if config.layout else "") + ("+padded" if config.pad_heads else "")
    if config.strategy == "ulysses" or config.head_group == 1:
        return config.strategy + layout
    return f"ulysses{config.head_group}x{config.strategy}{layout}"


def slug(shape: AttentionShape) -> str:
    """A file-name part, e.g. "8x64-bf16", "32-8kvx128-b4-fp16-causal", one per shape: the
    mask's parts and the mode too where set ("-causal-win4096-0s4", "-docs12-1a2b3c",
    "-text512", "-train"; documents given by their lengths with a digest of them)."""
    kv = "" if shape.kv_heads == shape.heads else f"-{shape.kv_heads}kv"
    batch = "" if shape.batch == 1 else f"-b{shape.batch}"
    mask = "-causal" if shape.causal else ""
    if shape.window:
        mask += f"-win{shape.window[0]}-{shape.window[1]}" + (f"s{shape.sinks}" if shape.sinks else "")
    if shape.documents.every:
        mask += f"-docs-of{shape.documents.every}"
    elif shape.documents.lengths:
        lengths = ",".join(map(str, shape.documents.lengths)).encode()
        mask += f"-docs{len(shape.documents.lengths)}-{hashlib.sha256(lengths).hexdigest()[:6]}"
    mask += f"-text{shape.text}" if shape.text else ""
    mask += "-train" if shape.mode == "train" else ""
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
    tied = "; tied: the noise cannot tell it from the baseline, so no speedup is shown by it"
    if cores is None:
        return ("speedup = fastest 1-rank ms / fastest ms on n ranks (combined estimates), each rank on a "
                f"GPU of its own: the ideal is n; efficiency = speedup / n{tied}")
    return (f"speedup = fastest ms of {baseline_text(cores)} as threads / fastest ms on n ranks (combined "
            f"estimates): every rank count computes on the same {cores} cores, split between its ranks, so "
            f"the ideal is 1x, not n; efficiency = speedup / (cores used / cores of 1 rank){tied}")


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
    #: Whether the noise cannot tell it from the baseline (the verdict's tie): its speedup is
    #: then no speedup, whatever the medians' ratio.
    tied: bool = False

    @property
    def speedup_text(self) -> str:
        """"1.52x", or "tied (1.13x)" where the verdict cannot tell it from the baseline."""
        return f"tied ({self.speedup:.2f}x)" if self.tied else f"{self.speedup:.2f}x"


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
    #: What its measurements shown ran with (``Result.ran_with``: kernel, process group, on a
    #: GPU cuDNN and NCCL) and how many ran so; none where no row recorded it.
    ran_with: tuple[tuple[str, int], ...] = ()

    def ran_with_text(self) -> str:
        """``ran_with`` in one line: "flash_for_cpu; process group gloo (24 runs)", ... ; "" if none."""
        return ", ".join(f"{line} ({count} run{'s' if count != 1 else ''})" for line, count in self.ran_with)

    def calibration_ran_with(self) -> str:
        """What the calibration's timings ran with (``cptune.measurement.ran_with``): the
        kernel(s) its attention rates describe among it; "" where not recorded."""
        return "" if self.calibration is None else ran_with(self.calibration.facts)


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
