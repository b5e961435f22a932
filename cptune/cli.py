"""The ``cptune`` command line: ``search``, ``results``, ``measure``, ``calibrate``, ``fit``,
``recommend``, ``export``, ``report`` and ``export-graph``.

Bad input (flags, space files, databases) ends with one line on stderr naming the problem
and the fix, and exit code 2; never a traceback. Normal output goes to stdout (to stderr
when stdout carries --json or --csv); errors and warnings always to stderr. Text from users
and messages is printed as text, never as Rich markup.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from cptune import __version__
from cptune.calibration import REPEATS, RETIMED, ROUNDS, Calibration, calibrate
from cptune.config import STRATEGIES, CPConfig
from cptune.engines import BACKENDS, get_engine, untimed
from cptune.errors import CPTuneError, EngineError, InfeasibleConfigError
from cptune.execute import measure
from cptune.feasibility import check_feasible, enumerate_configs
from cptune.guard import enabled as guard_enabled
from cptune.hardware import Hardware, this_gpu_node, this_host
from cptune.measurement import Measurement, available_cores, format_ms, oversubscribed
from cptune.space import DEMO_SPACE, MeasureSettings, SearchSpace, check_runnable, load_space, resolve_space
from cptune.workload import WIRE_DTYPES, Workload

if TYPE_CHECKING:
    from cptune.engines.tensorrt import NodeProbe
    from cptune.estimate import Comparison, Estimate, Verdict
    from cptune.model import GroupScore
    from cptune.search import Visit, WorkloadSearch
    from cptune.store import Result, Store

USAGE_ERROR = 2
Number = TypeVar("Number", int, float)
#: Workload defaults of ``cptune measure`` (a small demo shape).
_MEASURE_DEFAULTS = {"seq_len": 4096, "heads": 8, "head_dim": 64}


class UsageError(CPTuneError):
    """Bad input from the user: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """A flag error in one line and where to get help, instead of the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


#: Errors and warnings: always stderr, whatever stdout carries.
_STDERR = Console(stderr=True)
Part = str | tuple[str, str]


def _say(console: Console, *parts: Part) -> None:
    """Print one message: each part plain text (never markup) or (text, style). Soft-wrapped:
    the terminal wraps it, so a path or command copies out whole."""
    console.print(Text.assemble(*parts), highlight=False, soft_wrap=True)


def _warn(*parts: Part) -> None:
    _say(_STDERR, *parts)


def _ids(text: str) -> tuple[int, ...]:
    """Measurement ids, e.g. 12,15 (as cptune results lists them)."""
    try:
        ids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        ids = ()
    if not ids or min(ids) < 1:
        raise argparse.ArgumentTypeError(f"expected measurement ids like 12,15 (cptune results lists them), "
                                         f"got {text!r}")
    return ids


def _strategies(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown strategy {', '.join(unknown) or '(none)'}; choose from {', '.join(STRATEGIES)}"
        )
    return names


def _number_type(convert: Callable[[str], Number], what: str, zero: bool = False) -> Callable[[str], Number]:
    """An argparse type: ``convert`` the text, refusing what is not a number above zero (or,
    with ``zero``, at least zero)."""

    def parse(text: str) -> Number:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be {'0 or more' if zero else 'positive'}, got {text}")
        return value

    return parse


_positive = _number_type(int, "a whole number")
_non_negative = _number_type(int, "a whole number", zero=True)
_seconds = _number_type(float, "a number of seconds")


def _positive_list(text: str) -> tuple[int, ...]:
    values = tuple(_positive(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError("expected comma-separated whole numbers, e.g. 1024,2048")
    return values


def _add_shape(parser: argparse.ArgumentParser, defaults: dict[str, int] | None) -> None:
    """Flags that describe one attention layer (defaults only for ``measure``)."""
    d = defaults or {}
    shape = parser.add_argument_group("workload (one attention layer)")
    if "seq_len" in d:
        shape.add_argument("--seq-len", type=_positive, default=d["seq_len"],
                           help=f"tokens per sequence (default {d['seq_len']})")
    else:
        shape.add_argument("--seq-lens", type=_positive_list, help="sequence lengths, e.g. 1024,2048")
    shape.add_argument("--heads", type=_positive, default=d.get("heads"), help="query heads")
    shape.add_argument("--kv-heads", type=_positive, default=None,
                       help="KV heads (default: as many as --heads)")
    shape.add_argument("--head-dim", type=_positive, default=d.get("head_dim"), help="head dimension")
    shape.add_argument("--batch", type=_positive, default=1, help="sequences per batch (default 1)")
    shape.add_argument("--dtype", choices=sorted(WIRE_DTYPES), default="bf16",
                       help="activation dtype (default bf16)")
    shape.add_argument("--causal", action="store_true", help="causal mask (LLM prefill)")
    shape.add_argument("--strategies", type=_strategies, default=None,
                       help=f"comma-separated subset of {','.join(STRATEGIES)} (default: all)")


def _add_backend(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKENDS, default="mpi",
                        help="engine: mpi (CPU ranks, the default), tensorrt (one GPU per rank, "
                             "pip install 'cptune[tensorrt]') or onnx (checks graphs, does not time)")


def _gpu_node(backend: str, ranks: int | None) -> NodeProbe | None:
    """For ``--backend tensorrt``: this node's GPUs, after the preflight (one line, exit 2,
    naming what is missing for ``ranks`` ranks, or 1 when not given); None for mpi."""
    if backend != "tensorrt":
        return None
    from cptune.engines.tensorrt import preflight, probe_node

    node = probe_node()
    preflight(ranks or 1, node)
    return node


def _capacity(node: NodeProbe | None) -> int:
    """Ranks the backend runs here by default: one per GPU, or one per CPU core."""
    return len(node.gpus) if node is not None else available_cores()


def _this_hardware(node: NodeProbe | None) -> Hardware:
    """This host's fingerprint as the backend sees it: its GPUs for tensorrt, else its cores."""
    if node is None:
        return this_host()
    try:
        return this_gpu_node(node.gpus)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read this node's GPU facts for its fingerprint ({exc}); "
                         f"check that nvidia-smi works here") from None


#: ``cptune.search.ORDERS``, spelled here so that the parser does not import Optuna.
SEARCH_ORDERS = ("guided", "exhaustive")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="cptune",
        description="Measure context-parallel attention strategies on this machine and pick one.",
    )
    parser.add_argument("--version", action="version", version=f"cptune {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    db_help = "database: a file path or SQLAlchemy URL (default: $CPTUNE_DB or ./cptune.db)"
    oversubscribe_help = ("allow more ranks than this host's cores: such runs time ranks waiting for a "
                          "core, so they are stored marked oversubscribed and left out of the model and "
                          "the picks")
    max_ranks_help = "largest rank count (default: this host's cores; its GPUs with --backend tensorrt)"
    hardware_help = ("this host (default), a stored fingerprint, a shipped description (h100-sxm-8, "
                     "h200-sxm-8, a100-sxm-8, l40s-pcie-8, l20-pcie-8, h100-sxm-2x8-ib) or a TOML file")

    search = commands.add_parser(
        "search",
        help="search the CP configurations of a model on this hardware and store every result",
        description=(
            "For each sequence length of a search space, run Optuna trials over strategy, rank "
            "count and head group: every configuration is run on real ranks, checked against a "
            "float64 reference, timed, and stored. Then interleaved rounds visit each one again in "
            "a fresh random order, and a final race re-runs those tied with the fastest until it is "
            "separated or the budget is spent; the answer is a winner with its margin or a tie. "
            "What is stored counts: a rerun runs only what is missing. SPACE is a TOML file or a "
            f"built-in space name (default: {DEMO_SPACE}); or describe one model with the workload flags."
        ),
    )
    search.add_argument("space", nargs="?",
                        help=f"search space file or built-in name (default {DEMO_SPACE})")
    search.add_argument("--db", help=db_help)
    search.add_argument("--trials", type=_positive,
                        help="trial budget per sequence length (default: the space's)")
    search.add_argument("--timeout", type=_seconds,
                        help="time budget per sequence length (trials, rounds and race), in seconds")
    search.add_argument("--max-ranks", type=_positive, help=max_ranks_help)
    search.add_argument("--ranks", type=_positive_list,
                        help="rank counts to try, e.g. 1,2 (with workload flags)")
    _add_backend(search)
    search.add_argument("--remeasure", action="store_true",
                        help="visit every configuration afresh (exploration, rounds, race) even if stored; "
                             "the verdict combines the new visits with the stored ones")
    search.add_argument("--rounds", type=_positive,
                        help="clean visits every configuration that ran gets, in interleaved rounds "
                             "(default: the space's [measure] rounds, else 2); each visit times [measure] "
                             "repeats iterations")
    search.add_argument("--race-rounds", type=_non_negative,
                        help="further visits the configurations tied with the fastest may get in the final "
                             "race (default: the space's [measure] race_rounds, else 10; 0: no race)")
    search.add_argument("--confirm-rounds", type=_non_negative,
                        help="rounds a winner and the configurations close to it get again in a second "
                             "sitting, after the other sequence lengths, so the verdict covers two states "
                             "of the host (default: the space's [measure] confirm_rounds, else 3; 0: none)")
    search.add_argument("--no-calibrate", action="store_true",
                        help="skip the calibration a first search on new hardware runs (the cost "
                             "model needs one; cptune calibrate adds it later)")
    search.add_argument("--oversubscribe", action="store_true", help=oversubscribe_help)
    search.add_argument("--order", choices=SEARCH_ORDERS, default="exhaustive",
                        help="guided: the cost model orders the trials, best predicted first, and the search "
                             "stops when no configuration left is likely to beat the fastest measured one "
                             "(needs a calibration); exhaustive: every configuration (TPE within a --trials "
                             "budget below the space's size). Default: exhaustive")
    _add_shape(search, None)

    results = commands.add_parser("results", help="list stored measurements",
                                  description=(
                                      "List what the database holds, oldest first, with the interleaved "
                                      "round each run belongs to; excluded, oversubscribed and disturbed "
                                      "measurements are marked. --combined shows each configuration's "
                                      "clean rounds combined and each workload's verdict instead. "
                                      "--exclude, --include and --delete change the rows with the ids "
                                      "listed."))
    results.add_argument("--db", help=db_help)
    results.add_argument("--seq-len", type=_positive)
    results.add_argument("--heads", type=_positive)
    results.add_argument("--head-dim", type=_positive)
    results.add_argument("--strategy", choices=STRATEGIES)
    results.add_argument("--ranks", type=_positive)
    results.add_argument("--status", help="ok, or a failure kind (crash, timeout, error, ...)")
    results.add_argument("--combined", action="store_true",
                         help="per workload and configuration: every clean round combined (median visit, "
                              "95%% interval, rounds) and the workload's verdict, the fastest marked and the "
                              "configurations tied with it; excluded, oversubscribed and disturbed runs "
                              "left out. With --json or --csv: those estimates instead of the rows")
    fmt = results.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="a JSON list of objects")
    fmt.add_argument("--csv", action="store_true", help="CSV with a header row")
    fmt.add_argument("--exclude", type=_ids, metavar="ID[,ID...]",
                     help="keep these measurements but leave them out of the model and the picks")
    fmt.add_argument("--include", type=_ids, metavar="ID[,ID...]", help="take excluded measurements back")
    fmt.add_argument("--delete", type=_ids, metavar="ID[,ID...]", help="delete these measurements for good")

    run = commands.add_parser(
        "measure",
        help="measure every feasible configuration of one workload (nothing stored)",
        description=(
            "Run every feasible strategy / rank count / head group for one attention workload "
            "on real MPI ranks, check each output against a float64 reference, and print their "
            "latencies. With no flags: a small demo workload."
        ),
    )
    _add_shape(run, _MEASURE_DEFAULTS)
    run.add_argument("--max-ranks", type=_positive, default=None, help=max_ranks_help)
    run.add_argument("--warmup", type=_non_negative, default=2, help="untimed iterations (default 2)")
    run.add_argument("--repeats", type=_positive, default=10, help="timed iterations (default 10)")
    run.add_argument("--timeout", type=_seconds, default=None,
                     help="seconds before a configuration's run is stopped (default: scaled to its size)")
    run.add_argument("--json", action="store_true", help="print results as JSON instead of a table")
    _add_backend(run)

    calibrate = commands.add_parser(
        "calibrate",
        help="measure this host's collective latency/bandwidth and attention rate (about a minute)",
        description=(
            "For each rank count, time every collective the strategies use over a sweep of "
            "message sizes (fitted to latency + bytes / bandwidth) and the attention kernel on "
            "a few shapes; store the result for this hardware. The cost model's prior stands on it."
        ),
    )
    calibrate.add_argument("--db", help=db_help)
    calibrate.add_argument("--max-ranks", type=_positive, help=max_ranks_help)
    calibrate.add_argument("--repeats", type=_positive, default=REPEATS,
                           help=f"timed iterations per point in each round (default {REPEATS})")
    calibrate.add_argument("--rounds", type=_positive, default=ROUNDS,
                           help=f"rounds, each timing every point once; a point's time is the median "
                                f"of its rounds (default {ROUNDS})")
    calibrate.add_argument("--oversubscribe", action="store_true",
                           help="allow --max-ranks above this host's cores (those rates time the sharing)")
    _add_backend(calibrate)

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
    fit.add_argument("--db", help=db_help)
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
    rec.add_argument("--seq-len", type=_positive, required=True, help="tokens per sequence")
    rec.add_argument("--heads", type=_positive, required=True, help="query heads")
    rec.add_argument("--head-dim", type=_positive, required=True, help="head dimension")
    rec.add_argument("--kv-heads", type=_positive, help="KV heads (default: as many as --heads)")
    rec.add_argument("--batch", type=_positive, default=1, help="sequences per batch (default 1)")
    rec.add_argument("--dtype", choices=sorted(WIRE_DTYPES), default="bf16",
                     help="activation dtype (default bf16)")
    rec.add_argument("--causal", action="store_true", help="causal mask (LLM prefill)")
    rec.add_argument("--ranks", type=_positive,
                     help="exactly this many ranks (default: any up to the hardware's)")
    rec.add_argument("--hardware", help=hardware_help)
    rec.add_argument("--db", help=db_help)
    rec.add_argument("--json", action="store_true", help="print the recommendation as JSON")

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
    export.add_argument("-o", "--output", default="plan.json", help="plan file to write (default plan.json)")
    export.add_argument("--hardware", help=hardware_help)
    export.add_argument("--ranks", dest="plan_ranks", type=_positive,
                        help="exactly this many ranks (default: the fastest count up to the hardware's)")
    export.add_argument("--db", help=db_help)
    _add_shape(export, None)
    export.set_defaults(ranks=None)  # the search-space reader's rank list: not a flag of export

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
    report.add_argument("--db", help=db_help)
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
    layer = graph.add_argument_group("workload (one attention layer)")
    layer.add_argument("--seq-len", type=_positive, required=True, help="tokens per sequence")
    layer.add_argument("--heads", type=_positive, required=True, help="query heads")
    layer.add_argument("--kv-heads", type=_positive, default=None,
                       help="KV heads (default: as many as --heads)")
    layer.add_argument("--head-dim", type=_positive, required=True, help="head dimension")
    layer.add_argument("--batch", type=_positive, default=1, help="sequences per batch (default 1)")
    layer.add_argument("--dtype", choices=sorted(WIRE_DTYPES), default="bf16",
                       help="activation dtype (default bf16)")
    layer.add_argument("--causal", action="store_true", help="causal mask (LLM prefill)")
    graph.add_argument("--strategy", choices=STRATEGIES, required=True, help="context strategy")
    graph.add_argument("--ranks", type=_positive, required=True, help="ranks (one graph each)")
    graph.add_argument("--head-group", type=_positive, default=None,
                       help="Ulysses degree u (default: all ranks for ulysses, else 1)")
    graph.add_argument("-o", "--output-dir", required=True, help="directory to write the graphs into")
    for command_parser in commands.choices.values():  # flags it does not know are its error
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def _workload(args: argparse.Namespace, seq_len: int) -> Workload:
    try:
        return Workload(seq_len=seq_len, heads=args.heads, head_dim=args.head_dim, kv_heads=args.kv_heads,
                        batch=args.batch, dtype=args.dtype, causal=args.causal)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# --------------------------------------------------------------------------- measure


def _measurements_table(
    workload: Workload, results: list[Measurement], failures: list[tuple[CPConfig, EngineError]]
) -> Table:
    disturbed = "; * = disturbed by other load (why: below)" if any(m.disturbed for m in results) else ""
    table = _table(f"{workload.describe()} - fastest first",
                   "ms per iteration, slowest rank; spread = p90 - p10; peak = MiB per rank; "
                   f"ulysses2xring2 = 2-way Ulysses x 2-way Ring{disturbed}")
    for column in ("config", "ranks", "median", "spread", "compute", "comm", "peak", "error"):
        table.add_column(column, justify="left" if column == "config" else "right", no_wrap=True)
    for m in sorted(results, key=lambda m: m.median_ms):
        table.add_row(
            m.config.label, str(m.config.ranks), f"{m.median_ms:.1f}{'*' if m.disturbed else ''}",
            f"{m.spread_ms:.1f}", f"{m.compute_ms:.1f}", f"{m.comm_ms:.1f}",
            f"{m.peak_bytes / 2**20:.0f}", f"{m.max_error:.0e}",
        )
    for config, error in failures:
        table.add_row(config.label, str(config.ranks), f"[red]failed: {error.kind}[/]", "", "", "", "", "")
    return table


def _table(title: str, caption: str) -> Table:
    # collapse_padding: fits 80 columns, so CI logs and narrow terminals show every figure;
    # title and caption as Text: they carry names from users' files, never markup
    return Table(title=Text(title, style="table.title"), caption=Text(caption, style="table.caption"),
                 box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)


def cmd_measure(args: argparse.Namespace, console: Console) -> int:
    guard_enabled()  # a bad CPTUNE_GUARD is refused before anything runs
    workload = _workload(args, args.seq_len)
    node = _gpu_node(args.backend, args.max_ranks)
    max_ranks = args.max_ranks or _capacity(node)
    configs = enumerate_configs(workload, max_ranks, args.strategies or STRATEGIES)
    results: list[Measurement] = []
    failures: list[tuple[CPConfig, EngineError]] = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True, disable=args.json)
    with progress:
        task = progress.add_task("measuring", total=len(configs))
        for config in configs:
            progress.update(task, description=f"measuring {config.describe()}")
            try:
                results.append(measure(workload, config, backend=args.backend, warmup=args.warmup,
                                       repeats=args.repeats, timeout=args.timeout))
            except EngineError as error:
                failures.append((config, error))
            progress.advance(task)
    if args.json:
        print(json.dumps({
            "results": [m.to_dict() for m in results],
            "failures": [{"config": c.to_dict(), "kind": e.kind, "error": str(e)} for c, e in failures],
        }, indent=2))
    else:
        console.print(_measurements_table(workload, results, failures))
    for m in results:
        if m.disturbed:
            _warn((f"{m.config.describe()} disturbed:", "yellow"),
                  f" {m.disturbed}, so its timing is not clean; measure again when the host is quiet")
    for config, failure in failures:
        _warn((f"{config.describe()} failed ({failure.kind}):", "red"), f" {failure}")
    return USAGE_ERROR if failures else 0


# --------------------------------------------------------------------------- search


def _space_from_flags(args: argparse.Namespace) -> SearchSpace:
    missing = [flag for flag, value in (("--heads", args.heads), ("--head-dim", args.head_dim),
                                        ("--seq-lens", args.seq_lens)) if value is None]
    if missing:
        raise UsageError(f"a workload given by flags needs {', '.join(missing)} "
                         f"(or name a search space file instead)")
    for seq_len in args.seq_lens:
        _workload(args, seq_len)  # refuses a bad shape in the user's terms
    return SearchSpace(
        name="flags", description="workload from command-line flags", source=None,
        shape=_workload(args, args.seq_lens[0]).shape, seq_lens=tuple(dict.fromkeys(args.seq_lens)),
        ranks=args.ranks,
        strategies=args.strategies or STRATEGIES, trials=None, measure=MeasureSettings(),
    )


def _load_search_space(args: argparse.Namespace) -> tuple[SearchSpace, str]:
    flags_given = any(v is not None for v in (args.heads, args.head_dim, args.seq_lens, args.kv_heads,
                                              args.strategies, args.ranks)) or args.causal
    if args.space and flags_given:
        raise UsageError("give either a search space or workload flags (--heads, --seq-lens, ...), not both")
    if flags_given:
        return _space_from_flags(args), "command-line flags"
    path = resolve_space(args.space or DEMO_SPACE)
    return load_space(path), str(path)


def _best_table(space: SearchSpace, verdicts: dict[int, Verdict | None], finished: set[int]) -> Table:
    """Each sequence length's fastest configuration so far, with its interval and standing."""
    table = _table(f"{space.name}: fastest configuration so far",
                   "ms per iteration of the slowest rank, combined over its clean visits, 95% interval; "
                   "tied: within the noise of this hardware")
    for column in ("seq_len", "config", "ranks", "ms", "95% interval", "visits", "verdict"):
        table.add_column(column, justify="left" if column in ("config", "verdict") else "right", no_wrap=True)
    for seq_len, verdict in verdicts.items():
        if verdict is None:
            table.add_row(str(seq_len), "-", "-", "-", "-", "-", "-")
            continue
        lead, done = verdict.leader, seq_len in finished
        if verdict.tied:
            standing = f"tied with {len(verdict.tied)}"
        elif not verdict.comparisons:
            standing = "only one" if done else "only one so far"
        else:
            standing = "winner" if done else "leads"
        table.add_row(str(seq_len), lead.config.label, str(lead.config.ranks), format_ms(lead.median_ms),
                      f"{format_ms(lead.low_ms)}-{format_ms(lead.high_ms)}", str(lead.rounds), standing)
    return table


#: How the progress bar names each phase of a search (``cptune.search.PHASES``).
_PHASE_WORDS = {"explore": "exploring", "round": "rounds", "race": "final race", "confirm": "second sitting"}


def _verdict_line(seq_len: int, search: WorkloadSearch, second: bool, unconfirmed: bool) -> str | None:
    """What one sitting of a workload's search found, in words, and whether its winner is
    still ``unconfirmed`` (``WorkloadSearch.unconfirmed``); None when nothing ran clean."""
    verdict = search.verdict
    if verdict is None:
        return None
    line = f"seq {seq_len}" + (" after a second sitting" if second else "") + f": {verdict.describe()}"
    if unconfirmed:
        line += ("; not confirmed yet (the time budget or the runs ran out, or the leader changed): a "
                 "rerun of this search adds a sitting" if second
                 else "; a second sitting after the other lengths confirms it")
    if oversubscribed(verdict.leader.config.ranks):
        line += ("; it ran more ranks than cores (--oversubscribe), so the model and the picks leave it "
                 "out")
    return line


def cmd_search(args: argparse.Namespace, console: Console) -> int:
    from cptune.search import WorkloadSearch
    from cptune.store import Store, display_url

    guard_enabled()  # a bad CPTUNE_GUARD is refused before anything runs, not at the first run
    if not get_engine(args.backend).timed:
        raise untimed(args.backend)
    space, where = _load_search_space(args)
    rounds = args.rounds or space.measure.rounds
    race_rounds = space.measure.race_rounds if args.race_rounds is None else args.race_rounds
    confirm_rounds = space.measure.confirm_rounds if args.confirm_rounds is None else args.confirm_rounds
    node = _gpu_node(args.backend, args.max_ranks)
    cores = _capacity(node)  # one rank per core, or per GPU with --backend tensorrt
    available = args.max_ranks or cores
    counts = tuple(n for n in space.rank_counts(available) if args.max_ranks is None or n <= args.max_ranks)
    if not counts:
        raise UsageError(f"--max-ranks {args.max_ranks} leaves none of the space's rank counts")
    over = ", ".join(str(n) for n in counts if n > cores)
    if over and node is None:  # tensorrt: the preflight below refuses more ranks than GPUs
        _refuse_oversubscription(f"ranks {over} of {where}", cores, args.oversubscribe)
    space = dataclasses.replace(space, ranks=counts)
    check_runnable(space, available, where)
    if node is not None:
        from cptune.engines.tensorrt import preflight

        preflight(max(counts), node)
    hardware = _this_hardware(node)
    with Store(args.db) as store:
        store.require_writable()
        _say(console, "searching ", (space.name, "bold"), f" ({where}) on {hardware.describe()} ",
             (hardware.fingerprint, "dim"), f" in {rounds} round(s), up to {race_rounds} more in the final "
             f"race, {confirm_rounds} in a second sitting for each winner; results in {store.url}, "
             f"{args.order} order")
        studies = store.optuna_storage()
        if not args.no_calibrate and store.calibration(hardware.fingerprint) is None:
            calibrated = min(max(counts), cores)  # oversubscribed rank counts would time the sharing
            _say(console, f"this hardware has no calibration yet: calibrating 1..{calibrated} ranks first "
                          f"(the cost model's prior needs it; --no-calibrate skips)")
            _calibrate(store, hardware, calibrated, REPEATS, ROUNDS, console, args.backend)
        verdicts: dict[int, Verdict | None] = dict.fromkeys(space.seq_lens)
        finished: set[int] = set()
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console)
        visits = failed = disturbed = 0
        measured: set[tuple[int, CPConfig]] = set()

        with Live(Group(progress, _best_table(space, verdicts, finished)), console=console,
                  refresh_per_second=4) as live:

            def sitting(search: WorkloadSearch, second: bool) -> bool:
                """Run one sitting of ``search`` (``run``, or ``confirm`` when ``second``) with a
                progress bar of its own, say what it found, and return whether its winner is
                still unconfirmed."""
                seq_len = search.workload.seq_len
                name = f"seq {seq_len}" + (" (second sitting)" if second else "")
                seen = 0  # visits (reused ones too), for the bar
                task = progress.add_task(name, total=None)

                def on_visit(visit: Visit) -> None:
                    nonlocal visits, failed, disturbed, seen
                    _ctrl_c.raise_if_pressed()
                    if not visit.reused:
                        visits += 1
                        failed += visit.status != "ok"
                        disturbed += visit.disturbed is not None
                    seen += 1
                    progress.update(task, description=f"seq {seq_len} {_PHASE_WORDS[visit.phase]}",
                                    completed=seen, total=seen + visit.left)
                    verdicts[seq_len] = search.verdict
                    live.update(Group(progress, _best_table(space, verdicts, finished)))

                search.on_visit = on_visit
                ran = search.confirm() if second else search.run()
                measured.update((seq_len, v.config) for v in ran if not v.reused)
                progress.update(task, description=name, total=seen, completed=seen)
                verdicts[seq_len] = search.verdict
                if not second and search.unguided is not None:
                    _say(console, f"seq {seq_len}: not guided, every configuration instead: "
                                  f"{search.unguided}")
                if not second and search.early_stop is not None:
                    _say(console, f"seq {seq_len}: {search.early_stop.describe()}")
                unconfirmed = bool(search.unconfirmed())
                if line := _verdict_line(seq_len, search, second, unconfirmed):
                    _say(console, line)
                if here := sum(v.disturbed is not None for v in ran):
                    _say(console, f"seq {seq_len}: {here} visit(s) disturbed by other load: stored marked, "
                                  f"not counted, visited again")
                if search.never_clean:
                    names = ", ".join(c.describe() for c in search.never_clean)
                    them = "it" if len(search.never_clean) == 1 else "them"
                    _say(console, f"seq {seq_len}: {names} never ran clean in {search.max_attempts} visits "
                                  f"(other load each time), so the verdict leaves {them} out; rerun when the "
                                  f"host is quiet")
                return unconfirmed

            pending = []  # searches whose winner a second sitting confirms
            for workload in space.workloads():
                configs = [c for c in enumerate_configs(workload, max(counts), space.strategies)
                           if c.ranks in counts]
                search = WorkloadSearch(
                    workload, configs, store, hardware, warmup=space.measure.warmup,
                    repeats=space.measure.repeats, run_timeout=space.measure.timeout,
                    trials=args.trials or space.trials, time_budget=args.timeout, remeasure=args.remeasure,
                    backend=args.backend, order=args.order, study_storage=studies, rounds=rounds,
                    race_rounds=race_rounds, confirm_rounds=confirm_rounds,
                )
                verdicts[workload.seq_len] = search.current_verdict()
                if sitting(search, second=False):
                    pending.append(search)
                else:
                    finished.add(workload.seq_len)
                live.update(Group(progress, _best_table(space, verdicts, finished)))
            for search in pending:
                sitting(search, second=True)
                finished.add(search.workload.seq_len)
                live.update(Group(progress, _best_table(space, verdicts, finished)))
        if not console.is_terminal:
            console.line()  # Rich ends the last frame with a newline only on a terminal
    where_db = f" --db {display_url(args.db)}" if args.db else ""
    _say(console, f"{len(measured)} configuration(s) measured now in {visits} visit(s) ({failed} failed, "
                  f"stored with their reason; {disturbed} disturbed by other load, stored marked and visited "
                  f"again); see them with: cptune results{where_db}")
    _say(console, f"each workload's runs are also an Optuna study there: optuna-dashboard {store.url}")
    return 0


def _refuse_oversubscription(asked: str, cores: int, allowed: bool) -> None:
    """A ``UsageError`` for rank counts (``asked``, in words) above this host's ``cores``,
    unless ``allowed``."""
    if not allowed:
        raise UsageError(
            f"{asked}: more ranks than this host's {cores} cores, and ranks sharing a core time the "
            f"sharing, not the strategy. Use at most {cores} ranks, or add --oversubscribe to run them "
            f"anyway (stored marked oversubscribed, left out of the model and the picks)"
        )


# --------------------------------------------------------------------------- results


def cmd_results(args: argparse.Namespace, console: Console) -> int:
    from cptune.store import RESULT_COLUMNS, Store, display_url

    workload_filters = {"seq_len": args.seq_len, "heads": args.heads, "head_dim": args.head_dim}
    row_filters = {"strategy": args.strategy, "ranks": args.ranks, "status": args.status}
    changes = args.exclude or args.include or args.delete
    if args.combined and changes:
        raise UsageError("--combined lists estimates and changes nothing; run --exclude, --include or "
                         "--delete without it")
    if args.combined and args.status not in (None, "ok"):
        raise UsageError(f"--combined combines successful runs only, so --status {args.status} selects "
                         f"nothing there; drop --status, or list the rows without --combined")
    with Store(args.db, create=False) as store:
        if changes:
            store.require_writable()
        if args.exclude or args.include:
            return _set_excluded(store, args.exclude or args.include, args.exclude is not None, console)
        if args.delete:
            gone = store.delete(args.delete)
            _say(console, f"deleted {len(gone)} measurement(s) from {display_url(store.url)}:")
            for r in gone:
                _say(console, f"  {r.id}: {r.config.describe()}, {r.workload.describe()}, {r.status}, "
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
        writer.writerows(r.to_dict() for r in rows)
        return 0
    table = _table(f"{len(rows)} stored result(s)",
                   "median ms per iteration of the slowest rank; round: the interleaved rounds of each "
                   "workload numbered in the order they ran (--json gives their ids)")
    for column in ("id", "seq_len", "heads", "config", "ranks", "round", "status", "median ms", "hardware"):
        table.add_column(column, justify="left" if column in ("config", "status", "hardware") else "right",
                         no_wrap=column != "hardware")
    for r in rows:
        median = f"{r.median_ms:.2f}" if r.median_ms is not None else "-"
        heads = f"{r.workload.heads}/{r.workload.kv_heads}"
        status = Text(r.status, style="" if r.status == "ok" else "red")
        for mark, marked in (("oversub.", r.oversubscribed), ("excluded", r.excluded),
                             ("disturbed", bool(r.disturbed))):
            if marked:
                status.append(f", {mark}", style="yellow")
        table.add_row(str(r.id), str(r.workload.seq_len), heads, r.config.label, str(r.config.ranks),
                      str(numbers.get(r.id, "-")), status, median, Text(r.hardware))
    console.print(table)
    if marked := sum(r.oversubscribed or r.excluded or bool(r.disturbed) for r in rows):
        _say(console, f"{marked} marked: oversub. = oversubscribed, run on more ranks than the host's cores; "
                      f"excluded = set aside with --exclude (--include ID takes it back); disturbed = the "
                      f"contention guard saw other load while it ran (--json says what). All are kept but "
                      f"left out of the model and the picks")
    if any(r.clean and not r.oversubscribed for r in rows):
        _say(console, "each configuration's rounds combined, with its 95% interval, and each workload's "
                      "verdict: cptune results --combined")
    return 0


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
    "hardware", "seq_len", "heads", "head_dim", "kv_heads", "batch", "dtype", "causal", "strategy", "ranks",
    "head_group", "label", "median_ms", "low_ms", "high_ms", "rounds", "interval_from", "role",
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
                writer.writerow({"hardware": hardware, **workload.to_dict(), **_estimate_record(e, verdict),
                                 "measurement_ids": ";".join(map(str, e.ids)), "verdict": verdict.describe()})
        return 0
    for i, (hardware, workload, verdict, estimates) in enumerate(judged, 1):
        console.print(_combined_table(hardware, workload, verdict, estimates, explained=i == len(judged)))
        _say(console, ("verdict: ", "bold"), verdict.describe())
        console.print()
    if not judged:
        _say(console, "no clean successful measurement matches: nothing to combine (cptune results lists "
                      "every row)")
    left_out = {"disturbed": sum(r.status == "ok" and bool(r.disturbed) for r in rows),
                "excluded": sum(r.status == "ok" and r.excluded for r in rows),
                "oversubscribed": sum(r.status == "ok" and r.oversubscribed for r in rows)}
    if any(left_out.values()):
        listed = ", ".join(f"{n} {why}" for why, n in left_out.items() if n)
        _say(console, f"left out: {listed} run(s), kept but counting for nothing (cptune results lists them)")
    return 0


def _combined_table(
    hardware: str, workload: Workload, verdict: Verdict, estimates: list[Estimate], explained: bool
) -> Table:
    """One workload's estimates, fastest first; ``explained``: with the caption saying what
    the columns mean (the last table only, so a long listing says it once)."""
    table = _table(f"{workload.describe()} [{hardware[:8]}]",
                   "ms per attention call, slowest rank: the median of the clean rounds; interval: "
                   "its 95% interval (* from one round's iterations: understates drift); xN: on N ranks; vs "
                   "fastest %: how much longer than the fastest [95% interval], paired by round where they "
                   "share 3 or more" if explained else "")
    for column in ("config", "ms", "interval", "rounds", "vs fastest %", ""):
        table.add_column(column, justify="left" if column in ("config", "") else "right", no_wrap=True)
    for e in estimates:
        role, comparison = _standing(e, verdict)
        star = "*" if e.noise.source == "iterations" else ""
        versus = "" if comparison is None else (
            f"{_change(comparison.ratio)} [{_change(comparison.low)}, {_change(comparison.high)}]")
        name = e.config.label if e.config.ranks == 1 else f"{e.config.label} x{e.config.ranks}"
        table.add_row(name, format_ms(e.median_ms), f"{format_ms(e.low_ms)}-{format_ms(e.high_ms)}{star}",
                      str(e.rounds), versus, Text("" if role == "slower" else role, style="bold"))
    return table


def _change(ratio: float) -> str:
    """A ratio to the fastest as a change in percent: 1.034 -> "+3.4", 1.2345 -> "+23"."""
    percent = (ratio - 1) * 100
    return f"{percent:+.1f}" if abs(percent) < 9.95 else f"{percent:+.0f}"


def _set_excluded(store: Store, ids: tuple[int, ...], excluded: bool, console: Console) -> int:
    changed = store.set_excluded(ids, excluded)
    unchanged = sorted(set(ids) - set(changed))
    done = "excluded" if excluded else "included again"
    listed = f": {', '.join(map(str, changed))}" if changed else ""
    _say(console, f"{done} {len(changed)} measurement(s){listed}")
    if unchanged:
        _say(console, f"already {'excluded' if excluded else 'included'}: {', '.join(map(str, unchanged))}")
    if excluded and changed:
        _say(console, f"they stay stored but the model, the picks and a search's resume ignore them; "
                      f"cptune results --include {','.join(map(str, changed))} takes them back")
    return 0


# --------------------------------------------------------------------------- calibrate


def _calibration_tables(calibration: Calibration) -> list[Table]:
    comms = _table("collectives: time = latency + bytes sent per rank / bandwidth",
                   "bus bw: nccl-tests' bus bandwidth at the largest message (bytes sent per rank / s); "
                   "the mpi engine's all-to-all and all-gather are timed with their copies")
    for column in ("collective", "ranks", "group", "latency us", "fit GB/s", "bus bw GB/s"):
        comms.add_column(column, justify="left" if column == "collective" else "right", no_wrap=True)
    for f in calibration.collectives:
        comms.add_row(f.kind, str(f.ranks), str(f.group), f"{f.latency_s * 1e6:.1f}",
                      f"{f.bandwidth / 1e9:.2f}", f"{f.bus_bandwidth / 1e9:.2f}")
    compute = _table("attention compute rate", "every rank computing at once on its share of the cores")
    for column in ("ranks", "head_dim", "mask", "GFLOP per call", "GFLOP/s per rank", "GFLOP/s total"):
        compute.add_column(column, justify="left" if column == "mask" else "right", no_wrap=True)
    for r in calibration.compute:
        mask = "causal" if r.causal else "full"
        compute.add_row(str(r.ranks), str(r.head_dim), mask, f"{r.flops / 1e9:.2f}",
                        f"{r.flops_per_s / 1e9:.1f}", f"{r.flops_per_s * r.ranks / 1e9:.1f}")
    if not calibration.steps:
        return [comms, compute]
    steps = _table("the kernel's memory-bound steps (the work each Ring step repeats)",
                   "query: a query block made scaled float32; merge: a block's output merged into the "
                   "running one; every rank at once")
    for column in ("step", "wire dtype", "ranks", "ns per element"):
        justify = "left" if column in ("step", "wire dtype") else "right"
        steps.add_column(column, justify=justify, no_wrap=True)
    for step in calibration.steps:
        steps.add_row(step.kind, step.wire, str(step.ranks), f"{step.seconds_per_element * 1e9:.3f}")
    return [comms, compute, steps]


def _calibrate(
    store: Store, hardware: Hardware, max_ranks: int, repeats: int, rounds: int, console: Console,
    backend: str,
) -> Calibration:
    with console.status("calibrating") as status:

        def show(step: str) -> None:
            status.update(f"calibrating: {step}")
            if RETIMED in step:  # a step timed again: say so beyond the spinner
                console.print(step, style="yellow", markup=False, highlight=False)

        calibration = calibrate(max_ranks, backend=backend, repeats=repeats, progress=show, rounds=rounds)
    store.add_calibration(hardware, calibration)
    return calibration


def cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    from cptune.store import Store

    node = _gpu_node(args.backend, args.max_ranks)
    cores = _capacity(node)
    max_ranks = args.max_ranks or cores
    if max_ranks > cores and node is None:  # tensorrt: the preflight refused more ranks than GPUs
        _refuse_oversubscription(f"--max-ranks {max_ranks}", cores, args.oversubscribe)
    with Store(args.db) as store:
        store.require_writable()
        hardware = _this_hardware(node)
        _say(console, f"calibrating {hardware.describe()} ", (hardware.fingerprint, "dim"),
             f" on 1..{max_ranks} ranks; results in {store.url}")
        calibration = _calibrate(store, hardware, max_ranks, args.repeats, args.rounds, console, args.backend)
    for table in _calibration_tables(calibration):
        console.print(table)
    return 0


# --------------------------------------------------------------------------- fit


def _score_cells(score: GroupScore) -> list[str]:
    """top-1, regret and worst, both again with ties as ties, Spearman, MAPE and coverage of
    one score; "-" where it does not apply."""
    def shown(value: float, form: str) -> str:
        return "-" if math.isnan(value) else format(value, form)

    return [f"{score.top1:.2f}", f"{score.regret:.3f}", f"{score.worst_regret:.3f}",
            f"{score.tie_regret:.3f}", f"{score.worst_tie_regret:.3f}",
            shown(score.spearman, ".2f"), shown(score.mape, ".1f"), shown(score.coverage * 100, ".0f")]


_SCORE_COLUMNS = ("top-1", "regret", "worst", "regret*", "worst*", "rho", "MAPE%", "cover%")


def cmd_fit(args: argparse.Namespace, console: Console) -> int:
    from cptune.model import CostModel, compare, fit_advised, load_training

    data = load_training(args.db, args.include_oversubscribed)
    tied = data.tied_with_leader()
    if uncalibrated := ", ".join(sorted(data.uncalibrated)):
        _warn(("left out", "yellow"), f": measurements of {uncalibrated}, which have no calibration "
                                      f"(run cptune calibrate there)")
    groupings = ["seq_len"] + (["hardware"] if len(data.profiles) > 1 else [])
    band = CostModel().interval
    for by in groupings:
        held_out = by.replace("_", " ")
        evaluations = compare(data.cases, data.latencies_s, by, tied=tied)
        advised = evaluations[2]
        summary = _table(f"cost model against baselines, holding out each {held_out} in turn",
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
        table = _table(f"recommend's pick, holding out each {held_out} in turn",
                       f"over held-out groups: median regret {advised.median_regret:.3f}, worst "
                       f"{advised.worst_regret:.3f}; ties as ties: median {advised.median_tie_regret:.3f}, "
                       f"worst {advised.worst_tie_regret:.3f}")
        for column in ("held out", "workloads", "configs", *_SCORE_COLUMNS[:5]):
            table.add_column(column, justify="left" if column == "held out" else "right", no_wrap=True)
        for g in advised.groups:
            table.add_row(g.held_out, str(g.decisions), str(g.samples), *_score_cells(g)[:5])
        console.print(table)
    _, verdict = fit_advised(data.cases, data.latencies_s, tied)
    use = "applies the learned correction" if verdict.applied else "uses the prior alone"
    console.print(f"recommend {use} on this database: {verdict.reason}", markup=False, highlight=False,
                  soft_wrap=True)
    return 0


# --------------------------------------------------------------------------- recommend


def cmd_recommend(args: argparse.Namespace, console: Console) -> int:
    from cptune.model import recommend

    workload = _workload(args, args.seq_len)
    pick = recommend(workload, ranks=args.ranks, hardware=args.hardware, db=args.db)
    if args.json:
        print(json.dumps(pick.to_dict(), indent=2))
        return 0
    table = _table(f"{workload.describe()}\non {pick.hardware}",
                   "ms per attention call, slowest rank; measured: every clean visit combined, interval "
                   "95%; predicted: the model's 10-90% band, or what the figures' ranges allow for a "
                   "description's prior")
    for column in ("#", "config", "ranks", "latency ms", "interval", "source"):
        table.add_column(column, justify="left" if column in ("config", "source") else "right", no_wrap=True)
    for i, c in enumerate(pick.candidates, start=1):
        style = "bold green" if i == 1 else ""
        table.add_row(str(i), c.config.label, str(c.config.ranks), format_ms(c.latency_ms),
                      f"{format_ms(c.low_ms)}-{format_ms(c.high_ms)}", c.source, style=style)
    console.print(table)
    _say(console, ("pick:", "bold"),
         f" {pick.config.describe()}, {format_ms(pick.latency_ms)} ms ({pick.source})")
    if pick.verdict is not None:
        _say(console, ("measured verdict:", "yellow" if pick.tied else "bold"), f" {pick.describe()}")
    for tie in pick.ties:
        _say(console, ("tied within what the description's figures allow:", "yellow"),
             f" {tie.other.label} on {tie.other.ranks} may be faster; "
             f"{tie.figure} at its {tie.end} end decides")
    sources = {c.source for c in pick.candidates}
    correction = None
    if "model" in sources:
        correction = f"learned correction applied: {pick.correction.reason}"
    elif "prior" in sources and not pick.correction.applied:
        correction = f"learned correction not applied, predictions are the prior's: {pick.correction.reason}"
    elif "prior" in sources:
        correction = "predictions are the prior's: the learned correction is fitted on other hardware"
    if correction:
        _say(console, (correction, "dim"))
    for config, reasons in pick.infeasible.items():
        _say(console, (f"cannot run {config.label} on {config.ranks}: {'; '.join(reasons)}", "dim"))
    return 0


# --------------------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace, console: Console) -> int:
    from cptune.plans.export import export_plan

    space, _ = _load_search_space(args)
    plan = export_plan(space.workloads(), ranks=args.plan_ranks, hardware=args.hardware, db=args.db,
                       strategies=space.strategies)
    path = plan.write(args.output)
    table = _table(f"plan for {plan.shape.describe()}\non {plan.hardware.description}",
                   "ms per attention call, slowest rank: the pick's stored measurements combined, "
                   "or predicted (model/prior); the plan lists every measurement compared")
    for column in ("seq_len range", "tuned at", "config", "ranks", "ms", "source", "measurement"):
        table.add_column(column, justify="left" if column in ("config", "source") else "right", no_wrap=True)
    for b in plan.buckets:
        pick_id = str(b.measurement_ids[0]) if b.measurement_ids else "-"
        table.add_row(f"{b.min_seq_len}-{b.max_seq_len}", str(b.seq_len), b.config.label, str(b.config.ranks),
                      format_ms(b.latency_ms), b.source, pick_id)
    console.print(table)
    for b in plan.buckets:
        if b.tied:
            names = ", ".join(c.describe() for c in b.tied)
            _say(console, (f"{b.min_seq_len}-{b.max_seq_len}:", "yellow"),
                 f" {b.config.describe()} is tied with {names}; the plan lists them (tied), any may run")
    _say(console, f"launch {plan.launch.ranks} rank(s): {' '.join(plan.launch.mpiexec)} <your program>  "
                  f"(Slurm: {' '.join(plan.launch.srun)} <your program>)")
    _say(console, f"wrote {path}; a deployment reads it with cptune.load_plan({str(path)!r})")
    return 0


# --------------------------------------------------------------------------- report


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    from cptune.report import gather, text_tables, write_report

    with console.status("reading the database and predicting the strategy map"):
        data = gather(args.db, args.hardware)
    if args.text:
        for table in text_tables(data):
            console.print(table)
        return 0
    with console.status("drawing"):
        try:
            written = write_report(data, Path(args.output_dir))
        except OSError as exc:
            raise UsageError(f"cannot write the report to {args.output_dir}: {exc.strerror or exc}") from None
    _say(console, f"wrote {len(written) - 1} figure(s) and {written[-1]}: open it in a browser")
    return 0


# --------------------------------------------------------------------------- export-graph


def cmd_export_graph(args: argparse.Namespace, console: Console) -> int:
    from cptune.engines.onnx import export_graphs

    workload = _workload(args, args.seq_len)
    try:
        config = CPConfig(args.strategy, args.ranks, args.head_group)
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
    table = _table(f"{config.describe()} for {workload.describe()}",
                   "one ONNX graph per rank; tokens = the positions each rank holds, as [start, stop) runs")
    for column in ("rank", "file", "nodes", "tokens", "sha256"):
        table.add_column(column, justify="right" if column in ("rank", "nodes") else "left", no_wrap=True)
    for r in manifest["ranks"]:
        tokens = " ".join(f"{a}-{b}" for a, b in r["tokens"])
        table.add_row(str(r["rank"]), r["file"], str(r["nodes"]), tokens, r["sha256"][:12])
    console.print(table)
    console.print(f"wrote {len(manifest['ranks'])} graph(s) and {manifest_path}",
                  highlight=False, soft_wrap=True)
    return 0


COMMANDS = {"search": cmd_search, "results": cmd_results, "measure": cmd_measure,
            "calibrate": cmd_calibrate, "fit": cmd_fit, "recommend": cmd_recommend, "export": cmd_export,
            "report": cmd_report, "export-graph": cmd_export_graph}


class _CtrlC:
    """Ctrl-C, remembered. Python drops a KeyboardInterrupt raised while a finalizer runs
    (a ``__del__`` or weakref callback; SQLAlchemy's and sqlite3's connections have them),
    prints it as a traceback and goes on as if no key was pressed. Remembered, the press is
    raised again at the search's next visit and, at the latest, makes the command's return
    the interrupted exit; the dropped one is not printed."""

    def __init__(self) -> None:
        self.pressed = False

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.pressed = True
        raise KeyboardInterrupt

    def install(self) -> Callable[[], None]:
        """Take over SIGINT unless it is ignored (a job started in the background keeps it
        ignored); returns what puts the previous handlers back."""
        self.pressed = False
        previous_sigint, previous_unraisable = signal.getsignal(signal.SIGINT), sys.unraisablehook
        if previous_sigint is not signal.default_int_handler:
            return lambda: None

        def on_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
            if not isinstance(unraisable.exc_value, KeyboardInterrupt):
                previous_unraisable(unraisable)

        def restore() -> None:
            signal.signal(signal.SIGINT, previous_sigint)
            sys.unraisablehook = previous_unraisable

        signal.signal(signal.SIGINT, self._on_sigint)
        sys.unraisablehook = on_unraisable
        return restore

    def raise_if_pressed(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt


_ctrl_c = _CtrlC()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    machine_output = getattr(args, "json", False) or getattr(args, "csv", False)
    console = Console(stderr=machine_output)  # normal output; stdout unless it carries JSON/CSV
    restore_sigint = _ctrl_c.install()
    try:
        code = COMMANDS[args.command](args, console)
        _ctrl_c.raise_if_pressed()
        return code
    except CPTuneError as error:
        _warn(("cptune: error:", "red"), f" {error}")
        return USAGE_ERROR
    except KeyboardInterrupt:
        _warn(("interrupted", "yellow"), ": every finished measurement is stored; rerun to resume")
        return 130
    except BrokenPipeError:
        # the reader left (cptune results --csv | head -1): nothing more to say, and the
        # interpreter's last flush must not fail on the closed pipe either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        restore_sigint()


if __name__ == "__main__":
    sys.exit(main())
