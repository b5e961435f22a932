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
    UsageError,
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
    from cptune.mixes import BatchPlan
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
    lengths = add_workload_flags(rec, required=True, length_choices=True)
    assert lengths is not None
    lengths.add_argument("--lengths", metavar="FILE",
                         help="a length mix: one length a line, a JSON list or histogram {\"length\": "
                              "count}, or a .npy array (docs/mixes.md): the one configuration with the "
                              "lowest expected time per sequence, its p90/p99, and a bucketed plan")
    lengths.add_argument("--batch-lengths", metavar="FILE",
                         help="one batch's lengths (the same forms): the ranks split into CP groups, a "
                              "configuration each and the sequences each runs, for the least predicted "
                              "makespan")
    rec.add_argument("--exact", action="store_true",
                     help="with --batch-lengths: solve it exactly (a MILP; small batches only) as well "
                          "as fast")
    rec.add_argument("--ranks", type=positive,
                     help="exactly this many ranks (default: any up to the hardware's; with "
                          "--batch-lengths: the ranks the groups share)")
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

    if args.exact and args.batch_lengths is None:
        raise UsageError("--exact solves a batch: give --batch-lengths FILE")
    if args.seq_len is None:
        if args.framework or args.nodes:
            given = "--lengths" if args.lengths is not None else "--batch-lengths"
            raise UsageError(f"{'--for' if args.framework else '--nodes'} takes --seq-len, not {given}")
        return _mixes(args, console)
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


def _mixes(args: argparse.Namespace, console: Console) -> int:
    """``recommend --lengths`` (the static answer over a mix) or ``--batch-lengths`` (a plan per
    batch)."""
    from cptune.mixes import exact_batch_plan, mix_costs, plan_batch, read_mix, recommend_mix

    mix = read_mix(args.lengths or args.batch_lengths)
    shape = workload_of(args, mix.longest).shape
    where = dict(hardware=args.hardware, db=args.db, backend=args.backend, figures=figures_of(args),
                 nccl_path=args.nccl_path)
    if args.lengths is None:
        costs = mix_costs(shape, mix, args.ranks, **where)
        plans = [plan_batch(costs, mix)] + ([exact_batch_plan(costs, mix)] if args.exact else [])
        if args.json:
            print(json.dumps({"hardware": costs.hardware, "plans": [p.to_dict() for p in plans]}, indent=2))
        else:
            for plan in plans:
                _show_batch_plan(console, plan, mix.lengths.tolist(),
                                 f"{shape.describe()}\non {costs.hardware}")
        return 0
    answer = recommend_mix(shape, mix, args.ranks, **where)
    if args.json:
        print(json.dumps(answer.to_dict(), indent=2))
        return 0
    ranked = table(f"{mix.describe()}, {shape.describe()}\non {answer.costs.hardware}",
                   "ms per sequence, slowest rank, over the mix's sequences; each length measured where "
                   "stored, else the cost model's or the prior's, read between the lengths asked")
    for column in ("#", "config", "ranks", "mean ms", "p90 ms", "p99 ms", "measured"):
        ranked.add_column(column, justify="left" if column == "config" else "right", no_wrap=True)
    for i, (config, time) in enumerate(answer.ranked[:SHOWN_CANDIDATES], start=1):
        ranked.add_row(str(i), config.label, str(config.ranks),
                       *_tail(time.mean_ms, time.p90_ms, time.p99_ms), f"{time.measured_share:.0%}",
                       style="bold green" if i == 1 else "")
    console.print(ranked)
    if answer.config is not None and answer.time is not None:
        mean, p90, p99 = _tail(answer.time.mean_ms, answer.time.p90_ms, answer.time.p99_ms)
        say(console, ("pick:", "bold"),
            f" {answer.config.describe()}, {mean} ms a sequence on average (p90 {p90}, p99 {p99})")
    else:
        say(console, ("no single configuration holds every sequence:", "yellow"), " run the bucketed plan")
    mean, p90, p99 = _tail(answer.plan_time.mean_ms, answer.plan_time.p90_ms, answer.plan_time.p99_ms)
    buckets = ", ".join(f"{b.min_seq_len:,}-{b.max_seq_len:,}: {b.config.label} on {b.config.ranks}"
                        for b in answer.plan.buckets)
    say(console, ("bucketed plan:", "bold"),
        f" {mean} ms a sequence on average (p90 {p90}, p99 {p99}); {buckets}")
    words = shape.at(mix.longest).flags("--seq-lens")
    words[1] = ",".join(str(b.seq_len) for b in answer.plan.buckets)
    words += [*(["--ranks", str(args.ranks)] if args.ranks else []),
              *(["--hardware", args.hardware] if args.hardware else [])]
    say(console, ("to write it:", "dim"), f" cptune export {' '.join(words)} -o plan.json")
    if answer.unheld:
        say(console, ("over memory in its bucket's configuration:", "yellow"),
            f" {', '.join(f'{n:,}' for n in answer.unheld[:10])} tokens; export more buckets near them")
    return 0


def _tail(*ms: float) -> list[str]:
    return [format_ms(x) for x in ms]


def _show_batch_plan(console: Console, plan: BatchPlan, lengths: list[int], title: str) -> None:
    """A batch plan's groups, one row each, and its makespan."""
    solver = f"{plan.solver} solver{', optimal' if plan.optimal else ''}"
    shown = table(f"a batch of {len(lengths)} on {plan.ranks} ranks ({solver}), {title}",
                  "each group runs its sequences one after another; ms predicted per group, the makespan "
                  "the slowest group's")
    for column in ("group", "config", "ranks", "ms", "sequences"):
        shown.add_column(column, justify="left" if column in ("config", "sequences") else "right")
    for i, group in enumerate(plan.groups, start=1):
        listed = ", ".join(f"{lengths[s]:,}" for s in group.sequences[:8])
        more = f" + {len(group.sequences) - 8} more" if len(group.sequences) > 8 else ""
        shown.add_row(str(i), group.config.label, str(group.config.ranks), format_ms(group.ms), listed + more)
    console.print(shown)
    say(console, ("plan:", "bold"), f" {plan.describe()}")
