"""Predictions beyond the measured range, against measurements the model never saw.

Fits on ``--train-db`` (through ``cptune.recommend``) and, for every workload measured in
``--check-db`` on this host, prints each configuration's predicted latency and interval next
to its measured latency, with the rank correlation and the regret of the model's pick.
Use it with a check database measured at sequence lengths longer than any in the training
one (e.g. twice the longest).

    python benchmarks/extrapolation.py --train-db TRAIN_DB --check-db LONGER_DB
"""

from __future__ import annotations

import argparse

import numpy as np
from scipy.stats import spearmanr

from cptune.hardware import this_host
from cptune.model import recommend
from cptune.store import Store


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train-db", required=True)
    parser.add_argument("--check-db", required=True)
    args = parser.parse_args()

    host = this_host().fingerprint
    with Store(args.check_db) as store:
        rows = [r for r in store.results(status="ok", hardware=host) if r.median_ms]
    for workload in dict.fromkeys(r.workload for r in rows):
        measured = {r.config: r.median_ms for r in rows if r.workload == workload}
        pick = recommend(workload, db=args.train_db)
        predicted = {c.config: c for c in pick.candidates if c.config in measured}
        print(f"\n{workload.describe()}")
        print(f"{'config':24} {'ranks':>5} {'predicted ms':>13} {'interval':>17} {'source':>7} "
              f"{'measured ms':>12}")
        for config in sorted(measured, key=measured.__getitem__):
            c = predicted[config]
            print(f"{config.label:24} {config.ranks:5d} {c.latency_ms:13.1f} "
                  f"{c.low_ms:8.1f}-{c.high_ms:<8.1f} {c.source:>7} {measured[config]:12.1f}")
        configs = list(measured)
        truth = np.array([measured[c] for c in configs])
        guess = np.array([predicted[c].latency_ms for c in configs])
        inside = np.mean([predicted[c].low_ms <= measured[c] <= predicted[c].high_ms for c in configs])
        chosen = min(configs, key=lambda c: predicted[c].latency_ms)
        print(f"spearman {spearmanr(guess, truth).statistic:.2f}; pick {chosen.label} on {chosen.ranks} "
              f"(regret {measured[chosen] / truth.min():.3f}); measured inside the interval: {inside:.0%}; "
              f"MAPE {np.mean(np.abs(guess - truth) / truth) * 100:.0f}%")


if __name__ == "__main__":
    main()
