"""How a report is read from a database: ``gather``, every query and every prediction.

The combined estimate of each (hardware, workload, configuration) over its clean rounds
(``cptune.estimate``; disturbed, excluded and oversubscribed runs count for nothing),
grouped by hardware and attention shape into latency panels, speedup curves and the
compute / communication breakdown; the strategy map from ``recommend`` (a cell where every
feasible configuration was measured is the verdict on them); and the cost model's held-out
predictions against the measurements. What it returns is ``_data``'s ``ReportData``.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime
from itertools import pairwise

import numpy as np

from cptune.config import LOCAL
from cptune.errors import CPTuneError, InfeasibleConfigError
from cptune.estimate import Estimate, Verdict, combine, compare, judge
from cptune.model import TrainingSet, correction_decision_of, held_out_predictions, recommend, training_set
from cptune.report._data import (
    Accuracy,
    Breakdown,
    HardwareReport,
    LatencyPanel,
    LatencyPoint,
    MapCell,
    PredictionPoint,
    ReportData,
    Series,
    ShapeReport,
    SpeedupCurve,
    SpeedupPoint,
    family,
    mape,
    processors_used,
)
from cptune.store import Result, Store
from cptune.version import __version__
from cptune.workload import AttentionShape


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
        baseline = fastest[(seq_len, 1)]
        one = baseline.median_ms
        points = []
        for (length, ranks), estimate in sorted(fastest.items()):
            if length == seq_len:
                ms, used = estimate.median_ms, processors_used(ranks, cores)
                efficiency = one / ms / (used / processors_used(1, cores))
                tied = ranks > 1 and not compare(estimate, baseline).separated
                points.append(SpeedupPoint(ranks, estimate.config.label, ms, one / ms, efficiency,
                                           estimate.ids, used, tied))
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
    with Store(db, reading=True) as store:
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
        visits = [v for e in estimates if e.hardware == fp for v in e.visits]
        engines = ", ".join(sorted({v.engine for v in visits}))
        description = f"{described[fp].describe()} (engine: {engines})"
        ran_with = Counter(v.ran_with for v in visits if v.ran_with)
        sections.append(HardwareReport(fp, description, calibrated, tuple(shapes),
                                       accuracy.get(fp), tuple(dict.fromkeys(notes)),
                                       profile.calibration if profile else None,
                                       tuple(sorted(ran_with.items()))))
    return ReportData(url, datetime.now(UTC).isoformat(timespec="seconds"), __version__, tuple(sections),
                      len(fingerprints) > 1)
