"""The search as Optuna sees it: a conditional space (strategy, then a rank count feasible for
it, then a head group feasible for both), so an infeasible point is never proposed, and
stored runs as trials of a study a dashboard can show."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from cptune.config import STRATEGIES, CPConfig
from cptune.hardware import Hardware
from cptune.store import Result
from cptune.workload import Workload

Tree = dict[str, dict[int, list[int]]]
Known = tuple[str, float | None, str | None]  # status, median_ms, error of a stored run


def tree_of(configs: list[CPConfig]) -> Tree:
    """strategy -> rank count -> head groups: the conditional search space."""
    tree: Tree = {}
    for c in configs:
        tree.setdefault(c.strategy, {}).setdefault(c.ranks, []).append(c.head_group)
    return tree


def distributions(tree: Tree, config: CPConfig) -> dict[str, BaseDistribution]:
    return {
        "strategy": CategoricalDistribution(sorted(tree)),
        f"ranks|{config.strategy}": CategoricalDistribution(sorted(tree[config.strategy])),
        f"head_group|{config.strategy}|{config.ranks}": CategoricalDistribution(
            tree[config.strategy][config.ranks]
        ),
    }


def params_of(config: CPConfig) -> dict[str, object]:
    return {
        "strategy": config.strategy,
        f"ranks|{config.strategy}": config.ranks,
        f"head_group|{config.strategy}|{config.ranks}": config.head_group,
    }


def config_of(params: dict[str, Any]) -> CPConfig | None:
    """The configuration a trial's conditional ``params`` name (None before they are all sampled)."""
    strategy = params.get("strategy")
    ranks = params.get(f"ranks|{strategy}")
    head_group = params.get(f"head_group|{strategy}|{ranks}")
    if ranks is None or head_group is None:
        return None
    return CPConfig(str(strategy), int(ranks), int(head_group))


def study_name(workload: Workload, hardware: Hardware) -> str:
    """The name of the Optuna study a search keeps for ``workload`` on ``hardware``."""
    return f"{hardware.fingerprint}:{workload.describe()}"


def view_trial(row: Result) -> FrozenTrial:
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


def suggest(trial: optuna.Trial, tree: Tree) -> CPConfig:
    strategy = trial.suggest_categorical("strategy", sorted(tree))
    ranks = trial.suggest_categorical(f"ranks|{strategy}", sorted(tree[strategy]))
    head_group = trial.suggest_categorical(f"head_group|{strategy}|{ranks}", tree[strategy][ranks])
    return CPConfig(strategy, ranks, head_group)


