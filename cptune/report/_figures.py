"""The report's figures as PNG bytes, drawn with matplotlib's Agg canvas.

Each figure is a ``matplotlib.figure.Figure`` on its own ``FigureCanvasAgg``: no pyplot, no
global state, no display needed, and the same data always gives the same picture (fixed
sizes per panel, fixed dpi, bounded however many ranks or lengths there are). Measured points
are filled; predicted ones are hollow or hatched, and the legend says which.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Sequence

from matplotlib import colormaps
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from cptune.config import LOCAL
from cptune.report._data import Accuracy, HardwareReport, ReportData, ShapeReport, margin_text, slug

DPI = 110
#: Figure kinds, each one PNG per (hardware, shape); ``ACCURACY`` is one PNG per hardware.
LATENCY, SPEEDUP, STRATEGY_MAP = "latency-vs-ranks", "speedup", "strategy-map"
BREAKDOWN, ACCURACY = "compute-vs-communication", "predicted-vs-measured"
#: The breakdown figure shows at most this many configurations per length, the fastest.
BREAKDOWN_BARS = 12
#: A panel's y axis turns logarithmic when its values span more than this factor.
LOG_SPAN = 10.0
#: Rank-count axes label every count up to this many counts, else only powers of two.
LABELLED_COUNTS = 12
#: Series at one rank count sit this far apart sideways (in octaves) so none hides another.
SIDESTEP = 0.04
#: The strategy map's largest size in inches (width, height), however many cells it has.
MAP_MAX_SIZE = (16.0, 9.0)
#: How each kind of map cell is drawn: (face filled?, hatch, legend text), by (status, source);
#: a measured cell whose leader is tied with others is drawn as ("tied", "measured").
_CELL_STYLES = {
    ("measured", "measured"): (True, "", "measured"),
    ("tied", "measured"): (True, "xxx", "measured, tied within the noise"),
    ("predicted", "model"): (False, "", "predicted (model)"),
    ("predicted", "prior"): (False, "////", "predicted (prior)"),
    ("predicted", "measured"): (False, "....", "predicted (winner measured, rivals not)"),
}


def file_name(data: ReportData, hardware: HardwareReport, shape: ShapeReport | None, kind: str) -> str:
    """E.g. "8x64-bf16-latency-vs-ranks.png"; prefixed with the fingerprint's first 8
    characters when the database holds several hardware."""
    prefix = f"{hardware.fingerprint[:8]}-" if data.several_hardware else ""
    middle = f"{slug(shape.shape)}-" if shape is not None else ""
    return f"{prefix}{middle}{kind}.png"


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return buffer.getvalue()


def _colors(names: Iterable[str]) -> dict[str, str]:
    """One color per name, assigned in sorted order: the same data always gets the same colors."""
    ordered = sorted(set(names))
    palette = colormaps["tab10" if len(ordered) <= 10 else "tab20"]
    return {name: to_hex(palette(i % palette.N)) for i, name in enumerate(ordered)}


def _hardware_title(hardware: HardwareReport) -> str:
    # a "$" in a host or CPU name would otherwise start matplotlib's math mode
    return f"{hardware.description} [{hardware.fingerprint[:8]}]".replace("$", r"\$")


def _count_labels(counts: Sequence[int]) -> list[str]:
    """Tick labels for rank counts: every count when few, else powers of two and the last
    (the others stay ticked, unlabelled, so labels never overlap)."""
    few = len(counts) <= LABELLED_COUNTS
    return [str(n) if few or n & (n - 1) == 0 or n == counts[-1] else "" for n in counts]


def _rank_axis(axes: Axes, ranks: Sequence[int]) -> None:
    """Rank counts on a base-2 log axis, ticked at exactly the given counts."""
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(ranks), _count_labels(ranks))
    axes.minorticks_off()
    axes.set_xlim(min(ranks) / 1.25, max(ranks) * 1.25)


def _log_ticks(axes: Sequence[Axis], low: float, high: float) -> None:
    """Log axes over ``low``-``high``: major ticks at 1, 2, 5 x 10^k (only 10^k beyond three
    decades) labelled as plain numbers, minor ticks unlabelled, so labels never crowd
    whatever the span."""
    subs = (1.0,) if high / low > 1e3 else (1.0, 2.0, 5.0)
    for axis in axes:
        axis.set_major_locator(LogLocator(base=10, subs=subs))
        axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.set_minor_formatter(NullFormatter())


def _sidestep(index: int, count: int) -> float:
    """The factor that moves series ``index`` of ``count`` sideways on a log-2 axis."""
    return float(2 ** ((index - (count - 1) / 2) * SIDESTEP))


def _grid(count: int, columns: int = 3) -> tuple[int, int]:
    cols = min(columns, count)
    return math.ceil(count / cols), cols


def latency_figure(hardware: HardwareReport, shape: ShapeReport) -> bytes:
    """Latency against rank count, one panel per sequence length, one line per strategy
    family: combined estimates with their 95% intervals as error bars, each family nudged
    sideways so markers at one rank count stay visible; the 1-rank configuration is a dotted
    baseline across the panel."""
    rows, cols = _grid(len(shape.latency))
    figure = Figure(figsize=(3.9 * cols + 1.8, 3.3 * rows + 0.8), dpi=DPI, layout="constrained")
    grid = figure.subplots(rows, cols, squeeze=False)
    families = sorted({s.family for panel in shape.latency for s in panel.series if s.family != LOCAL})
    colors = _colors(families)
    ranks = shape.rank_counts
    for axes, panel in zip(grid.flat, shape.latency, strict=False):
        low = min(p.low_ms for s in panel.series for p in s.points)
        high = max(p.high_ms for s in panel.series for p in s.points)
        for series in panel.series:
            ys = [p.median_ms for p in series.points]
            bars = [[p.median_ms - p.low_ms for p in series.points],
                    [p.high_ms - p.median_ms for p in series.points]]
            if series.family == LOCAL:
                axes.axhline(ys[0], color="0.4", linestyle=":", linewidth=1)
                axes.errorbar([p.ranks for p in series.points], ys, yerr=bars, fmt="D", color="black",
                              capsize=3, label=f"{LOCAL} (1 rank)")
            else:
                step = _sidestep(families.index(series.family), len(families))
                axes.errorbar([p.ranks * step for p in series.points], ys, yerr=bars, fmt="-o",
                              color=colors[series.family], capsize=3, markersize=4, label=series.family)
        if high / low > LOG_SPAN:
            axes.set_yscale("log")
            _log_ticks((axes.yaxis,), low, high)
        _rank_axis(axes, ranks)
        axes.set_title(f"seq_len {panel.seq_len}", fontsize=10)
        axes.set_xlabel("ranks")
        axes.set_ylabel("latency (ms)")
        axes.grid(alpha=0.3)
    for axes in grid.flat[len(shape.latency):]:
        axes.set_visible(False)
    handles: dict[str, Artist] = {}
    for axes in grid.flat[: len(shape.latency)]:
        for handle, label in zip(*axes.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    figure.legend(list(handles.values()), list(handles), loc="outside right center", fontsize=8,
                  title="clean rounds combined,\nbars: 95% interval", title_fontsize=8)
    figure.suptitle(f"Latency against rank count: {shape.shape.describe()}\n{_hardware_title(hardware)}",
                    fontsize=11)
    return _png(figure)


def speedup_figure(hardware: HardwareReport, shape: ShapeReport) -> bytes | None:
    """Speedup of the fastest measured configuration over the fastest 1-rank run, and the
    parallel efficiency (speedup / ranks), one line per sequence length; None when no length
    has a 1-rank measurement."""
    if not shape.speedup:
        return None
    figure = Figure(figsize=(10.5, 4.2), dpi=DPI, layout="constrained")
    speed, efficiency = figure.subplots(1, 2)
    ranks = shape.rank_counts
    speed.plot(ranks, ranks, linestyle="--", color="0.5", linewidth=1, label="ideal")
    efficiency.axhline(1.0, linestyle="--", color="0.5", linewidth=1, label="ideal")
    colors = {curve.seq_len: to_hex(colormaps["viridis"](i / max(1, len(shape.speedup) - 1) * 0.85))
              for i, curve in enumerate(shape.speedup)}
    for curve in shape.speedup:
        xs = [p.ranks for p in curve.points]
        label = f"seq_len {curve.seq_len}"
        speed.plot(xs, [p.speedup for p in curve.points], "-o", color=colors[curve.seq_len], label=label)
        efficiency.plot(xs, [p.efficiency for p in curve.points], "-o", color=colors[curve.seq_len],
                        label=label)
    for axes in (speed, efficiency):
        _rank_axis(axes, ranks)
        axes.set_xlabel("ranks")
        axes.grid(alpha=0.3)
    speed.set_ylabel("speedup over 1 rank (x)")
    speed.set_title("speedup: T(1 rank) / T(n ranks), fastest measured of each", fontsize=9)
    efficiency.set_ylabel("parallel efficiency (speedup / ranks)")
    efficiency.set_ylim(bottom=0)
    efficiency.set_title("efficiency", fontsize=9)
    efficiency.legend(fontsize=8, loc="best")
    figure.suptitle(f"Speedup and efficiency: {shape.shape.describe()}\n{_hardware_title(hardware)}",
                    fontsize=11)
    return _png(figure)


def strategy_map_figure(hardware: HardwareReport, shape: ShapeReport) -> bytes:
    """The winning configuration at each sequence length and measured rank count: filled
    squares where every rival was measured, labelled with the verdict (the winner and the
    runner-up's margin, or cross-hatched with every configuration tied), hollow or hatched
    where any rival was predicted. Rows are the rank counts that exist, evenly spaced; the figure grows with
    them up to ``MAP_MAX_SIZE`` and the squares shrink to fit."""
    lengths, ranks = shape.map_lengths, shape.rank_counts
    width = min(MAP_MAX_SIZE[0], max(6.0, 1.1 * len(lengths) + 3.5))
    height = min(MAP_MAX_SIZE[1], 1.0 * len(ranks) + 2.2)
    # a square fills at most 60% of its row and of its column (in points)
    side = min(18.0, 0.6 * 72 * (height - 2.2) / len(ranks), 0.6 * 72 * (width - 3.5) / len(lengths))
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    axes = figure.subplots()
    colors = _colors(c.label for c in shape.strategy_map)
    row = {n: i for i, n in enumerate(ranks)}
    seen_styles: list[tuple[str, str]] = []
    for cell in shape.strategy_map:
        style = ("tied" if cell.tied else cell.status, cell.source)
        filled, hatch, _ = _CELL_STYLES[style]
        color = colors[cell.label]
        axes.scatter([cell.seq_len], [row[cell.ranks]], marker="s", s=side**2, linewidths=1.6,
                     edgecolors="white" if filled and hatch else color,
                     facecolors=color if filled else "none", hatch=hatch or None)
        if filled and side >= 12:
            if cell.tied:
                words = "\n= ".join(cell.labels) + "\n(tied)"
            elif cell.margin is None:
                words = cell.label
            else:
                words = f"{cell.label}\n{margin_text(cell, named=False)}\nvs {cell.runner_up}"
            axes.annotate(words, (cell.seq_len, row[cell.ranks]), xytext=(0, side / 2 + 2),
                          textcoords="offset points", ha="center", va="bottom", fontsize=5.5)
        if style not in seen_styles:
            seen_styles.append(style)
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(lengths), [str(n) for n in lengths], rotation=45, ha="right")
    axes.minorticks_off()
    axes.set_xlim(lengths[0] / 1.4, lengths[-1] * 1.4)
    axes.set_yticks(range(len(ranks)), _count_labels(ranks))
    axes.set_ylim(-0.6, len(ranks) - 0.3)
    axes.set_xlabel("sequence length (tokens, log scale)")
    axes.set_ylabel("ranks (exactly; the counts measured)")
    axes.grid(alpha=0.2)
    handles: list[Line2D | Patch] = [
        Line2D([], [], marker="s", linestyle="none", markersize=9, color=color, label=label)
        for label, color in colors.items()
    ]
    for key in sorted(seen_styles, key=list(_CELL_STYLES).index):
        filled, hatch, text = _CELL_STYLES[key]
        # a hatch takes the edge's color: white on a filled square, as the cells draw it
        handles.append(Patch(facecolor="0.45" if filled else "none", edgecolor="white" if filled and hatch
                             else "0.45", hatch=hatch or None, label=text))
    figure.legend(handles=handles, loc="outside right center", fontsize=8)
    figure.suptitle(f"Fastest configuration: {shape.shape.describe()}\n{_hardware_title(hardware)}",
                    fontsize=11)
    return _png(figure)


def breakdown_figure(hardware: HardwareReport, shape: ShapeReport) -> bytes | None:
    """Where each measured configuration's time goes, one panel per sequence length, the
    fastest ``BREAKDOWN_BARS`` configurations as horizontal bars: the slowest rank's compute,
    its exposed communication, and the rest of the call (waiting on slower ranks, overhead);
    None when no measurement stored the split."""
    split = [b for b in shape.breakdown if b.compute_ms is not None and b.comm_ms is not None]
    lengths = sorted({b.seq_len for b in split})
    if not lengths:
        return None
    rows, cols = _grid(len(lengths), columns=2)
    bars = min(BREAKDOWN_BARS, max(sum(1 for b in split if b.seq_len == n) for n in lengths))
    figure = Figure(figsize=(6.2 * cols + 1.6, (0.22 * bars + 1.2) * rows + 0.8), dpi=DPI,
                    layout="constrained")
    grid = figure.subplots(rows, cols, squeeze=False)
    parts = (("compute", "tab:blue"), ("exposed communication", "tab:orange"), ("rest of the call", "0.8"))
    for axes, seq_len in zip(grid.flat, lengths, strict=False):
        shown = sorted((b for b in split if b.seq_len == seq_len), key=lambda b: b.median_ms)[:BREAKDOWN_BARS]
        names = [f"{b.label} x{b.ranks}" if b.ranks > 1 else b.label for b in shown]
        compute = [b.compute_ms or 0.0 for b in shown]
        comm = [b.comm_ms or 0.0 for b in shown]
        rest = [max(0.0, b.median_ms - c - m) for b, c, m in zip(shown, compute, comm, strict=True)]
        left = [0.0] * len(shown)
        for (name, color), widths in zip(parts, (compute, comm, rest), strict=True):
            axes.barh(names, widths, left=left, color=color, label=name, height=0.7)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        axes.invert_yaxis()  # the fastest on top
        axes.tick_params(axis="y", labelsize=7)
        axes.set_xlabel("ms per attention call (clean rounds combined; slowest rank's split)")
        axes.set_title(f"seq_len {seq_len}", fontsize=10)
        axes.grid(alpha=0.3, axis="x")
    for axes in grid.flat[len(lengths):]:
        axes.set_visible(False)
    handles, labels = grid.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside right center", fontsize=8)
    figure.suptitle(f"Compute against communication: {shape.shape.describe()}\n{_hardware_title(hardware)}",
                    fontsize=11)
    return _png(figure)


def accuracy_figure(hardware: HardwareReport) -> bytes | None:
    """Predicted against measured latency, log-log: the cost model with each sequence length
    held out (filled circles) and the prior alone (x), with y = x; None without predictions."""
    if hardware.accuracy is None:
        return None
    return _png(accuracy_plot(hardware, hardware.accuracy))


def accuracy_plot(hardware: HardwareReport, accuracy: Accuracy) -> Figure:
    """The figure ``accuracy_figure`` draws."""
    figure = Figure(figsize=(6.4, 5.6), dpi=DPI, layout="constrained")
    axes = figure.subplots()
    measured = [p.measured_ms for p in accuracy.points]
    axes.scatter(measured, [p.model_ms for p in accuracy.points], marker="o", s=22, color="tab:blue",
                 label=f"cost model, seq_len held out (MAPE {accuracy.model_mape:.1f}%,\n"
                       f"{accuracy.model_coverage:.0%} inside its 10-90% band)")
    axes.scatter(measured, [p.prior_ms for p in accuracy.points], marker="x", s=26, color="tab:red",
                 label=f"prior alone (MAPE {accuracy.prior_mape:.1f}%)")
    values = [v for p in accuracy.points for v in (p.measured_ms, p.model_ms, p.prior_ms)]
    edge = (min(values) / 1.3, max(values) * 1.3)
    axes.plot(edge, edge, linestyle="--", color="0.4", linewidth=1, label="y = x (exact)")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlim(edge)
    axes.set_ylim(edge)
    _log_ticks((axes.xaxis, axes.yaxis), *edge)
    axes.set_aspect("equal")
    axes.set_xlabel("measured latency (ms)")
    axes.set_ylabel("predicted latency (ms)")
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=8, loc="best")
    figure.suptitle(f"Predicted against measured ({len(measured)} measurements)\n"
                    f"{_hardware_title(hardware)}", fontsize=11)
    return figure
