"""Predictions beyond the measured range, against measurements the model never saw.

Fits on ``--train-db`` (through ``cptune.recommend``) and, for every workload measured in
``--check-db`` on this host, prints each configuration's predicted latency and interval next
to its measured one (its clean visits combined, with their 95% interval, as ``cptune results
--combined`` gives it), with the rank correlation and the regret of the model's pick, also
with ties as ties (1.0 where the check's verdict cannot tell the pick from the fastest, as
``cptune fit`` scores a pick). Use it with a check database measured at sequence lengths
longer than any in the training one (e.g. twice the longest).

    python benchmarks/extrapolation.py --train-db TRAIN_DB --check-db LONGER_DB
"""

from __future__ import annotations

import argparse

import numpy as np
from scipy.stats import spearmanr

from cptune.estimate import combine, judge
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
    with Store(args.check_db, reading=True) as store:
        rows = store.results(status="ok", hardware=host, excluded=False, disturbed=False,
                             oversubscribed=False)
    estimates = list(combine(rows).values())
    for workload in dict.fromkeys(e.workload for e in estimates):
        measured = {e.config: e for e in estimates if e.workload == workload}
        verdict = judge(measured.values())
        assert verdict is not None
        pick = recommend(workload, db=args.train_db)
        predicted = {c.config: c for c in pick.candidates if c.config in measured}
        print(f"\n{workload.describe()}")
        print(f"{'config':24} {'ranks':>5} {'predicted ms':>13} {'interval':>17} {'source':>7} "
              f"{'measured ms':>12} {'95% interval':>17}")
        for config in sorted(measured, key=lambda c: measured[c].median_ms):
            c, m = predicted[config], measured[config]
            print(f"{config.label:24} {config.ranks:5d} {c.latency_ms:13.1f} "
                  f"{c.low_ms:8.1f}-{c.high_ms:<8.1f} {c.source:>7} {m.median_ms:12.1f} "
                  f"{m.low_ms:8.1f}-{m.high_ms:<8.1f}")
        configs = list(measured)
        truth = np.array([measured[c].median_ms for c in configs])
        guess = np.array([predicted[c].latency_ms for c in configs])
        inside = np.mean([predicted[c].low_ms <= measured[c].median_ms <= predicted[c].high_ms
                          for c in configs])
        chosen = min(configs, key=lambda c: predicted[c].latency_ms)
        regret = measured[chosen].median_ms / truth.min()
        as_ties = 1.0 if chosen in verdict.contenders else regret
        print(f"spearman {spearmanr(guess, truth).statistic:.2f}; pick {chosen.label} on {chosen.ranks} "
              f"(regret {regret:.3f}, ties as ties {as_ties:.3f}); measured inside the interval: "
              f"{inside:.0%}; MAPE {np.mean(np.abs(guess - truth) / truth) * 100:.0f}%")


if __name__ == "__main__":
    main()
