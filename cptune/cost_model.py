"""The cost model: the physical prior, sharpened by a learned correction where measurements exist.

``CostModel`` follows scikit-learn's estimator conventions (parameters only in
``__init__``, ``fit`` returns self, fitted attributes end in ``_``), so ``clone``,
``cross_validate`` and ``GroupKFold`` work on it. Its samples are ``Case`` objects - a
workload, a configuration and the ``Profile`` of the hardware - and its target is the
measured latency in seconds.

Prediction = prior x exp(correction). The correction is gradient boosting on the log of
measured / prior, with quantile boosting at the interval's edges for the uncertainty. Trees
cannot extrapolate: beyond the measured range they hold their edge value, so the prior's
physics carries the trend (longer sequences, more ranks). The correction is applied only to
hardware the model was fitted on; elsewhere the prediction is the prior's. Its interval on
described hardware spans what the description's figure ranges allow (``prior_range``); on a
calibrated host without a correction it is at least a factor ``prior_band`` wide each way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.ensemble import GradientBoostingRegressor
from sklearn.utils.validation import check_is_fitted

from cptune.config import STRATEGIES, CPConfig
from cptune.prior import CalibratedProfile, PriorTime, Profile, figure_swings, prior_range, prior_time
from cptune.store import Result, Store
from cptune.workload import Workload

#: Fewer measurements than this leave the correction out: the prior alone predicts.
MIN_SAMPLES = 8


@dataclass(frozen=True)
class Case:
    """One sample: ``config`` running ``workload`` on the hardware ``profile`` describes."""

    workload: Workload
    config: CPConfig
    profile: Profile

    def prior(self) -> PriorTime:
        return prior_time(self.workload, self.config, self.profile)


def features(cases: Sequence[Case], priors: Sequence[PriorTime]) -> np.ndarray:
    """The correction's inputs: the shape, the configuration and the prior's breakdown, on
    log scales where the quantity spans orders of magnitude."""
    rows = []
    for case, prior in zip(cases, priors, strict=True):
        w, c = case.workload, case.config
        total = prior.total_s
        rows.append([
            np.log2(w.seq_len), np.log2(w.heads), np.log2(w.kv_heads), np.log2(w.head_dim),
            float(w.causal), w.wire_dtype.itemsize, np.log2(w.batch),
            np.log2(c.ranks), np.log2(c.head_group), np.log2(c.context_degree),
            *(float(c.strategy == s) for s in STRATEGIES),
            np.log(total), prior.compute_s / total, prior.all_to_all_s / total,
            prior.all_gather_s / total, prior.ring_exposed_s / total,
        ])
    return np.asarray(rows, dtype=float)


class CostModel(RegressorMixin, BaseEstimator):
    """Predicts a ``Case``'s latency in seconds, with an interval (see the module docstring).

    Parameters: the boosting's ``n_estimators``, ``learning_rate``, ``max_depth`` and
    ``min_samples_leaf``; ``interval`` the quantiles of the reported interval; ``prior_band``
    the narrowest factor a prior-only interval spans each way; ``random_state``."""

    def __init__(
        self,
        n_estimators: int = 200,
        learning_rate: float = 0.05,
        max_depth: int = 3,
        min_samples_leaf: int = 3,
        interval: tuple[float, float] = (0.1, 0.9),
        prior_band: float = 2.0,
        random_state: int = 0,
    ) -> None:
        self.n_estimators = n_estimators
        self.learning_rate = learning_rate
        self.max_depth = max_depth
        self.min_samples_leaf = min_samples_leaf
        self.interval = interval
        self.prior_band = prior_band
        self.random_state = random_state

    def _booster(self, **loss: object) -> GradientBoostingRegressor:
        return GradientBoostingRegressor(
            n_estimators=self.n_estimators, learning_rate=self.learning_rate, max_depth=self.max_depth,
            min_samples_leaf=self.min_samples_leaf, subsample=0.8, random_state=self.random_state, **loss,
        )

    def fit(self, X: Sequence[Case], y: Sequence[float] | np.ndarray) -> CostModel:
        """Learn the correction from measured latencies ``y`` (seconds) of cases ``X``."""
        cases, latency = list(X), np.asarray(y, dtype=float)
        if len(cases) != len(latency) or not np.all(latency > 0):
            raise ValueError("fit needs one positive latency per case")
        priors = [case.prior() for case in cases]
        residual = np.log(latency) - np.log([p.total_s for p in priors])
        self.fingerprints_ = frozenset(case.profile.fingerprint for case in cases)
        self.n_samples_ = len(cases)
        low, high = np.quantile(residual, self.interval) if len(cases) else (0.0, 0.0)
        #: The prior's own error on the fitted data, as factors: the prior-only interval.
        self.prior_interval_ = (
            min(float(np.exp(low)), 1 / self.prior_band), max(float(np.exp(high)), self.prior_band)
        )
        if len(cases) < MIN_SAMPLES:
            self.correction_ = None
            return self
        table = features(cases, priors)
        self.correction_ = (
            self._booster(loss="squared_error").fit(table, residual),
            self._booster(loss="quantile", alpha=self.interval[0]).fit(table, residual),
            self._booster(loss="quantile", alpha=self.interval[1]).fit(table, residual),
        )
        return self

    def corrects(self, case: Case) -> bool:
        """Whether the learned correction applies to ``case`` (its hardware was fitted on)."""
        return self.correction_ is not None and case.profile.fingerprint in self.fingerprints_

    def predict_interval(self, X: Sequence[Case]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Latency, low and high edge of the interval, in seconds, for each case."""
        check_is_fitted(self, "prior_interval_")
        cases = list(X)
        priors = [case.prior() for case in cases]
        prior = np.array([p.total_s for p in priors])
        estimate, low, high = prior.copy(), prior * self.prior_interval_[0], prior * self.prior_interval_[1]
        corrected = np.array([self.corrects(case) for case in cases], dtype=bool)
        for i, case in enumerate(cases):
            if not corrected[i] and (swings := figure_swings(case.workload, case.config, case.profile)):
                low[i], high[i] = prior_range(prior[i], swings)
        if corrected.any():
            assert self.correction_ is not None
            table = features([c for c, k in zip(cases, corrected, strict=True) if k],
                             [p for p, k in zip(priors, corrected, strict=True) if k])
            middle, lower, upper = (np.exp(model.predict(table)) for model in self.correction_)
            estimate[corrected] = prior[corrected] * middle
            low[corrected] = prior[corrected] * np.minimum(lower, middle)
            high[corrected] = prior[corrected] * np.maximum(upper, middle)
        return estimate, low, high

    def predict(self, X: Sequence[Case]) -> np.ndarray:
        """Latency in seconds for each case."""
        return self.predict_interval(X)[0]


@dataclass(frozen=True)
class TrainingSet:
    """What a store holds for the model: the latest successful measurement of each
    configuration, on every hardware that has a calibration (the prior needs its rates)."""

    cases: list[Case]
    latencies_s: np.ndarray
    results: list[Result]
    profiles: dict[str, CalibratedProfile]
    #: Fingerprints with measurements but no calibration: left out, ``cptune calibrate`` fixes it.
    uncalibrated: frozenset[str]


def training_set(store: Store) -> TrainingSet:
    """Read ``store`` into cases and their measured latencies."""
    hardware = store.hardware()
    profiles = {
        fingerprint: CalibratedProfile(host, calibration)
        for fingerprint, host in hardware.items()
        if (calibration := store.calibration(fingerprint)) is not None
    }
    latest = {(r.hardware, r.workload, r.config): r for r in store.results(status="ok")}
    kept = [r for r in latest.values() if r.hardware in profiles and r.median_ms]
    return TrainingSet(
        cases=[Case(r.workload, r.config, profiles[r.hardware]) for r in kept],
        latencies_s=np.array([r.median_ms for r in kept], dtype=float) / 1e3,
        results=kept,
        profiles=profiles,
        uncalibrated=frozenset(r.hardware for r in latest.values()) - set(profiles),
    )
