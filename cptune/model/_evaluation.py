"""How good the cost model's picks are on what it has not seen: grouped cross-validation.

Auto-tuners are judged by the latency of their pick, not by RMSE (TVM/Ansor, TenSet), so
each held-out group is scored on its decisions - one per (hardware, workload): choose among
the configurations measured for it - and on the fit of the numbers themselves:

- top-1: fraction of decisions whose pick is the fastest measured configuration;
- regret: measured latency of the pick / the best measured latency (1.0 is perfect);
- regret with ties as ties: 1.0 when the measured verdict of the decision
  (``cptune.estimate.judge``) cannot tell the pick from the fastest (it is the leader or
  tied with it within the noise of that hardware), else the plain regret. Measured
  latencies are the combined estimates of all clean visits, so a pick that differs from the
  leader by less than the noise is not charged for the noise;
- Spearman: rank correlation of predicted and measured latencies within a decision;
- MAPE: mean absolute percentage error of the predicted latencies;
- error within a workload: the mean absolute log error (as a percentage) once each
  decision's shared error is taken out - how wrong the predictions are about one workload's
  configurations relative to one another, which is all its pick depends on;
- coverage: fraction of measurements inside the predicted interval (the model advertises
  its ``interval`` quantiles, 80% by default).

Groups are whole sequence lengths (``by="seq_len"``: the model never saw that length on
any workload) or whole hardware fingerprints (``by="hardware"``: only the prior speaks).

Every method is scored the same way, and so is ``recommend``'s own pick (the model as
``fit_advised`` settles it on each training fold: with the learned correction unless it is
worse than the prior alone), beside two baselines a user would otherwise rely on:
the physical prior alone (no learned correction), and a fixed rule - always the
configuration that was fastest in the most decisions of the training folds (among those
measured for the decision; a rule picks, it predicts no latency, so it has no MAPE or
coverage). ``correction_decision`` decides whether ``recommend`` applies the learned
correction: unless, out of fold, it is worse than the prior alone beyond the noise, on how
its numbers order the configurations of each workload (their log error with the
decision's shared part taken out: a level every configuration shares misleads no pick, so
MAPE is not the judge; paired sample by sample) or on regret with ties as ties (paired
decision by decision: same workloads, same truth). Worse means the 95% interval of the
mean paired difference lies above 0. A difference within that interval is a tie, as one
between two measured configurations is, and a tie keeps the correction, which speaks from
measurements where the prior speaks from rates: refusing it on a difference the noise
could make cost ``recommend`` cptune fit's goal on a database where the correction met it
(``docs/decisions/0014-averaged-correction.md``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import spearmanr
from scipy.stats import t as student_t
from sklearn.base import clone
from sklearn.model_selection import GroupKFold

from cptune.config import CPConfig
from cptune.errors import CPTuneError
from cptune.model._cost_model import MIN_SAMPLES, Case, CostModel, TrainingSet, training_set
from cptune.store import Store

GROUPINGS: tuple[str, ...] = ("seq_len", "hardware")
#: The methods ``compare`` scores, in the order ``cptune fit`` shows them.
MODEL, PRIOR, FIXED_RULE, RECOMMENDED = "cost model", "prior alone", "fixed rule", "recommend's pick"


@dataclass(frozen=True)
class GroupScore:
    """The scores of one held-out group; ``spearman``, ``mape`` and ``coverage`` are NaN
    where they do not apply (no decision of three configurations; a method that predicts
    no latency or no interval)."""

    held_out: str
    decisions: int
    samples: int
    top1: float
    regret: float
    worst_regret: float
    spearman: float
    mape: float
    coverage: float
    #: Mean and worst regret with ties as ties (the plain ones where no verdict was given).
    tie_regret: float
    worst_tie_regret: float
    #: Percent error of the predictions relative to one another within each decision
    #: (``_workload_error``); NaN where there is no MAPE or a prediction is not a latency.
    workload_error: float = float("nan")


@dataclass(frozen=True)
class Evaluation:
    """Per held-out group scores of one ``method``, grouped ``by`` a sequence length or a
    hardware; ``overall`` scores every held-out prediction together."""

    by: str
    groups: tuple[GroupScore, ...]
    overall: GroupScore
    method: str = MODEL

    @property
    def median_regret(self) -> float:
        return float(np.median([g.regret for g in self.groups]))

    @property
    def worst_regret(self) -> float:
        return max(g.worst_regret for g in self.groups)

    @property
    def median_tie_regret(self) -> float:
        """The median over held-out groups of their mean regret with ties as ties."""
        return float(np.median([g.tie_regret for g in self.groups]))

    @property
    def worst_tie_regret(self) -> float:
        """The worst single decision's regret with ties as ties."""
        return max(g.worst_tie_regret for g in self.groups)


@dataclass(frozen=True)
class CorrectionDecision:
    """Whether ``recommend`` applies the learned correction, and the out-of-fold scores of
    the correction and of the prior alone it was decided on (None when nothing was fitted)."""

    applied: bool
    reason: str
    correction: GroupScore | None
    prior: GroupScore | None

    def to_dict(self) -> dict[str, object]:
        def scores(score: GroupScore | None) -> dict[str, float] | None:
            return None if score is None else {"regret": score.regret, "tie_regret": score.tie_regret,
                                               "mape": score.mape, "workload_error": score.workload_error}

        return {"applied": self.applied, "reason": self.reason, "correction": scores(self.correction),
                "prior": scores(self.prior)}


def _group_of(case: Case, by: str) -> str:
    return f"seq_len {case.workload.seq_len}" if by == "seq_len" else f"hardware {case.profile.fingerprint}"


def _decisions(cases: Sequence[Case]) -> list[list[int]]:
    """Indices of ``cases`` by decision: one per (hardware, workload)."""
    decisions: dict[tuple[str, object], list[int]] = defaultdict(list)
    for i, case in enumerate(cases):
        decisions[(case.profile.fingerprint, case.workload)].append(i)
    return list(decisions.values())


def score_group(
    name: str,
    cases: Sequence[Case],
    measured: np.ndarray,
    predicted: np.ndarray,
    interval: tuple[np.ndarray, np.ndarray] | None = None,
    latencies: bool = True,
    tied: np.ndarray | None = None,
) -> GroupScore:
    """Score predictions for ``cases`` against their measured latencies (same units), and
    the ``interval`` (low, high) when given. ``latencies`` False: ``predicted`` is only a
    preference (lower first), so there is no MAPE. ``tied``: for each case, whether its
    decision's measured verdict cannot tell it from the fastest (``TrainingSet.tied_with_leader``);
    a pick among those has regret 1.0 with ties as ties."""
    correlations = [float(spearmanr(predicted[members], measured[members]).statistic)
                    for members in _decisions(cases) if len(members) > 2]
    regrets, tie_regrets = _decision_regrets(cases, measured, predicted, tied)
    hits = regrets == 1.0
    coverage = float("nan")
    if interval is not None:
        low, high = interval
        coverage = float(np.mean((low <= measured) & (measured <= high)))
    return GroupScore(
        held_out=name,
        decisions=len(regrets),
        samples=len(cases),
        top1=float(np.mean(hits)),
        regret=float(np.mean(regrets)),
        worst_regret=float(np.max(regrets)),
        spearman=float(np.nanmean(correlations)) if correlations else float("nan"),
        mape=float(np.mean(np.abs(predicted - measured) / measured) * 100) if latencies else float("nan"),
        coverage=coverage,
        tie_regret=float(np.mean(tie_regrets)),
        worst_tie_regret=float(np.max(tie_regrets)),
        workload_error=(100 * _workload_error(cases, measured, predicted)
                        if latencies and np.all(predicted > 0) else float("nan")),
    )


def _decision_regrets(
    cases: Sequence[Case], measured: np.ndarray, predicted: np.ndarray, tied: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Each decision's regret and its regret with ties as ties (see ``score_group``)."""
    regrets, tie_regrets = [], []
    for members in _decisions(cases):
        truth = measured[members]
        pick = int(np.argmin(predicted[members]))
        regret = float(truth[pick] / truth.min())
        regrets.append(regret)
        tie_regrets.append(1.0 if tied is not None and tied[members[pick]] else regret)
    return np.array(regrets), np.array(tie_regrets)


def _worse_beyond_noise(differences: np.ndarray) -> bool:
    """Whether paired ``differences`` (one method's loss minus another's, same cases) say the
    first is worse beyond their noise: the 95% t interval of their mean lies above 0."""
    mean = float(differences.mean())
    if len(differences) < 2:
        return mean > 0
    count = len(differences)
    half = float(student_t.ppf(0.975, count - 1)) * float(differences.std(ddof=1)) / np.sqrt(count)
    return bool(mean - half > 0)


def _folds(cases: Sequence[Case], by: str) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """Each case's group name and the (train, test) index pairs holding out one group each."""
    if by not in GROUPINGS:
        raise ValueError(f"by must be one of {', '.join(GROUPINGS)}, got {by!r}")
    groups = np.array([_group_of(case, by) for case in cases])
    count = len(set(groups))
    if count < 2:
        raise CPTuneError(
            f"cross-validation by {by} needs measurements of at least two groups, found "
            f"{count}; measure more with cptune search"
        )
    return groups, list(GroupKFold(n_splits=count).split(groups, groups, groups))


def held_out_predictions(
    cases: Sequence[Case], latencies: np.ndarray, by: str = "seq_len", model: CostModel | None = None,
    advised: bool = False, tied: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each case's group name and its latency (s) and interval (low, high, s) predicted by
    a clone of ``model`` fitted on every other group (``GroupKFold``, one fold per group):
    what the model says about data it has not seen. ``advised``: the model ``recommend``
    would use instead (``fit_advised`` on the training groups, with their ``tied`` flags)."""
    cases = list(cases)
    groups, folds = _folds(cases, by)
    predicted, low, high = (np.empty(len(cases)) for _ in range(3))
    for train, test in folds:
        training = [cases[i] for i in train]
        if advised:
            fitted, _ = fit_advised(training, latencies[train], None if tied is None else tied[train])
        else:
            fitted = clone(model or CostModel()).fit(training, latencies[train])
        predicted[test], low[test], high[test] = fitted.predict_interval([cases[i] for i in test])
    return groups, predicted, low, high


def _fixed_rule_preferences(
    cases: Sequence[Case], latencies: np.ndarray, by: str
) -> tuple[np.ndarray, np.ndarray]:
    """Each case's group name and its held-out preference under the fixed rule: 0 for the
    configuration fastest in the most training decisions, 1 for the next, ... (configs never
    fastest in training come last, fewest ranks first)."""
    cases = list(cases)
    groups, folds = _folds(cases, by)
    preference = np.empty(len(cases))
    for train, test in folds:
        training = [cases[i] for i in train]
        wins: Counter[CPConfig] = Counter(
            training[members[int(np.argmin(latencies[train][members]))]].config
            for members in _decisions(training)
        )
        order = sorted({cases[i].config for i in test},
                       key=lambda c: (-wins[c], c.ranks, c.label, c.head_group))
        rank = {config: position for position, config in enumerate(order)}
        preference[test] = [rank[cases[i].config] for i in test]
    return groups, preference


def _evaluation(
    method: str, by: str, cases: list[Case], latencies: np.ndarray, groups: np.ndarray, predicted: np.ndarray,
    interval: tuple[np.ndarray, np.ndarray] | None, predicts_latency: bool = True,
    tied: np.ndarray | None = None,
) -> Evaluation:
    scores = []
    for name in sorted(set(groups), key=lambda g: (len(g), g)):
        members = np.flatnonzero(groups == name)
        band = None if interval is None else (interval[0][members], interval[1][members])
        scores.append(score_group(name, [cases[i] for i in members], latencies[members], predicted[members],
                                  band, predicts_latency, None if tied is None else tied[members]))
    overall = score_group("all", cases, latencies, predicted, interval, predicts_latency, tied)
    return Evaluation(by=by, groups=tuple(scores), overall=overall, method=method)


def cross_validate_groups(
    cases: Sequence[Case], latencies: np.ndarray, by: str = "seq_len", model: CostModel | None = None,
    method: str = MODEL, tied: np.ndarray | None = None, advised: bool = False,
) -> Evaluation:
    """Hold out each group in turn and score the held-out predictions of each group
    (``tied`` and ``advised`` as for ``score_group`` and ``held_out_predictions``)."""
    cases = list(cases)
    groups, predicted, low, high = held_out_predictions(cases, latencies, by, model, advised, tied)
    return _evaluation(method, by, cases, latencies, groups, predicted, (low, high), tied=tied)


def fixed_rule(
    cases: Sequence[Case], latencies: np.ndarray, by: str = "seq_len", tied: np.ndarray | None = None
) -> Evaluation:
    """The fixed-rule baseline (see the module docstring), held out and scored as the model is."""
    cases = list(cases)
    groups, preference = _fixed_rule_preferences(cases, latencies, by)
    return _evaluation(FIXED_RULE, by, cases, latencies, groups, preference, None, predicts_latency=False,
                       tied=tied)


def compare(
    cases: Sequence[Case], latencies: np.ndarray, by: str = "seq_len", model: CostModel | None = None,
    tied: np.ndarray | None = None,
) -> tuple[Evaluation, Evaluation, Evaluation, Evaluation]:
    """The cost model, the prior alone, ``recommend``'s pick (``fit_advised`` per fold; with
    the default model) and the fixed rule, each held out ``by`` and scored alike."""
    prior_only = clone(model or CostModel()).set_params(learn_correction=False)
    return (cross_validate_groups(cases, latencies, by, model, tied=tied),
            cross_validate_groups(cases, latencies, by, prior_only, method=PRIOR, tied=tied),
            cross_validate_groups(cases, latencies, by, method=RECOMMENDED, tied=tied, advised=True),
            fixed_rule(cases, latencies, by, tied))


def _within_errors(cases: Sequence[Case], measured: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """Each case's absolute log error once its decision's mean log error is taken out: how
    wrong the prediction is about that configuration relative to the workload's others, which
    is all a pick depends on (a level all of them share misleads no pick)."""
    errors = np.log(predicted / measured)
    within = np.empty(len(cases))
    for members in _decisions(cases):
        within[members] = np.abs(errors[members] - errors[members].mean())
    return within


def _workload_error(cases: Sequence[Case], measured: np.ndarray, predicted: np.ndarray) -> float:
    """The mean of ``_within_errors``: the error of the predictions within a workload."""
    return float(np.mean(_within_errors(cases, measured, predicted)))


def correction_decision(
    model: CostModel, cases: Sequence[Case], latencies: np.ndarray, tied: np.ndarray | None = None
) -> CorrectionDecision:
    """Whether the learned correction of ``model`` (fitted on ``cases``) should be applied:
    its out-of-fold predictions against the prior alone on the same cases, by their error
    within each decision and by regret with ties as ties (``tied`` as for ``score_group``);
    applied unless worse than the prior beyond the noise on either (module docstring)."""
    if model.out_of_fold_ is None:
        reason = (f"fewer than {MIN_SAMPLES} measurements" if model.learn_correction and
                  model.n_samples_ < MIN_SAMPLES else "no correction fitted")
        return CorrectionDecision(False, reason, None, None)
    cases = list(cases)
    prior = np.array([case.prior().total_s for case in cases])
    learned = score_group("correction", cases, latencies, model.out_of_fold_, tied=tied)
    alone = score_group("prior", cases, latencies, prior, tied=tied)
    worse_picks = _worse_beyond_noise(np.log(_decision_regrets(cases, latencies, model.out_of_fold_, tied)[1])
                                      - np.log(_decision_regrets(cases, latencies, prior, tied)[1]))
    worse_order = _worse_beyond_noise(_within_errors(cases, latencies, model.out_of_fold_)
                                      - _within_errors(cases, latencies, prior))
    applied = not (worse_picks or worse_order)
    finding = "not worse than the prior alone beyond the noise" if applied else "worse than the prior alone"
    reason = (f"held out, the learned correction is {finding}: regret (ties as ties) "
              f"{learned.tie_regret:.3f} vs {alone.tie_regret:.3f}, error within a workload "
              f"{learned.workload_error:.1f}% vs {alone.workload_error:.1f}% "
              f"(MAPE {learned.mape:.1f}% vs {alone.mape:.1f}%)")
    return CorrectionDecision(applied, reason, learned, alone)


def fit_advised(
    cases: Sequence[Case], latencies_s: np.ndarray, tied: np.ndarray | None = None
) -> tuple[CostModel, CorrectionDecision]:
    """The model ``recommend`` predicts with, fitted on ``cases``: the learned correction (both
    layers averaged, ``CostModel``'s default) where the decision keeps it (``tied`` as for
    ``correction_decision``), else the prior alone. One candidate and no choice among layers:
    such a choice is won by the noise of a dozen decisions."""
    cases = list(cases)
    model = CostModel().fit(cases, latencies_s)
    decision = correction_decision(model, cases, latencies_s, tied)
    if not decision.applied and model.correction_ is not None:
        model = model.set_params(learn_correction=False).fit(cases, latencies_s)
    return model, decision


def load_training(db: str | None = None, include_oversubscribed: bool = False) -> TrainingSet:
    """The training set of ``db`` (see ``training_set``); a ``CPTuneError`` saying what to
    run when it is empty."""
    with Store(db, reading=True) as store:
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
    return cross_validate_groups(data.cases, data.latencies_s, by, model, tied=data.tied_with_leader())
