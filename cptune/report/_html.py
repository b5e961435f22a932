"""The report as PNG files and one self-contained HTML page.

The page embeds every figure as a ``data:image/png`` URI and its CSS inline: it has no
scripts and no links, so it can be mailed, archived or opened offline as one file. Every
text that comes from the database goes through ``html.escape``.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from cptune._files import check_ours, write_regular
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
from cptune.report._figures import (
    ACCURACY,
    BREAKDOWN,
    LATENCY,
    SPEEDUP,
    STRATEGY_MAP,
    accuracy_figure,
    breakdown_figure,
    file_name,
    latency_figure,
    speedup_figure,
    strategy_map_figure,
)

_CAPTIONS = {
    LATENCY: "Latency per attention call (slowest rank) against the number of ranks, one panel per "
             "sequence length and one line per strategy family: each point combines every clean round of "
             "that configuration (the median of the rounds' medians), its bar spans the estimate's 95% "
             "interval (not the spread of single iterations), and the dotted line marks the fastest 1-rank "
             "configuration; every point is measured, none is predicted. The bars include the drift "
             "between rounds, which the verdicts below cancel by comparing configurations round by "
             "round: overlapping bars can still be a separated winner.",
    SPEEDUP: "Speedup of the fastest measured configuration at each rank count over the fastest 1-rank "
             "configuration (combined estimates of their clean rounds; left) and efficiency, the speedup "
             "per processor used against the 1-rank run's (right), against the dashed ideal; every point "
             "is measured, none is predicted. On a CPU host one rank already computes on every core as "
             "threads and n ranks split the same cores between them, so the baseline is 1 rank using all "
             "the cores, the ideal speedup is 1x (not n) and efficiency is the speedup per core used; "
             "with one GPU per rank the ideal is n and efficiency is speedup / ranks. Both axes start at "
             "0, so a speedup within the noise of 1x lies flat beside the ideal; a hollow point is one the "
             "table calls tied with the baseline.",
    STRATEGY_MAP: "The fastest configuration on exactly that many ranks (the rank counts measured) at each "
                  "sequence length: filled squares are measured (every rival measured), labelled with the "
                  "verdict on their combined clean rounds: the winner and how much slower the runner-up is, "
                  "with its 95% interval, or, cross-hatched, the configurations tied within the noise of "
                  "this hardware; hollow squares are predicted by the cost model, hatched ones by the prior "
                  "alone, dotted ones have a measured winner but some rival predicted. Labels are 8 pt; "
                  "one with no room is left out rather than shrunk (the tables below give every verdict).",
    BREAKDOWN: "Where the time of each measured configuration goes, fastest first (at most "
               "twelve per sequence length), each bar exactly as long as the call's combined estimate "
               "and in its strategy's colour: the slowest rank's time in attention math (solid), its "
               "communication that compute did not hide (hatched; each the median over its clean "
               "rounds), and the rest of the call (grey: waiting on slower ranks, launch and copy "
               "overheads). Compute and communication are medians of the slowest rank's figures, not "
               "always the same rank or iteration: where they add up to more than the estimate, the bar "
               "(marked *) shows them as their shares of it, never longer than the call; every bar is "
               "measured.",
    ACCURACY: "Predicted against measured latency of every measurement of this hardware: filled circles "
              "are the cost model's predictions with that sequence length held out of its training, x "
              "marks the physical prior alone, the dashed line y = x; the legend gives each MAPE and how "
              "many measurements fall inside the model's held-out 10-90% band.",
}

#: The fix offered when a file in the report's folder is something cptune never writes into.
_ELSEWHERE = "write the report into another folder (cptune report -o DIR)"
#: What begins the page ``write_report`` writes, by which it is told from other files.
_PAGE_START = ('<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
               "<title>cptune report</title>\n")


def _our_page(head: bytes) -> bool:
    return head.startswith(_PAGE_START.encode())


def _our_figure(head: bytes) -> bool:
    """Whether a file beginning ``head`` is a figure a report drew: a PNG that Matplotlib wrote
    (its Software text chunk follows the header)."""
    return head.startswith(b"\x89PNG\r\n\x1a\n") and b"tEXtSoftware\x00Matplotlib" in head[:256]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; } h3 { margin-top: 1.6em; }
code { background: #f3f3f3; padding: 0 .25em; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: .9em; color: #555; max-width: 60em; }
table { border-collapse: collapse; margin: .8em 0; font-size: .9em; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
th { background: #f5f5f5; } td.name, th.name { text-align: left; }
td.predicted { color: #777; font-style: italic; }
caption { caption-side: bottom; font-size: .85em; color: #555; text-align: left; padding-top: .3em; }
.note { background: #fff6dd; border-left: 4px solid #e0b000; padding: .4em .8em; margin: .6em 0; }
.meta { color: #555; }
"""


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], caption: str, names: int = 1) -> str:
    """An HTML table; ``headers`` and ``caption`` are plain text, ``rows`` already-escaped
    HTML cells (a cell may carry its own ``<td ...>``), the first ``names`` columns left-aligned."""
    head = "".join(f'<th class="name">{escape(h)}</th>' if i < names else f"<th>{escape(h)}</th>"
                   for i, h in enumerate(headers))
    body = "".join(
        "<tr>" + "".join(c if c.startswith("<td") else (f'<td class="name">{c}</td>' if i < names
                                                      else f"<td>{c}</td>") for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return (f"<table><caption>{escape(caption)}</caption><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table>")


def _latency_table(shape: ShapeReport) -> str:
    ranks = shape.rank_counts
    rows = []
    for seq_len, name, points in shape.latency_rows():
        cells = [escape(str(seq_len)), escape(name)]
        for n in ranks:
            p = points.get(n)
            if p is None:
                cells.append("")
                continue
            interval = f"95% interval {format_ms(p.low_ms)}-{format_ms(p.high_ms)} ms"
            ids = ", ".join(map(str, p.measurement_ids))
            cells.append(f'<td title="{escape(p.label)}: {interval}, {p.rounds} clean round(s), '
                         f'measurements {escape(ids)}">{escape(format_ms(p.median_ms))}</td>')
        rows.append(cells)
    return _table(["seq_len", "strategy", *(rank_count(n) for n in ranks)], rows,
                  "ms per attention call, slowest rank: every clean round of a configuration combined "
                  "(median of the rounds; hover for the 95% interval and the rounds); all measured", names=2)


def _speedup_table(shape: ShapeReport) -> str:
    rows = [
        [escape(str(curve.seq_len)), escape(str(p.ranks)), escape(p.label), escape(format_ms(p.latency_ms)),
         escape(p.speedup_text), escape(f"{p.efficiency:.0%}")]
        for curve in shape.speedup for p in curve.points
    ]
    baseline, cores = shape.speedup[0].baseline, shape.speedup[0].cores
    return _table(["seq_len", "ranks", "fastest measured", "ms", f"speedup vs {baseline}",
                   "efficiency per core" if cores else "efficiency"], rows,
                  speedup_caption(cores), names=1)


def _map_table(shape: ShapeReport) -> str:
    grid, ranks = shape.map_grid(), shape.rank_counts
    rows = []
    for seq_len in shape.map_lengths:
        measured = seq_len in shape.measured_lengths
        cells = [escape(f"{seq_len}" if measured else f"{seq_len} (not measured)")]
        for n in ranks:
            cell = grid.get((seq_len, n))
            if cell is None:
                cells.append("")
            elif cell.measured:
                cells.append(f'<td title="{escape(cell.verdict)}">{escape(cell.label)}'
                             f"<br><small>{format_ms(cell.latency_ms)} ms<br>{escape(margin_text(cell))}"
                             "</small></td>")
            else:
                cells.append(f'<td class="predicted">{escape(cell.label)}*<br><small>'
                             f"{escape(format_ms(cell.latency_ms))} ms, {escape(cell.source)}<br>"
                             f"{escape(margin_text(cell))}</small></td>")
        rows.append(cells)
    return _table(["seq_len", *(rank_count(n) for n in ranks)], rows,
                  "* predicted: some rival on that many ranks was not measured, so the comparison rests on "
                  "the cost model or the prior (the small text names the winner's source); +x% vs y: the "
                  "runner-up y is x% slower (measured cells: with the 95% interval); tied with y: the noise "
                  "of this hardware cannot tell the first from y; empty: nothing can run there")


def _verdict_table(shape: ShapeReport) -> str:
    """Each measured map cell's verdict in words ("" when none is measured)."""
    rows = [[escape(str(c.seq_len)), escape(str(c.ranks)), f'<td class="name">{escape(c.verdict)}</td>']
            for c in shape.strategy_map if c.measured]
    if not rows:
        return ""
    return _table(["seq_len", "ranks", "verdict"], rows,
                        "the verdict on each measured cell: the configurations on exactly that many ranks, "
                        "their clean rounds combined; the percentages say how much longer the runner-up "
                        "takes, with the 95% interval", names=0)


def _plain_table(headers: Sequence[str], rows: Sequence[Sequence[str]], caption: str, names: int = 1) -> str:
    """``_table`` of plain-text cells (escaped here)."""
    return _table(headers, [[escape(cell) for cell in row] for row in rows], caption, names)


def _breakdown_table(shape: ShapeReport) -> str:
    return _plain_table(BREAKDOWN_COLUMNS, breakdown_rows(shape),
                        "ms: the whole call (combined estimate of the clean rounds), and the slowest rank's "
                        "time in attention math (compute) and waiting on communication compute did not hide "
                        "(comm), each the median over the clean rounds; comm % = comm / (compute + comm); "
                        "peak: the most MiB one rank held; all measured", names=2)


def _calibration_section(hardware: HardwareReport) -> list[str]:
    if hardware.calibration is None:
        return []
    collectives, compute, steps = calibration_rows(hardware.calibration)
    section = [
        f"<h3>Calibration ({escape(hardware.calibration.measured_at)})</h3>",
        *([f'<p class="meta">timed with {escape(timed)}</p>'] if (timed := hardware.calibration_ran_with())
          else []),
        _plain_table(COLLECTIVE_COLUMNS, collectives,
                     "each collective in groups of that size while that many ranks run: time = latency + "
                     "bytes sent per rank / fit bandwidth; bus: nccl-tests' bus bandwidth at the largest "
                     "message. The prior stands on these fits."),
        _plain_table(COMPUTE_COLUMNS, compute,
                     "the attention kernel's rate per rank with that many ranks computing at once",
                     names=0),
    ]
    if steps:
        section.append(_plain_table(STEP_COLUMNS, steps, STEP_CAPTION, names=2))
    return section


def _accuracy_table(hardware: HardwareReport) -> str:
    assert hardware.accuracy is not None
    accuracy = hardware.accuracy
    rows = [[escape(str(seq_len)), escape(str(count)), escape(f"{model:.1f}%"), escape(f"{prior:.1f}%"),
             escape(f"{coverage:.0%}")]
            for seq_len, count, model, prior, coverage in accuracy.by_seq_len()]
    rows.append(["all", escape(str(len(accuracy.points))), escape(f"{accuracy.model_mape:.1f}%"),
                 escape(f"{accuracy.prior_mape:.1f}%"), escape(f"{accuracy.model_coverage:.0%}")])
    return _table(["seq_len held out", "measurements", "model MAPE", "prior MAPE", "inside band"], rows,
                  "mean absolute percentage error against the measured medians; inside band: measurements "
                  f"within the model's held-out 10-90% interval (80% advertised). {accuracy.verdict}")


@dataclass
class _Output:
    """Where the figures go, and every file written so far."""

    data: ReportData
    out_dir: Path
    written: list[Path] = field(default_factory=list)

    def figure(self, hardware: HardwareReport, shape: ShapeReport | None, kind: str, png: bytes) -> str:
        """Write ``png`` and return its HTML figure, the image embedded, with its caption."""
        name = file_name(self.data, hardware, shape, kind)
        path = self.out_dir / name
        write_regular(path, png, _ELSEWHERE, _our_figure)
        self.written.append(path)
        source = base64.b64encode(png).decode("ascii")
        return (f'<figure><img src="data:image/png;base64,{source}" alt="{escape(name)}">'
                f"<figcaption>{escape(_CAPTIONS[kind])} <code>{escape(name)}</code></figcaption></figure>")


def _hardware_section(hardware: HardwareReport, out: _Output) -> str:
    parts = [f"<h2>{escape(hardware.description)}</h2>",
             f'<p class="meta">fingerprint <code>{escape(hardware.fingerprint)}</code>, '
             f"{'calibrated' if hardware.calibrated else 'not calibrated'}</p>"]
    if ran := hardware.ran_with_text():
        parts.append(f'<p class="meta">the measurements ran with {escape(ran)}</p>')
    parts += [f'<p class="note">{escape(note)}</p>' for note in hardware.notes]
    for shape in hardware.shapes:
        parts.append(f"<h3>{escape(shape.shape.describe())}</h3>")
        parts += [out.figure(hardware, shape, LATENCY, latency_figure(hardware, shape)),
                  _latency_table(shape)]
        speedup = speedup_figure(hardware, shape)
        if speedup is None:
            parts.append('<p class="note">no sequence length has a 1-rank measurement: no speedup figure</p>')
        else:
            parts += [out.figure(hardware, shape, SPEEDUP, speedup), _speedup_table(shape)]
        parts += [out.figure(hardware, shape, STRATEGY_MAP, strategy_map_figure(hardware, shape)),
                  _map_table(shape), _verdict_table(shape)]
        breakdown = breakdown_figure(hardware, shape)
        if breakdown is not None:
            parts.append(out.figure(hardware, shape, BREAKDOWN, breakdown))
        parts.append(_breakdown_table(shape))
    accuracy = accuracy_figure(hardware)
    if accuracy is not None:
        parts += ["<h3>Predicted against measured</h3>", out.figure(hardware, None, ACCURACY, accuracy),
                  _accuracy_table(hardware)]
    parts += _calibration_section(hardware)
    return "\n".join(parts)


def write_report(data: ReportData, out_dir: Path) -> list[Path]:
    """Write every figure as a PNG into ``out_dir`` (created if needed) and ``report.html``,
    which embeds them; returns the written paths, the HTML last. A file already there is
    replaced only if a report wrote it (``check_ours``): the page is checked before anything
    is drawn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    html_path = out_dir / "report.html"
    check_ours(html_path, _our_page, _ELSEWHERE)
    out = _Output(data, out_dir)
    sections = [_hardware_section(hardware, out) for hardware in data.hardware]
    page = f"""{_PAGE_START}<style>{_CSS}</style>
</head>
<body>
<h1>cptune report</h1>
<p class="meta">database <code>{escape(data.url)}</code>; generated {escape(data.generated_at)} by cptune
{escape(data.version)}. Latencies are per attention call of the slowest rank, in ms: each
configuration's clean rounds combined (the median of the rounds' medians, with a 95% interval);
disturbed, excluded and oversubscribed runs count for nothing. Measured points are filled;
predicted ones are hollow or hatched (figures) or marked * (tables). Each strategy has one colour in
every figure of every report.</p>
{"".join(sections)}
</body>
</html>
"""
    write_regular(html_path, page.encode("utf-8"), _ELSEWHERE, _our_page)
    return [*out.written, html_path]
