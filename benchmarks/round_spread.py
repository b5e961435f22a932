"""How much two configurations' latency ratio moves from round to round in stored sweeps.

A search's verdict pairs configurations round by round, so what decides how sure it can be
is the round-to-round spread of their log latency ratio. This reads it from a stored sweep:
for every workload and every pair of configurations sharing at least ``--min-shared``
rounds after the exploration (a search's round 0, whole visits back to back, is left out),
the standard deviation of the log ratio over those rounds; per database, the median and
quartiles over the pairs. Compare sweeps taken before and after a change to the rounds
(whole visits, then interleaved passes: ``cptune.execute.measure_round``).

    python benchmarks/round_spread.py --db sweep.db [--db another.db ...] [--hardware FINGERPRINT]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections import defaultdict

import numpy as np

from cptune.errors import CPTuneError
from cptune.hardware import this_host
from cptune.store import Result, Store


def pair_spreads(rows: list[Result], min_shared: int = 4) -> list[float]:
    """The round-to-round standard deviation of the log latency ratio of each pair of
    configurations of a workload (one engine) with ``min_shared`` clean rounds in common."""
    latency: dict[tuple, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        if row.clean and row.round_id is not None and not row.round_id.endswith(":0"):
            latency[(row.engine, row.workload)][row.config.describe()][row.round_id] = row.median_ms
    spreads = []
    for configs in latency.values():
        for a, b in itertools.combinations(sorted(configs), 2):
            shared = configs[a].keys() & configs[b].keys()
            if len(shared) >= min_shared:
                logs = [math.log(configs[a][r] / configs[b][r]) for r in shared]
                spreads.append(float(np.std(logs, ddof=1)))
    return spreads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", action="append", required=True,
                        help="a swept database, read only (repeatable)")
    parser.add_argument("--hardware", help="fingerprint of the hardware to read (default: this host)")
    parser.add_argument("--min-shared", type=int, default=4, help="rounds a pair must share (default 4)")
    args = parser.parse_args(argv)
    if args.min_shared < 2:
        parser.error("--min-shared must be at least 2 (a spread needs two rounds)")
    for db in args.db:
        try:
            with Store(db, create=False) as store:
                rows = store.results(hardware=args.hardware or this_host().fingerprint)
        except CPTuneError as exc:
            print(f"round_spread: {exc}", file=sys.stderr)
            return 2
        spreads = pair_spreads(rows, args.min_shared)
        if not spreads:
            print(f"{db}: no pair of configurations shares {args.min_shared} rounds")
            continue
        p25, median, p75 = np.percentile(spreads, [25, 50, 75])
        print(f"{db}: {len(spreads)} pairs sharing {args.min_shared}+ rounds; round-to-round sd of the "
              f"log ratio: median {median:.3f} (quartiles {p25:.3f}-{p75:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
