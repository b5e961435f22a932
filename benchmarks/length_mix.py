"""Batches of a long-tailed length mix on this host's ranks, measured under four rules side by
side (issue 58, item 4): is cptune's per-batch plan no slower than the peers' rules, and how
far is each predicted makespan from the measured one?

    python benchmarks/length_mix.py --db FILE [--calibrate] [--ranks 4] [--batches 3]
        [--sequences 12] [--rounds 7] [--repeats 3] [--seed 58] [--out FILE]

The layer: 4 query heads and 4 KV heads of head_dim 64, causal, bf16, forward (``SHAPE``), one
sequence at a time. Each batch: ``--sequences`` lengths drawn (seeded) from a log-normal mix,
128 + lognormal(mean 6.0, sigma 1.1) tokens cut at 4,096 (median about 530; a few long ones).
Plans from this host's model in ``--db`` (its measurements where stored, else the prior on its
calibration; ``--calibrate`` calibrates it first on 1..``--ranks`` ranks, oversubscribed where
the ranks outnumber the cores):

(a) one group of all ranks in the configuration best for the whole batch (``one_group_plan``);
(b) FlexSP's space: pure Ulysses groups of power-of-two sizes (one rank: the local kernel),
    cptune's solver restricted to it (``plan_batch(allowed=...)``);
(c) Megatron dynamic CP's rule as implemented here: a sequence of L tokens runs on a Ring group
    of 2^ceil(log2(L / ``--per-rank``)) ranks (Megatron-Bridge's dynamic CP: "every packed
    microbatch on a context-parallel group sized for its longest sequence", one rank for a
    sequence of at most ``max_seqlen_per_dp_cp_rank`` tokens,
    https://docs.nvidia.com/nemo/megatron-bridge/nightly/training/dynamic-context-parallel.html;
    each sequence its own bin here; at most all ranks); each size gets ranks in proportion to
    its sequences' summed L^2 / cp (whole groups, at least one; while they overshoot, the size
    holding most ranks in groups of which it has several gives one back; where one group of
    each size still overshoots, the size of least L^2 / cp joins the next larger size), and
    the sequences, largest L^2 / cp first, go to the least loaded group of their size
    (predicted time);
(d) cptune's per-batch plan (``plan_batch``).

Measured interleaved: in each of ``--rounds`` rounds every batch's distinct plans run in a
fresh seeded random order (rules that chose the same plan share its run), each checked against
the float64 reference and timed ``--repeats`` iterations (``cptune.execute.measure_batch``: all
groups start after one barrier, the makespan the slowest rank's end). A plan's measured
makespan is the median of all its iterations. (d) against the best peer is also taken round by
round, each round's plans measured minutes apart at most: the median of those paired ratios and
their range say whether a difference stands above the noise between rounds (on this host one
plan's round medians spread by up to 1.4x). On this 2-core host 4 ranks are oversubscribed
(``--oversubscribe`` in measure's terms): every group runs beside the others on cores they
share, which the plans' costs price from the calibration's rates with all 4 ranks busy
(``MixCosts.shared_ms``).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from _provenance import command, commit

from cptune.config import CPConfig
from cptune.engines.mpi import MPIEngine
from cptune.execute import measure_batch
from cptune.mixes import BatchPlan, Group, LengthMix, MixCosts, mix_costs, one_group_plan, plan_batch
from cptune.workload import AttentionShape

SHAPE = AttentionShape(heads=4, kv_heads=4, head_dim=64, batch=1, dtype="bf16", causal=True)
LONGEST = 4096
RULES = ("a one group", "b FlexSP space", "c Megatron rule", "d cptune")


def draw(rng: np.random.Generator, n: int) -> list[int]:
    """``n`` lengths of the long-tailed mix."""
    return np.minimum(rng.lognormal(6.0, 1.1, n).astype(int) + 128, LONGEST).tolist()


def flexsp(config: CPConfig) -> bool:
    """FlexSP's space: pure Ulysses on a power-of-two group, or one rank alone."""
    return config.ranks & (config.ranks - 1) == 0 and (config.strategy == "ulysses" or config.ranks == 1)


def megatron_plan(costs: MixCosts, batch: list[int], ranks: int, per_rank: int) -> BatchPlan:
    """Megatron dynamic CP's rule as implemented here (module docstring, (c)), as a plan."""
    size = [min(ranks, 2 ** math.ceil(math.log2(max(1.0, n / per_rank)))) for n in batch]
    while True:
        work = [n * n / g for n, g in zip(batch, size, strict=True)]
        by_size: dict[int, float] = {}
        for g, w in zip(size, work, strict=True):
            by_size[g] = by_size.get(g, 0.0) + w
        total = sum(by_size.values())
        count = {g: max(1, int(ranks * share / total) // g) for g, share in by_size.items()}
        while sum(g * k for g, k in count.items()) > ranks and any(k > 1 for k in count.values()):
            count[max((g for g in count if count[g] > 1), key=lambda g: count[g] * g)] -= 1
        if sum(g * k for g, k in count.items()) <= ranks:
            break
        # one group of each size still overshoots: the size of least work joins the next larger one
        least = min((g for g in by_size if g < max(by_size)), key=lambda g: by_size[g])
        larger = min(g for g in by_size if g > least)
        size = [larger if g == least else g for g in size]
    times = costs.times(batch)
    row = {g: costs.configs.index(CPConfig("ring", g)) for g in count}
    members: dict[int, list[list[int]]] = {g: [[] for _ in range(k)] for g, k in count.items()}
    loads: dict[int, list[float]] = {g: [0.0] * k for g, k in count.items()}
    for s in sorted(range(len(batch)), key=lambda s: -work[s]):
        g = size[s]
        k = min(range(count[g]), key=lambda i: loads[g][i])
        loads[g][k] += float(times[row[g], s])
        members[g][k].append(s)
    groups = [Group(CPConfig("ring", g), tuple(sorted(m)), loads[g][k])
              for g in sorted(count, reverse=True) for k, m in enumerate(members[g]) if m]
    return BatchPlan(tuple(batch), ranks, tuple(groups), max(g.ms for g in groups), "Megatron rule")


def round_ratios(ours: list[list[float]], theirs: list[list[float]]) -> list[float]:
    """Round by round, the median of ``ours``' iterations over the median of ``theirs``' (1.0
    each round where both are one run)."""
    return [statistics.median(a) / statistics.median(b) for a, b in zip(ours, theirs, strict=True)]


def same_run(plan: BatchPlan) -> tuple:
    """What a run of ``plan`` is: its groups' configurations and sequences, in its order."""
    return tuple((g.config.describe(), g.sequences) for g in plan.groups)


def plans_for(costs: MixCosts, batch: list[int], ranks: int, per_rank: int) -> dict[str, BatchPlan]:
    return {RULES[0]: one_group_plan(costs, batch, ranks),
            RULES[1]: plan_batch(costs, batch, ranks, allowed=flexsp),
            RULES[2]: megatron_plan(costs, batch, ranks, per_rank),
            RULES[3]: plan_batch(costs, batch, ranks)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="this host's database (its calibration prices the plans)")
    parser.add_argument("--calibrate", action="store_true", help="calibrate this host into --db first")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=12, help="sequences per batch")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3, help="timed iterations per plan per round")
    parser.add_argument("--per-rank", type=int, default=1024,
                        help="the Megatron rule's tokens per rank (max_seqlen_per_dp_cp_rank)")
    parser.add_argument("--seed", type=int, default=58)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    lines = [f"# {command('length_mix.py', argv)}",
             f"# commit {commit()}, {datetime.now(UTC).isoformat(timespec='seconds')}; measured on this "
             f"host's mpi ranks ({args.ranks}), predicted by its model in --db",
             f"# layer: {SHAPE.describe()}"]
    if args.calibrate:
        from cptune.search import calibrate_host

        calibrate_host(args.db, max_ranks=args.ranks, oversubscribe=True)
    rng = np.random.default_rng(args.seed)
    batches = [draw(rng, args.sequences) for _ in range(args.batches)]
    costs = mix_costs(SHAPE, LengthMix.of([n for b in batches for n in b]), args.ranks, db=args.db)
    plans = [plans_for(costs, batch, args.ranks, args.per_rank) for batch in batches]
    for i, (batch, planned) in enumerate(zip(batches, plans, strict=True)):
        lines.append(f"batch {i + 1}: {LengthMix.of(batch).describe()}: {batch}")
        lines += [f"  {rule}: {plan.describe()}" for rule, plan in planned.items()]
    # rules that chose the same plan share its run: measured apart they would differ by noise alone
    runs = {(i, rule): (i, same_run(plan))
            for i, planned in enumerate(plans) for rule, plan in planned.items()}
    first = {run: rule for (i, rule), run in reversed(runs.items())}
    samples: dict[tuple[int, tuple], list[list[float]]] = {run: [] for run in runs.values()}  # by round
    engine = MPIEngine()
    order = random.Random(args.seed)
    disturbed = 0
    try:
        for round_ in range(args.rounds):
            visits = list(samples)
            order.shuffle(visits)
            for run in visits:
                i, rule = run[0], first[run]
                m = measure_batch(plans[i][rule], SHAPE, engine, warmup=0 if round_ else 1,
                                  repeats=args.repeats, oversubscribe=True)
                samples[run].append(list(m.samples_ms))
                disturbed += m.disturbed is not None
                print(f"round {round_ + 1} batch {i + 1} {rule}: {m.median_ms:.2f} ms"
                      f"{' (disturbed: ' + m.disturbed + ')' if m.disturbed else ''}", flush=True)
    finally:
        engine.close()
    lines.append("batch  rule               predicted ms  measured ms  (pred - meas) / meas")
    errors: list[float] = []
    for i in range(len(batches)):
        measured = {r: statistics.median(t for one in samples[runs[(i, r)]] for t in one) for r in RULES}
        for rule in RULES:
            predicted = plans[i][rule].makespan_ms
            error = (predicted - measured[rule]) / measured[rule]
            shared = first[runs[(i, rule)]]
            if shared == rule:
                errors.append(abs(error))
            lines.append(f"{i + 1:>5}  {rule:<17}  {predicted:>12.2f}  {measured[rule]:>11.2f}  "
                         f"{error:>+20.1%}{'' if shared == rule else '  (the plan of ' + shared[0] + ')'}")
        best_peer = min(RULES[:3], key=lambda r: measured[r])
        paired = round_ratios(samples[runs[(i, RULES[3])]], samples[runs[(i, best_peer)]])
        lines.append(f"       (d) / best of (a)-(c) measured: {measured[RULES[3]] / measured[best_peer]:.3f} "
                     f"(against {best_peer[0]}; round by round: median {statistics.median(paired):.3f}, "
                     f"{min(paired):.3f}-{max(paired):.3f} over {len(paired)}); "
                     f"(d) / (a): {measured[RULES[3]] / measured[RULES[0]]:.3f} measured, "
                     f"{plans[i][RULES[3]].makespan_ms / plans[i][RULES[0]].makespan_ms:.3f} predicted")
    lines.append(f"predicted-vs-measured makespan error |pred - meas| / meas over the {len(errors)} distinct "
                 f"plans: median {statistics.median(errors):.1%}, worst {max(errors):.1%}")
    visits = len(samples) * args.rounds
    lines.append(f"visits the contention guard marked disturbed: {disturbed} of {visits}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
