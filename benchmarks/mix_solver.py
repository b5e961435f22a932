"""The per-batch solver of ``cptune.mixes``: how fast the fast one runs, and how close it comes to
the exact one (a MILP through SciPy's HiGHS).

Costs from the prior alone (no database) of a Llama-3.1-8B attention layer (32 query heads, 8 KV
heads, head_dim 128, causal, bf16) in training, on described hardware; batches drawn from a
long-tailed mix (lengths log-normal, median about 3K tokens, cut at 128K). Computed, not measured
on any GPU.

    python benchmarks/mix_solver.py --speed [--out FILE]
    python benchmarks/mix_solver.py --quality 200 [--out FILE]

``--speed``: ``plan_batch`` on 512 sequences over 64 ranks (8 nodes of ``h100-sxm-2x8-ib``) and
4,096 over 1,024 (128 nodes), the median of 5 calls after one warm call, wall and this process's
CPU seconds (on a shared host the CPU time is the steadier), beside reading the costs
(``mix_costs``, once per mix) and the makespan against one group of all ranks.
``--quality N``: N random batches of 2-16 sequences on 2-8 ranks of ``h100-sxm-8`` (the rank
count and the batch drawn at random), the fast plan's makespan over the MILP's, how many are
within 2%, the worst, and how many are no slower than one group of all ranks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from _provenance import command, commit

from cptune.hardware import builtin_descriptions
from cptune.mixes import LengthMix, MixError, exact_batch_plan, mix_costs, one_group_plan, plan_batch
from cptune.workload import Workload

SHAPE = Workload(seq_len=1024, heads=32, kv_heads=8, head_dim=128, causal=True, mode="train").shape
LONGEST = 131072


def draw(rng: np.random.Generator, n: int) -> list[int]:
    """``n`` lengths of the long-tailed mix."""
    return np.minimum(rng.lognormal(8.0, 1.2, n).astype(int) + 128, LONGEST).tolist()


def cluster(nodes: int, folder: Path) -> str:
    """``h100-sxm-2x8-ib`` with ``nodes`` nodes, written to ``folder``."""
    text = builtin_descriptions()["h100-sxm-2x8-ib"].read_text()
    path = folder / f"h100-sxm-{nodes}x8-ib.toml"
    path.write_text(text.replace("\nnodes = 2\n", f"\nnodes = {nodes}\n"))
    return str(path)


def timed(call: object, repeats: int = 5) -> tuple[float, float]:
    """Median wall and CPU seconds of ``call()`` over ``repeats`` calls, after one warm call."""
    assert callable(call)
    call()
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        call()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def speed(lines: list[str]) -> None:
    rng = np.random.default_rng(58)
    lines.append("sequences  ranks  solve wall ms  solve CPU ms  costs s  groups  makespan ms  one group ms")
    with tempfile.TemporaryDirectory() as folder:
        for sequences, nodes in ((512, 8), (4096, 128)):
            ranks = nodes * 8
            batch = draw(rng, sequences)
            start = time.perf_counter()
            costs = mix_costs(SHAPE, LengthMix.of(batch), ranks, hardware=cluster(nodes, Path(folder)))
            reading = time.perf_counter() - start
            wall, cpu = timed(lambda costs=costs, batch=batch: plan_batch(costs, batch))
            plan = plan_batch(costs, batch)
            try:
                one = f"{one_group_plan(costs, batch).makespan_ms:.4g}"
            except MixError:
                one = "-"
            lines.append(f"{sequences:>9}  {ranks:>5}  {wall * 1e3:>13.1f}  {cpu * 1e3:>12.1f}  "
                         f"{reading:>7.1f}  {len(plan.groups):>6}  {plan.makespan_ms:>11.4g}  {one:>12}")
            print(lines[-1], flush=True)


def quality(count: int, lines: list[str]) -> None:
    rng = np.random.default_rng(59)
    pool = draw(rng, 4000)
    costs = mix_costs(SHAPE, LengthMix.of(pool), 8, hardware="h100-sxm-8")
    ratios, unproved, beats_one, milp_s, fast_s = [], 0, 0, [], []
    lines.append("batch  sequences  ranks  fast ms  exact ms  ratio  optimal  MILP s")
    for i in range(count):
        ranks = int(rng.integers(2, 9))
        batch = [int(x) for x in rng.choice(pool, int(rng.integers(2, 17)))]
        start = time.process_time()
        fast = plan_batch(costs, batch, ranks)
        fast_s.append(time.process_time() - start)
        start = time.perf_counter()
        exact = exact_batch_plan(costs, batch, ranks, time_limit_s=60)
        milp_s.append(time.perf_counter() - start)
        unproved += not exact.optimal
        ratios.append(fast.makespan_ms / exact.makespan_ms)
        try:
            beats_one += fast.makespan_ms <= one_group_plan(costs, batch, ranks).makespan_ms * (1 + 1e-9)
        except MixError:
            beats_one += 1  # no single configuration of all ranks holds the batch
        lines.append(f"{i:>5}  {len(batch):>9}  {ranks:>5}  {fast.makespan_ms:>7.4g}  "
                     f"{exact.makespan_ms:>8.4g}  {ratios[-1]:>5.3f}  {str(exact.optimal):>7}  "
                     f"{milp_s[-1]:>6.2f}")
        print(lines[-1], flush=True)
    within = sum(r <= 1.02 for r in ratios)
    lines += ["", f"fast within 2% of the MILP: {within} of {count} ({within / count:.1%}); worst ratio "
                  f"{max(ratios):.3f}; median {statistics.median(ratios):.4f}",
              f"fast no slower than one group of all ranks: {beats_one} of {count}",
              f"MILP not proved optimal within 60 s: {unproved}; MILP wall s median "
              f"{statistics.median(milp_s):.2f}, worst {max(milp_s):.1f}; fast CPU ms median "
              f"{statistics.median(fast_s) * 1e3:.1f}, worst {max(fast_s) * 1e3:.1f}"]
    print("\n".join(lines[-3:]))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--quality", type=int, default=0, metavar="N")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    lines = [f"# {command('mix_solver.py', argv)}", f"# commit {commit()}, "
             f"{datetime.now(UTC).isoformat(timespec='seconds')}; prior only, computed, not measured"]
    if args.speed:
        speed(lines)
    if args.quality:
        quality(args.quality, lines)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
