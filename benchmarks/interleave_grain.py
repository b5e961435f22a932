"""How much finer interleaving steadies a latency ratio: visits of R iterations against the
same iterations interleaved between the two configurations, two ways.

On this project's 2-core VMs the host has slow phases of one to two seconds (whole visits
1.3x slower, no host counter moving with them): about as long as a round of whole visits
at short sequence lengths, so a phase hits some of a round's candidates and not others.
This measurement is why a search's round now interleaves its candidates' iterations
(``cptune.execute.measure_round``, two iterations per pass). This script measures, in one run
and one engine pool, the round-to-round spread of the log ratio of two configurations'
latencies each way, the kinds of round interleaved in a random order so drift hits all
alike:

- visit grain: each configuration visited once per round, ``repeats`` iterations (the
  median iteration of the slowest rank);
- iteration grain: ``repeats`` alternations per round of one-iteration visits, in a fresh
  random order each time; each configuration's figure is the median of its iterations;
- pass grain: one round as a search runs it (``cptune.execute.measure_round``: passes of
  ``ITERATIONS_PER_PASS`` iterations, each after a checked run of the configuration).

Every grain times the same number of iterations per round; the finer ones spend more on
warm-ups and output checks. The contention guard is off for all (its 0.1 s watch window
would dwarf a one-iteration visit).

    python benchmarks/interleave_grain.py [--seq-len 1024] [--rounds 20] [--repeats 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import random

import numpy as np

import cptune
from cptune import CPConfig, Workload
from cptune.engines.mpi import MPIEngine
from cptune.execute import measure_round

CONFIGS = (CPConfig("allgather_kv", 2), CPConfig("ulysses", 2, 2))
GRAINS = ("visit", "iteration", "pass")


def measure_rounds(workload: Workload, rounds: int, repeats: int, seed: int) -> dict[str, list[float]]:
    """Per grain, each round's log latency ratio of the second configuration over the first."""
    rng = np.random.default_rng(seed)
    ratios: dict[str, list[float]] = {grain: [] for grain in GRAINS}
    engine = MPIEngine()

    def visit(config: CPConfig, iterations: int) -> float:
        return cptune.measure(workload, config, backend=engine, warmup=1, repeats=iterations,
                              guard=False).median_ms

    try:
        for _ in range(rounds):
            for grain in rng.permutation(GRAINS):
                if grain == "pass":
                    measured = measure_round(workload, CONFIGS, backend=engine, warmup=1, repeats=repeats,
                                             guard=False, rng=random.Random(int(rng.integers(2**32))))
                    first, second = (measured[config].median_ms for config in CONFIGS)
                    ratios["pass"].append(math.log(second / first))
                    continue
                samples: dict[CPConfig, list[float]] = {config: [] for config in CONFIGS}
                for _ in range(1 if grain == "visit" else repeats):
                    for i in rng.permutation(len(CONFIGS)):
                        config = CONFIGS[i]
                        samples[config].append(visit(config, repeats if grain == "visit" else 1))
                first, second = (float(np.median(samples[config])) for config in CONFIGS)
                ratios[str(grain)].append(math.log(second / first))
    finally:
        engine.close()
    return ratios


def spreads(ratios: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per grain: the mean ratio and the round-to-round standard deviation of its log."""
    return {grain: {"ratio": math.exp(float(np.mean(logs))), "log_sd": float(np.std(logs, ddof=1)),
                    "rounds": len(logs)}
            for grain, logs in ratios.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    args = parser.parse_args()
    if args.rounds < 2 or args.repeats < 1:
        parser.error("--rounds must be at least 2 (a spread needs two) and --repeats at least 1")
    workload = Workload(seq_len=args.seq_len, heads=8, kv_heads=2, head_dim=64, dtype="bf16", causal=False)
    against = f"{CONFIGS[1].describe()} / {CONFIGS[0].describe()}"
    print(f"{workload.describe()}: {against}, {args.rounds} rounds of each grain, {args.repeats} iterations "
          f"per configuration per round")
    ratios = measure_rounds(workload, args.rounds, args.repeats, args.seed)
    figures = spreads(ratios)
    for grain, f in figures.items():
        print(f"{grain} grain: ratio {f['ratio']:.3f}, log sd round to round {f['log_sd']:.3f}")
    if args.json:
        print(json.dumps({"workload": workload.describe(), "ratio": against, "figures": figures,
                          "log_ratios": ratios}))


if __name__ == "__main__":
    main()
