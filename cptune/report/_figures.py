"""The report's figures as PNG bytes, drawn with matplotlib's Agg canvas.

Each figure is a ``matplotlib.figure.Figure`` on its own ``FigureCanvasAgg``: no pyplot, no
global state, no display needed, and the same data always gives the same picture (fixed
sizes per panel, fixed dpi, bounded however many ranks or lengths there are). Measured points
are filled; predicted ones are hollow or hatched, and the legend says which.
"""

from __future__ import annotations

import io
import itertools
import math
import re
from collections.abc import Iterable, Sequence

from matplotlib import colormaps
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Annotation
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from matplotlib.transforms import Bbox

from cptune.config import LOCAL
from cptune.report._data import Accuracy, HardwareReport, MapCell, ReportData, ShapeReport, margin_text, slug

DPI = 110
#: Figure kinds, each one PNG per (hardware, shape); ``ACCURACY`` is one PNG per hardware.
LATENCY, SPEEDUP, STRATEGY_MAP = "latency-vs-ranks", "speedup", "strategy-map"
BREAKDOWN, ACCURACY = "compute-vs-communication", "predicted-vs-measured"
#: The breakdown figure shows at most this many configurations per length, the fastest.
BREAKDOWN_BARS = 12
#: How the breakdown draws compute, exposed communication and the rest of the call: (face,
#: None for the strategy's colour; hatch; alpha).
_BREAKDOWN_PARTS = ((None, None, 1.0), (None, "////", 0.55), ("0.85", None, 1.0))
#: A panel's y axis turns logarithmic when its values span more than this factor.
LOG_SPAN = 10.0
#: Rank-count axes label every count up to this many counts, else only powers of two.
LABELLED_COUNTS = 12
#: Series at one rank count sit this far apart sideways (in octaves) so none hides another.
SIDESTEP = 0.04
#: The speedup figure's y axes run from 0 to this factor over the highest point or ideal.
SPEEDUP_HEADROOM = 1.25
#: Each sequence length's marker in the speedup figure, in turn.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
#: The strategy map's largest size in inches (width, height), however many cells it has.
MAP_MAX_SIZE = (16.0, 9.0)
#: The strategy map's labels (winner, margin, runner-up; or the tied configurations), in points:
#: as large as the legend's text, never shrunk to fit (a label with no room is left out).
MAP_LABEL_PT = 8.0
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


def _mix(color: str, toward: str, share: float) -> str:
    """``color`` moved ``share`` of the way to ``toward`` (white: lighter, black: darker)."""
    a, b = to_rgb(color), to_rgb(toward)
    red, green, blue = (x + (y - x) * share for x, y in zip(a, b, strict=True))
    return to_hex((red, green, blue))


#: One colour per strategy, the same in every figure of every report: never assigned by
#: what a figure happens to hold, so ring is ring's orange whichever strategies sit beside it.
STRATEGY_COLORS = {LOCAL: "#3b3b3b", "allgather_kv": "#1f77b4", "ring": "#ff7f0e", "ulysses": "#2ca02c"}
#: Each hybrid family (Ulysses in groups of u ranks x another strategy across them) has one
#: hue, by the strategy across the groups; each head group u a fixed shade of it.
HYBRID_HUES = {"allgather_kv": "#9467bd", "ring": "#d62728"}
#: The shades of a hybrid hue, by head group: 2, 3, 4, 6, 8, 12 (then round again).
_SHADES = ((None, 0.0), ("black", 0.35), ("white", 0.4), ("black", 0.6), ("white", 0.65), ("black", 0.15))
#: A name no strategy has (drawn grey rather than failing).
UNKNOWN_COLOR = "#9e9e9e"
_HYBRID = re.compile(r"ulysses(\d+)x([a-z_]+?)\d*")


#: What a padded-heads family's label ends in (``CPConfig.label``): drawn in its strategy's
#: colour, lightened by this share toward white.
_PADDED, _PADDED_LIGHTER = "+padded", 0.5


def _order(name: str) -> tuple[int, str, int]:
    """Where a strategy family stands in every legend: local, the plain strategies, then the
    hybrids by the strategy across their groups and their head group; padded heads beside
    their strategy."""
    if name.endswith(_PADDED):
        group, strategy, head_group = _order(name.removesuffix(_PADDED))
        return group, strategy + _PADDED, head_group
    if name in STRATEGY_COLORS:
        return 0, f"{list(STRATEGY_COLORS).index(name):02d}", 0
    hybrid = _HYBRID.fullmatch(name)
    return (1, hybrid.group(2), int(hybrid.group(1))) if hybrid else (2, name, 0)


def strategy_family(name: str) -> str:
    """The colour family of a configuration label or strategy family: "ulysses2xring4" and
    "ulysses2xring" are both "ulysses2xring"; plain strategies and ``LOCAL`` are themselves."""
    padded = _PADDED if name.endswith(_PADDED) else ""
    hybrid = _HYBRID.fullmatch(name.removesuffix(_PADDED))
    return f"ulysses{hybrid.group(1)}x{hybrid.group(2)}{padded}" if hybrid else name


def strategy_color(name: str) -> str:
    """The one colour of a configuration label or strategy family in every figure:
    ``STRATEGY_COLORS``, or a hybrid's hue (``HYBRID_HUES``) in its head group's shade; padded
    heads lighter."""
    if name.endswith(_PADDED):
        return _mix(strategy_color(name.removesuffix(_PADDED)), "white", _PADDED_LIGHTER)
    if name in STRATEGY_COLORS:
        return STRATEGY_COLORS[name]
    hybrid = _HYBRID.fullmatch(name)
    if hybrid is None or hybrid.group(2) not in HYBRID_HUES:
        return UNKNOWN_COLOR
    group = int(hybrid.group(1))
    toward, share = _SHADES[(round(2 * math.log2(max(group, 2))) - 2) % len(_SHADES)]
    hue = HYBRID_HUES[hybrid.group(2)]
    return to_hex(hue) if toward is None else _mix(hue, toward, share)


def _colors(names: Iterable[str]) -> dict[str, str]:
    """The colour of each strategy family among ``names`` (labels or families), in legend order."""
    return {name: strategy_color(name) for name in sorted({strategy_family(n) for n in names}, key=_order)}


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
                axes.errorbar([p.ranks for p in series.points], ys, yerr=bars, fmt="D",
                              color=strategy_color(LOCAL), capsize=3, label=f"{LOCAL} (1 rank)")
            else:
                step = _sidestep(families.index(series.family), len(families))
                axes.errorbar([p.ranks * step for p in series.points], ys, yerr=bars, fmt="-o",
                              color=strategy_color(series.family), capsize=3, markersize=4,
                              label=series.family)
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
    handles = dict(sorted(handles.items(), key=lambda item: _order(item[0].split(" (")[0])))
    figure.legend(list(handles.values()), list(handles), loc="outside right center", fontsize=8,
                  title="clean rounds combined,\nbars: 95% interval", title_fontsize=8)
    figure.suptitle(f"Latency against rank count: {shape.shape.describe()}\n{_hardware_title(hardware)}",
                    fontsize=11)
    return _png(figure)


def speedup_figure(hardware: HardwareReport, shape: ShapeReport) -> bytes | None:
    """Speedup of the fastest measured configuration over the fastest 1-rank run, and the
    efficiency (speedup per processor against the baseline's), one line per sequence length;
    None when no length has a 1-rank measurement. The axes name the baseline: on a CPU host
    one rank already computes on every core as threads, so the ideal is 1x, drawn as such,
    not the rank count. Both axes run from 0 past the ideal and the highest point, so a
    speedup within the noise of 1x stays flat; points tied with the baseline are hollow."""
    if not shape.speedup:
        return None
    return _png(speedup_plot(hardware, shape))


def speedup_plot(hardware: HardwareReport, shape: ShapeReport) -> Figure:
    """The figure ``speedup_figure`` draws."""
    figure = Figure(figsize=(10.5, 4.2), dpi=DPI, layout="constrained")
    speed, efficiency = figure.subplots(1, 2)
    ranks = shape.rank_counts
    first = shape.speedup[0]
    shared = first.cores is not None
    ideal = "ideal: the same cores, 1x" if shared else "ideal: n GPUs, n x"
    (ideal_line,) = speed.plot(ranks, [first.ideal(n) for n in ranks], linestyle="--", color="0.5",
                               linewidth=1, label=ideal)
    efficiency_ideal = efficiency.axhline(1.0, linestyle="--", color="0.5", linewidth=1, label="ideal")
    colors = {curve.seq_len: to_hex(colormaps["viridis"](i / max(1, len(shape.speedup) - 1) * 0.85))
              for i, curve in enumerate(shape.speedup)}
    count = len(shape.speedup)
    lengths: list[Line2D] = []
    for i, curve in enumerate(shape.speedup):
        # lines that coincide (every length near 1x on a CPU host) must all show: each length a
        # step sideways and a marker of its own
        xs = [p.ranks * _sidestep(i, count) for p in curve.points]
        marker, color = _MARKERS[i % len(_MARKERS)], colors[curve.seq_len]
        for axes, ys in ((speed, [p.speedup for p in curve.points]),
                         (efficiency, [p.efficiency for p in curve.points])):
            axes.plot(xs, ys, "-", color=color, zorder=_LINE_Z)
            _speedup_markers(axes, xs, ys, [p.tied for p in curve.points], marker, color)
        lengths.append(Line2D([], [], marker=marker, color=color, label=f"seq_len {curve.seq_len}"))
    points = [p for c in shape.speedup for p in c.points]
    highest_speed = max([p.speedup for p in points] + [first.ideal(n) for n in ranks])
    highest_efficiency = max([p.efficiency for p in points] + [1.0])
    for axes, highest in ((speed, highest_speed), (efficiency, highest_efficiency)):
        _rank_axis(axes, ranks)
        axes.set_xlabel("ranks")
        axes.grid(alpha=0.3)
        # from zero, as ratios compare, so a tie within a percent of the ideal stays flat beside
        # it; the highest point or ideal below the top, clear of it and of the legend
        axes.set_ylim(0, highest * SPEEDUP_HEADROOM)
    speed.set_ylabel(f"speedup vs {first.baseline} (x)")
    speed.set_title(f"T({first.baseline}) / T(n ranks), fastest measured of each", fontsize=9)
    if shared:
        efficiency.set_ylabel("efficiency (speedup per core used)")
        efficiency.set_title(f"every rank count computes on the same {first.cores} cores:\n"
                             f"1.0 = as fast as {first.baseline}", fontsize=9)
    else:
        efficiency.set_ylabel("parallel efficiency (speedup / ranks)")
        efficiency.set_title("efficiency: one GPU per rank", fontsize=9)
    handles = [ideal_line]
    if any(p.tied for curve in shape.speedup for p in curve.points):
        handles.append(Line2D([], [], linestyle="none", marker="o", color="0.3", markerfacecolor="white",
                              label="hollow: tied with the baseline"))
    speed.legend(handles=handles, fontsize=8, loc="best")
    efficiency.legend(handles=[efficiency_ideal, *lengths], fontsize=8, loc="best")
    figure.suptitle(f"Speedup and efficiency: {shape.shape.describe()}\n{_hardware_title(hardware)}",
                    fontsize=11)
    return figure


#: The speedup figure's lines under its filled markers, and those under its hollow ones: a
#: tied point is never covered by another length's filled marker beside it.
_LINE_Z, _FILLED_Z, _HOLLOW_Z = 2.0, 3.0, 4.0


def _speedup_markers(axes: Axes, xs: Sequence[float], ys: Sequence[float], tied: Sequence[bool], marker: str,
                     color: str) -> None:
    """One marker per point of a speedup line: filled, or hollow where the point is tied with
    the baseline (its speedup is no speedup), each drawn once, so a tied point shows no
    filled marker under its hollow one."""
    for hollow in (False, True):
        if points := [(x, y) for x, y, t in zip(xs, ys, tied, strict=True) if t == hollow]:
            axes.plot(*zip(*points, strict=True), linestyle="none", marker=marker, color=color,
                      markerfacecolor="white" if hollow else color, zorder=_HOLLOW_Z if hollow else _FILLED_Z)


def _map_words(cell: MapCell) -> str:
    """A measured cell's label: the winner, the runner-up's margin and name; or every tied
    configuration, one a line."""
    if cell.tied:
        return "\n= ".join(cell.labels) + "\n(tied)"
    if cell.margin is None:
        return cell.label
    return f"{cell.label}\n{margin_text(cell, named=False)}\nvs {cell.runner_up}"


def _text_inches(words: str) -> tuple[float, float]:
    """About how wide and tall ``words`` are at ``MAP_LABEL_PT``, in inches (to size the figure;
    the drawn labels are checked for real in ``_fit_labels``)."""
    lines = words.split("\n")
    return (max(map(len, lines)) * 0.6 * MAP_LABEL_PT / 72, len(lines) * 1.25 * MAP_LABEL_PT / 72)


def _map_size(shape: ShapeReport, labels: dict[tuple[int, int], str]) -> tuple[float, float, float]:
    """The strategy map's (width, height) in inches and a square's side in points: room for
    every label at ``MAP_LABEL_PT`` between the labelled columns and above each row, up to
    ``MAP_MAX_SIZE`` (the labels that still collide are left out, not shrunk)."""
    lengths, ranks = shape.map_lengths, shape.rank_counts
    width, row = max(6.0, 1.1 * len(lengths) + 3.5), 1.0
    if labels:
        label_width = max(_text_inches(words)[0] for words in labels.values())
        label_height = max(_text_inches(words)[1] for words in labels.values())
        # a label sits above its square and must clear the square of the row above
        row = max(row, label_height + (18.0 + 8) / 72)
        columns = sorted({seq_len for seq_len, _ in labels})
        span = math.log2(lengths[-1] * 1.4) - math.log2(lengths[0] / 1.4)
        gap = min((math.log2(b / a) for a, b in itertools.pairwise(columns)), default=span)
        width = max(width, 1.1 * label_width * span / gap + 3.5)
    width, height = min(MAP_MAX_SIZE[0], width), min(MAP_MAX_SIZE[1], row * len(ranks) + 2.2)
    # a square fills at most 60% of a 1-inch row and of its column (in points)
    side = min(18.0, 0.6 * 72 * (height - 2.2) / len(ranks), 0.6 * 72 * (width - 3.5) / len(lengths))
    return width, height, side


def _fit_labels(figure: Figure, axes: Axes, labels: list[Annotation], squares: list[tuple[float, float]],
                side: float) -> None:
    """Make room for ``labels`` inside ``axes`` (widening its limits), then leave out each
    label that would overlap an earlier one or another cell's square: none is ever drawn over
    another or smaller than ``MAP_LABEL_PT``; the tables below give every verdict."""
    renderer = FigureCanvasAgg(figure).get_renderer()
    for _ in range(4):
        figure.draw_without_rendering()
        frame = axes.get_window_extent(renderer)
        boxes = [label.get_window_extent(renderer) for label in labels]
        top = max(b.y1 for b in boxes) - frame.y1
        left, right = frame.x0 - min(b.x0 for b in boxes), max(b.x1 for b in boxes) - frame.x1
        if max(top, left, right) <= 0.5:
            break
        (x0, x1), (y0, y1) = axes.get_xlim(), axes.get_ylim()
        octaves = math.log2(x1 / x0) / frame.width
        grow = 1.15
        axes.set_xlim(x0 / 2 ** (max(0.0, left) * octaves * grow),
                      x1 * 2 ** (max(0.0, right) * octaves * grow))
        axes.set_ylim(y0, y1 + max(0.0, top) * (y1 - y0) / frame.height * grow)
    figure.draw_without_rendering()
    half = side / 2 * figure.dpi / 72
    cells = [axes.transData.transform(point) for point in squares]
    kept: list[Bbox] = []
    for label in labels:
        box = label.get_window_extent(renderer)
        x, y = axes.transData.transform(label.xy)
        others = [Bbox.from_extents(cx - half, cy - half, cx + half, cy + half) for cx, cy in cells
                  if abs(cx - x) > 0.5 or abs(cy - y) > 0.5]
        if any(box.overlaps(other) for other in (*kept, *others)):
            label.set_visible(False)
        else:
            kept.append(box)


def strategy_map_figure(hardware: HardwareReport, shape: ShapeReport) -> bytes:
    """The winning configuration at each sequence length and measured rank count: filled
    squares where every rival was measured, labelled with the verdict (the winner and the
    runner-up's margin, or cross-hatched with every configuration tied), hollow or hatched
    where any rival was predicted. Rows are the rank counts that exist, evenly spaced; the figure grows with
    them up to ``MAP_MAX_SIZE`` and the squares shrink to fit."""
    return _png(strategy_map_plot(hardware, shape))


def strategy_map_plot(hardware: HardwareReport, shape: ShapeReport) -> Figure:
    """The figure ``strategy_map_figure`` draws. Each strategy has its colour of every
    figure (``strategy_color``); the labels are ``MAP_LABEL_PT`` points, each where it fits."""
    lengths, ranks = shape.map_lengths, shape.rank_counts
    row = {n: i for i, n in enumerate(ranks)}
    words = {(c.seq_len, c.ranks): _map_words(c) for c in shape.strategy_map
             if _CELL_STYLES["tied" if c.tied else c.status, c.source][0]}
    width, height, side = _map_size(shape, words)
    if side < 12:
        words = {}  # squares too small to label: the tables hold every verdict
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    axes = figure.subplots()
    colors = _colors(c.label for c in shape.strategy_map)
    seen_styles: list[tuple[str, str]] = []
    labels: list[Annotation] = []
    for cell in shape.strategy_map:
        style = ("tied" if cell.tied else cell.status, cell.source)
        filled, hatch, _ = _CELL_STYLES[style]
        color = strategy_color(cell.label)
        axes.scatter([cell.seq_len], [row[cell.ranks]], marker="s", s=side**2, linewidths=1.6,
                     edgecolors="white" if filled and hatch else color,
                     facecolors=color if filled else "none", hatch=hatch or None)
        if (cell.seq_len, cell.ranks) in words:
            label = axes.annotate(words[cell.seq_len, cell.ranks], (cell.seq_len, row[cell.ranks]),
                                  xytext=(0, side / 2 + 2), textcoords="offset points", ha="center",
                                  va="bottom", fontsize=MAP_LABEL_PT, linespacing=1.1)
            label.set_in_layout(False)  # the axes make room for them (_fit_labels)
            labels.append(label)
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
    figure.legend(handles=handles, loc="outside right center", fontsize=8,
                  title="labels where they fit;\nthe tables give\nevery verdict", title_fontsize=8)
    figure.suptitle(f"Fastest configuration: {shape.shape.describe()}\n{_hardware_title(hardware)}",
                    fontsize=11)
    if labels:
        _fit_labels(figure, axes, labels, [(c.seq_len, row[c.ranks]) for c in shape.strategy_map], side)
    return figure


def breakdown_figure(hardware: HardwareReport, shape: ShapeReport) -> bytes | None:
    """Where each measured configuration's time goes, one panel per sequence length, the
    fastest ``BREAKDOWN_BARS`` configurations as horizontal bars in their strategy's colour,
    each exactly as long as the call's estimate: the slowest rank's compute (solid), its
    exposed communication (hatched) and the rest of the call (waiting on slower ranks,
    overhead; grey). Where compute and communication, medians of the slowest rank's figures,
    add up to more than the estimate they are drawn as their shares of it, marked "*"
    (``Breakdown.bars``); None when no measurement stored the split."""
    split = [b for b in shape.breakdown if b.bars() is not None]
    if not split:
        return None
    return _png(breakdown_plot(hardware, shape))


def breakdown_plot(hardware: HardwareReport, shape: ShapeReport) -> Figure:
    """The figure ``breakdown_figure`` draws."""
    split = [b for b in shape.breakdown if b.bars() is not None]
    lengths = sorted({b.seq_len for b in split})
    rows, cols = _grid(len(lengths), columns=2)
    bars = min(BREAKDOWN_BARS, max(sum(1 for b in split if b.seq_len == n) for n in lengths))
    figure = Figure(figsize=(6.2 * cols + 1.6, (0.22 * bars + 1.2) * rows + 0.8), dpi=DPI,
                    layout="constrained")
    grid = figure.subplots(rows, cols, squeeze=False)
    scaled = False
    for axes, seq_len in zip(grid.flat, lengths, strict=False):
        shown = sorted((b for b in split if b.seq_len == seq_len), key=lambda b: b.median_ms)[:BREAKDOWN_BARS]
        names = [(f"{b.label} x{b.ranks}" if b.ranks > 1 else b.label) + (" *" if b.scaled else "")
                 for b in shown]
        scaled |= any(b.scaled for b in shown)
        widths = [b.bars() or (0.0, 0.0, 0.0) for b in shown]
        colors = [strategy_color(b.label) for b in shown]
        left = [0.0] * len(shown)
        for part, (faces, hatch, alpha) in enumerate(_BREAKDOWN_PARTS):
            width = [w[part] for w in widths]
            axes.barh(names, width, left=left, height=0.7, color=faces or colors, alpha=alpha,
                      hatch=hatch, edgecolor="white" if hatch else None, linewidth=0)
            left = [a + b for a, b in zip(left, width, strict=True)]
        axes.invert_yaxis()  # the fastest on top
        axes.tick_params(axis="y", labelsize=7)
        for tick, color in zip(axes.get_yticklabels(), colors, strict=True):
            tick.set_color(color)
        axes.set_xlabel("ms per attention call: the bar is the call's estimate (clean rounds combined)")
        axes.set_title(f"seq_len {seq_len}", fontsize=10)
        axes.grid(alpha=0.3, axis="x")
    for axes in grid.flat[len(lengths):]:
        axes.set_visible(False)
    handles = [Patch(facecolor="0.35", label="compute (slowest rank)"),
               Patch(facecolor="0.35", alpha=_BREAKDOWN_PARTS[1][2], hatch=_BREAKDOWN_PARTS[1][1],
                     edgecolor="white", linewidth=0, label="exposed communication"),
               Patch(facecolor=_BREAKDOWN_PARTS[2][0], label="rest of the call")]
    title = "bar colour: the strategy's"
    if scaled:
        title += ("\n* compute + communication\n(medians) exceed the call's\nestimate: drawn as their\n"
                  "shares of it")
    figure.legend(handles=handles, loc="outside right center", fontsize=8, title=title, title_fontsize=8)
    figure.suptitle(f"Compute against communication: {shape.shape.describe()}\n{_hardware_title(hardware)}",
                    fontsize=11)
    return figure


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
