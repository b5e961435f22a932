"""The search: Optuna trials over strategy, rank count and head group, each run for real.

One study per (workload, hardware), seeded from the store, which is the single source of
truth: configurations already measured on this hardware are told to the sampler rather
than run again (unless ``remeasure``), every new result is committed as soon as it exists,
so an interrupted search resumes where it stopped. The parameters are suggested
conditionally (strategy, then a rank count feasible for it, then a head group feasible for
both), so an infeasible point is never proposed. A run that fails (crash, timeout, out of
memory, wrong output) is stored with its reason and told to Optuna as infeasible
(``trial.set_constraint``); the search goes on.

Two orders. ``exhaustive``: spaces small enough for the trial budget are covered
exhaustively (BruteForceSampler); larger ones by TPE, warm-started with the best
configurations measured for the same model at other sequence lengths on this hardware.
``guided`` (``GuidedSampler``): the cost model ``recommend`` uses, fitted on what the store
holds (refitted as each measurement lands), orders the trials - the best predicted first,
then the configuration most likely to beat the leader - and the search stops when none
left is likely enough to (``STOP_PROBABILITY``, see ``GuidedSampler``) or the budget is
spent. Without a calibration of the hardware covering the space's rank counts there is no
model, and the guided order falls back to the exhaustive one.

With ``study_storage`` (``Store.optuna_storage``) every stored run of the workload on this
hardware is also kept as a trial of an Optuna study in the database, named by
``study_name``: a view for ``optuna-dashboard`` and ``optuna.load_study``. The store stays
the source of truth: the sampler's own study lives in memory, seeded from the store.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.samplers import BaseSampler
from optuna.storages import BaseStorage
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

from cptune.config import STRATEGIES, CPConfig
from cptune.engines import Engine, get_engine
from cptune.errors import EngineError
from cptune.execute import measure
from cptune.hardware import Hardware
from cptune.measurement import format_ms, oversubscribed
from cptune.model import Candidate, CostModel, predict_for
from cptune.store import Result, Store, StoreError
from cptune.workload import Workload

# the search reports each failure itself; Optuna would also log every trial an exception
# ends (Ctrl-C included) with its traceback
optuna.logging.set_verbosity(logging.ERROR)

#: The objective of a configuration whose run failed; the constraint marks it infeasible.
FAILED_LATENCY_MS = float("inf")
_WARM_START = 3
#: The orders a search can take (see the module docstring).
ORDERS = ("guided", "exhaustive")
#: A guided search stops when the chance that any unmeasured configuration beats the
#: leader falls below this (see ``GuidedSampler``).
STOP_PROBABILITY = 0.1
#: The quantiles of the interval the cost model predicts (``CostModel.interval``).
_INTERVAL = CostModel().interval


@dataclass(frozen=True)
class TrialOutcome:
    """What one trial of the search did."""

    config: CPConfig
    status: str  # "ok" or an EngineError kind
    median_ms: float | None
    error: str | None
    reused: bool  # taken from the store rather than run


Tree = dict[str, dict[int, list[int]]]
Known = tuple[str, float | None, str | None]  # status, median_ms, error of a stored run


def _tree(configs: list[CPConfig]) -> Tree:
    """strategy -> rank count -> head groups: the conditional search space."""
    tree: Tree = {}
    for c in configs:
        tree.setdefault(c.strategy, {}).setdefault(c.ranks, []).append(c.head_group)
    return tree


def _distributions(tree: Tree, config: CPConfig) -> dict[str, BaseDistribution]:
    return {
        "strategy": CategoricalDistribution(sorted(tree)),
        f"ranks|{config.strategy}": CategoricalDistribution(sorted(tree[config.strategy])),
        f"head_group|{config.strategy}|{config.ranks}": CategoricalDistribution(
            tree[config.strategy][config.ranks]
        ),
    }


def _params(config: CPConfig) -> dict[str, object]:
    return {
        "strategy": config.strategy,
        f"ranks|{config.strategy}": config.ranks,
        f"head_group|{config.strategy}|{config.ranks}": config.head_group,
    }


def _config(params: dict[str, Any]) -> CPConfig | None:
    """The configuration a trial's conditional ``params`` name (None before they are all sampled)."""
    strategy = params.get("strategy")
    ranks = params.get(f"ranks|{strategy}")
    head_group = params.get(f"head_group|{strategy}|{ranks}")
    return None if head_group is None else CPConfig(str(strategy), int(ranks), int(head_group))


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
        return _params(self._chosen[trial.number])[param_name]

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
            config = _config(other.params)
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


def study_name(workload: Workload, hardware: Hardware) -> str:
    """The name of the Optuna study a search keeps for ``workload`` on ``hardware``."""
    return f"{hardware.fingerprint}:{workload.describe()}"


def _view_trial(row: Result) -> FrozenTrial:
    """A stored run as a trial of the dashboard's study: flat parameters, the median latency
    as its value (a failed run is a FAIL trial), the row's id and marks as user attributes."""
    config = row.config
    ok = row.status == "ok" and row.median_ms is not None
    return optuna.trial.create_trial(
        state=TrialState.COMPLETE if ok else TrialState.FAIL,
        value=row.median_ms if ok else None,
        params=config.to_dict(),
        distributions={"strategy": CategoricalDistribution(STRATEGIES),
                       "ranks": IntDistribution(1, config.ranks),
                       "head_group": IntDistribution(1, config.ranks)},
        user_attrs={"measurement_id": row.id, "label": config.label, "status": row.status,
                    "p10_ms": row.p10_ms, "p90_ms": row.p90_ms, "error": row.error,
                    "oversubscribed": row.oversubscribed, "excluded": row.excluded,
                    "measured_at": row.measured_at},
    )


def _suggest(trial: optuna.Trial, tree: Tree) -> CPConfig:
    strategy = trial.suggest_categorical("strategy", sorted(tree))
    ranks = trial.suggest_categorical(f"ranks|{strategy}", sorted(tree[strategy]))
    head_group = trial.suggest_categorical(f"head_group|{strategy}|{ranks}", tree[strategy][ranks])
    return CPConfig(strategy, ranks, head_group)


@dataclass
class WorkloadSearch:
    """Search the configurations ``configs`` of one workload on this hardware."""

    workload: Workload
    configs: list[CPConfig]
    store: Store
    hardware: Hardware
    warmup: int = 2
    repeats: int = 10
    run_timeout: float | None = None
    trials: int | None = None
    time_budget: float | None = None  # seconds for the whole study; None: no limit
    remeasure: bool = False
    backend: str | Engine = "mpi"
    on_trial: Callable[[TrialOutcome], None] | None = None
    order: str = "exhaustive"  # one of ORDERS
    stop_probability: float = STOP_PROBABILITY
    #: Where the dashboard's study is kept (``Store.optuna_storage``); None: nowhere.
    study_storage: BaseStorage | None = None
    #: After ``run``: why a guided search stopped early, or why it could not be guided.
    early_stop: EarlyStop | None = field(default=None, init=False)
    unguided: str | None = field(default=None, init=False)

    def known(self) -> dict[CPConfig, Known]:
        """Stored outcomes of this workload's configurations on this hardware (latest each)."""
        if self.remeasure:
            return {}
        wanted = set(self.configs)
        measured = self.store.measured(self.hardware, self.workload)
        return {c: (r.status, r.median_ms, r.error) for c, r in measured.items() if c in wanted}

    def _warm_starts(self) -> list[CPConfig]:
        """Best configuration per other sequence length of the same model, fastest first."""
        shape = {k: v for k, v in self.workload.to_dict().items() if k != "seq_len"}
        best: dict[int, tuple[float, CPConfig]] = {}
        for r in self.store.results(**shape, hardware=self.hardware.fingerprint, status="ok", excluded=False,
                                    oversubscribed=False):
            seq, median = r.workload.seq_len, r.median_ms
            if median is None or seq == self.workload.seq_len or r.config not in self.configs:
                continue
            if seq not in best or median < best[seq][0]:
                best[seq] = (median, r.config)
        ordered = [config for _, config in sorted(best.values(), key=lambda pair: pair[0])]
        return list(dict.fromkeys(ordered))[:_WARM_START]

    def _why_not_guided(self) -> str | None:
        """Why the cost model cannot order this search (None when it can)."""
        calibration = self.store.calibration(self.hardware.fingerprint)
        if calibration is None:
            return "this hardware has no calibration, so there is no cost model to order by"
        if (most := max(c.ranks for c in self.configs)) > calibration.max_ranks:
            return f"its calibration covers up to {calibration.max_ranks} ranks, the search {most}"
        return None

    def _predict(self, configs: list[CPConfig]) -> list[Candidate]:
        return predict_for(self.store, self.hardware.fingerprint, self.workload, configs)

    def _sync_view(self, view: Study) -> None:
        """Add every stored run of this workload on this hardware that ``view`` lacks."""
        try:
            kept = {trial.user_attrs.get("measurement_id") for trial in view.get_trials(deepcopy=False)}
            for row in self.store.results(**self.workload.to_dict(), hardware=self.hardware.fingerprint):
                if row.id not in kept:
                    view.add_trial(_view_trial(row))
        except optuna.exceptions.StorageInternalError:
            raise StoreError(f"cannot add to the Optuna study {view.study_name!r} in {self.store.url} (is "
                             f"another process holding the database?); every measurement is stored, and "
                             f"the next search adds what the study lacks") from None

    def run(self) -> list[TrialOutcome]:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        tree = _tree(self.configs)
        known = self.known()
        view = None
        if self.study_storage is not None:
            view = optuna.create_study(storage=self.study_storage, direction="minimize", load_if_exists=True,
                                       study_name=study_name(self.workload, self.hardware))
            self._sync_view(view)
        exhaustive = self.trials is None or self.trials >= len(self.configs)
        self.unguided = self._why_not_guided() if self.order == "guided" else None
        guided = self.order == "guided" and self.unguided is None
        sampler: optuna.samplers.BaseSampler
        if guided:
            sampler = GuidedSampler(self.configs, self._predict, self.stop_probability)
        elif exhaustive:
            with warnings.catch_warnings():  # experimental since Optuna 3.1, and what we want
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                sampler = optuna.samplers.BruteForceSampler(seed=0, avoid_premature_stop=True)
        else:
            sampler = optuna.samplers.TPESampler(seed=0)
        study = optuna.create_study(direction="minimize", sampler=sampler,
                                    study_name=study_name(self.workload, self.hardware))
        for config, (status, median, _) in known.items():
            study.add_trial(optuna.trial.create_trial(
                params=_params(config), distributions=_distributions(tree, config),
                value=median if status == "ok" else None,
                state=TrialState.COMPLETE if status == "ok" else TrialState.FAIL,
            ))
        outcomes: list[TrialOutcome] = []
        pending = [c for c in self.configs if c not in known]
        if guided:
            budget = min(len(pending), max(0, (self.trials or len(self.configs)) - len(known)))
        elif exhaustive:
            budget = len(pending)
        else:
            budget = max(0, (self.trials or 0) - len(known))
            for config in self._warm_starts():
                if config in pending:
                    study.enqueue_trial(_params(config))
        if budget == 0:
            return outcomes

        def objective(trial: optuna.Trial) -> float:
            config = _suggest(trial, tree)
            outcome = self._outcome(config, known)
            known[config] = (outcome.status, outcome.median_ms, outcome.error)
            outcomes.append(outcome)
            if view is not None and not outcome.reused:
                self._sync_view(view)
            if self.on_trial is not None:
                self.on_trial(outcome)
            trial.set_constraint("runs", 0.0 if outcome.status == "ok" else 1.0)
            if outcome.error:
                trial.set_user_attr("error", outcome.error)
            return outcome.median_ms if outcome.median_ms is not None else FAILED_LATENCY_MS

        study.optimize(objective, n_trials=budget, timeout=self.time_budget)
        if isinstance(sampler, GuidedSampler):
            self.early_stop = sampler.early_stop
        return outcomes

    def _outcome(self, config: CPConfig, known: dict[CPConfig, Known]) -> TrialOutcome:
        """Measure ``config`` and store the result, or reuse what is known of it."""
        if config in known:
            status, median, error = known[config]
            return TrialOutcome(config, status, median, error, reused=True)
        try:
            m = measure(self.workload, config, backend=self.backend, warmup=self.warmup,
                        repeats=self.repeats, timeout=self.run_timeout)
        except EngineError as error:
            engine = get_engine(self.backend).name
            self.store.add_failure(self.hardware, self.workload, config, error.kind, str(error), engine,
                                   oversubscribed=oversubscribed(config.ranks))
            return TrialOutcome(config, error.kind, None, str(error), reused=False)
        self.store.add_measurement(self.hardware, m)
        return TrialOutcome(config, "ok", m.median_ms, None, reused=False)
