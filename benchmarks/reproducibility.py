"""How reproducible "the fastest configuration" is on this host: the noise floor of regret.

For every workload measured on this host in both databases (two separate measurement runs
of the same configurations), picks the fastest configuration by the first run and prints
its regret judged by the second (latency of that pick / best latency in the second run).
No model can be scored below this floor with measurements of that quality. It also
prints how far one configuration's latency moves between the runs.

    python benchmarks/reproducibility.py --first run1.db --second run2.db
"""

from __future__ import annotations

import argparse

import numpy as np

from cptune.hardware import this_host
from cptune.store import Store


def latest_medians(db: str) -> dict:
    fingerprint = this_host().fingerprint
    with Store(db) as store:
        rows = store.results(status="ok", hardware=fingerprint)
    medians: dict = {}
    for r in rows:  # oldest first: the latest measurement of a configuration wins
        medians.setdefault(r.workload, {})[r.config] = r.median_ms
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--first", required=True)
    parser.add_argument("--second", required=True)
    args = parser.parse_args()
    first, second = latest_medians(args.first), latest_medians(args.second)
    regrets, ratios = [], []
    for workload in sorted(set(first) & set(second), key=lambda w: (w.heads, w.seq_len)):
        common = set(first[workload]) & set(second[workload])
        ratios += [second[workload][c] / first[workload][c] for c in common]
        pick = min(common, key=first[workload].__getitem__)
        best = min(common, key=second[workload].__getitem__)
        regrets.append(second[workload][pick] / second[workload][best])
        print(f"{workload.describe():45} first run's best {pick.label} on {pick.ranks}, second run's "
              f"{best.label} on {best.ranks}: regret {regrets[-1]:.3f}")
    print(f"regret of the first run's picks in the second: median {np.median(regrets):.3f}, "
          f"worst {max(regrets):.3f} over {len(regrets)} workloads")
    p10, p50, p90 = np.percentile(ratios, [10, 50, 90])
    print(f"one configuration's latency, second run / first: median {p50:.2f}, p10 {p10:.2f}, p90 {p90:.2f}, "
          f"range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} configurations")


if __name__ == "__main__":
    main()
