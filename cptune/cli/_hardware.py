"""``cptune hardware``: the shipped hardware descriptions, with their GPUs, ranks and links."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from cptune.cli._common import say
from cptune.hardware import shipped_descriptions


def add_parser(commands: argparse._SubParsersAction) -> None:
    listed = commands.add_parser(
        "hardware",
        help="list the shipped hardware descriptions (--hardware NAME)",
        description=(
            "List the hardware descriptions shipped with cptune, for recommend and export --hardware: "
            "each one's GPU, ranks, ranks per node and links (inside a node and between nodes) with "
            "their bandwidths. See docs/hardware.md for what the figures mean and where they come from."
        ),
    )
    listed.add_argument("--json", action="store_true", help="print every description's figures as JSON")


def _figure(figure: dict[str, float], unit: str) -> str:
    """"360 GB/s (290-370)": a figure's value, and its range where the source gives one."""
    def shown(x: float) -> str:
        return f"{x:g}"
    spread = f" ({shown(figure['low'])}-{shown(figure['high'])})" if figure["low"] < figure["high"] else ""
    return f"{shown(figure['value'])} {unit}{spread}"


def _link(link: dict) -> str:
    """One tier's link in words: its name, bandwidth (other collective kinds after; on a mesh,
    one pair's link, then everything one rank sends over all its links), latency, and whether
    NCCL's path through a CPU decides its all-to-all."""
    def by_kind(table: dict) -> str:
        default, *others = table.items()
        return _figure(default[1], "GB/s") + "".join(f", {kind} {_figure(figure, 'GB/s')}"
                                                      for kind, figure in others)
    shared = f" per {link['ranks']} ranks" if link["tier"] == "domain" else ""
    bandwidth = by_kind(link["bandwidth_gbps"])
    if link["mesh"]:
        every = by_kind(link["aggregate_gbps"])
        bandwidth = f"a link per pair of GPUs, {bandwidth} each; all links at once {every}"
    latency = _figure(link["latency_us"], "us")
    path = "; through a CPU: all-to-all by NCCL's path (--nccl-path)" if link["through_cpu"] else ""
    return f"{link['name']}{shared}: {bandwidth}, {latency}{path}"


def run(args: argparse.Namespace, console: Console) -> int:
    summaries = [d.summary() for d in shipped_descriptions()]
    if args.json:
        print(json.dumps(summaries, indent=2))
        return 0
    say(console, ("Shipped hardware descriptions", "bold"), " (cptune recommend --hardware NAME; bandwidth: "
        "GB/s one flow reaches, ranges where the sources give one; --json lists every figure)")
    for summary in summaries:
        say(console, "")
        say(console, (summary["name"], "bold"), f"  {summary['gpu']}, {summary['ranks']} ranks, "
            f"{summary['ranks_per_node']} per node")
        for link in summary["links"]:
            where = "between nodes" if link["tier"] == "network" else "inside a node"
            say(console, (f"  {where}: ", "dim"), _link(link))
    return 0
