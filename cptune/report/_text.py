"""The report as rich tables for the terminal: the HTML page's tables, without the figures."""

from __future__ import annotations

from rich import box
from rich.markup import escape
from rich.table import Table

from cptune.measurement import format_ms
from cptune.report._data import (
    BREAKDOWN_COLUMNS,
    COLLECTIVE_COLUMNS,
    COMPUTE_COLUMNS,
    STEP_CAPTION,
    STEP_COLUMNS,
    HardwareReport,
    ReportData,
    ShapeReport,
    breakdown_rows,
    calibration_rows,
    margin_text,
    rank_count,
    speedup_caption,
)


def _table(title: str, caption: str) -> Table:
    # as cptune's other commands: collapse_padding fits 80 columns
    return Table(title=escape(title), caption=escape(caption), box=box.SIMPLE_HEAD, pad_edge=False,
                 collapse_padding=True)


def _where(hardware: HardwareReport, shape: ShapeReport) -> str:
    return f"{shape.shape.describe()} on {hardware.description} [{hardware.fingerprint[:8]}]"


def _latency(hardware: HardwareReport, shape: ShapeReport) -> Table:
    table = _table(f"latency (ms): {_where(hardware, shape)}",
                   "per attention call, slowest rank: each configuration's clean rounds combined (the median "
                   "of their medians); all measured")
    table.add_column("seq_len", justify="right")
    table.add_column("strategy")
    for n in shape.rank_counts:
        table.add_column(rank_count(n), justify="right")
    for seq_len, name, points in shape.latency_rows():
        table.add_row(str(seq_len), escape(name),
                      *(format_ms(points[n].median_ms) if n in points else "" for n in shape.rank_counts))
    return table


def _speedup(hardware: HardwareReport, shape: ShapeReport) -> Table:
    baseline, cores = shape.speedup[0].baseline, shape.speedup[0].cores
    table = _table(f"speedup vs {baseline}: {_where(hardware, shape)}", speedup_caption(cores))
    efficiency = "efficiency per core" if cores else "efficiency"
    for name in ("seq_len", "ranks", "fastest", "ms", "speedup", efficiency):
        table.add_column(name, justify="left" if name == "fastest" else "right")
    for curve in shape.speedup:
        for p in curve.points:
            table.add_row(str(curve.seq_len), str(p.ranks), escape(p.label), format_ms(p.latency_ms),
                          p.speedup_text, f"{p.efficiency:.0%}")
    return table


def _strategy_map(hardware: HardwareReport, shape: ShapeReport) -> Table:
    table = _table(f"fastest configuration: {_where(hardware, shape)}",
                   "* predicted: some rival was not measured, the comparison rests on the cost model or the "
                   "prior (second line: the winner's ms and source); +x% (a% to b%): how much slower the "
                   "runner-up is, with its 95% interval (measured cells; the verdicts table names it); tied: "
                   "the configurations the noise of this hardware cannot tell from the first; empty: nothing "
                   "can run there")
    table.add_column("seq_len", justify="right")
    for n in shape.rank_counts:
        table.add_column(rank_count(n))
    grid = shape.map_grid()
    for seq_len in shape.map_lengths:
        cells = []
        for n in shape.rank_counts:
            cell = grid.get((seq_len, n))
            if cell is None:
                cells.append("")
            elif cell.measured:
                cells.append(f"{escape(cell.label)}\n{format_ms(cell.latency_ms)}\n"
                             f"{escape(margin_text(cell, named=False))}")
            else:
                cells.append(f"[dim]{escape(cell.label)}*\n{format_ms(cell.latency_ms)} {cell.source}\n"
                             f"{escape(margin_text(cell, named=False))}[/]")
        measured = seq_len in shape.measured_lengths
        table.add_row(str(seq_len) if measured else f"{seq_len} (not measured)", *cells)
    return table


def _verdicts(hardware: HardwareReport, shape: ShapeReport) -> Table | None:
    """Each measured map cell's verdict in words; None when no cell is measured."""
    measured = [c for c in shape.strategy_map if c.measured]
    if not measured:
        return None
    table = _table(f"verdicts on the measured cells: {_where(hardware, shape)}",
                   "the configurations on exactly that many ranks, their clean rounds combined; the "
                   "percentages: how much longer the runner-up takes, with the 95% interval")
    for name in ("seq_len", "ranks", "verdict"):
        table.add_column(name, justify="left" if name == "verdict" else "right")
    for cell in measured:
        table.add_row(str(cell.seq_len), str(cell.ranks), escape(cell.verdict))
    return table


def _accuracy(hardware: HardwareReport) -> Table:
    assert hardware.accuracy is not None
    accuracy = hardware.accuracy
    table = _table(f"predicted against measured: {hardware.description} [{hardware.fingerprint[:8]}]",
                   "model: held out by seq_len; MAPE against the measured medians; inside band: measurements "
                   f"within the model's held-out 10-90% interval (80% advertised). {accuracy.verdict}")
    for name in ("seq_len held out", "measurements", "model MAPE", "prior MAPE", "inside band"):
        table.add_column(name, justify="right")
    for seq_len, count, model, prior, coverage in accuracy.by_seq_len():
        table.add_row(str(seq_len), str(count), f"{model:.1f}%", f"{prior:.1f}%", f"{coverage:.0%}")
    table.add_row("all", str(len(accuracy.points)), f"{accuracy.model_mape:.1f}%",
                  f"{accuracy.prior_mape:.1f}%", f"{accuracy.model_coverage:.0%}", style="bold")
    return table


def _rows(title: str, caption: str, columns: tuple[str, ...], rows: list[list[str]], names: int = 1) -> Table:
    """A table of plain-text rows, the first ``names`` columns left-aligned."""
    table = _table(title, caption)
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i < names else "right", no_wrap=i < names)
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    return table


def _breakdown(hardware: HardwareReport, shape: ShapeReport) -> Table:
    return _rows(f"compute, communication and memory: {_where(hardware, shape)}",
                 "ms: the whole call (combined estimate), and the slowest rank's time in attention math "
                 "(compute) and waiting on communication compute did not hide (comm), each the median over "
                 "the clean rounds; comm % = comm / (compute + comm); peak: MiB one rank held at most; all "
                 "measured",
                 BREAKDOWN_COLUMNS, breakdown_rows(shape), names=2)


def _calibration(hardware: HardwareReport) -> list[Table]:
    assert hardware.calibration is not None
    collectives, compute, steps = calibration_rows(hardware.calibration)
    where = f"{hardware.description} [{hardware.fingerprint[:8]}]"
    tables = [
        _rows(f"calibration, collectives: {where}",
              "time = latency + bytes sent per rank / fit bandwidth, in groups of that size while that many "
              "ranks run; bus: nccl-tests' bus bandwidth at the largest message",
              COLLECTIVE_COLUMNS, collectives),
        _rows(f"calibration, attention rate: {where}", "per rank, with that many ranks computing at once"
              + (f"; timed with {timed}" if (timed := hardware.calibration_ran_with()) else ""),
              COMPUTE_COLUMNS, compute, names=0),
    ]
    if steps:
        tables.append(_rows(f"calibration, the kernel's steps: {where}", STEP_CAPTION, STEP_COLUMNS, steps,
                            names=2))
    return tables


def _ran_with(hardware: HardwareReport) -> Table:
    table = _table(f"ran with: {hardware.description} [{hardware.fingerprint[:8]}]",
                   "what the measurements shown ran with, as each recorded it: the attention kernel(s), the "
                   "process group, on a GPU the cuDNN and NCCL versions")
    table.add_column("ran with")
    table.add_column("runs", justify="right")
    for line, count in hardware.ran_with:
        table.add_row(escape(line), str(count))
    return table


def _notes(hardware: HardwareReport) -> Table:
    table = _table(f"notes: {hardware.description} [{hardware.fingerprint[:8]}]", "why something is missing")
    table.add_column("note")
    for note in hardware.notes:
        table.add_row(escape(note))
    return table


def text_tables(data: ReportData) -> list[Table]:
    """For each hardware and shape: latency, speedup (when a 1-rank run exists), strategy
    map, the verdicts on its measured cells and compute / communication / memory; then the
    hardware's prediction accuracy, what its measurements ran with, its calibration and notes,
    when there are any."""
    tables = []
    for hardware in data.hardware:
        for shape in hardware.shapes:
            tables.append(_latency(hardware, shape))
            if shape.speedup:
                tables.append(_speedup(hardware, shape))
            tables.append(_strategy_map(hardware, shape))
            if verdicts := _verdicts(hardware, shape):
                tables.append(verdicts)
            tables.append(_breakdown(hardware, shape))
        if hardware.accuracy is not None:
            tables.append(_accuracy(hardware))
        if hardware.ran_with:
            tables.append(_ran_with(hardware))
        if hardware.calibration is not None:
            tables += _calibration(hardware)
        if hardware.notes:
            tables.append(_notes(hardware))
    return tables
