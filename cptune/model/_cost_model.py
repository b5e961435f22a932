"""The cost model: the physical prior, sharpened by a learned correction where measurements exist.

``CostModel`` follows scikit-learn's estimator conventions (parameters only in
``__init__``, ``fit`` returns self, fitted attributes end in ``_``), so ``clone``,
``cross_validate`` and ``GroupKFold`` work on it. Its samples are ``Case`` objects - a
workload, a configuration and the ``Profile`` of the hardware - and its target is the
measured latency in seconds.

Prediction = prior x exp(correction), the correction learned from the log of measured /
prior in two layers. Gradient boosting on the residual over features of the shape, the
configuration and the prior's breakdown speaks for every case. Where the same
configuration of the same workload shape (everything but the sequence length) was
measured on the same hardware at other lengths, a second estimate speaks too: the mean of
those measurements' log residuals, the shape's level - the prior's physics carries the
length trend and the configuration's own measurements its level (how far this host's
calibration misjudges it). There the correction is the two averaged (``shape_weight`` of
the level, 0.5): neither is chosen over the other, since which one orders a held-out
length better is decided by the noise of a dozen decisions. Held out by length on the 16
databases of four fresh pairs calibrated in rounds, where this rule was chosen, the
average met ``cptune fit``'s goal on all 16; choosing between the two per database, as
``recommend`` did before, met it on 13; on a fifth pair and a run made afterwards, 6 of 6
either way (``docs/decisions/0014-averaged-correction.md``). Trees cannot
extrapolate: beyond the measured range they hold their edge value, so there the prior
carries the trend (longer sequences, more ranks). The correction is applied only to
hardware the model was fitted on; elsewhere the prediction is the prior's. Its interval on
described hardware spans what the description's figure ranges allow (``prior_range``); on
a calibrated host without a correction it is the prior-only band (``prior_only_band``: at
least a factor ``prior_band`` wide each way).

The learned correction's interval is conformal: ``fit`` also fits the correction on folds
that each leave whole sequence lengths out (a shape's level from its other lengths only),
and the interval's edges are the quantiles of those out-of-fold errors log(measured /
predicted) - the error the model makes on lengths it has not seen, which is how it is
used. So the band is centred on the estimate's own error distribution, its edges never
cross (one error distribution, two quantiles), and it is widened to contain the estimate
(low <= estimate <= high, always). Its coverage on held-out measurements is what ``cptune
fit`` reports. The same out-of-fold predictions (``out_of_fold_``) are what ``recommend``
judges the correction by against the prior alone
(``cptune.model._evaluation.correction_decision``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.ensemble import GradientBoostingRegressor
from sklearn.model_selection import GroupKFold, KFold
from sklearn.utils.validation import check_is_fitted

from cptune.config import LAYOUTS, STRATEGIES, CPConfig
from cptune.estimate import Estimate, combine, judge_each
from cptune.layout import padded_heads
from cptune.model._prior import PriorTime, prior_time
from cptune.model._profiles import CalibratedProfile, Profile, UnpredictedModeError, check_predicts
from cptune.model._ties import described_prior, prior_range
from cptune.store import Result, Store
from cptune.workload import AttentionShape, Workload

#: Fewer measurements than this leave the correction out: the prior alone predicts.
MIN_SAMPLES = 8
#: At most this many folds for the out-of-fold errors that set the correction's interval.
INTERVAL_FOLDS = 5


#: A configuration of one attention shape (all but the sequence length) on one hardware:
#: what a shape's level pools measurements over.
ShapeKey = tuple[str, CPConfig, AttentionShape]


@dataclass(frozen=True)
class Case:
    """One sample: ``config`` running ``workload`` on the hardware ``profile`` describes."""

    workload: Workload
    config: CPConfig
    profile: Profile

    def prior(self) -> PriorTime:
        return prior_time(self.workload, self.config, self.profile)

    @property
    def shape(self) -> ShapeKey:
        """The hardware, the configuration and the workload but for its length."""
        return self.profile.fingerprint, self.config, self.workload.shape


def _mask_features(workload: Workload) -> tuple[float, ...]:
    """What the mask does to a layer, as the correction reads it: the share of the (query,
    key) pairs it leaves (log; 0 for full attention), how many documents (log2), the window's
    reach and the text's share of the sequence. A plain layer has the same values whatever
    its length (causal's share is its own feature's), so rows of different masks are never
    one workload to the boosting."""
    if not workload.masked:
        return (0.0, 0.0, 0.0, 0.0)
    mask, n = workload.mask, workload.seq_len
    reach = sum(workload.window) / n if workload.window else 0.0
    return (float(np.log(max(mask.area, 1) / (n * n))), float(np.log2(mask.documents)), reach,
            workload.text / n)


def features(cases: Sequence[Case], priors: Sequence[PriorTime]) -> np.ndarray:
    """The correction's inputs: the shape, the configuration (its padded heads' share of the
    heads among them) and the prior's breakdown, on log scales where the quantity spans orders
    of magnitude."""
    rows = []
    for case, prior in zip(cases, priors, strict=True):
        w, c = case.workload, case.config
        total = prior.total_s
        rows.append([
            np.log2(w.seq_len), np.log2(w.heads), np.log2(w.kv_heads), np.log2(w.head_dim),
            float(w.causal), w.wire_dtype.itemsize, np.log2(w.batch), float(w.training),
            np.log2(c.ranks), np.log2(c.head_group), np.log2(c.context_degree),
            *(float(c.strategy == s) for s in STRATEGIES),
            np.log(total), prior.compute_s / total, prior.all_to_all_s / total,
            prior.all_gather_s / total, prior.ring_exposed_s / total,
            *_mask_features(w), *(float(c.layout == layout) for layout in LAYOUTS),
            padded_heads(w, c)[0] / w.heads - 1,
        ])
    return np.asarray(rows, dtype=float)


class CostModel(RegressorMixin, BaseEstimator):  # type: ignore[misc]  # scikit-learn has no types
    """Predicts a ``Case``'s latency in seconds, with an interval (see the module docstring).

    Parameters: the boosting's ``n_estimators``, ``learning_rate``, ``max_depth`` and
    ``min_samples_leaf``; ``interval`` the quantiles of the reported interval; ``prior_band``
    the narrowest factor a prior-only interval spans each way; ``learn_correction`` False
    for the prior alone (a baseline, or when the correction does not help); ``shape_weight``
    the weight of a shape's level against the boosted correction where the shape was
    measured at other lengths (1: the level alone, 0: boosting alone); ``random_state``."""

    def __init__(
        self,
        n_estimators: int = 200,
        learning_rate: float = 0.05,
        max_depth: int = 3,
        min_samples_leaf: int = 3,
        interval: tuple[float, float] = (0.1, 0.9),
        prior_band: float = 2.0,
        learn_correction: bool = True,
        shape_weight: float = 0.5,
        random_state: int = 0,
    ) -> None:
        self.n_estimators = n_estimators
        self.learning_rate = learning_rate
        self.max_depth = max_depth
        self.min_samples_leaf = min_samples_leaf
        self.interval = interval
        self.prior_band = prior_band
        self.learn_correction = learn_correction
        self.shape_weight = shape_weight
        self.random_state = random_state

    def _booster(self) -> GradientBoostingRegressor:
        return GradientBoostingRegressor(
            n_estimators=self.n_estimators, learning_rate=self.learning_rate, max_depth=self.max_depth,
            min_samples_leaf=self.min_samples_leaf, subsample=0.8, random_state=self.random_state,
        )

    def _out_of_fold(self, table: np.ndarray, residual: np.ndarray, cases: list[Case]) -> np.ndarray:
        """The correction each case gets from boosters fitted without it: folds of whole
        sequence lengths (as the model is used: on lengths it has not seen), or of samples
        when only one length was measured."""
        lengths = np.array([case.workload.seq_len for case in cases])
        count = len(set(lengths.tolist()))
        if count >= 2:
            folds = GroupKFold(n_splits=min(INTERVAL_FOLDS, count)).split(table, residual, lengths)
        else:
            folds = KFold(n_splits=INTERVAL_FOLDS, shuffle=True, random_state=self.random_state).split(table)
        predicted = np.empty(len(residual))
        for train, test in folds:
            predicted[test] = self._booster().fit(table[train], residual[train]).predict(table[test])
        return predicted

    def fit(self, X: Sequence[Case], y: Sequence[float] | np.ndarray) -> CostModel:
        """Learn the correction from measured latencies ``y`` (seconds) of cases ``X``."""
        cases, latency = list(X), np.asarray(y, dtype=float)
        if len(cases) != len(latency) or not np.all(latency > 0):
            raise ValueError("fit needs one positive latency per case")
        if not 0.0 <= self.shape_weight <= 1.0:
            raise ValueError(f"shape_weight must lie in [0, 1], got {self.shape_weight}")
        priors = [case.prior() for case in cases]
        prior = np.array([p.total_s for p in priors])
        residual = np.log(latency) - np.log(prior)
        self.fingerprints_ = frozenset(case.profile.fingerprint for case in cases)
        self.n_samples_ = len(cases)
        #: The prior's own error on the fitted data, as factors: the prior-only interval.
        self.prior_interval_ = self._prior_interval(residual)
        self.correction_: GradientBoostingRegressor | None = None
        #: Held-out latencies (s) of the fitted cases, from the out-of-fold corrections.
        self.out_of_fold_: np.ndarray | None = None
        #: The correction's interval as log factors around its estimate (low <= 0 <= high).
        self.correction_interval_ = (0.0, 0.0)
        #: Log residuals of each measured shape, by sequence length (its level's evidence).
        self.shape_residuals_: dict[ShapeKey, dict[int, list[float]]] = {}
        if not self.learn_correction or len(cases) < MIN_SAMPLES:
            return self
        if self.shape_weight > 0:
            for case, error in zip(cases, residual, strict=True):
                self.shape_residuals_.setdefault(case.shape, {}).setdefault(case.workload.seq_len, []).append(
                    float(error))
        table = features(cases, priors)
        boosted = self._out_of_fold(table, residual, cases)
        held_out = self._with_levels(cases, boosted, leave_out_own_length=True)
        self.correction_interval_ = self._error_interval(residual - held_out)
        self.out_of_fold_ = prior * np.exp(held_out)
        self.correction_ = self._booster().fit(table, residual)
        return self

    def _error_interval(self, errors: np.ndarray) -> tuple[float, float]:
        """The ``interval`` quantiles of held-out log errors, as log factors around the
        estimate (low <= 0 <= high)."""
        low, high = np.quantile(errors, self.interval)
        return min(float(low), 0.0), max(float(high), 0.0)

    def _with_levels(self, cases: Sequence[Case], boosted: np.ndarray, leave_out_own_length: bool = False
                     ) -> np.ndarray:
        """Each case's log correction: the boosted one (``boosted``), averaged with its
        shape's level (``shape_weight`` of it) where the shape was measured at other lengths."""
        corrections = boosted.copy()
        for i, case in enumerate(cases):
            if (level := self._shape_level(case, leave_out_own_length)) is not None:
                corrections[i] = self.shape_weight * level + (1 - self.shape_weight) * boosted[i]
        return corrections

    def _shape_level(self, case: Case, leave_out_own_length: bool = False) -> float | None:
        """The mean log residual of ``case``'s shape over its measured lengths (each length
        weighs alike; without the case's own when ``leave_out_own_length``), or None when
        there are none."""
        lengths = self.shape_residuals_.get(case.shape, {})
        means = [float(np.mean(errors)) for seq_len, errors in lengths.items()
                 if not (leave_out_own_length and seq_len == case.workload.seq_len)]
        return float(np.mean(means)) if means else None

    def _prior_interval(self, residual: np.ndarray) -> tuple[float, float]:
        """The prior-only interval as factors of the prior: its error quantiles on the
        fitted data, at least ``prior_band`` wide each way."""
        low, high = np.quantile(residual, self.interval) if len(residual) else (0.0, 0.0)
        return min(float(np.exp(low)), 1 / self.prior_band), max(float(np.exp(high)), self.prior_band)

    def prior_only_band(self, cases: Sequence[Case], prior: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Low and high edge (s) of the prior-only interval of ``cases``, whose prior
        latencies are ``prior`` (s): where the correction does not apply. On described hardware
        the range the description's figures allow; elsewhere the prior's error on the fitted
        data, at least ``prior_band`` each way."""
        low, high = prior * self.prior_interval_[0], prior * self.prior_interval_[1]
        for i, case in enumerate(cases):
            described = described_prior(case.workload, case.config, case.profile)
            if described is not None and described.swings:
                same = prior[i] == described.total_s  # the usual case: its range is worked out
                low[i], high[i] = (described.low_s, described.high_s) if same else prior_range(
                    prior[i], described.swings)
        return low, high

    def corrects(self, case: Case) -> bool:
        """Whether the learned correction applies to ``case`` (its hardware was fitted on)."""
        return self.correction_ is not None and case.profile.fingerprint in self.fingerprints_

    def predict_interval(self, X: Sequence[Case]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Latency, low and high edge of the interval, in seconds, for each case;
        low <= latency <= high."""
        check_is_fitted(self, "prior_interval_")
        cases = list(X)
        corrected = np.array([self.corrects(case) for case in cases], dtype=bool)
        # a described configuration's total comes with its ranges (one evaluation for both);
        # the breakdown is needed only where the correction reads it
        described = [None if k else described_prior(c.workload, c.config, c.profile)
                     for c, k in zip(cases, corrected, strict=True)]
        priors = {i: cases[i].prior() for i, d in enumerate(described) if d is None}
        prior = np.array([priors[i].total_s if d is None else d.total_s for i, d in enumerate(described)])
        estimate = prior.copy()
        low, high = self.prior_only_band(cases, prior)
        if corrected.any():
            assert self.correction_ is not None
            table = features([c for c, k in zip(cases, corrected, strict=True) if k],
                             [priors[i] for i, k in enumerate(corrected) if k])
            correction = self._with_levels([c for c, k in zip(cases, corrected, strict=True) if k],
                                           self.correction_.predict(table))
            estimate[corrected] = prior[corrected] * np.exp(correction)
            below, above = self.correction_interval_
            low[corrected] = estimate[corrected] * np.exp(below)
            high[corrected] = estimate[corrected] * np.exp(above)
        return estimate, low, high

    def predict(self, X: Sequence[Case]) -> np.ndarray:
        """Latency in seconds for each case."""
        return self.predict_interval(X)[0]


@dataclass(frozen=True)
class TrainingSet:
    """What a store holds for the model: the combined estimate (``cptune.estimate.combine``)
    of each configuration over all its clean visits, on every hardware that has a calibration
    (the prior needs its rates). ``cases[i]``, ``latencies_s[i]`` and ``estimates[i]`` are one
    configuration; its latency is the estimate's, never the newest visit alone."""

    cases: list[Case]
    latencies_s: np.ndarray
    estimates: list[Estimate]
    profiles: dict[str, CalibratedProfile]
    #: Fingerprints with measurements but no calibration: left out, ``cptune calibrate`` fixes it.
    uncalibrated: frozenset[str]
    #: The combined estimates on those: no case for the model, but measurements still
    #: (``recommend`` compares them where it cannot predict).
    unfitted: tuple[Estimate, ...] = ()

    @property
    def results(self) -> list[Result]:
        """The newest clean visit of each estimate: the stored row that stands for it (its id,
        hardware and marks). Its own ``median_ms`` is one visit's; the combined latency is
        ``latencies_s``."""
        return [estimate.visits[-1] for estimate in self.estimates]

    def tied_with_leader(self) -> np.ndarray:
        """For each case, whether the measured verdict of its (hardware, workload) cannot
        tell it from the fastest (``cptune.estimate.judge``: the leader or one tied with it).
        A pick among these is as good as the leader within the noise of that hardware."""
        top = {(hardware, workload, config)
               for (hardware, workload), verdict in judge_each(self.estimates).items()
               for config in verdict.contenders}
        return np.array([(e.hardware, e.workload, e.config) in top for e in self.estimates], dtype=bool)


def _predicts(workload: Workload, profile: CalibratedProfile) -> bool:
    """Whether the prior predicts ``workload`` on ``profile`` (a training step needs the
    backward's speed, which calibrations stored before it was timed lack)."""
    try:
        check_predicts(workload, profile)
    except UnpredictedModeError:
        return False
    return True


def training_set(store: Store, include_oversubscribed: bool = False) -> TrainingSet:
    """Read ``store`` into cases and their combined measured latencies, forward and training
    steps alike (a shape's mode is part of its key, and a feature). Failed, disturbed and
    excluded visits count for nothing; oversubscribed ones are left out unless
    ``include_oversubscribed`` (they are also left out of the noise the intervals pool);
    training steps on a host whose calibration did not time the backward are left out."""
    hardware = store.hardware()
    profiles = {
        fingerprint: CalibratedProfile(host, calibration)
        for fingerprint, host in hardware.items()
        if (calibration := store.calibration(fingerprint)) is not None
    }
    oversubscribed = None if include_oversubscribed else False  # None: no filter
    rows = store.results(status="ok", excluded=False, disturbed=False, oversubscribed=oversubscribed)
    estimates = combine(rows)
    kept = [e for e in estimates.values()
            if e.hardware in profiles and _predicts(e.workload, profiles[e.hardware])]
    fitted = {id(e) for e in kept}
    return TrainingSet(
        cases=[Case(e.workload, e.config, profiles[e.hardware]) for e in kept],
        latencies_s=np.array([e.median_ms for e in kept], dtype=float) / 1e3,
        estimates=kept,
        profiles=profiles,
        uncalibrated=frozenset(e.hardware for e in estimates.values()) - set(profiles),
        unfitted=tuple(e for e in estimates.values() if id(e) not in fitted),
    )
