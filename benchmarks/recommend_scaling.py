"""How long ``recommend`` takes on described clusters of many GPUs, and what it picks.

The shipped one-node H100 description (``h100-sxm-8``) and the two-node one
(``h100-sxm-2x8-ib``: 8 GPUs per node on NVSwitch, InfiniBand between nodes) with its node
count changed give clusters of 8 x nodes GPUs; for each, one prior-only ``recommend`` of a
FLUX.1-sized and a long-context workload, timed in this process, with the pick and the
number of candidates it weighed (no database here: the prior
alone). Computed,
not measured on any GPU.

    python benchmarks/recommend_scaling.py [--nodes 8 32 128 1024] [--out FILE]

Wall seconds and this process's CPU seconds: on a shared host the CPU time is the steadier.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from _provenance import command, commit

from cptune.hardware import builtin_descriptions
from cptune.model import recommend
from cptune.workload import Workload

WORKLOADS = {
    "FLUX.1-dev (24 heads x 128, 16896 tokens)": Workload(seq_len=16896, heads=24, head_dim=128),
    "long context (32 heads / 8 KV x 128, 128K tokens, causal)": Workload(
        seq_len=131072, heads=32, kv_heads=8, head_dim=128, causal=True),
}


def cluster(nodes: int, folder: Path) -> Path:
    """The shipped two-node description with ``nodes`` nodes, written to ``folder``."""
    text = builtin_descriptions()["h100-sxm-2x8-ib"].read_text()
    assert "\nnodes = 2\n" in text
    path = folder / f"h100-sxm-{nodes}x8-ib.toml"
    path.write_text(text.replace("\nnodes = 2\n", f"\nnodes = {nodes}\n"))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128, 1024],
                        help="node counts of the multi-node cluster (8 GPUs each)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = ["# benchmarks/recommend_scaling.py: recommend on described clusters, the prior only; no GPU",
             f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, commit {commit()}, this project's 2-core VM",
             f"#   {command('recommend_scaling.py', sys.argv[1:])}",
             f"{'GPUs':>6} {'seconds':>8} {'cpu s':>6} {'candidates':>10}  workload: pick"]
    with tempfile.TemporaryDirectory() as folder:
        machines = [(8, "h100-sxm-8"), *((8 * n, str(cluster(n, Path(folder)))) for n in args.nodes)]
        for gpus, hardware in machines:
            for name, workload in WORKLOADS.items():
                start, cpu = time.perf_counter(), time.process_time()
                picked = recommend(workload, hardware=hardware)
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                lines.append(f"{gpus:6d} {seconds:8.2f} {cpu:6.2f} {len(picked.candidates):10d}  {name}: "
                             f"{picked.config.describe()}")
                print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
