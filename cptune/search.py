"""The search: Optuna trials over strategy, rank count and head group, each run for real.

One study per (workload, hardware), seeded from the store, which is the single source of
truth: configurations already measured on this hardware are told to the sampler rather
than run again (unless ``remeasure``), every new result is committed as soon as it exists,
so an interrupted search resumes where it stopped. The parameters are suggested
conditionally (strategy, then a rank count feasible for it, then a head group feasible for
both), so an infeasible point is never proposed. A run that fails (crash, timeout, out of
memory, wrong output) is stored with its reason and told to Optuna as infeasible
(``trial.set_constraint``); the search goes on.

Spaces small enough for the trial budget are covered exhaustively (BruteForceSampler);
larger ones by TPE, warm-started with the best configurations measured for the same
model at other sequence lengths on this hardware.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import TrialState

from cptune.config import CPConfig
from cptune.engines import Engine, get_engine
from cptune.errors import EngineError
from cptune.execute import measure
from cptune.hardware import Hardware
from cptune.measurement import oversubscribed
from cptune.store import Store
from cptune.workload import Workload

# the search reports each failure itself; Optuna would also log every trial an exception
# ends (Ctrl-C included) with its traceback
optuna.logging.set_verbosity(logging.ERROR)

#: The objective of a configuration whose run failed; the constraint marks it infeasible.
FAILED_LATENCY_MS = float("inf")
_WARM_START = 3


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

    def run(self) -> list[TrialOutcome]:
        tree = _tree(self.configs)
        known = self.known()
        exhaustive = self.trials is None or self.trials >= len(self.configs)
        sampler: optuna.samplers.BaseSampler
        if exhaustive:
            with warnings.catch_warnings():  # experimental since Optuna 3.1, and what we want
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                sampler = optuna.samplers.BruteForceSampler(seed=0, avoid_premature_stop=True)
        else:
            sampler = optuna.samplers.TPESampler(seed=0)
        study = optuna.create_study(direction="minimize", sampler=sampler,
                                    study_name=f"{self.hardware.fingerprint}:{self.workload.describe()}")
        for config, (status, median, _) in known.items():
            study.add_trial(optuna.trial.create_trial(
                params=_params(config), distributions=_distributions(tree, config),
                value=median if status == "ok" else None,
                state=TrialState.COMPLETE if status == "ok" else TrialState.FAIL,
            ))
        outcomes: list[TrialOutcome] = []
        pending = [c for c in self.configs if c not in known]
        if exhaustive:
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
            if self.on_trial is not None:
                self.on_trial(outcome)
            trial.set_constraint("runs", 0.0 if outcome.status == "ok" else 1.0)
            if outcome.error:
                trial.set_user_attr("error", outcome.error)
            return outcome.median_ms if outcome.median_ms is not None else FAILED_LATENCY_MS

        study.optimize(objective, n_trials=budget, timeout=self.time_budget)
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
