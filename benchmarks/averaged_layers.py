"""Does averaging the cost model's two correction layers beat choosing between them?

``recommend`` used to choose, per database (per training fold when held out), among three
models: the learned correction with each shape's level from its other lengths, the boosted
correction alone, and the prior alone - the correction with the smaller error within a
workload held out, among those whose error was no larger than the prior's and whose regret
was not worse beyond the noise; the prior alone when neither passed. Now it averages the two
layers (``CostModel``'s ``shape_weight`` 0.5) and falls back to the prior alone only when
the average is worse than the prior beyond the noise (``cptune.model.correction_verdict``).

This script scores ``cptune fit``'s goal for recommend's pick on each database - held out
by sequence length, ties as ties, median <= 1.02 and worst <= 1.05 (issue 13, acceptance
2) - under each rule: ``now`` (``fit_advised`` as shipped), ``before`` (the choice above,
restated here), and the level alone, boosting alone and the prior alone, each always.
Nothing is measured or written.

    python benchmarks/averaged_layers.py --db a.db b.db ... [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cptune.errors import CPTuneError
from cptune.model import Case, CostModel, fit_advised, load_training, score_group
from cptune.model._evaluation import (  # the old rule's tests, and cptune fit's folds and scoring
    _decision_regrets,
    _evaluation,
    _folds,
    _worse_beyond_noise,
)

#: cptune fit's goal for recommend's pick: median and worst regret, ties as ties.
GOAL = (1.02, 1.05)

Rule = Callable[[list[Case], np.ndarray, np.ndarray], CostModel]


def before(cases: list[Case], latencies: np.ndarray, tied: np.ndarray) -> CostModel:
    """The choice ``recommend`` made before the layers were averaged (module docstring)."""
    prior = np.array([case.prior().total_s for case in cases])
    prior_score = score_group("prior", cases, latencies, prior, tied=tied)
    prior_regrets = _decision_regrets(cases, latencies, prior, tied)[1]
    candidates = []
    for weight in (1.0, 0.0):  # the level where measured, boosted elsewhere; boosted alone
        model = CostModel(shape_weight=weight).fit(cases, latencies)
        if model.out_of_fold_ is None:
            continue
        held_out = score_group("correction", cases, latencies, model.out_of_fold_, tied=tied)
        regrets = _decision_regrets(cases, latencies, model.out_of_fold_, tied)[1]
        if (held_out.workload_error <= prior_score.workload_error
                and not _worse_beyond_noise(np.log(regrets) - np.log(prior_regrets))):
            candidates.append((held_out.workload_error, weight == 1.0, model))  # ties: boosted first
    if candidates:
        return min(candidates, key=lambda candidate: candidate[:2])[2]
    return CostModel(learn_correction=False).fit(cases, latencies)


RULES: dict[str, Rule] = {
    "now": lambda cases, latencies, tied: fit_advised(cases, latencies, tied)[0],
    "before": before,
    "level alone": lambda cases, latencies, tied: CostModel(shape_weight=1.0).fit(cases, latencies),
    "boosted alone": lambda cases, latencies, tied: CostModel(shape_weight=0.0).fit(cases, latencies),
    "prior alone": lambda cases, latencies, tied: CostModel(learn_correction=False).fit(cases, latencies),
}


def score(cases: list[Case], latencies: np.ndarray, tied: np.ndarray) -> dict[str, dict[str, float | bool]]:
    """Each rule's pick held out by sequence length: the median over lengths of the mean
    regret, ties as ties, the worst single decision, and whether the goal is met."""
    groups, folds = _folds(cases, "seq_len")
    out: dict[str, dict[str, float | bool]] = {}
    for name, rule in RULES.items():
        predicted = np.empty(len(cases))
        for train, test in folds:
            model = rule([cases[i] for i in train], latencies[train], tied[train])
            predicted[test] = model.predict([cases[i] for i in test])
        held_out = _evaluation(name, "seq_len", cases, latencies, groups, predicted, None, tied=tied)
        median, worst = held_out.median_tie_regret, held_out.worst_tie_regret
        out[name] = {"median": median, "worst": worst, "meets_goal": median <= GOAL[0] and worst <= GOAL[1]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", nargs="+", required=True,
                        help="databases of measured sweeps, each calibrated")
    parser.add_argument("--json", action="store_true", help="one JSON object per database, then the totals")
    args = parser.parse_args(argv)
    met = dict.fromkeys(RULES, 0)
    for db in args.db:
        try:
            data = load_training(db)
        except CPTuneError as exc:
            print(f"averaged_layers: {db}: {exc}", file=sys.stderr)
            return 2
        scores = score(list(data.cases), data.latencies_s, data.tied_with_leader())
        for name, figures in scores.items():
            met[name] += bool(figures["meets_goal"])
        if args.json:
            print(json.dumps({"db": Path(db).name, **scores}))
        else:
            print(f"{Path(db).name}: " + "; ".join(
                f"{name} {f['median']:.3f}/{f['worst']:.3f}{'' if f['meets_goal'] else ' MISS'}"
                for name, f in scores.items()), flush=True)
    totals = {name: f"{count} of {len(args.db)}" for name, count in met.items()}
    print(json.dumps({"goal_met": totals}) if args.json else
          "goal met (median <= 1.02, worst <= 1.05): " + "; ".join(f"{n} {t}" for n, t in totals.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
