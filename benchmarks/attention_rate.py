"""How close the MPI engine's attention compute phase gets to the machine's GEMM rate.

For a few head_dim-128 workloads, measures every configuration up to this host's core count
on real ranks and prints its latency, its compute-phase FLOP rate per rank (the analytic
attention FLOPs of the busiest rank / its compute time) and, next to it, the float32 GEMM
rate (2048^3) at the same number of BLAS threads per rank, timed before and after in this
same run: the better reading is the reference (one taken while other load held a core reads low).
Goal: compute phase >= 70% of the GEMM rate.

    python benchmarks/attention_rate.py [--repeats N] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from threadpoolctl import threadpool_limits

import cptune
from cptune import Workload, analytic_cost, enumerate_configs, measure

WORKLOADS = [
    Workload(seq_len=4096, heads=8, head_dim=128, dtype="bf16"),
    Workload(seq_len=8192, heads=4, head_dim=128, kv_heads=1, dtype="bf16"),
    Workload(seq_len=8192, heads=4, head_dim=128, dtype="fp32", causal=True),
]


def gemm_rate(threads: int, n: int = 2048, tries: int = 5) -> float:
    """Best-of-``tries`` float32 n^3 GEMM rate in GFLOP/s on ``threads`` BLAS threads."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    with threadpool_limits(limits=threads, user_api="blas"):
        a @ b
        best = min(_timed(lambda: a @ b) for _ in range(tries))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    lines = [f"cptune {cptune.__version__}, {cores} cores, numpy {np.__version__}"]

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    thread_counts = sorted({max(1, cores // n) for n in range(1, cores + 1)})
    before = {t: gemm_rate(t) for t in thread_counts}
    say("float32 GEMM 2048^3 before: "
        + ", ".join(f"{t} thread(s) {r:.1f} GFLOP/s" for t, r in before.items()))
    rows = []
    for workload in WORKLOADS:
        say(f"\n{workload.describe()}")
        say(f"{'config':<18}{'ranks':>6}{'median ms':>11}{'spread':>8}{'compute ms':>12}"
            f"{'comm ms':>9}{'GFLOP/s/rank':>14}{'threads':>8}")
        for config in enumerate_configs(workload, cores):
            m = measure(workload, config, warmup=1, repeats=args.repeats)
            threads = max(1, cores // config.ranks)
            rate = analytic_cost(workload, config).flops / (m.compute_ms / 1e3) / 1e9
            rows.append((workload, config, threads, rate))
            say(f"{config.label:<18}{config.ranks:>6}{m.median_ms:>11.1f}{m.spread_ms:>8.1f}"
                f"{m.compute_ms:>12.1f}{m.comm_ms:>9.1f}{rate:>14.1f}{threads:>8}")
    after = {t: gemm_rate(t) for t in thread_counts}
    say("\nfloat32 GEMM 2048^3 after: "
        + ", ".join(f"{t} thread(s) {r:.1f} GFLOP/s" for t, r in after.items()))
    gemm = {t: max(before[t], after[t]) for t in thread_counts}
    say("\ncompute phase / the better GEMM reading at the rank's thread count")
    say(f"{'workload':<48}{'config':<18}{'ranks':>6}{'GEMM':>8}{'ratio':>7}")
    for workload, config, threads, rate in rows:
        say(f"{workload.describe():<48}{config.label:<18}{config.ranks:>6}{gemm[threads]:>8.1f}"
            f"{rate / gemm[threads]:>7.0%}")
    full = [rate / gemm[threads] for w, _, threads, rate in rows if not w.causal]
    say(f"non-causal compute phase / GEMM rate: median {np.median(full):.0%}, "
        f"min {min(full):.0%}, max {max(full):.0%} (goal >= 70%)")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
