"""How long ``cptune.recommend`` takes once its model is fitted (goal: under 10 ms).

The first call for a database opens it and fits the cost model; every later call costs a
revision query, the candidates' priors and the model's predictions. Prints the first call's
time and the median / p90 / max of the next calls, over a spread of workloads.

    python benchmarks/recommend_latency.py --db cptune.db [--hardware h100-sxm-8] [--calls 200]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cptune import Workload
from cptune.model import recommend

WORKLOADS = [
    Workload(seq_len=s, heads=h, head_dim=d, kv_heads=k, causal=c)
    for s in (1024, 4096, 16384, 65536)
    for h, k, d, c in ((8, 8, 64, False), (24, 24, 128, False), (32, 8, 128, True))
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--db", help="database (default: $CPTUNE_DB or ./cptune.db)")
    parser.add_argument("--hardware", help="as for cptune recommend (default: this host)")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    start = time.perf_counter()
    recommend(WORKLOADS[0], hardware=args.hardware, db=args.db)
    first = time.perf_counter() - start
    seconds = []
    for i in range(args.calls):
        start = time.perf_counter()
        pick = recommend(WORKLOADS[i % len(WORKLOADS)], hardware=args.hardware, db=args.db)
        seconds.append(time.perf_counter() - start)
    ms = np.array(seconds) * 1e3
    print(f"hardware: {pick.hardware}")
    print(f"first call (open database, fit model): {first * 1e3:.0f} ms")
    print(f"next {args.calls} calls over {len(WORKLOADS)} workloads, {len(pick.candidates)} candidates "
          f"in the last: median {np.median(ms):.2f} ms, p90 {np.percentile(ms, 90):.2f} ms, "
          f"max {ms.max():.2f} ms")


if __name__ == "__main__":
    main()
