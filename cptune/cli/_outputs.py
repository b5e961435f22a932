"""What cptune writes for deployments and people: ``cptune export`` (a plan), ``cptune
export-graph`` (each rank's ONNX graph) and ``cptune report`` (figures and an HTML page)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from cptune._files import same_file
from cptune.cli._common import (
    DB_HELP,
    HARDWARE_HELP,
    UsageError,
    add_framework_flag,
    add_given_flags,
    add_host_backend,
    add_layout_flag,
    add_workload_flags,
    figures_of,
    positive,
    say,
    show_framework_choice,
    table,
    workload_of,
)
from cptune.cli._search import space_of
from cptune.config import STRATEGIES, CPConfig
from cptune.errors import CPTuneError, InfeasibleConfigError
from cptune.feasibility import check_feasible
from cptune.measurement import format_ms
from cptune.space import DEMO_SPACE, find_space

if TYPE_CHECKING:
    from cptune.model import MeasuredHost, Profile
    from cptune.plans import Plan


def add_parsers(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export",
        help="write a plan: the configuration to run per sequence-length bucket, for a deployment",
        description=(
            "For each sequence length of a search space (or of the workload flags), take the "
            "recommended configuration - measured where the database has it, predicted elsewhere "
            "- and write them as a JSON plan with their evidence and the launch command. A "
            "deployment loads it with cptune.load_plan (or any JSON Schema reader: the schema "
            "ships as cptune/plans/plan.schema.json)."
        ),
    )
    export.add_argument("space", nargs="?",
                        help=f"search space file or built-in name (default {DEMO_SPACE})")
    export.add_argument("-o", "--output",
                        help="plan file to write (default plan.json; with --for, none unless named); a plan "
                             "cptune export wrote already there is replaced, any other file is left as it is")
    export.add_argument("--force", action="store_true",
                        help="replace the -o file even if it is a plan edited since cptune export wrote it")
    export.add_argument("--hardware", help=HARDWARE_HELP)
    add_given_flags(export)
    add_host_backend(export)
    export.add_argument("--ranks", dest="plan_ranks", type=positive,
                        help="exactly this many ranks (default: the fastest count up to the hardware's)")
    export.add_argument("--nodes", type=positive,
                        help="with a calibrated cluster's fingerprint: plan for this many nodes sharing "
                             "--ranks (a size it never ran; as cptune recommend --nodes)")
    export.add_argument("--db", help=DB_HELP)
    export.add_argument("--batch-lengths", metavar="FILE",
                        help="lengths of the batches to come (one a line, a JSON list or histogram, or a "
                             ".npy array): the plan carries the per-batch policy, so a deployment plans each "
                             "batch with cptune.plan_batch(plan, lengths) and no database (docs/mixes.md)")
    add_workload_flags(export, lengths=True, with_strategies=True)
    export.set_defaults(ranks=None)  # the search-space reader's rank list: not a flag of export
    add_framework_flag(export, "print each bucket as FRAMEWORK takes it: the fastest configuration it "
                               "can run, its settings and launch line, and what that costs against the "
                               "plan's pick")
    export.add_argument("--plan", help="with --for: a plan file cptune export wrote, taken as it is "
                                       "instead of exporting one")
    export.add_argument("--json", action="store_true", help="with --for: the settings as JSON, for tools")


    report = commands.add_parser(
        "report",
        help="figures and an HTML page (or terminal tables) of what the database holds",
        description=(
            "Draw, for each hardware and attention shape: latency against rank count per strategy, "
            "speedup and parallel efficiency, the strategy map (measured where measured, predicted "
            "elsewhere, marked so) and the cost model's held-out predictions against the "
            "measurements. Writes PNG files and one self-contained report.html; --text prints "
            "the same data as tables instead."
        ),
    )
    report.add_argument("--db", help=DB_HELP)
    report.add_argument("-o", "--output-dir", default="cptune-report",
                        help="directory for the PNGs and report.html (default cptune-report)")
    report.add_argument("--hardware", help="a stored fingerprint or 4+ of its leading characters "
                                           "(default: every hardware with measurements)")
    report.add_argument("--text", action="store_true", help="print tables in the terminal; write no files")


    graph = commands.add_parser(
        "export-graph",
        help="write each rank's ONNX graph of one configuration, for a TensorRT deployment",
        description=(
            "Write rank0.onnx ... rankN-1.onnx: one attention layer of the configuration as each "
            "rank runs it (standard ONNX ops plus TensorRT's DistCollective nodes), the very graphs "
            "the onnx engine checks on real ranks, and manifest.json (workload, configuration, each "
            "rank's tokens, input/output shapes, SHA-256 of each file). A deployment builds its "
            "TensorRT engines from these files."
        ),
    )
    add_workload_flags(graph, required=True, with_mode=False)  # inference graphs
    graph.add_argument("--strategy", choices=STRATEGIES, required=True, help="context strategy")
    graph.add_argument("--ranks", type=positive, required=True, help="ranks (one graph each)")
    graph.add_argument("--head-group", type=positive, default=None,
                       help="Ulysses degree u (default: all ranks for ulysses, else 1)")
    add_layout_flag(graph)
    graph.add_argument("-o", "--output-dir", required=True, help="directory to write the graphs into")


def run_export(args: argparse.Namespace, console: Console) -> int:
    from cptune.plans import check_replaceable, load_plan
    from cptune.plans.export import export_plan

    if (args.plan or args.json) and not args.framework:
        raise UsageError(f"{'--plan' if args.plan else '--json'} goes with --for FRAMEWORK: "
                         f"add --for, or leave it out to write a plan")
    if args.framework:
        from cptune.frameworks import check_engine, get_framework

        framework = get_framework(args.framework)  # an unknown one, before the work
        if args.plan is None and args.hardware is None:
            check_engine(framework, args.backend)
    output = args.output or (None if args.framework else "plan.json")
    if output is not None and args.plan is not None and same_file(output, args.plan):
        raise UsageError(f"-o {output} is the --plan file this command reads, so it is left as it is: write "
                         f"the plan elsewhere (cptune export -o PATH)")
    if args.batch_lengths is not None and (args.plan is not None or args.framework):
        raise UsageError("--batch-lengths exports a plan with a batch policy: leave out --for and --plan")
    batch = None
    if args.batch_lengths is not None:
        from cptune.mixes import read_mix

        if args.nodes is not None:
            raise UsageError("a batch policy is read on the hardware's own ranks, not a calibrated cluster "
                             "of --nodes: leave out --nodes or --batch-lengths")
        batch = read_mix(args.batch_lengths)  # bad input refused before the work
    if output is not None:
        check_replaceable(output, args.force)  # before the work, not only at the write
    if args.plan is not None:
        plan = load_plan(args.plan, hardware=args.hardware, force=args.hardware is None)
    else:
        space = find_space(space_of(args))
        where = {"hardware": args.hardware, "db": args.db, "strategies": space.strategies,
                 "backend": args.backend, "figures": figures_of(args), "nccl_path": args.nccl_path}
        policy = None
        if batch is not None:
            from cptune.mixes import mix_policy

            policy = mix_policy(space.workloads()[0].shape, batch, args.plan_ranks, **where)
        plan = export_plan(space.workloads(), ranks=args.plan_ranks, nodes=args.nodes, batch_policy=policy,
                           **where)
    if args.framework:  # the profile the plan was tuned on prices what the framework runs otherwise
        from cptune.model import hardware_profile

        profile = None
        if args.plan is None:
            profile = hardware_profile(args.hardware, args.db, args.backend, figures_of(args), args.nccl_path,
                                       args.nodes, args.plan_ranks)
        elif plan.hardware.kind == "host":
            try:  # this host's calibration; without one, what a framework runs otherwise is passed over
                profile = hardware_profile(None, args.db, plan.hardware.engine or args.backend)
            except CPTuneError:
                profile = None
        return _export_for(args, console, plan, output, profile)
    assert output is not None
    path = plan.write(output, force=args.force)
    shown = table(f"plan for {plan.shape.describe()}\non {plan.hardware.description}",
                   "ms per attention call, slowest rank: the pick's stored measurements combined, "
                   "or predicted (model/prior); the plan lists every measurement compared")
    for column in ("seq_len range", "tuned at", "config", "ranks", "ms", "source", "measurement"):
        shown.add_column(column, justify="left" if column in ("config", "source") else "right", no_wrap=True)
    for b in plan.buckets:
        pick_id = str(b.measurement_ids[0]) if b.measurement_ids else "-"
        shown.add_row(f"{b.min_seq_len}-{b.max_seq_len}", str(b.seq_len), b.config.label, str(b.config.ranks),
                      format_ms(b.latency_ms), b.source, pick_id)
    console.print(shown)
    for b in plan.buckets:
        if b.decided_by:
            say(console, (f"{b.min_seq_len}-{b.max_seq_len} across nodes:", "bold"), f" {b.decided_by}")
        if b.tied:
            names = ", ".join(c.describe() for c in b.tied)
            say(console, (f"{b.min_seq_len}-{b.max_seq_len}:", "yellow"),
                 f" {b.config.describe()} is tied with {names}; the plan lists them (tied), any may run")
    say(console, f"launch {plan.launch.ranks} rank(s): {' '.join(plan.launch.mpiexec)} <your program>  "
                  f"(Slurm: {' '.join(plan.launch.srun)} <your program>; PyTorch: "
                  f"{' '.join(plan.launch.torchrun)} <your program>)")
    if plan.batch_policy is not None:
        policy = plan.batch_policy
        say(console, f"batch policy: {len(policy.curves)} configurations' cost curves over "
                     f"{len(policy.grid)} lengths ({policy.grid[0]:,}-{policy.grid[-1]:,} tokens), "
                     f"batches on up to {policy.ranks} ranks; a deployment plans one with "
                     f"cptune.plan_batch(load_plan(...), lengths, ranks)")
    say(console, f"wrote {path}; a deployment reads it with cptune.load_plan({str(path)!r})")
    return 0


def _export_for(args: argparse.Namespace, console: Console, plan: Plan, output: str | None,
                profile: Profile | MeasuredHost | None) -> int:
    """``export --for``: the plan bucket by bucket as the framework takes it (what it runs
    otherwise than cptune priced on ``profile``)."""
    from cptune.frameworks import for_framework

    framed = for_framework(plan, args.framework, profile)
    if output is not None:
        plan.write(output, force=args.force)
    if args.json:
        print(json.dumps(framed.to_dict(), indent=2))
        return 0
    framework = framed.framework
    say(console, (f"{framework.name} ({framework.pinned})", "bold"),
        f" for {plan.shape.describe()} on {plan.hardware.description}")
    for entry in framed.buckets:
        b = entry.bucket
        show_framework_choice(console, f"seq {b.min_seq_len}-{b.max_seq_len} (tuned at {b.seq_len}):",
                              entry.substitution, entry.spelling)
    if output is not None:
        say(console, f"wrote the plan to {output}")
    return 0


def run_report(args: argparse.Namespace, console: Console) -> int:
    from cptune.report import gather, text_tables, write_report

    with console.status("reading the database and predicting the strategy map"):
        data = gather(args.db, args.hardware)
    if args.text:
        for shown in text_tables(data):
            console.print(shown)
        return 0
    with console.status("drawing"):
        try:
            written = write_report(data, Path(args.output_dir))
        except OSError as exc:
            raise UsageError(f"cannot write the report to {args.output_dir}: {exc.strerror or exc}") from None
    say(console, f"wrote {len(written) - 1} figure(s) and {written[-1]}: open it in a browser")
    return 0


def run_export_graph(args: argparse.Namespace, console: Console) -> int:
    from cptune.engines.onnx import export_graphs

    workload = workload_of(args, args.seq_len)
    try:
        config = CPConfig(args.strategy, args.ranks, args.head_group, args.layout)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        check_feasible(workload, config)
    except InfeasibleConfigError as exc:
        reasons = "; ".join(exc.reasons)
        raise UsageError(f"{config.describe()} cannot run {workload.describe()}: {reasons}") from None
    try:
        manifest_path = export_graphs(workload, config, Path(args.output_dir))
    except OSError as exc:
        raise UsageError(f"cannot write the graphs to {args.output_dir}: {exc.strerror or exc}") from None
    manifest = json.loads(manifest_path.read_text())
    shown = table(f"{config.describe()} for {workload.describe()}",
                   "one ONNX graph per rank; tokens = the positions each rank holds, as [start, stop) runs")
    for column in ("rank", "file", "nodes", "tokens", "sha256"):
        shown.add_column(column, justify="right" if column in ("rank", "nodes") else "left", no_wrap=True)
    for r in manifest["ranks"]:
        tokens = " ".join(f"{a}-{b}" for a, b in r["tokens"])
        shown.add_row(str(r["rank"]), r["file"], str(r["nodes"]), tokens, r["sha256"][:12])
    console.print(shown)
    console.print(f"wrote {len(manifest['ranks'])} graph(s) and {manifest_path}",
                  highlight=False, soft_wrap=True)
    return 0


