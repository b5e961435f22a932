"""How good the cost model's picks are on what it has not seen: grouped cross-validation.

Auto-tuners are judged by the latency of their pick, not by RMSE (TVM/Ansor, TenSet), so
each held-out group is scored on its decisions - one per (hardware, workload): choose among
the configurations measured for it - and on the fit of the numbers themselves:

- top-1: fraction of decisions whose pick is the fastest measured configuration;
- regret: measured latency of the pick / the best measured latency (1.0 is perfect);
- Spearman: rank correlation of predicted and measured latencies within a decision;
- MAPE: mean absolute percentage error of the predicted latencies.

Groups are whole sequence lengths (``by="seq_len"``: the model never saw that length on
any workload) or whole hardware fingerprints (``by="hardware"``: only the prior speaks).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import spearmanr
from sklearn.base import clone
from sklearn.model_selection import GroupKFold

from cptune.cost_model import Case, CostModel, TrainingSet, training_set
from cptune.errors import CPTuneError
from cptune.store import Store

GROUPINGS: tuple[str, ...] = ("seq_len", "hardware")


@dataclass(frozen=True)
class GroupScore:
    """The scores of one held-out group."""

    held_out: str
    decisions: int
    samples: int
    top1: float
    regret: float
    worst_regret: float
    spearman: float
    mape: float


@dataclass(frozen=True)
class Evaluation:
    """Per held-out group scores, grouped ``by`` a sequence length or a hardware."""

    by: str
    groups: tuple[GroupScore, ...]

    @property
    def median_regret(self) -> float:
        return float(np.median([g.regret for g in self.groups]))

    @property
    def worst_regret(self) -> float:
        return max(g.worst_regret for g in self.groups)


def _group_of(case: Case, by: str) -> str:
    return f"seq_len {case.workload.seq_len}" if by == "seq_len" else f"hardware {case.profile.fingerprint}"


def score_group(name: str, cases: Sequence[Case], measured: np.ndarray, predicted: np.ndarray) -> GroupScore:
    """Score predictions for ``cases`` against their measured latencies (same units)."""
    decisions: dict[tuple[str, object], list[int]] = defaultdict(list)
    for i, case in enumerate(cases):
        decisions[(case.profile.fingerprint, case.workload)].append(i)
    regrets, hits, correlations = [], [], []
    for members in decisions.values():
        truth, guess = measured[members], predicted[members]
        regret = float(truth[int(np.argmin(guess))] / truth.min())
        regrets.append(regret)
        hits.append(regret == 1.0)
        if len(members) > 2:
            correlations.append(float(spearmanr(guess, truth).statistic))
    return GroupScore(
        held_out=name,
        decisions=len(decisions),
        samples=len(cases),
        top1=float(np.mean(hits)),
        regret=float(np.mean(regrets)),
        worst_regret=float(np.max(regrets)),
        spearman=float(np.mean(correlations)) if correlations else float("nan"),
        mape=float(np.mean(np.abs(predicted - measured) / measured) * 100),
    )


def held_out_predictions(
    cases: Sequence[Case], latencies: np.ndarray, by: str = "seq_len", model: CostModel | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Each case's group name and its latency (s) predicted by a clone of ``model`` fitted on
    every other group (``GroupKFold``, one fold per group): what the model says about data
    it has not seen."""
    if by not in GROUPINGS:
        raise ValueError(f"by must be one of {', '.join(GROUPINGS)}, got {by!r}")
    cases = list(cases)
    groups = np.array([_group_of(case, by) for case in cases])
    count = len(set(groups))
    if count < 2:
        raise CPTuneError(
            f"cross-validation by {by} needs measurements of at least two groups, found "
            f"{count}; measure more with cptune search"
        )
    predicted = np.empty(len(cases))
    for train, test in GroupKFold(n_splits=count).split(cases, latencies, groups):
        fitted = clone(model or CostModel()).fit([cases[i] for i in train], latencies[train])
        predicted[test] = fitted.predict([cases[i] for i in test])
    return groups, predicted


def cross_validate_groups(
    cases: Sequence[Case], latencies: np.ndarray, by: str = "seq_len", model: CostModel | None = None
) -> Evaluation:
    """Hold out each group in turn and score the held-out predictions of each group."""
    cases = list(cases)
    groups, predicted = held_out_predictions(cases, latencies, by, model)
    names = sorted(set(groups), key=lambda g: (len(g), g))
    scores = []
    for name in names:
        members = np.flatnonzero(groups == name)
        scores.append(score_group(name, [cases[i] for i in members], latencies[members], predicted[members]))
    return Evaluation(by=by, groups=tuple(scores))


def load_training(db: str | None = None, include_oversubscribed: bool = False) -> TrainingSet:
    """The training set of ``db`` (see ``training_set``); a ``CPTuneError`` saying what to
    run when it is empty."""
    with Store(db, create=False) as store:
        data = training_set(store, include_oversubscribed)
    if not data.cases and data.uncalibrated:
        raise CPTuneError(
            f"the measurements in {store.url} are of hardware with no calibration "
            f"({', '.join(sorted(data.uncalibrated))}): run cptune calibrate on it with this database"
        )
    if not data.cases:
        raise CPTuneError(f"no measurements in {store.url}: run cptune search first")
    return data


def evaluate(db: str | None = None, by: str = "seq_len", model: CostModel | None = None) -> Evaluation:
    """Cross-validate the cost model on the measurements of ``db`` (default as for the
    CLI), holding out whole sequence lengths or whole hardware fingerprints."""
    data = load_training(db)
    return cross_validate_groups(data.cases, data.latencies_s, by, model)
