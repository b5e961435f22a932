"""How much one configuration's latency relative to another moves round to round and pool to pool.

Several fresh engine pools (new rank processes each) measure the same few configurations
of one workload in interleaved rounds (each round visits every configuration once, in a
fresh random order), with ``cptune.measure`` (output checked, warm-up, repeats, the slowest
rank's median iteration, the contention guard on: disturbed visits are left out). For each
configuration against the first it prints:

- the round-to-round spread of their log latency ratio within a pool (standard deviation):
  the noise a search's intervals see;
- the spread of the pools' mean log ratios, beside what the within-pool spread alone would
  give: more than that means each pool (each set of rank processes) has a level of its own,
  which no number of rounds in one pool can average out.

This is how the ranks' allocator fix (``steady_allocator``) was measured: run it on the
commit before and after, one after the other.

    python benchmarks/pool_variation.py [--seq-len 1024] [--pools 6] [--rounds 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

import cptune
from cptune import CPConfig, Workload
from cptune.engines.mpi import MPIEngine

CONFIGS = (CPConfig("allgather_kv", 2), CPConfig("ulysses", 2, 2), CPConfig("ring", 2))


def measure_pools(
    workload: Workload, pools: int, rounds: int, repeats: int, seed: int
) -> tuple[np.ndarray, dict]:
    """Latency (ms) [pool, round, config]; NaN where the guard judged the visit disturbed.
    Also the host details of the last measurement."""
    rng = np.random.default_rng(seed)
    latency = np.full((pools, rounds, len(CONFIGS)), np.nan)
    host: dict = {}
    for pool in range(pools):
        engine = MPIEngine()
        try:
            for round_ in range(rounds):
                for i in rng.permutation(len(CONFIGS)):
                    m = cptune.measure(workload, CONFIGS[i], backend=engine, warmup=2, repeats=repeats)
                    host = m.host
                    if m.disturbed is None:
                        latency[pool, round_, i] = m.median_ms
        finally:
            engine.close()
        medians = [f"{config.describe()} {np.nanmedian(latency[pool, :, i]):.2f} ms"
                   for i, config in enumerate(CONFIGS)]
        print(f"pool {pool + 1}: " + "  ".join(medians), flush=True)
    return latency, host


def ratio_spreads(latency: np.ndarray) -> list[dict[str, float | str]]:
    """Per configuration against the first: within-pool and between-pool spread of the log ratio."""
    rows = []
    for i, config in enumerate(CONFIGS[1:], start=1):
        logs = np.log(latency[:, :, i]) - np.log(latency[:, :, 0])  # [pool, round]
        within = math.sqrt(float(np.nanmean(np.nanvar(logs, axis=1, ddof=1))))
        means = np.nanmean(logs, axis=1)
        rounds = float(np.mean(np.sum(~np.isnan(logs), axis=1)))
        rows.append({
            "config": config.describe(), "against": CONFIGS[0].describe(),
            "ratio": math.exp(float(np.mean(means))),
            "within_pool_sd": within,
            "between_pool_sd": float(np.std(means, ddof=1)),
            "between_pool_sd_from_rounds_alone": within / math.sqrt(rounds),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--pools", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    args = parser.parse_args()
    if args.pools < 2 or args.rounds < 2:
        parser.error("--pools and --rounds must each be at least 2 (a spread needs two)")
    workload = Workload(seq_len=args.seq_len, heads=8, kv_heads=2, head_dim=64, dtype="bf16", causal=False)
    print(f"{workload.describe()}: {args.pools} fresh pools x {args.rounds} interleaved rounds")
    latency, host = measure_pools(workload, args.pools, args.rounds, args.repeats, args.seed)
    print(f"allocator: {host.get('allocator', 'not recorded (before the steady allocator)')}; "
          f"disturbed visits left out: {int(np.isnan(latency).sum())} of {latency.size}")
    rows = ratio_spreads(latency)
    for row in rows:
        print(f"{row['config']} / {row['against']}: ratio {row['ratio']:.3f}; log sd round to round "
              f"{row['within_pool_sd']:.3f}, of pool means {row['between_pool_sd']:.3f} "
              f"(rounds alone would give {row['between_pool_sd_from_rounds_alone']:.3f})")
    if args.json:
        print(json.dumps({"workload": workload.describe(), "allocator": host.get("allocator"), "ratios": rows,
                          "latency_ms": np.where(np.isnan(latency), None, latency).tolist()}))


if __name__ == "__main__":
    main()
