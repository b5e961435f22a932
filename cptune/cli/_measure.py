"""``cptune measure`` (every feasible configuration of one workload, timed, nothing stored)
and ``cptune calibrate`` (this machine's collectives and attention rate, stored)."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cptune.calibration import REPEATS, ROUNDS, Calibration
from cptune.cli._common import (
    DB_HELP,
    MAX_RANKS_HELP,
    SHARE_DB_HELP,
    USAGE_ERROR,
    UsageError,
    add_backend,
    add_hosts_flags,
    add_layout_flag,
    add_workload_flags,
    count,
    engine_of,
    positive,
    positive_list,
    seconds,
    table,
    warn,
    workload_of,
)
from cptune.cli._search import LiveSearch
from cptune.config import STRATEGIES, CPConfig
from cptune.cost import BACKWARD_FLOPS_RATIO
from cptune.errors import EngineError
from cptune.execute import measure_all
from cptune.measurement import Measurement
from cptune.workload import Workload

#: Workload defaults of ``cptune measure`` (a small demo shape).
_MEASURE_DEFAULTS = {"seq_len": 4096, "heads": 8, "head_dim": 64}


def add_parsers(commands: argparse._SubParsersAction) -> None:
    measure = commands.add_parser(
        "measure",
        help="measure every feasible configuration of one workload (nothing stored)",
        description=(
            "Run every feasible strategy / rank count / head group for one attention workload "
            "on real ranks, check each output against a float64 reference, and print their "
            "latencies. With no flags: a small demo workload."
        ),
    )
    add_workload_flags(measure, defaults=_MEASURE_DEFAULTS, with_strategies=True)
    measure.add_argument("--max-ranks", type=positive, default=None, help=MAX_RANKS_HELP)
    measure.add_argument("--ranks", type=positive_list, default=None,
                         help="only these rank counts, e.g. 2 or 2,4 (instead of 1..--max-ranks)")
    measure.add_argument("--head-group", type=positive, default=None,
                         help="only this Ulysses degree u: u-way Ulysses x ranks/u-way strategy (1: the pure "
                              "strategy; default: every one); with --strategies and --ranks it names one "
                              "configuration, as a search's output does")
    add_layout_flag(measure)
    measure.add_argument("--lengths", metavar="FILE",
                         help="one batch's sequence lengths (one a line, a JSON list or histogram, a .npy "
                              "array; docs/mixes.md): its batch plan solved for --ranks N on this host's "
                              "model, the groups run side by side, each sequence checked, the makespan "
                              "timed beside the predicted one (the shape's flags give the layer, batch 1)")
    measure.add_argument("--db", help=f"with --lengths: the {DB_HELP} whose calibration and measurements "
                                      f"price the plan")
    measure.add_argument("--warmup", type=count("warmup"), default=2, help="untimed iterations (default 2)")
    measure.add_argument("--repeats", type=count("repeats"), default=10, help="timed iterations (default 10)")
    measure.add_argument("--timeout", type=seconds, default=None,
                     help="seconds before a configuration's run is stopped (default: scaled to its size)")
    measure.add_argument("--json", action="store_true", help="print results as JSON instead of a table")
    measure.add_argument("--oversubscribe", action="store_true",
                         help="allow more ranks than this host's cores: such runs time ranks waiting for a "
                              "core (marked oversub. in the table, oversubscribed in the JSON)")
    add_backend(measure)
    add_hosts_flags(measure)

    calibrate = commands.add_parser(
        "calibrate",
        help="measure this host's collective latency/bandwidth and attention rate (about a minute)",
        description=(
            "For each rank count, time every collective the strategies use over a sweep of "
            "message sizes (fitted to latency + bytes / bandwidth) and the attention kernel on "
            "a few shapes; store the result for this hardware. The cost model's prior stands on it."
        ),
    )
    calibrate.add_argument("--db", help=DB_HELP)
    calibrate.add_argument("--share-db", action="store_true", help=SHARE_DB_HELP)
    calibrate.add_argument("--max-ranks", type=positive, help=MAX_RANKS_HELP)
    calibrate.add_argument("--repeats", type=count("repeats"), default=REPEATS,
                           help=f"timed iterations per point in each round (default {REPEATS})")
    calibrate.add_argument("--rounds", type=count("rounds"), default=ROUNDS,
                           help=f"rounds, each timing every point once; a point's time is the median "
                                f"of its rounds (default {ROUNDS})")
    calibrate.add_argument("--oversubscribe", action="store_true",
                           help="allow --max-ranks above this host's cores (those rates time the sharing)")
    add_backend(calibrate)
    add_hosts_flags(calibrate)



def _measurements_table(
    workload: Workload, results: list[Measurement], failures: list[tuple[CPConfig, EngineError]]
) -> Table:
    disturbed = "; * = disturbed by other load (why: below)" if any(m.disturbed for m in results) else ""
    if any(m.oversubscribed for m in results):
        disturbed += "; oversub. = more ranks than cores, timing the sharing (--oversubscribe)"
    train = workload.training
    shown = table(f"{workload.describe()} - fastest first",
                  f"ms per iteration{' (forward and backward; fwd: the forward alone)' if train else ''}, "
                  "slowest rank; spread = p90 - p10; peak = MiB per rank; "
                  f"ulysses2xring2 = 2-way Ulysses x 2-way Ring{disturbed}")
    columns = ("config", "ranks", "median", *(("fwd",) if train else ()), "spread", "compute", "comm", "peak",
               "error")
    for column in columns:
        shown.add_column(column, justify="left" if column == "config" else "right", no_wrap=True)
    for m in sorted(results, key=lambda m: m.median_ms):
        shown.add_row(
            m.config.label, f"{m.config.ranks}{' oversub.' if m.oversubscribed else ''}",
            f"{m.median_ms:.1f}{'*' if m.disturbed else ''}",
            *((_ms(m.forward_ms),) if train else ()), f"{m.spread_ms:.1f}", _ms(m.compute_ms), _ms(m.comm_ms),
            f"{m.peak_bytes / 2**20:.0f}", f"{m.max_error:.0e}",
        )
    for config, error in failures:
        shown.add_row(config.label, str(config.ranks), f"[red]failed: {error.kind}[/]",
                      *[""] * (len(columns) - 3))
    return shown


def run_measure(args: argparse.Namespace, console: Console) -> int:
    if args.lengths is not None:
        return _measure_batch(args, console)
    if args.db is not None:
        raise UsageError("--db prices a batch plan: give it with --lengths FILE (measure alone stores "
                         "nothing)")
    workload = workload_of(args, args.seq_len)
    if args.ranks and args.max_ranks:
        raise UsageError("give --ranks (these rank counts) or --max-ranks (1 up to it), not both")
    # drawn from the first configuration on: what is refused before anything runs draws nothing
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True, disable=args.json)
    task = progress.add_task("measuring", total=None)


    def on_config(config: CPConfig, index: int, total: int) -> None:
        if not progress.live.is_started:
            progress.start()
        progress.update(task, description=f"measuring {config.describe()}", completed=index, total=total)

    try:
        results, failures = measure_all(workload, args.max_ranks, args.strategies or STRATEGIES,
                                        backend=engine_of(args), warmup=args.warmup, repeats=args.repeats,
                                        timeout=args.timeout, on_config=on_config, ranks=args.ranks,
                                        head_group=args.head_group, oversubscribe=args.oversubscribe,
                                        layout=args.layout)
    finally:
        if progress.live.is_started:
            progress.stop()
    if args.json:
        print(json.dumps({
            "results": [m.to_dict() for m in results],
            "failures": [{"config": c.to_dict(), "kind": e.kind, "error": str(e)} for c, e in failures],
        }, indent=2))
    else:
        console.print(_measurements_table(workload, results, failures))
    for m in results:
        if m.disturbed:
            warn((f"{m.config.describe()} disturbed:", "yellow"),
                 f" {m.disturbed}, so its timing is not clean; measure again when the host is quiet")
    for config, failure in failures:
        warn((f"{config.describe()} failed ({failure.kind}):", "red"), f" {failure}")
    return USAGE_ERROR if failures else 0


def _measure_batch(args: argparse.Namespace, console: Console) -> int:
    """``measure --lengths FILE --ranks N``: one batch's plan solved and run, measured beside predicted."""
    from cptune.execute import measure_mix
    from cptune.mixes import read_mix

    if not args.ranks or len(args.ranks) != 1 or args.max_ranks:
        raise UsageError("--lengths runs one batch on one set of ranks: give --ranks N (one count), not "
                         "--max-ranks or several")
    if args.head_group is not None or args.layout is not None or args.strategies is not None:
        raise UsageError("--lengths lets the batch plan choose each group's configuration: leave out "
                         "--strategies, --head-group and --layout")
    mix = read_mix(args.lengths)
    shape = workload_of(args, mix.longest).shape
    result = measure_mix(shape, mix, args.ranks[0], backend=engine_of(args), warmup=args.warmup,
                         repeats=args.repeats, timeout=args.timeout, oversubscribe=args.oversubscribe,
                         db=args.db)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    plan = result.plan
    shown = table(f"a batch of {len(plan.lengths)} on {plan.ranks} ranks, {shape.describe()}",
                  "groups side by side, each running its sequences one after another; ms per group, "
                  "predicted (this host's model) and measured (median, its slowest rank); every sequence "
                  "checked against the float64 reference first")
    for column in ("group", "config", "ranks", "predicted", "measured", "sequences"):
        shown.add_column(column, justify="left" if column in ("config", "sequences") else "right")
    lengths = plan.lengths
    for i, (group, measured) in enumerate(zip(plan.groups, result.group_ms, strict=True), start=1):
        listed = ", ".join(f"{lengths[s]:,}" for s in group.sequences[:8])
        more = f" + {len(group.sequences) - 8} more" if len(group.sequences) > 8 else ""
        shown.add_row(str(i), group.config.label, str(group.config.ranks), f"{group.ms:.2f}",
                      f"{measured:.2f}", listed + more)
    console.print(shown)
    oversub = " (oversubscribed: ranks share cores)" if result.oversubscribed else ""
    console.print(f"makespan: measured {result.median_ms:.2f} ms (median of {len(result.samples_ms)}), "
                  f"predicted {plan.makespan_ms:.2f} ms ({result.error:+.0%}); largest error "
                  f"{result.max_error:.0e}{oversub}", markup=False, highlight=False, soft_wrap=True)
    if result.disturbed:
        warn(("batch disturbed:", "yellow"),
             f" {result.disturbed}, so its timing is not clean; measure again when the host is quiet")
    return 0


def _calibration_tables(calibration: Calibration) -> list[Table]:
    comms = table("collectives: time = latency + bytes sent per rank / bandwidth",
                   "bus bw: nccl-tests' bus bandwidth at the largest message (bytes sent per rank / s); "
                   "the mpi engine's all-to-all and all-gather are timed with their copies")
    across = "network" in calibration.tiers  # a cluster's: each tier where configurations use it
    columns = ("collective", "ranks", "group", *(("tier",) if across else ()), "latency us", "fit GB/s",
               "bus bw GB/s")
    for column in columns:
        left = column in ("collective", "tier")
        comms.add_column(column, justify="left" if left else "right", no_wrap=True)
    for f in calibration.collectives:
        tier = (("across nodes" if f.tier == "network" else "in a node"),) if across else ()
        comms.add_row(f.kind, str(f.ranks), str(f.group), *tier, f"{f.latency_s * 1e6:.1f}",
                      f"{f.bandwidth / 1e9:.2f}", f"{f.bus_bandwidth / 1e9:.2f}")
    compute = table("attention compute rate", "every rank computing at once on its share of the cores; "
                    f"the backward's FLOPs counted as {BACKWARD_FLOPS_RATIO:g}x the forward's")
    columns = ("pass", "ranks", "head_dim", "mask", "GFLOP per call", "GFLOP/s per rank", "GFLOP/s total")
    for column in columns:
        compute.add_column(column, justify="left" if column in ("pass", "mask") else "right", no_wrap=True)
    passes = [("forward", 1.0, r) for r in calibration.compute]
    passes += [("backward", BACKWARD_FLOPS_RATIO, r) for r in calibration.backward]
    for name, ratio, r in passes:
        mask = "causal" if r.causal else "full"
        compute.add_row(name, str(r.ranks), str(r.head_dim), mask, f"{ratio * r.flops / 1e9:.2f}",
                        f"{ratio * r.flops_per_s / 1e9:.1f}", f"{ratio * r.flops_per_s * r.ranks / 1e9:.1f}")
    if not calibration.steps:
        return [comms, compute]
    steps = table("the kernel's memory-bound steps (the work each Ring step repeats)",
                   "query: a query block made scaled float32; merge: a block's output merged into the "
                   "running one; every rank at once")
    for column in ("step", "wire dtype", "ranks", "ns per element"):
        steps.add_column(column, justify="left" if column in ("step", "wire dtype") else "right",
                         no_wrap=True)
    for step in calibration.steps:
        steps.add_row(step.kind, step.wire, str(step.ranks), f"{step.seconds_per_element * 1e9:.3f}")
    return [comms, compute, steps]


def run_calibrate(args: argparse.Namespace, console: Console) -> int:
    from cptune.search import calibrate_host

    shown = LiveSearch(console)
    try:
        _, calibration = calibrate_host(
            args.db, backend=engine_of(args), max_ranks=args.max_ranks, oversubscribe=args.oversubscribe,
            repeats=args.repeats, rounds=args.rounds, share=args.share_db,
            progress=shown,  # type: ignore[arg-type]  # a SearchProgress by shape
        )
    finally:
        shown.close()
    for shown_table in _calibration_tables(calibration):
        console.print(shown_table)
    return 0


def _ms(value: float | None) -> str:
    """A phase's milliseconds, or "n/a" where the engine could not split the phases."""
    return "n/a" if value is None else f"{value:.1f}"
