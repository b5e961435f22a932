"""How long ``recommend`` takes on described clusters of 8 to 8,192 GPUs, beside how many
configurations it weighs, and what it picks.

Two kinds of cluster: HGX nodes of 8 H100s (``h100-sxm-8``, and ``h100-sxm-2x8-ib`` with its node
count changed: InfiniBand between nodes) and GB200 NVL72 racks (``gb200-nvl72``, and
``gb200-nvl72-4x-ib`` with its rack count changed). For each, prior-only ``recommend`` calls (no
database: the prior alone) of a 64/8-head causal layer at 8K tokens per GPU, forward and
training (issue 57's workload), and of a FLUX.1-sized and a 128K-token causal prefill, timed in
this process, with the configurations weighed (those that can run) and those that cannot.
Computed, not measured on any GPU.

    python benchmarks/recommend_scaling.py [--gpus 8 64 ... 8192] [--whole-nodes] [--out FILE]

``--whole-nodes`` checks what weighing whole nodes beyond the first (``recommend`` without
``--ranks`` on several nodes) gives up: on HGX clusters of 16 to 256 GPUs, for six workloads
forward and training, the fastest configuration on any rank count (every count weighed, one
``recommend(ranks=n)`` each) against the pick on whole nodes.

Wall seconds and this process's CPU seconds: on a shared host the CPU time is the steadier.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from _provenance import command, commit

from cptune.hardware import builtin_descriptions
from cptune.model import recommend
from cptune.workload import Workload

#: name -> the workload on a cluster of that many GPUs.
WORKLOADS: dict[str, Callable[[int], Workload]] = {
    "64/8 heads x 128, causal, 8K tokens per GPU": lambda gpus: Workload(
        seq_len=8192 * gpus, heads=64, kv_heads=8, head_dim=128, causal=True),
    "64/8 heads x 128, causal, 8K tokens per GPU, training": lambda gpus: Workload(
        seq_len=8192 * gpus, heads=64, kv_heads=8, head_dim=128, causal=True, mode="train"),
    "FLUX.1-dev (24 heads x 128, 16896 tokens)": lambda gpus: Workload(
        seq_len=16896, heads=24, head_dim=128),
    "long context (32 heads / 8 KV x 128, 128K tokens, causal)": lambda gpus: Workload(
        seq_len=131072, heads=32, kv_heads=8, head_dim=128, causal=True),
}
#: Each machine family: (one node's description, a cluster's description, GPUs per node).
FAMILIES = {"HGX H100": ("h100-sxm-8", "h100-sxm-2x8-ib", 8),
            "GB200 NVL72": ("gb200-nvl72", "gb200-nvl72-4x-ib", 72)}
#: Workloads and node counts of ``--whole-nodes``.
CHECKED = {
    "FLUX.1-dev": Workload(16896, 24, 128),
    "128K causal, 32/8 heads": Workload(131072, 32, 128, kv_heads=8, causal=True),
    "64K causal, 32/8 heads": Workload(65536, 32, 128, kv_heads=8, causal=True),
    "40000 causal, 40/8 heads": Workload(40000, 40, 128, kv_heads=8, causal=True),
    "4096, 16 heads x 64": Workload(4096, 16, 64), "64K, 48 heads": Workload(65536, 48, 128),
}


def cluster(base: str, nodes: int, folder: Path) -> Path:
    """The shipped cluster description ``base`` with ``nodes`` nodes, written to ``folder``."""
    text = builtin_descriptions()[base].read_text()
    old = next(line for line in text.splitlines() if line.startswith("nodes = "))
    path = folder / f"{base}-{nodes}.toml"
    path.write_text(text.replace(f"\n{old}\n", f"\nnodes = {nodes}\n"))
    return path


def machine(family: str, gpus: int, folder: Path) -> str | None:
    """The description of ``gpus`` GPUs of ``family`` (whole nodes), or None where they are no
    whole number of its nodes."""
    node, base, per_node = FAMILIES[family]
    if gpus % per_node and gpus > per_node:
        return None
    nodes = max(1, round(gpus / per_node))
    return node if nodes == 1 else str(cluster(base, nodes, folder))


def timing_rows(gpu_counts: list[int], folder: Path) -> list[str]:
    lines = [f"{'machine':>11} {'GPUs':>6} {'seconds':>8} {'cpu s':>6} {'weighed':>8} {'cannot run':>10}  "
             "workload: pick"]
    for family, (_, _, per_node) in FAMILIES.items():
        for asked in gpu_counts:
            gpus = asked if asked <= per_node or asked % per_node == 0 else -(-asked // per_node) * per_node
            if asked < per_node and family == "GB200 NVL72":
                continue
            hardware = machine(family, gpus, folder)
            assert hardware is not None
            for name, make in WORKLOADS.items():
                start, cpu = time.perf_counter(), time.process_time()
                picked = recommend(make(gpus), hardware=hardware)
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                lines.append(f"{family:>11} {gpus:6d} {seconds:8.2f} {cpu:6.2f} {len(picked.candidates):8d} "
                             f"{picked.infeasible_count:10d}  {name}: {picked.config.describe()}")
                print(lines[-1], flush=True)
    return lines


def whole_node_rows(folder: Path) -> list[str]:
    """What weighing whole nodes beyond the first gives up (see the module docstring)."""
    lines = ["", "# --whole-nodes: the fastest on any rank count against the pick on whole nodes",
             f"{'GPUs':>6} {'mode':>8}  workload: whole-node pick; the fastest on a partial node if faster"]
    worse = cases = 0
    for nodes in (2, 4, 8, 32):
        hardware = str(cluster("h100-sxm-2x8-ib", nodes, folder))
        for name, workload in CHECKED.items():
            for mode in ("forward", "train"):
                w = workload.in_mode(mode)
                pick = recommend(w, hardware=hardware)
                partial = [recommend(w, ranks=n, hardware=hardware).best for n in range(9, 8 * nodes)
                           if n % 8 and n <= w.seq_len]
                fastest = min(partial, key=lambda c: c.latency_ms, default=None)
                beaten = fastest is not None and fastest.latency_ms < pick.latency_ms
                worse, cases = worse + beaten, cases + 1
                note = "; none faster"
                if beaten and fastest is not None:
                    note = (f"; {fastest.config.describe()} {fastest.latency_ms:.4g} ms against "
                            f"{pick.latency_ms:.4g}")
                lines.append(f"{8 * nodes:6d} {mode:>8}  {name}: {pick.config.describe()}{note}")
                print(lines[-1], flush=True)
    lines.append(f"# cases where a partial node was faster: {worse} of {cases}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 72, 512, 1024, 4096, 8192],
                        help="cluster sizes (rounded up to whole nodes of each family)")
    parser.add_argument("--whole-nodes", action="store_true", help="also check what whole nodes give up")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = ["# benchmarks/recommend_scaling.py: recommend on described clusters, the prior only; no GPU",
             f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, commit {commit()}, this project's 2-core VM",
             f"#   {command('recommend_scaling.py', sys.argv[1:])}",
             "# weighed: configurations that can run, each one evaluation of the prior; cannot run: the rest",
             "# (listed up to 1,000, counted beyond). Beyond one node, recommend weighs whole nodes."]
    with tempfile.TemporaryDirectory() as folder:
        lines += timing_rows(args.gpus, Path(folder))
        if args.whole_nodes:
            lines += whole_node_rows(Path(folder))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
