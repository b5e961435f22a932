"""The guided order: the cost model ranks the configurations not yet tried, best predicted
first, then the one most likely to beat the leader, and the search stops when none left is
likely enough to (``GuidedSampler``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

from cptune.config import CPConfig
from cptune.measurement import format_ms
from cptune.model import Candidate, CostModel
from cptune.search._trials import config_of, params_of, tree_of

#: A guided search stops when the chance that any unmeasured configuration beats the
#: leader falls below this (see ``GuidedSampler``).
STOP_PROBABILITY = 0.1
#: The quantiles of the interval the cost model predicts (``CostModel.interval``).
_INTERVAL = CostModel().interval


def win_probability(candidate: Candidate, leader_ms: float,
                    interval: tuple[float, float] = _INTERVAL, workload_spread: float = 0.0) -> float:
    """The model's probability that ``candidate`` runs faster than ``leader_ms``.

    Log latency is taken as normal on each side of the estimate (the median), with the
    spread that puts the interval's low and high edge at its ``interval`` quantiles: a
    skewed band gives a skewed distribution, and an edge on the estimate (no spread on that
    side) a certain answer on that side. ``workload_spread``, the model's log error on this
    workload's measured configurations (``GuidedSampler.workload_spread``), adds in
    quadrature on both sides: the interval is the model's error over the whole store, and
    some workloads it misses by far more."""
    below = leader_ms < candidate.latency_ms
    edge, quantile = (candidate.low_ms, interval[0]) if below else (candidate.high_ms, interval[1])
    model_spread = math.log(edge / candidate.latency_ms) / NormalDist().inv_cdf(quantile)
    spread = math.hypot(model_spread, workload_spread)
    if spread == 0:
        return 0.0 if below else 1.0
    return NormalDist().cdf(math.log(leader_ms / candidate.latency_ms) / spread)


def any_wins(probabilities: Sequence[float]) -> float:
    """The chance that at least one of several configurations beats the leader, each with
    its ``probabilities``, taken as independent. Their errors share the model's bias at the
    workload, so they are positively dependent, and then this independent figure is an upper
    bound: a stop rule on it is not fooled by a single long tail among many candidates."""
    return -math.expm1(math.fsum(math.log1p(-p) if p < 1 else -math.inf for p in probabilities))


@dataclass(frozen=True)
class EarlyStop:
    """Why a guided search ended before every configuration was measured: ``likeliest``,
    the unmeasured configuration most likely to beat ``leader``, had only ``probability``."""

    leader: CPConfig
    leader_ms: float
    tried: int
    unmeasured: int
    likeliest: CPConfig
    probability: float
    threshold: float  # the sampler's stop probability
    #: The chance that any unmeasured configuration beats the leader (``any_wins``).
    chance: float = 0.0
    #: The model's log error on the measured configurations, added to its interval.
    workload_spread: float = 0.0

    def describe(self) -> str:
        return (f"stopped after {self.tried} of {self.tried + self.unmeasured} configurations: the cost "
                f"model (its interval widened by its {math.expm1(self.workload_spread):.0%} root-mean-square "
                f"error on this workload's trials) gives the {self.unmeasured} unmeasured together "
                f"less than a {self.threshold:.0%} chance ({self.chance:.1%}) of beating "
                f"{self.leader.describe()} ({format_ms(self.leader_ms)} ms); the likeliest, "
                f"{self.likeliest.describe()}, {self.probability:.1%}")


class GuidedSampler(BaseSampler):
    """Optuna sampler that takes its trials in the order the cost model gives (see
    ``win_probability``) and stops the study when none left is likely to beat the leader.

    ``predict`` gives the model's latency and interval (``Candidate``) for configurations not
    yet tried; it is asked again after every trial, so a model refitted on the new
    measurement reorders what is left. The whole configuration is chosen when a trial asks
    for its first parameter; the later ones follow from it.

    The stop rule trusts the model only as far as this workload bears it out: each trial's
    measured latency is compared with what the model predicted for it just before it ran
    (an out-of-sample error, as the unmeasured ones' will be), and the root mean square of
    these log errors (``workload_spread``: centred on zero, so a bias of the model here
    counts as spread) widens every interval. The study stops when the chance that ANY
    unmeasured configuration beats the leader (``any_wins``), not only the likeliest one,
    is below ``stop_probability``."""

    def __init__(self, configs: Sequence[CPConfig], predict: Callable[[list[CPConfig]], list[Candidate]],
                 stop_probability: float = STOP_PROBABILITY) -> None:
        self._configs = list(configs)
        self._tree = tree_of(self._configs)
        self._predict = predict
        self._stop_probability = stop_probability
        self._chosen: dict[int, CPConfig] = {}
        #: The latency (ms) the model predicted for each trial's configuration when it chose it.
        self._predicted_ms: dict[int, float] = {}
        #: log(measured / predicted) of each trial the sampler chose, in the order they ended.
        self.errors: list[float] = []
        #: Set when the sampler stopped the study before every configuration was tried.
        self.early_stop: EarlyStop | None = None

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        if trial.number not in self._chosen:
            leader, tried = self._state(study, exclude=trial.number)
            pending = [c for c in self._configs if c not in tried] or self._configs
            chosen = self._ranked(pending, leader)[0][0]
            self._chosen[trial.number] = chosen.config
            self._predicted_ms[trial.number] = chosen.latency_ms
        return params_of(self._chosen[trial.number], self._tree)[param_name]

    @property
    def workload_spread(self) -> float:
        """Root mean square of the model's log errors on the trials measured so far (0 before any)."""
        return math.sqrt(sum(e * e for e in self.errors) / len(self.errors)) if self.errors else 0.0

    def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        config = self._chosen.get(trial.number)
        if state != TrialState.COMPLETE or config is None or not values:
            return  # the objective raised (Ctrl-C): nothing to judge, and no refit to wait for
        predicted_ms = self._predicted_ms.get(trial.number)
        if math.isfinite(values[0]) and values[0] > 0 and predicted_ms:
            self.errors.append(math.log(values[0] / predicted_ms))
        leader, tried = self._state(study, exclude=trial.number)
        tried.add(config)
        if math.isfinite(values[0]) and (leader is None or values[0] < leader[1]):
            leader = (config, values[0])
        pending = [c for c in self._configs if c not in tried]
        if leader is None or not pending:
            return
        ranked = self._ranked(pending, leader)
        chance = any_wins([probability for _, probability in ranked])
        if chance < self._stop_probability:
            likeliest, probability = ranked[0]
            self.early_stop = EarlyStop(leader[0], leader[1], len(tried), len(pending), likeliest.config,
                                        probability, self._stop_probability, chance, self.workload_spread)
            study.stop()

    def _state(self, study: Study, exclude: int) -> tuple[tuple[CPConfig, float] | None, set[CPConfig]]:
        """The fastest measured configuration and its latency (None before any), and every
        configuration tried, from the study's trials other than number ``exclude``."""
        leader: tuple[CPConfig, float] | None = None
        tried: set[CPConfig] = set()
        for other in study.get_trials(deepcopy=False):
            config = config_of(other.params)
            if other.number == exclude or config is None:
                continue
            tried.add(config)
            value = other.value if other.state == TrialState.COMPLETE else None
            if value is not None and math.isfinite(value) and (leader is None or value < leader[1]):
                leader = (config, value)
        return leader, tried

    def _ranked(self, pending: list[CPConfig], leader: tuple[CPConfig, float] | None
                ) -> list[tuple[Candidate, float]]:
        """``pending`` with each one's probability of beating ``leader`` (0 before there is
        one), most likely first; equal chances: the lower estimate first."""
        spread = self.workload_spread
        chances = [(c, win_probability(c, leader[1], workload_spread=spread) if leader else 0.0)
                   for c in self._predict(pending)]
        return sorted(chances, key=lambda pair: (-pair[1], pair[0].latency_ms))


