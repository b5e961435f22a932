"""``cptune results``: what the database holds, row by row or each configuration's rounds
combined with each workload's verdict (``--combined``); set rows aside or delete them."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from cptune.cli._common import DB_HELP, UsageError, ids, positive, say, table
from cptune.config import STRATEGIES
from cptune.measurement import STATUSES, format_ms
from cptune.workload import MODES, Workload

if TYPE_CHECKING:
    from cptune.estimate import Comparison, Estimate, Verdict
    from cptune.store import Result, Store


def add_parser(commands: argparse._SubParsersAction) -> None:
    results = commands.add_parser("results", help="list stored measurements",
                                  description=(
                                      "List what the database holds, oldest first, with the interleaved "
                                      "round each run belongs to; excluded, oversubscribed and disturbed "
                                      "measurements are marked. --combined shows each configuration's "
                                      "clean rounds combined and each workload's verdict instead. "
                                      "--exclude, --include and --delete change the rows with the ids "
                                      "listed."))
    results.add_argument("--db", help=DB_HELP)
    results.add_argument("--seq-len", type=positive)
    results.add_argument("--heads", type=positive)
    results.add_argument("--head-dim", type=positive)
    results.add_argument("--mode", choices=MODES, help="forward or train runs only")
    results.add_argument("--strategy", choices=STRATEGIES)
    results.add_argument("--ranks", type=positive)
    results.add_argument("--status", choices=STATUSES, help="ok, or how a run failed")
    results.add_argument("--combined", action="store_true",
                         help="per workload and configuration: every clean round combined (median visit, "
                              "95%% interval, rounds) and the workload's verdict, the fastest marked and the "
                              "configurations tied with it; excluded, oversubscribed and disturbed runs "
                              "left out. With --json or --csv: those estimates instead of the rows")
    fmt = results.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="a JSON list of objects")
    fmt.add_argument("--csv", action="store_true", help="CSV with a header row")
    fmt.add_argument("--exclude", type=ids, metavar="ID[,ID...]",
                     help="keep these measurements but leave them out of the model and the picks")
    fmt.add_argument("--include", type=ids, metavar="ID[,ID...]", help="take excluded measurements back")
    fmt.add_argument("--delete", type=ids, metavar="ID[,ID...]", help="delete these measurements for good")



def run(args: argparse.Namespace, console: Console) -> int:
    from cptune.store import RESULT_COLUMNS, Store, display_url

    workload_filters = {"seq_len": args.seq_len, "heads": args.heads, "head_dim": args.head_dim,
                        "mode": args.mode}
    row_filters = {"strategy": args.strategy, "ranks": args.ranks, "status": args.status}
    changes = args.exclude or args.include or args.delete
    if args.combined and changes:
        raise UsageError("--combined lists estimates and changes nothing; run --exclude, --include or "
                         "--delete without it")
    if args.combined and args.status not in (None, "ok"):
        raise UsageError(f"--combined combines successful runs only, so --status {args.status} selects "
                         f"nothing there; drop --status, or list the rows without --combined")
    with Store(args.db, create=False, reading=not changes) as store:
        if changes:
            store.require_writable()
        if args.exclude or args.include:
            return _set_excluded(store, args.exclude or args.include, args.exclude is not None, console)
        if args.delete:
            gone = store.delete(args.delete)
            say(console, f"deleted {len(gone)} measurement(s) from {display_url(store.url)}:")
            for r in gone:
                say(console, f"  {r.id}: {r.config.describe()}, {r.workload.describe()}, {r.status}, "
                              f"measured {r.measured_at}")
            return 0
        if args.combined:
            # the workloads' every row: a configuration filter picks what is shown and judged,
            # never what the estimates and their shared noise are made of
            return _combined_results(store.results(**workload_filters), args, console)
        rows = store.results(**workload_filters, **row_filters)
        numbers = _round_numbers(store.results() if any(r.round_id for r in rows) else rows)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        return 0
    if args.csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=RESULT_COLUMNS, lineterminator="\n")
        writer.writeheader()
        for row in (r.to_dict() for r in rows):
            writer.writerow(_cells(row) | {"facts": json.dumps(row["facts"])})  # one cell: the facts as JSON
        return 0
    modes = any(r.workload.training for r in rows)  # a column where training runs are listed
    masks = any(r.workload.masked for r in rows)  # ... and where a masked workload is
    ran = any(r.ran_with for r in rows)  # ... and where any row recorded what it ran with
    listing = table(f"{len(rows)} stored result(s)",
                   "median ms per iteration of the slowest rank; round: the interleaved rounds of each "
                   "workload numbered in the order they ran (--json gives their ids)"
                   + ("; mode: forward, or train (forward and backward)" if modes else "")
                   + ("; under each config +layout (how its tokens are dealt out): the workload's mask "
                      "(a window's keys before,after each query + sinks, packed documents NxLENGTH, joint "
                      "text tokens)" if masks else "")
                   + ("; ran with: the attention kernel(s), the process group and on a GPU the cuDNN and "
                      "NCCL versions (--json: every fact kept)" if ran else ""))
    labels = max((len(r.config.label) for r in rows), default=0)  # a wrapped config cell's least width
    for column in ("id", "seq_len", "heads", *(("mode",) if modes else ()), "config", "ranks", "round",
                   "status", "median ms", *(("ran with",) if ran else ()), "hardware"):
        left = column in ("config", "status", "ran with", "hardware")
        listing.add_column(column, justify="left" if left else "right",
                           no_wrap=column not in ("ran with", "hardware", *(("config",) if masks else ())),
                           min_width=labels if column == "config" else None)
    for r in rows:
        median = f"{r.median_ms:.2f}" if r.median_ms is not None else "-"
        heads = f"{r.workload.heads}/{r.workload.kv_heads}"
        status = Text(r.status, style="" if r.status == "ok" else "red")
        for mark, marked in (("oversub.", r.oversubscribed), ("excluded", r.excluded),
                             ("disturbed", bool(r.disturbed)), ("heads span nodes", r.heads_span_nodes)):
            if marked:
                status.append(f", {mark}", style="yellow")
        listing.add_row(str(r.id), str(r.workload.seq_len), heads, *((r.workload.mode,) if modes else ()),
                        _config_cell(r, masks), str(r.config.ranks),
                        str(numbers.get(r.id, "-")), status, median,
                        *((Text(r.ran_with or "-"),) if ran else ()), Text(r.hardware))
    console.print(listing)
    if count := sum(r.oversubscribed or r.excluded or bool(r.disturbed) for r in rows):
        say(console, f"{count} marked: oversub. = oversubscribed, run on more ranks than the host's cores; "
                      f"excluded = set aside with --exclude (--include ID takes it back); disturbed = the "
                      f"contention guard saw other load while it ran (--json says what). All are kept but "
                      f"left out of the model and the picks")
    if any(r.heads_span_nodes for r in rows):
        say(console, "heads span nodes: a head group (Ulysses' all-to-all) of that configuration ran across "
                     "nodes, over the network; search with --within-node-heads to measure only the "
                     "configurations whose head groups fit in a node")
    if any(r.clean and not r.oversubscribed for r in rows):
        say(console, "each configuration's rounds combined, with its 95% interval, and each workload's "
                      "verdict: cptune results --combined")
    return 0


def _config_cell(result: Result, masks: bool) -> Text:
    """A row's configuration, and where the listing holds masked workloads its mask below it
    (a line of its own: the table keeps to 80 columns)."""
    cell = Text(result.config.label)
    if masks:
        cell.append(f"\n{result.workload.shape.mask_label()}", style="dim")
    return cell


def _cells(row: dict[str, object]) -> dict[str, object]:
    """A row for CSV: a window's pair and the documents' lengths as JSON, one cell each."""
    lists = ("window", "documents")
    return row | {key: json.dumps(row[key]) for key in lists if isinstance(row.get(key), list)}


def _round_numbers(rows: list[Result]) -> dict[int, int]:
    """Each row's round as a number within its (hardware, workload): 1, 2, ... in the order
    the rounds first ran; rows without a round get none."""
    seen: dict[tuple[str, Workload], dict[str, int]] = {}
    numbers = {}
    for r in rows:
        if r.round_id:
            rounds = seen.setdefault((r.hardware, r.workload), {})
            numbers[r.id] = rounds.setdefault(r.round_id, len(rounds) + 1)
    return numbers


#: The columns of ``cptune results --combined --csv``, one row per configuration.
COMBINED_COLUMNS = (
    "hardware", "seq_len", "heads", "head_dim", "kv_heads", "batch", "dtype", "causal", "mode", "window",
    "sinks", "documents", "text", "strategy", "ranks", "head_group", "layout", "label", "median_ms", "low_ms",
    "high_ms", "rounds", "interval_from", "role",
    "vs_fastest", "vs_fastest_low", "vs_fastest_high", "paired_rounds", "measurement_ids", "verdict",
)


def _standing(estimate: Estimate, verdict: Verdict) -> tuple[str, Comparison | None]:
    """Where ``estimate`` stands in ``verdict``: "fastest", "tied" (with the fastest, within
    the noise) or "slower", and its comparison with the fastest (None for the fastest)."""
    comparison = next((c for c in verdict.comparisons if c.other == estimate.config), None)
    role = "fastest" if comparison is None else "slower" if comparison.separated else "tied"
    return role, comparison


def _estimate_record(estimate: Estimate, verdict: Verdict) -> dict[str, object]:
    """One configuration's combined estimate and its standing in ``verdict``, as JSON values:
    ``vs_fastest`` its latency over the fastest's, with the 95% interval (None for the fastest)."""
    role, comparison = _standing(estimate, verdict)
    return {
        **estimate.config.to_dict(), "label": estimate.config.label, "median_ms": estimate.median_ms,
        "low_ms": estimate.low_ms, "high_ms": estimate.high_ms, "rounds": estimate.rounds,
        "interval_from": estimate.noise.source, "role": role,
        "vs_fastest": comparison.ratio if comparison else None,
        "vs_fastest_low": comparison.low if comparison else None,
        "vs_fastest_high": comparison.high if comparison else None,
        "paired_rounds": comparison.paired_rounds if comparison else None,
        "measurement_ids": list(estimate.ids),
    }


def _combined_results(rows: list[Result], args: argparse.Namespace, console: Console) -> int:
    """``cptune results --combined``: each workload's clean rounds combined and judged."""
    from cptune.estimate import combine, judge

    groups: dict[tuple[str, Workload], list[Estimate]] = {}
    for (hardware, workload, config), estimate in combine(r for r in rows if not r.oversubscribed).items():
        if args.strategy in (None, config.strategy) and args.ranks in (None, config.ranks):
            groups.setdefault((hardware, workload), []).append(estimate)
    judged = []
    for (hardware, workload), estimates in sorted(
        groups.items(), key=lambda item: (item[0][0], item[0][1].shape, item[0][1].seq_len)
    ):
        verdict = judge(estimates)
        assert verdict is not None  # a group holds one estimate or more
        judged.append((hardware, workload, verdict, sorted(estimates, key=lambda e: e.median_ms)))
    if args.json:
        print(json.dumps([
            {"hardware": hardware, "workload": workload.to_dict(), "verdict": verdict.describe(),
             "winner": verdict.winner.label if verdict.winner else None,
             "tied": [verdict.leader.config.label, *(c.label for c in verdict.tied)] if verdict.tied else [],
             "estimates": [_estimate_record(e, verdict) for e in estimates]}
            for hardware, workload, verdict, estimates in judged
        ], indent=2))
        return 0
    if args.csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=COMBINED_COLUMNS, lineterminator="\n")
        writer.writeheader()
        for hardware, workload, verdict, estimates in judged:
            for e in estimates:
                writer.writerow({"hardware": hardware, **_cells(workload.to_dict()),
                                 **_estimate_record(e, verdict),
                                 "measurement_ids": ";".join(map(str, e.ids)), "verdict": verdict.describe()})
        return 0
    for i, (hardware, workload, verdict, estimates) in enumerate(judged, 1):
        console.print(_combinedtable(hardware, workload, verdict, estimates, explained=i == len(judged)))
        say(console, ("verdict: ", "bold"), verdict.describe())
        console.print()
    if not judged:
        say(console, "no clean successful measurement matches: nothing to combine (cptune results lists "
                      "every row)")
    left_out = {"disturbed": sum(r.status == "ok" and bool(r.disturbed) for r in rows),
                "excluded": sum(r.status == "ok" and r.excluded for r in rows),
                "oversubscribed": sum(r.status == "ok" and r.oversubscribed for r in rows)}
    if any(left_out.values()):
        listed = ", ".join(f"{n} {why}" for why, n in left_out.items() if n)
        say(console, f"left out: {listed} run(s), kept but counting for nothing (cptune results lists them)")
    return 0


def _combinedtable(
    hardware: str, workload: Workload, verdict: Verdict, estimates: list[Estimate], explained: bool
) -> Table:
    """One workload's estimates, fastest first; ``explained``: with the caption saying what
    the columns mean (the last table only, so a long listing says it once)."""
    shown = table(f"{workload.describe()} [{hardware[:8]}]",
                   "ms per attention call, slowest rank: the median of the clean rounds; interval: "
                   "its 95% interval (* from one round's iterations: understates drift); xN: on N ranks; vs "
                   "fastest %: how much longer than the fastest [95% interval], paired by round where they "
                   "share 3 or more" if explained else "")
    for column in ("config", "ms", "interval", "rounds", "vs fastest %", ""):
        shown.add_column(column, justify="left" if column in ("config", "") else "right", no_wrap=True)
    for e in estimates:
        role, comparison = _standing(e, verdict)
        star = "*" if e.noise.source == "iterations" else ""
        versus = "" if comparison is None else (
            f"{_change(comparison.ratio)} [{_change(comparison.low)}, {_change(comparison.high)}]")
        name = e.config.label if e.config.ranks == 1 else f"{e.config.label} x{e.config.ranks}"
        shown.add_row(name, format_ms(e.median_ms), f"{format_ms(e.low_ms)}-{format_ms(e.high_ms)}{star}",
                      str(e.rounds), versus, Text("" if role == "slower" else role, style="bold"))
    return shown


def _change(ratio: float) -> str:
    """A ratio to the fastest as a change in percent: 1.034 -> "+3.4", 1.2345 -> "+23"."""
    percent = (ratio - 1) * 100
    return f"{percent:+.1f}" if abs(percent) < 9.95 else f"{percent:+.0f}"


def _set_excluded(store: Store, ids: tuple[int, ...], excluded: bool, console: Console) -> int:
    changed = store.set_excluded(ids, excluded)
    unchanged = sorted(set(ids) - set(changed))
    done = "excluded" if excluded else "included again"
    listed = f": {', '.join(map(str, changed))}" if changed else ""
    say(console, f"{done} {len(changed)} measurement(s){listed}")
    if unchanged:
        say(console, f"already {'excluded' if excluded else 'included'}: {', '.join(map(str, unchanged))}")
    if excluded and changed:
        say(console, f"they stay stored but the model, the picks and a search's resume ignore them; "
                      f"cptune results --include {','.join(map(str, changed))} takes them back")
    return 0


