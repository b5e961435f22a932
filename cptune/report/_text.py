"""The report as rich tables for the terminal: the HTML page's tables, without the figures."""

from __future__ import annotations

from rich import box
from rich.markup import escape
from rich.table import Table

from cptune.measurement import format_ms
from cptune.report._data import HardwareReport, ReportData, ShapeReport, rank_count


def _table(title: str, caption: str) -> Table:
    # as cptune's other commands: collapse_padding fits 80 columns
    return Table(title=escape(title), caption=escape(caption), box=box.SIMPLE_HEAD, pad_edge=False,
                 collapse_padding=True)


def _where(hardware: HardwareReport, shape: ShapeReport) -> str:
    return f"{shape.shape.describe()} on {hardware.description} [{hardware.fingerprint[:8]}]"


def _latency(hardware: HardwareReport, shape: ShapeReport) -> Table:
    table = _table(f"latency (ms): {_where(hardware, shape)}",
                   "median per attention call, slowest rank; all measured")
    table.add_column("seq_len", justify="right")
    table.add_column("strategy")
    for n in shape.rank_counts:
        table.add_column(rank_count(n), justify="right")
    for seq_len, name, points in shape.latency_rows():
        table.add_row(str(seq_len), escape(name),
                      *(format_ms(points[n].median_ms) if n in points else "" for n in shape.rank_counts))
    return table


def _speedup(hardware: HardwareReport, shape: ShapeReport) -> Table:
    table = _table(f"speedup over 1 rank: {_where(hardware, shape)}",
                   "fastest measured on n ranks against the fastest on 1; efficiency = speedup / n")
    for name in ("seq_len", "ranks", "fastest", "ms", "speedup", "efficiency"):
        table.add_column(name, justify="left" if name == "fastest" else "right")
    for curve in shape.speedup:
        for p in curve.points:
            table.add_row(str(curve.seq_len), str(p.ranks), escape(p.label), format_ms(p.latency_ms),
                          f"{p.speedup:.2f}x", f"{p.efficiency:.0%}")
    return table


def _strategy_map(hardware: HardwareReport, shape: ShapeReport) -> Table:
    table = _table(f"fastest configuration: {_where(hardware, shape)}",
                   "* predicted: some rival was not measured, the comparison rests on the cost model or the "
                   "prior (second line: the winner's ms and source); empty: nothing can run there")
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
                cells.append(f"{escape(cell.label)}\n{format_ms(cell.latency_ms)}")
            else:
                cells.append(f"[dim]{escape(cell.label)}*\n{format_ms(cell.latency_ms)} {cell.source}[/]")
        measured = seq_len in shape.measured_lengths
        table.add_row(str(seq_len) if measured else f"{seq_len} (not measured)", *cells)
    return table


def _accuracy(hardware: HardwareReport) -> Table:
    assert hardware.accuracy is not None
    accuracy = hardware.accuracy
    table = _table(f"predicted against measured: {hardware.description} [{hardware.fingerprint[:8]}]",
                   "model: held out by seq_len; MAPE against the measured medians")
    for name in ("seq_len held out", "measurements", "model MAPE", "prior MAPE"):
        table.add_column(name, justify="right")
    for seq_len, count, model, prior in accuracy.by_seq_len():
        table.add_row(str(seq_len), str(count), f"{model:.1f}%", f"{prior:.1f}%")
    table.add_row("all", str(len(accuracy.points)), f"{accuracy.model_mape:.1f}%",
                  f"{accuracy.prior_mape:.1f}%", style="bold")
    return table


def _notes(hardware: HardwareReport) -> Table:
    table = _table(f"notes: {hardware.description} [{hardware.fingerprint[:8]}]", "why something is missing")
    table.add_column("note")
    for note in hardware.notes:
        table.add_row(escape(note))
    return table


def text_tables(data: ReportData) -> list[Table]:
    """For each hardware and shape: latency, speedup (when a 1-rank run exists) and strategy
    map; then the hardware's prediction accuracy and notes, when there are any."""
    tables = []
    for hardware in data.hardware:
        for shape in hardware.shapes:
            tables.append(_latency(hardware, shape))
            if shape.speedup:
                tables.append(_speedup(hardware, shape))
            tables.append(_strategy_map(hardware, shape))
        if hardware.accuracy is not None:
            tables.append(_accuracy(hardware))
        if hardware.notes:
            tables.append(_notes(hardware))
    return tables
