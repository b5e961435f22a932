"""The per-batch solver of ``cptune.mixes``: how fast the fast one runs, and how close it comes to
the exact one (a MILP through SciPy's HiGHS).

Costs from the prior alone (no database) of a Llama-3.1-8B attention layer (32 query heads, 8 KV
heads, head_dim 128, causal, bf16) in training, on described hardware; batches drawn from a
long-tailed mix (lengths log-normal, median about 3K tokens, cut at 128K). Computed, not measured
on any GPU.

    python benchmarks/mix_solver.py --speed [--out FILE]
    python benchmarks/mix_solver.py --quality 200 [--out FILE]
    python benchmarks/mix_solver.py --peers [--out FILE]

``--speed``: ``plan_batch`` on 512 sequences over 64 ranks (8 nodes of ``h100-sxm-2x8-ib``) and
4,096 over 1,024 (128 nodes), the median of 11 calls after one warm call, wall and this process's
CPU seconds (on a shared host the CPU time is the steadier), and the least CPU time of the 11
(the call the host's load slowed least; the load average is in the header): the solve alone, on
costs already read. The warm call's wall time beside them: the process's first solve loads the
solver's compiled loops (Numba's cached machine code, or compiles them where none is cached).
Beside it, the wall seconds of reading the costs (``mix_costs``, asking the cost model at each
grid length), paid once per mix - at ``cptune export --batch-lengths``, not per batch: a
deployment solves from the plan's batch policy - and the makespan against one group of all ranks.
``--quality N``: N random batches of 2-16 sequences on 2-8 ranks of ``h100-sxm-8`` (the rank
count and the batch drawn at random), the fast plan's makespan over the MILP's, how many are
within 2%, the worst, and how many are no slower than one group of all ranks.
``--peers``: one stated batch (64 sequences of the mix, seed 60) on ``h100-sxm-8`` and
``h100-sxm-2x8-ib``, the predicted makespan of (a) one group of all ranks in its best
configuration, (b) FlexSP's space (pure Ulysses groups of power-of-two sizes, our solver within
it), (c) Megatron's dynamic-CP rule as read here: a sequence of L tokens in a Ring group of
2^ceil(log2(L / 16,384)) ranks (16,384 tokens per rank stated), each size given ranks in
proportion to its sequences' L^2 / cp, longest L^2 / cp first into the least loaded group of its
size, and (d) cptune's plan. Predicted, not measured.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from _provenance import command, commit

from cptune.config import CPConfig
from cptune.hardware import builtin_descriptions
from cptune.mixes import (
    LengthMix,
    MixCosts,
    MixError,
    exact_batch_plan,
    mix_costs,
    one_group_plan,
    plan_batch,
)
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


#: Timed calls per speed case, after one warm call.
REPEATS = 11


def timed(call: object, repeats: int = REPEATS) -> tuple[float, float, float, float]:
    """Median wall and CPU seconds of ``call()`` over ``repeats`` calls, after one warm call, the
    least CPU seconds (what a call takes when the shared host's load slows it least), and the warm
    call's wall seconds."""
    assert callable(call)
    first = time.perf_counter()
    call()
    first = time.perf_counter() - first
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        call()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), min(cpus), first


def speed(lines: list[str]) -> None:
    rng = np.random.default_rng(58)
    lines.append(f"# load average (1 min) before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    lines.append("sequences  ranks  solve wall ms  solve CPU ms  least CPU ms  first wall ms  costs s  "
                 "groups  makespan ms  one group ms")
    with tempfile.TemporaryDirectory() as folder:
        for sequences, nodes in ((512, 8), (4096, 128)):
            ranks = nodes * 8
            batch = draw(rng, sequences)
            start = time.perf_counter()
            costs = mix_costs(SHAPE, LengthMix.of(batch), ranks, hardware=cluster(nodes, Path(folder)))
            reading = time.perf_counter() - start
            wall, cpu, least, first = timed(lambda costs=costs, batch=batch: plan_batch(costs, batch))
            plan = plan_batch(costs, batch)
            try:
                one = f"{one_group_plan(costs, batch).makespan_ms:.4g}"
            except MixError:
                one = "-"
            lines.append(f"{sequences:>9}  {ranks:>5}  {wall * 1e3:>13.1f}  {cpu * 1e3:>12.1f}  "
                         f"{least * 1e3:>12.1f}  {first * 1e3:>13.1f}  {reading:>7.1f}  "
                         f"{len(plan.groups):>6}  {plan.makespan_ms:>11.4g}  {one:>12}")
            print(lines[-1], flush=True)
    lines.append(f"# load average (1 min) after: {os.getloadavg()[0]:.1f}")


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


#: Megatron's ``max_seqlen_per_dp_cp_rank`` as stated for ``--peers``.
PER_RANK = 16384


def megatron(costs: MixCosts, batch: list[int], ranks: int) -> float:
    """The predicted makespan of Megatron's dynamic-CP rule as read here (module docstring)."""
    size = {s: 2 ** math.ceil(math.log2(max(1.0, n / PER_RANK))) for s, n in enumerate(batch)}
    work = {s: batch[s] ** 2 / size[s] for s in size}
    by_size: dict[int, float] = {}
    for s, g in size.items():
        by_size[g] = by_size.get(g, 0.0) + work[s]
    total = sum(by_size.values())
    groups = {g: max(1, int(ranks * share / total) // g) for g, share in by_size.items()}
    while sum(g * k for g, k in groups.items()) > ranks:  # one group a size overshot: take from the most
        spare = [x for x in groups if groups[x] > 1]
        if not spare:
            return math.inf  # the sizes the rule asks for do not fit in the ranks side by side
        groups[max(spare, key=lambda x: groups[x] * x)] -= 1
    rows = {g: costs.configs.index(CPConfig("ring", g) if g > 1 else CPConfig("ring", 1)) for g in groups}
    loads = {g: [0.0] * k for g, k in groups.items()}
    times = costs.times(batch)
    for s in sorted(size, key=lambda s: -work[s]):
        g = size[s]
        k = min(range(len(loads[g])), key=lambda i: loads[g][i])
        loads[g][k] += float(times[rows[g], s])
    return max(max(v) for v in loads.values())


def peers(lines: list[str]) -> None:
    batch = draw(np.random.default_rng(60), 64)
    lines.append(f"batch: {LengthMix.of(batch).describe()}: {batch}")
    lines.append("hardware          ranks  (a) one group  (b) FlexSP space  (c) Megatron rule  (d) cptune  "
                 "plan")
    for hardware, ranks in (("h100-sxm-8", 8), ("h100-sxm-2x8-ib", 16)):
        costs = mix_costs(SHAPE, LengthMix.of(batch), ranks, hardware=hardware)
        one = one_group_plan(costs, batch).makespan_ms
        pure = plan_batch(costs, batch, allowed=lambda c: c.ranks & (c.ranks - 1) == 0
                          and (c.strategy == "ulysses" or c.ranks == 1)).makespan_ms
        rule = megatron(costs, batch, ranks)
        plan = plan_batch(costs, batch)
        lines.append(f"{hardware:<16}  {ranks:>5}  {one:>13.4g}  {pure:>16.4g}  {rule:>17.4g}  "
                     f"{plan.makespan_ms:>10.4g}  {plan.describe()}")
        print(lines[-1], flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--quality", type=int, default=0, metavar="N")
    parser.add_argument("--peers", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    lines = [f"# {command('mix_solver.py', argv)}", f"# commit {commit()}, "
             f"{datetime.now(UTC).isoformat(timespec='seconds')}; prior only, computed, not measured"]
    if args.speed:
        speed(lines)
    if args.quality:
        quality(args.quality, lines)
    if args.peers:
        peers(lines)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
