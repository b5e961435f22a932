"""``cptune fit`` (the cost model, cross-validated on what is stored) and ``cptune recommend``
(the fastest configuration for a workload, measured or predicted)."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console

from cptune.cli._common import (
    DB_HELP,
    HARDWARE_HELP,
    NCCL_PATH_RULE,
    add_framework_flag,
    add_given_flags,
    add_host_backend,
    add_workload_flags,
    figures_of,
    positive,
    say,
    show_framework_choice,
    table,
    warn,
    workload_of,
)
from cptune.measurement import format_ms

if TYPE_CHECKING:
    from cptune.model import GroupScore, Tie

#: What the recommend table and its notes show; --json holds everything.
SHOWN_CANDIDATES = 20
SHOWN_TIES = 3
SHOWN_INFEASIBLE = 10


def add_parsers(commands: argparse._SubParsersAction) -> None:
    fit = commands.add_parser(
        "fit",
        help="cross-validate the cost model on the stored measurements",
        description=(
            "Fit the cost model holding out each sequence length in turn (and each hardware, "
            "when the database has several) and print, beside the prior alone and a fixed rule "
            "(always the config fastest most often in the training folds), and per held-out "
            "group: top-1 accuracy, regret (latency of the pick / best measured), Spearman rank "
            "correlation, MAPE and the interval's coverage; then whether recommend applies the "
            "learned correction."
        ),
    )
    fit.add_argument("--db", help=DB_HELP)
    fit.add_argument("--include-oversubscribed", action="store_true",
                     help="also train on measurements that ran more ranks than their host's cores")


    rec = commands.add_parser(
        "recommend",
        help="the fastest configuration for a workload, measured or predicted",
        description=(
            "Rank every feasible configuration of one attention workload by latency: measured "
            "where this database has it, predicted by the cost model (or its physical prior) "
            "elsewhere, and say why the others cannot run."
        ),
    )
    add_workload_flags(rec, required=True)
    rec.add_argument("--ranks", type=positive,
                     help="exactly this many ranks (default: any up to the hardware's)")
    rec.add_argument("--hardware", help=HARDWARE_HELP)
    rec.add_argument("--nodes", type=positive,
                     help="with a calibrated cluster's fingerprint: read it for this many nodes sharing "
                          "--ranks (a size it never ran: the same nodes and links, each exchange at its "
                          "tier's rates)")
    add_given_flags(rec)
    add_host_backend(rec)
    rec.add_argument("--db", help=DB_HELP)
    rec.add_argument("--json", action="store_true", help="print the recommendation as JSON")
    add_framework_flag(rec, "also the fastest configuration FRAMEWORK can run, its settings as the "
                            "framework spells them, and what it costs against the pick")


def _score_cells(score: GroupScore) -> list[str]:
    """top-1, regret and worst, both again with ties as ties, Spearman, MAPE and coverage of
    one score; "-" where it does not apply."""
    def shown(value: float, form: str) -> str:
        return "-" if math.isnan(value) else format(value, form)

    return [f"{score.top1:.2f}", f"{score.regret:.3f}", f"{score.worst_regret:.3f}",
            f"{score.tie_regret:.3f}", f"{score.worst_tie_regret:.3f}",
            shown(score.spearman, ".2f"), shown(score.mape, ".1f"), shown(score.coverage * 100, ".0f")]


_SCORE_COLUMNS = ("top-1", "regret", "worst", "regret*", "worst*", "rho", "MAPE%", "cover%")


def run_fit(args: argparse.Namespace, console: Console) -> int:
    from cptune.model import CostModel, compare, fit_advised, load_training

    data = load_training(args.db, args.include_oversubscribed)
    tied = data.tied_with_leader()
    if uncalibrated := ", ".join(sorted(data.uncalibrated)):
        warn(("left out", "yellow"), f": measurements of {uncalibrated}, which have no calibration "
                                      f"(run cptune calibrate there)")
    groupings = ["seq_len"] + (["hardware"] if len(data.profiles) > 1 else [])
    band = CostModel().interval
    for by in groupings:
        held_out = by.replace("_", " ")
        evaluations = compare(data.cases, data.latencies_s, by, tied=tied)
        advised = evaluations[2]
        summary = table(f"cost model against baselines, holding out each {held_out} in turn",
                         f"{len(data.cases)} configurations measured (each its clean visits combined), "
                         f"{advised.overall.decisions} workloads; regret = measured latency of the pick / "
                         f"best measured (mean, worst); * = ties as ties: 1.0 where the measured verdict "
                         f"cannot tell the pick from the best; rho = Spearman rank "
                         f"correlation within a workload; cover = measurements "
                         f"inside the {band[0]:.0%}-{band[1]:.0%} band (advertised "
                         f"{band[1] - band[0]:.0%}); recommend's pick = the correction unless it is worse "
                         f"than the prior beyond the noise on the training folds; fixed rule = always "
                         f"the config fastest most often in the training folds")
        summary.add_column("method", no_wrap=True)
        for column in _SCORE_COLUMNS:
            summary.add_column(column, justify="right", no_wrap=True)
        for evaluation in evaluations:
            summary.add_row(evaluation.method, *_score_cells(evaluation.overall))
        console.print(summary)
        picks = table(f"recommend's pick, holding out each {held_out} in turn",
                       f"over held-out groups: median regret {advised.median_regret:.3f}, worst "
                       f"{advised.worst_regret:.3f}; ties as ties: median {advised.median_tie_regret:.3f}, "
                       f"worst {advised.worst_tie_regret:.3f}")
        for column in ("held out", "workloads", "configs", *_SCORE_COLUMNS[:5]):
            picks.add_column(column, justify="left" if column == "held out" else "right", no_wrap=True)
        for g in advised.groups:
            picks.add_row(g.held_out, str(g.decisions), str(g.samples), *_score_cells(g)[:5])
        console.print(picks)
    _, decision = fit_advised(data.cases, data.latencies_s, tied)
    use = "applies the learned correction" if decision.applied else "uses the prior alone"
    console.print(f"recommend {use} on this database: {decision.reason}", markup=False, highlight=False,
                  soft_wrap=True)
    return 0


def run_recommend(args: argparse.Namespace, console: Console) -> int:
    from cptune.model import recommend

    workload = workload_of(args, args.seq_len)
    framed = None
    engine = args.backend if args.hardware is None else None  # whose ranks measured the hardware
    if args.framework:  # an unknown framework, or an engine no framework runs, before the work
        from cptune.frameworks import check_engine, for_recommendation, get_framework

        check_engine(get_framework(args.framework), engine)
    pick = recommend(workload, ranks=args.ranks, hardware=args.hardware, db=args.db, backend=args.backend,
                     figures=figures_of(args), nccl_path=args.nccl_path, nodes=args.nodes)
    if args.framework:  # the profile recommend used prices what the framework runs otherwise than cptune
        from cptune.model import hardware_profile

        profile = hardware_profile(args.hardware, args.db, args.backend, figures_of(args), args.nccl_path,
                                   args.nodes, args.ranks)
        framed = for_recommendation(pick, args.framework, engine, profile)
    if args.json:
        print(json.dumps(pick.to_dict() | ({"for": framed.to_dict()} if framed else {}), indent=2))
        return 0
    ranked = table(f"{workload.describe()}\non {pick.hardware}",
                   "ms per attention call, slowest rank; measured: every clean visit combined, interval "
                   "95%; predicted: the model's 10-90% band, or what the figures' ranges allow for a "
                   "description's prior")
    for column in ("#", "config", "ranks", "latency ms", "interval", "source"):
        ranked.add_column(column, justify="left" if column in ("config", "source") else "right",
                          no_wrap=True)
    for i, c in enumerate(pick.candidates[:SHOWN_CANDIDATES], start=1):
        style = "bold green" if i == 1 else ""
        ranked.add_row(str(i), c.config.label, str(c.config.ranks), format_ms(c.latency_ms),
                      f"{format_ms(c.low_ms)}-{format_ms(c.high_ms)}", c.source, style=style)
    if (hidden := len(pick.candidates) - SHOWN_CANDIDATES) > 0:
        ranked.add_row("", f"+ {hidden:,} slower", "", "", "", "--json lists them", style="dim")
    console.print(ranked)
    say(console, ("pick:", "bold"),
         f" {pick.config.describe()}, {format_ms(pick.latency_ms)} ms ({pick.source})")
    if pick.verdict is not None:
        say(console, ("measured verdict:", "yellow" if pick.tied else "bold"), f" {pick.describe()}")
    if pick.tiers is not None:
        say(console, ("across nodes:", "bold"), f" {pick.tiers.describe()}")
    for tie in pick.ties[:SHOWN_TIES]:
        say(console, ("tied within what the prior can tell apart:", "yellow"),
             f" {tie.other.label} on {tie.other.ranks} may be faster; {_decides(tie)}")
    if rest := pick.ties[SHOWN_TIES:]:
        say(console, (f"+ {len(rest)} more within the tie:", "yellow"), f" {_what_decides(rest)}; measure "
             f"the tied configurations on the hardware (cptune search there), or the figures named, to "
             f"decide; the same command with --json lists them all")
    if settle := pick.settling_search():
        say(console, ("to settle it on that machine:", "yellow"), f" {' '.join(settle)}")
    if deciding := Counter(t.figure for t in pick.ties if not t.structural).most_common(1):
        say(console, ("or give a figure measured there:", "yellow"),
             f" --figure {deciding[0][0]}=VALUE, in the description's units (GB/s, microseconds, TFLOP/s), "
             f"closes its range")
    if pick.path_decides:
        say(console, ("or name the path NCCL takes between GPUs only a CPU joins:", "yellow"),
            f" --nccl-path {NCCL_PATH_RULE}")
    sources = {c.source for c in pick.candidates}
    correction = None
    if "model" in sources:
        correction = f"learned correction applied: {pick.correction.reason}"
    elif "prior" in sources:
        correction = f"learned correction not applied, predictions are the prior's: {pick.correction.reason}"
    if correction:
        say(console, (correction, "dim"))
    if pick.unpredicted:
        names = ", ".join(f"{c.label} on {c.ranks}" for c in pick.unpredicted)
        flag = "" if args.backend == "mpi" else f" --backend {args.backend}"
        say(console, ("not measured at this length and not predicted:", "yellow"),
            f" {names}; this hardware has no calibration for the prior to stand on: run cptune calibrate"
            f"{flag} (about a minute) to predict them")
    for config, reasons in list(pick.infeasible.items())[:SHOWN_INFEASIBLE]:
        say(console, (f"cannot run {config.label} on {config.ranks}: {'; '.join(reasons)}", "dim"))
    if (hidden := len(pick.infeasible) - SHOWN_INFEASIBLE) > 0:
        say(console, (f"+ {hidden:,} more configurations cannot run: --json lists each with its reasons",
                      "dim"))
    for excluded in pick.excluded:
        say(console, (f"+ {excluded.describe()}", "dim"))
    if pick.whole_nodes is not None:
        say(console, (f"beyond one node, whole nodes of {pick.whole_nodes} ranks were weighed; --ranks N "
                      f"weighs any other count", "dim"))
    if framed is not None:
        show_framework_choice(console, f"for {framed.framework.name} ({framed.framework.pinned}):",
                              framed.substitution, framed.spelling)
    return 0


def _decides(tie: Tie) -> str:
    """What would order ``tie``'s configuration against the pick, in words."""
    if tie.structural:
        return "the prior's own error covers the gap"
    return f"{tie.figure} at its {tie.end} end decides"


def _what_decides(ties: Sequence[Tie]) -> str:
    """Which figures decide ``ties``, most first: "links.node.bandwidth_gbps.default decides
    9 of them, device.matmul_tflops.bf16 5" (the structural ones as "the prior's own error")."""
    counts = Counter("the prior's own error" if t.structural else t.figure for t in ties).most_common()
    first, *others = counts
    return ", ".join([f"{first[0]} decides {first[1]} of them", *(f"{figure} {n}" for figure, n in others)])
