"""Model-guided search against exhaustive search, replayed on a stored exhaustive sweep.

For each workload of the database with at least ``--min-configs`` measured configurations,
both orders are replayed on that workload's configurations: a trial counts as one run, and
its latency is the one the sweep stored (nothing is measured again). Scored per workload:

- trials until the order first reaches a configuration within 2% of the sweep's best
  (goal for the guided order: at most 30% of the grid);
- where the guided search's stop rule (``cptune.search.STOP_PROBABILITY``, and the other
  thresholds of ``--stop-probabilities``: the chance that any unmeasured configuration beats
  the leader, see ``GuidedSampler``) stopped, and whether it stopped too early: before
  reaching a configuration within 2% of the best.

The exhaustive order is the one ``cptune search`` takes without guidance (BruteForceSampler,
seed 0); "random" is the expected trials of a uniformly random order, (n + 1) / (k + 1) for
k configurations within 2% among n.

Held out, so the replay is not contaminated by its own answer: for each workload the model
is fitted WITHOUT any measurement at that workload's sequence length (on any shape), as
``cptune fit`` holds out lengths; ``--hold-out workload`` leaves out only the workload itself
(the other shapes at its length stay, as in a store that has measured them). As the replay
goes, each revealed trial joins the training set (a live search stores it and the model
refits), fitted with ``fit_advised``, the fit ``recommend`` uses. The guided order itself is
``cptune.search.GuidedSampler``, the sampler ``cptune search --order guided`` runs.

Oversubscribed rows (more ranks than the host's cores) are left out unless
``--include-oversubscribed``: they time the sharing of cores, so a replay that uses them
scores the order on those timings, marked as such in the output.

    python benchmarks/guided_search.py --db COPY_OF_A_SWEEP --include-oversubscribed
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import optuna

from cptune.config import CPConfig
from cptune.model import Candidate, Case, Profile, fit_advised, predicted, training_set
from cptune.search import STOP_PROBABILITY, GuidedSampler, suggest, tree_of
from cptune.store import Store, display_url
from cptune.workload import Workload

WITHIN = 1.02


@dataclass(frozen=True)
class Replay:
    workload: Workload
    configs: int
    near_best: int  # configurations within 2% of the best
    exhaustive_trials: int
    random_trials: float
    guided_trials: int  # guided order, run to the end
    stops: dict[float, tuple[int, bool, float]]  # threshold -> trials spent, too early, regret of its pick


def _first_within(order: list[CPConfig], latency: dict[CPConfig, float]) -> int:
    best = min(latency.values())
    return next(i + 1 for i, c in enumerate(order) if latency[c] <= best * WITHIN)


def _run(sampler: optuna.samplers.BaseSampler, latency: dict[CPConfig, float],
         order: list[CPConfig] | None = None) -> list[CPConfig]:
    """The configurations ``sampler`` tries (appended to ``order``), each valued at its sweep
    latency, until it stops or has tried as many as there are."""
    tree = tree_of(list(latency))
    order = [] if order is None else order

    def objective(trial: optuna.Trial) -> float:
        config = suggest(trial, tree)
        order.append(config)
        return latency[config]

    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.optimize(objective, n_trials=len(latency))
    return order


def _predictor(cases: list[Case], latencies_s: np.ndarray, workload: Workload, profile: Profile,
               latency: dict[CPConfig, float], revealed: list[CPConfig]
               ) -> Callable[[list[CPConfig]], list[Candidate]]:
    """What a live search's model predicts: fitted on ``cases`` (the held-out length already
    removed) plus the trials ``revealed`` so far; one fit per revealed prefix, shared by runs."""
    fits: dict[tuple[CPConfig, ...], object] = {}

    def predict(configs: list[CPConfig]) -> list[Candidate]:
        key = tuple(revealed)
        if key not in fits:
            extra = [Case(workload, c, profile) for c in key]
            seconds = np.array([latency[c] / 1e3 for c in key])
            fits[key] = fit_advised(cases + extra, np.concatenate([latencies_s, seconds]))[0]
        return predicted(fits[key], workload, configs, profile)  # type: ignore[arg-type]

    return predict


def replay(data, workload: Workload, thresholds: list[float],  # type: ignore[no-untyped-def]
           hold_out: str = "length") -> Replay:
    rows = [(case, seconds) for case, seconds in zip(data.cases, data.latencies_s, strict=True)
            if case.workload == workload]
    latency = {case.config: seconds * 1e3 for case, seconds in rows}
    profile = rows[0][0].profile
    keep = [i for i, case in enumerate(data.cases)
            if (case.workload.seq_len if hold_out == "length" else case.workload)
            != (workload.seq_len if hold_out == "length" else workload)]
    cases, latencies_s = [data.cases[i] for i in keep], data.latencies_s[keep]
    best = min(latency.values())
    near = sum(v <= best * WITHIN for v in latency.values())

    exhaustive = _run(optuna.samplers.BruteForceSampler(seed=0), latency)

    revealed: list[CPConfig] = []
    predict = _predictor(cases, latencies_s, workload, profile, latency, revealed)

    def guided_run(threshold: float) -> tuple[list[CPConfig], bool]:
        revealed.clear()  # the predictor's view: what this run has measured so far
        sampler = GuidedSampler(list(latency), predict, threshold)
        order = _run(sampler, latency, revealed)
        return list(order), sampler.early_stop is not None

    full, _ = guided_run(0.0)  # never stops: the whole guided order
    stops = {}
    for threshold in thresholds:
        order, stopped = guided_run(threshold)
        reached = any(latency[c] <= best * WITHIN for c in order)
        pick = min(latency[c] for c in order)
        stops[threshold] = (len(order), stopped and not reached, pick / best)
    return Replay(workload, len(latency), near, _first_within(exhaustive, latency),
                  (len(latency) + 1) / (near + 1), _first_within(full, latency), stops)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", required=True, help="a stored exhaustive sweep (a copy: nothing is written)")
    parser.add_argument("--include-oversubscribed", action="store_true",
                        help="replay rows run on more ranks than the host's cores too (marked in the output)")
    parser.add_argument("--min-configs", type=int, default=10)
    parser.add_argument("--stop-probabilities", default=f"{STOP_PROBABILITY},0.05,0.2")
    parser.add_argument("--hold-out", choices=("length", "workload"), default="length",
                        help="what each workload's model is fitted without: every shape at its sequence "
                             "length (default), or only the workload itself")
    args = parser.parse_args()
    thresholds = [float(t) for t in args.stop_probabilities.split(",")]
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)

    with Store(args.db, reading=True) as store:
        data = training_set(store, include_oversubscribed=args.include_oversubscribed)
        oversubscribed = sum(r.oversubscribed for r in data.results)
    workloads = sorted({case.workload for case in data.cases},
                       key=lambda w: (w.shape.describe(), w.seq_len))
    workloads = [w for w in workloads if sum(case.workload == w for case in data.cases) >= args.min_configs]
    print(f"database {display_url(args.db)}: {len(data.cases)} measurements, {oversubscribed} of them "
          f"oversubscribed ({'included' if args.include_oversubscribed else 'left out'}); "
          f"{len(workloads)} workloads with >= {args.min_configs} configurations")
    held = "any measurement at its sequence length" if args.hold_out == "length" else "its own measurements"
    print(f"model fitted per workload without {held} (held out), plus the trials the replay has "
          f"revealed so far\n")
    main_threshold = thresholds[0]
    header = (f"{'workload':<52} {'n':>3} {'<2%':>3} {'exh.':>4} {'rand.':>5} {'guided':>6} "
              f"{'stop@':>5} {'early':>5} {'regret':>6}")
    print(f"stop rule: the chance that any unmeasured configuration beats the leader is below "
          f"{main_threshold} (the model's interval widened by its error on the trials measured)")
    print(header)
    results = []
    for workload in workloads:
        r = replay(data, workload, thresholds, args.hold_out)
        results.append(r)
        spent, early, regret = r.stops[main_threshold]
        print(f"{workload.describe():<52} {r.configs:>3} {r.near_best:>3} {r.exhaustive_trials:>4} "
              f"{r.random_trials:>5.1f} {r.guided_trials:>6} {spent:>5} {'YES' if early else 'no':>5} "
              f"{regret:>6.3f}", flush=True)
    grid = np.array([r.configs for r in results], dtype=float)
    guided = np.array([r.guided_trials for r in results], dtype=float)
    exhaustive = np.array([r.exhaustive_trials for r in results], dtype=float)
    rand = np.array([r.random_trials for r in results])
    def shares(trials: np.ndarray) -> str:
        share = trials / grid
        return f"{np.mean(share):.0%} / {np.median(share):.0%} / {np.max(share):.0%}"

    print(f"\ntrials to reach within 2% of the best, as a share of the grid (mean / median / worst): "
          f"guided {shares(guided)}, exhaustive (BruteForce seed 0) {shares(exhaustive)}, "
          f"random order (expected) {shares(rand)}; within 30% of the grid: guided "
          f"{int(np.sum(guided <= 0.3 * grid))} of {len(results)}, exhaustive "
          f"{int(np.sum(exhaustive <= 0.3 * grid))} of {len(results)}")
    for threshold in thresholds:
        spent = np.array([r.stops[threshold][0] for r in results], dtype=float)
        early = sum(r.stops[threshold][1] for r in results)
        regrets = [r.stops[threshold][2] for r in results]
        print(f"stop probability {threshold}: trials spent {np.mean(spent / grid):.0%} of the grid on "
              f"average (worst {np.max(spent / grid):.0%}), stopped too early {early} of {len(results)}, "
              f"regret of the pick at the stop median {np.median(regrets):.3f} worst {np.max(regrets):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
