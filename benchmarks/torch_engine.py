"""The torch engine against the MPI engine on this host, and its compute phase against torch's
own GEMM.

Part A, the demo space (``search_spaces/demo.toml``: 8 heads x 64, bf16, non-causal, 1K-4K
tokens, 1..cores ranks): every feasible configuration measured on both engines in interleaved
rounds (round 0 torch then mpi, round 1 mpi then torch, and so on, configuration by
configuration). Per configuration: each engine's median latency over the rounds and its spread
(max - min of the rounds' medians), the torch / mpi ratio (the median of each round's paired
ratio, and its range), and a verdict that names a faster engine only when every round agrees.

Part B, the compute phase at head_dim 128 (the workloads of ``attention_rate.py``): every
configuration on 1..cores ranks on the torch engine, in rounds; its compute-phase FLOP rate per
rank (the analytic attention FLOPs of the busiest rank / the median compute time) beside
``torch.matmul``'s rate at the same threads per rank (cores // ranks), float32 2048^3 and bf16
(2048^3, or smaller where one call would take over a second: a CPU without bf16 units runs it
slowly), measured before and after in this run. Ratio: the rate / the best GEMM rate the
kernel could have used (float32 for float32 workloads, the faster of the two for bf16 ones).
Goal: >= 0.75 on the non-causal workloads. The float32 rate is also measured with as many
GEMM processes at once as the configuration has ranks (each at its threads; the slowest of
them): a rank's kernel computes while the others do, sharing the caches and memory.

    python benchmarks/torch_engine.py [--rounds N] [--repeats N] [--part A|B] [--out FILE]
    python benchmarks/torch_engine.py --quick        # tiny shapes: a smoke test, not a result
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from _provenance import command, commit

import cptune
from cptune import CPConfig, EngineError, Workload, analytic_cost, enumerate_configs, measure
from cptune.hardware import this_host
from cptune.measurement import available_cores
from cptune.space import find_space

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("torch", "mpi")
#: As attention_rate.py: the MPI engine's analog of part B.
COMPUTE_WORKLOADS = (
    Workload(seq_len=4096, heads=8, head_dim=128, dtype="bf16"),
    Workload(seq_len=8192, heads=4, head_dim=128, kv_heads=1, dtype="bf16"),
    Workload(seq_len=8192, heads=4, head_dim=128, dtype="fp32", causal=True),
)
QUICK_DEMO_LENGTHS = (256, 512)
QUICK_COMPUTE_LENGTH = 512
GOAL = 0.75
#: The longest one GEMM call may take while its size is chosen.
GEMM_CALL_S = 1.0


@dataclass
class Rounds:
    """One configuration's measurements on each engine, a list entry per round."""

    median_ms: dict[str, list[float]] = field(default_factory=lambda: {e: [] for e in ENGINES})
    compute_ms: dict[str, list[float]] = field(default_factory=lambda: {e: [] for e in ENGINES})
    disturbed: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, engine: str, workload: Workload, config: CPConfig, warmup: int, repeats: int) -> None:
        try:
            m = measure(workload, config, backend=engine, warmup=warmup, repeats=repeats)
        except EngineError as error:
            self.errors.append(f"{engine}: {error.kind}")
            return
        self.median_ms[engine].append(m.median_ms)
        self.compute_ms[engine].append(m.compute_ms)
        self.disturbed += m.disturbed is not None


def _spread(values: Sequence[float]) -> float:
    return max(values) - min(values)


def engines_compared(workloads: Sequence[Workload], max_ranks: int, rounds: int, warmup: int, repeats: int,
                     say: Callable[[str], None]) -> tuple[int, int]:
    """Part A: both engines on every configuration in interleaved rounds; the measurements
    done and how many of them were disturbed."""
    pairs = [(w, c) for w in workloads for c in enumerate_configs(w, max_ranks)]
    results = {pair: Rounds() for pair in pairs}
    for r in range(rounds):
        order = ENGINES if r % 2 == 0 else ENGINES[::-1]
        for (workload, config), rounds_of in results.items():
            for engine in order:
                rounds_of.add(engine, workload, config, warmup, repeats)
        say(f"round {r + 1} of {rounds} done")
    say("")
    say(f"{'seq_len':>8}  {'config':<14}{'ranks':>6}{'torch ms':>10}{'spread':>8}{'compute':>9}"
        f"{'mpi ms':>9}{'spread':>8}{'compute':>9}{'torch/mpi':>10}{'range':>13}  verdict")
    ratios, verdicts, done, disturbed = [], {}, 0, 0
    for (workload, config), of in results.items():
        done += sum(map(len, of.median_ms.values()))
        disturbed += of.disturbed
        torch_ms, mpi_ms = of.median_ms["torch"], of.median_ms["mpi"]
        head = f"{workload.seq_len:>8}  {config.label:<14}{config.ranks:>6}"
        if of.errors:
            say(f"{head}  failed: {', '.join(of.errors)}")
            continue
        paired = [t / m for t, m in zip(torch_ms, mpi_ms, strict=True)]
        ratio = statistics.median(paired)
        ratios.append(ratio)
        verdict = ("torch faster" if max(paired) < 1 else "mpi faster" if min(paired) > 1
                   else "within noise")
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
        say(f"{head}{statistics.median(torch_ms):>10.1f}{_spread(torch_ms):>8.1f}"
            f"{statistics.median(of.compute_ms['torch']):>9.1f}{statistics.median(mpi_ms):>9.1f}"
            f"{_spread(mpi_ms):>8.1f}{statistics.median(of.compute_ms['mpi']):>9.1f}{ratio:>10.3f}"
            f"{f'{min(paired):.3f}-{max(paired):.3f}':>13}  {verdict}")
    if ratios:
        say(f"torch / mpi over {len(ratios)} configurations: median {statistics.median(ratios):.3f}, "
            f"min {min(ratios):.3f}, max {max(ratios):.3f}; "
            + ", ".join(f"{v} {n}" for v, n in sorted(verdicts.items())))
    return done, disturbed


def gemm_rate(dtype: torch.dtype, threads: int, largest: int, tries: int = 3) -> tuple[float, int]:
    """Best-of-``tries`` rate (GFLOP/s) of ``torch.matmul`` on n x n ``dtype`` matrices with
    ``threads`` threads, and n: ``largest``, or the size (from 256, doubling) past which one
    call would take over ``GEMM_CALL_S``."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    n = 256
    while True:
        a = torch.randn(n, n, generator=generator).to(dtype)
        b = torch.randn(n, n, generator=generator).to(dtype)
        first = _timed(lambda: a @ b)  # noqa: B023 (called at once)
        if n >= largest or first * 8 > GEMM_CALL_S:
            break
        n *= 2
    best = min(first, *(_timed(lambda: a @ b) for _ in range(tries)))
    return 2 * n**3 / best / 1e9, n


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


GemmRates = dict[tuple[str, int], tuple[float, int]]


def gemm_rates(threads: Sequence[int], largest: int) -> GemmRates:
    """(dtype name, threads) -> (GFLOP/s, n) for float32 and bf16."""
    return {(name, t): gemm_rate(dtype, t, largest)
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)) for t in threads}


#: One of several processes timing float32 GEMMs at once: argv threads, n, start time.
_GEMM_AT_ONCE = """
import sys, time, torch
threads, n, start = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
torch.set_num_threads(threads)
a, b = torch.randn(n, n), torch.randn(n, n)
a @ b
time.sleep(max(0.0, start - time.time()))
best = float("inf")
for _ in range(3):
    began = time.perf_counter(); a @ b; best = min(best, time.perf_counter() - began)
print(2 * n**3 / best / 1e9)
"""


def gemm_rate_at_once(processes: int, threads: int, n: int = 2048) -> float:
    """The slowest of ``processes`` processes' float32 GEMM rate (GFLOP/s), all timing at
    once with ``threads`` threads each: what a rank's kernel gets while the others compute."""
    start = time.time() + 3.0
    running = [subprocess.Popen([sys.executable, "-c", _GEMM_AT_ONCE, str(threads), str(n), str(start)],
                                stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    return min(float(proc.communicate(timeout=120)[0]) for proc in running)


def _gemm_line(when: str, rates: GemmRates) -> str:
    return f"torch.matmul {when}: " + ", ".join(
        f"{name} {n}^3 {t} thread(s) {rate:.1f} GFLOP/s" for (name, t), (rate, n) in rates.items())


def compute_phase(workloads: Sequence[Workload], max_ranks: int, rounds: int, warmup: int, repeats: int,
                  gemm_largest: int, say: Callable[[str], None]) -> tuple[int, int]:
    """Part B: the torch engine's compute phase per rank against torch's GEMM at the same
    threads; the measurements done and how many of them were disturbed."""
    cores = available_cores()
    thread_counts = sorted({max(1, cores // n) for n in range(1, max_ranks + 1)})
    before = gemm_rates(thread_counts, gemm_largest)
    say(_gemm_line("before", before))
    pairs = [(w, c) for w in workloads for c in enumerate_configs(w, max_ranks)]
    results = {pair: Rounds() for pair in pairs}
    for r in range(rounds):
        for (workload, config), rounds_of in results.items():
            rounds_of.add("torch", workload, config, warmup, repeats)
        say(f"round {r + 1} of {rounds} done")
    after = gemm_rates(thread_counts, gemm_largest)
    say(_gemm_line("after", after))
    best = {key: max(before[key][0], after[key][0]) for key in before}
    at_once = {n: gemm_rate_at_once(n, max(1, cores // n)) for n in range(1, max_ranks + 1)}
    say("torch.matmul fp32 2048^3, as many processes at once as ranks (the slowest): " + ", ".join(
        f"{n} x {max(1, cores // n)} thread(s) {rate:.1f} GFLOP/s" for n, rate in at_once.items()))
    say("")
    say(f"{'workload':<49}{'config':<14}{'ranks':>6}{'median ms':>10}{'compute ms':>11}{'spread':>8}"
        f"{'GFLOP/s/rank':>13}{'threads':>8}{'GEMM':>8}{'of':>5}{'ratio':>7}{'at once':>8}{'ratio':>7}")
    full, full_at_once, done, disturbed = [], [], 0, 0
    for (workload, config), of in results.items():
        done += len(of.median_ms["torch"])
        disturbed += of.disturbed
        head = f"{workload.describe():<49}{config.label:<14}{config.ranks:>6}"
        if of.errors:
            say(f"{head}  failed: {', '.join(of.errors)}")
            continue
        threads = max(1, cores // config.ranks)
        compute_ms = statistics.median(of.compute_ms["torch"])
        rate = analytic_cost(workload, config).flops / (compute_ms / 1e3) / 1e9
        kinds = ("fp32",) if workload.dtype == "fp32" else ("fp32", "bf16")
        kind = max(kinds, key=lambda k: best[(k, threads)])
        ratio = rate / best[(kind, threads)]
        shared = at_once[config.ranks] if kind == "fp32" else best[(kind, threads)]
        if not workload.causal:
            full.append(ratio)
            full_at_once.append(rate / shared)
        say(f"{head}{statistics.median(of.median_ms['torch']):>10.1f}{compute_ms:>11.1f}"
            f"{_spread(of.compute_ms['torch']):>8.1f}{rate:>13.1f}{threads:>8}{best[(kind, threads)]:>8.1f}"
            f"{kind:>5}{ratio:>7.0%}{shared:>8.1f}{rate / shared:>7.0%}")
    for name, ratios in (("alone", full), ("as many at once as ranks", full_at_once)):
        if ratios:
            reached = sum(ratio >= GOAL for ratio in ratios)
            say(f"non-causal compute phase / GEMM rate ({name}): median {np.median(ratios):.0%}, "
                f"min {min(ratios):.0%}, max {max(ratios):.0%}; {reached} of {len(ratios)} configurations "
                f"reach the goal of {GOAL:.0%}")
    return done, disturbed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, help="rounds per configuration (default 3; 2 with --quick)")
    parser.add_argument("--repeats", type=int,
                        help="timed iterations per measurement (default 5; 2 with --quick)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed iterations per measurement (default 1)")
    parser.add_argument("--part", choices=("A", "B"), help="run only part A or part B (default both)")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny shapes (demo at {' and '.join(map(str, QUICK_DEMO_LENGTHS))} tokens, "
                             f"part B at {QUICK_COMPUTE_LENGTH}): a smoke test, not a result")
    parser.add_argument("--out", help="also write the report, with its header, to this file")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    rounds = args.rounds or (2 if args.quick else 3)
    repeats = args.repeats or (2 if args.quick else 5)
    if rounds < 2:
        parser.error("--rounds must be at least 2: one round cannot tell a difference from noise")
    cores = available_cores()
    host = this_host()
    load_before = os.getloadavg()[0]
    started = datetime.now(UTC)
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"cptune {cptune.__version__}, torch {torch.__version__}, numpy {np.__version__}, {cores} cores; "
        f"{rounds} rounds of {args.warmup} warm-up + {repeats} timed iterations per measurement")
    done = disturbed = 0
    if args.part in (None, "A"):
        space = find_space("demo")
        lengths = QUICK_DEMO_LENGTHS if args.quick else space.seq_lens
        say(f"\nA. torch against mpi, the demo space ({space.shape.describe()}), interleaved rounds")
        n, bad = engines_compared([space.shape.at(s) for s in lengths], cores, rounds, args.warmup,
                                  repeats, say)
        done, disturbed = done + n, disturbed + bad
    if args.part in (None, "B"):
        workloads = COMPUTE_WORKLOADS
        if args.quick:
            workloads = tuple(w.shape.at(QUICK_COMPUTE_LENGTH) for w in workloads)
        say("\nB. the torch engine's compute phase against torch.matmul at the same threads per rank")
        n, bad = compute_phase(workloads, cores, rounds, args.warmup, repeats,
                               512 if args.quick else 2048, say)
        done, disturbed = done + n, disturbed + bad
    load = (f"1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; "
            f"{disturbed} of {done} measurements flagged disturbed by the contention guard")
    say(f"\n{load}")
    if args.out:
        header = [
            "# benchmarks/torch_engine.py: the torch engine's latency against the mpi engine's on the demo "
            "space (interleaved rounds), and its compute phase against torch's own GEMM at head_dim 128 "
            f"(goal >= {GOAL}).",
            f"# {started:%Y-%m-%d %H:%M} UTC, commit {commit()}, host {host.fingerprint} "
            f"({host.cpu_model}, {cores} cores); {load}.",
            f"#   {command('torch_engine.py', argv)}",
            "",
        ]
        Path(args.out).write_text("\n".join(header + lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
