"""The ``cptune`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cptune import __version__
from cptune.config import STRATEGIES, CPConfig
from cptune.errors import CPTuneError, EngineError
from cptune.execute import measure
from cptune.feasibility import enumerate_configs
from cptune.measurement import Measurement, available_cores
from cptune.workload import WIRE_DTYPES, Workload

USAGE_ERROR = 2


class UsageError(Exception):
    """Bad input from the user: reported in one line, exit code 2."""


def _strategies(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown strategy {', '.join(unknown) or '(none)'}; choose from {', '.join(STRATEGIES)}"
        )
    return names


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    return 0 if text.strip() == "0" else _positive(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cptune",
        description="Measure context-parallel attention strategies on this machine and pick one.",
    )
    parser.add_argument("--version", action="version", version=f"cptune {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "measure",
        help="measure every feasible configuration of one workload on real ranks",
        description=(
            "Run every feasible strategy / rank count / head group for one attention workload "
            "on real MPI ranks, check each output against a float64 reference, and print their "
            "latencies. With no flags: a small demo workload."
        ),
    )
    shape = run.add_argument_group("workload (one attention layer)")
    shape.add_argument("--seq-len", type=_positive, default=4096, help="tokens per sequence (default 4096)")
    shape.add_argument("--heads", type=_positive, default=8, help="query heads (default 8)")
    shape.add_argument("--kv-heads", type=_positive, default=None,
                       help="KV heads (default: as many as --heads)")
    shape.add_argument("--head-dim", type=_positive, default=64, help="head dimension (default 64)")
    shape.add_argument("--batch", type=_positive, default=1, help="sequences per batch (default 1)")
    shape.add_argument("--dtype", choices=sorted(WIRE_DTYPES), default="bf16",
                       help="activation dtype (default bf16)")
    shape.add_argument("--causal", action="store_true", help="causal mask (LLM prefill)")
    sweep = run.add_argument_group("what to run")
    sweep.add_argument("--max-ranks", type=_positive, default=None,
                       help="largest rank count (default: this host's cores)")
    sweep.add_argument("--strategies", type=_strategies, default=STRATEGIES,
                       help=f"comma-separated subset of {','.join(STRATEGIES)} (default: all)")
    sweep.add_argument("--warmup", type=_non_negative, default=2, help="untimed iterations (default 2)")
    sweep.add_argument("--repeats", type=_positive, default=10, help="timed iterations (default 10)")
    sweep.add_argument("--timeout", type=float, default=None,
                       help="seconds before a configuration's run is stopped (default: scaled to its size)")
    run.add_argument("--json", action="store_true", help="print results as JSON instead of a table")
    return parser


def _workload(args: argparse.Namespace) -> Workload:
    try:
        return Workload(
            seq_len=args.seq_len, heads=args.heads, head_dim=args.head_dim, kv_heads=args.kv_heads,
            batch=args.batch, dtype=args.dtype, causal=args.causal,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _results_table(
    workload: Workload, results: list[Measurement], failures: list[tuple[CPConfig, EngineError]]
) -> Table:
    table = Table(
        title=f"{workload.describe()} - fastest first",
        caption="ms per iteration, slowest rank; spread = p90 - p10; peak = MiB per rank; "
        "ulysses2xring2 = 2-way Ulysses x 2-way Ring",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,  # fits 80 columns, so CI logs and narrow terminals show every figure
    )
    for column in ("config", "ranks", "median", "spread", "compute", "comm", "peak", "error"):
        table.add_column(column, justify="left" if column == "config" else "right", no_wrap=True)
    for m in sorted(results, key=lambda m: m.median_ms):
        table.add_row(
            m.config.label, str(m.config.ranks), f"{m.median_ms:.1f}",
            f"{m.spread_ms:.1f}", f"{m.compute_ms:.1f}", f"{m.comm_ms:.1f}",
            f"{m.peak_bytes / 2**20:.0f}", f"{m.max_error:.0e}",
        )
    for config, error in failures:
        table.add_row(config.label, str(config.ranks), f"[red]failed: {error.kind}[/]", "", "", "", "", "")
    return table


def cmd_measure(args: argparse.Namespace, console: Console) -> int:
    workload = _workload(args)
    max_ranks = args.max_ranks or available_cores()
    configs = list(enumerate_configs(workload, max_ranks, args.strategies))
    results: list[Measurement] = []
    failures: list[tuple[CPConfig, EngineError]] = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True, disable=args.json)
    with progress:
        task = progress.add_task("measuring", total=len(configs))
        for config in configs:
            progress.update(task, description=f"measuring {config.describe()}")
            try:
                results.append(measure(workload, config, warmup=args.warmup, repeats=args.repeats,
                                       timeout=args.timeout))
            except EngineError as error:
                failures.append((config, error))
            progress.advance(task)
    if args.json:
        print(json.dumps({
            "results": [m.to_dict() for m in results],
            "failures": [{"config": c.to_dict(), "kind": e.kind, "error": str(e)} for c, e in failures],
        }, indent=2))
    else:
        console.print(_results_table(workload, results, failures))
    for config, failure in failures:
        console.print(f"[red]{config.describe()} failed ({failure.kind}):[/] {failure}", highlight=False)
    return USAGE_ERROR if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console(stderr=args.json if hasattr(args, "json") else False)
    try:
        return cmd_measure(args, console)
    except (UsageError, CPTuneError) as error:
        console.print(f"[red]cptune: error:[/] {error}", highlight=False)
        return USAGE_ERROR
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
