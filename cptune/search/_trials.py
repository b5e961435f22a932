"""The search as Optuna sees it: a conditional space (strategy, then a rank count feasible for
it, then a head group feasible for both, then - only where the head group does not divide the
heads - padded heads, the one form it runs in, then - only where the mask offers more than one
(``cptune.layout.layout_choices``) - a token layout), so an infeasible point is never
proposed, and stored runs as trials of a study a dashboard can show."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from cptune.config import LAYOUTS, STRATEGIES, CPConfig
from cptune.hardware import Hardware
from cptune.store import Result
from cptune.workload import Workload

#: strategy -> rank count -> head group -> layouts (``DEFAULT_LAYOUT`` for a workload's default).
Tree = dict[str, dict[int, dict[int, list[str]]]]
#: The (strategy, ranks, head group) whose heads a tree's configurations pad (``CPConfig.pad_heads``).
Padded = frozenset[tuple[str, int, int]]
Known = tuple[str, float | None, str | None]  # status, median_ms, error of a stored run

#: How a trial's parameters name a configuration's default layout (``CPConfig.layout`` None).
DEFAULT_LAYOUT = "default"


def _layout_name(layout: str | None) -> str:
    return DEFAULT_LAYOUT if layout is None else layout


class SearchTree(Tree):
    """strategy -> rank count -> head group -> layouts: the conditional search space, and the
    points of it that pad heads (``padded``)."""

    padded: Padded = frozenset()


def tree_of(configs: list[CPConfig]) -> SearchTree:
    """The conditional search space of ``configs`` (``SearchTree``)."""
    tree = SearchTree()
    tree.padded = frozenset((c.strategy, c.ranks, c.head_group) for c in configs if c.pad_heads)
    for c in configs:
        layouts = tree.setdefault(c.strategy, {}).setdefault(c.ranks, {}).setdefault(c.head_group, [])
        if _layout_name(c.layout) not in layouts:
            layouts.append(_layout_name(c.layout))
    return tree


def _layout_key(config: CPConfig) -> str:
    return f"layout|{config.strategy}|{config.ranks}|{config.head_group}"


def _pad_key(config: CPConfig) -> str:
    return f"pad_heads|{config.strategy}|{config.ranks}|{config.head_group}"


def _swept(tree: Tree, config: CPConfig) -> bool:
    """Whether ``config``'s layout is a parameter of its own (more than one to choose from)."""
    return len(tree[config.strategy][config.ranks][config.head_group]) > 1


def distributions(tree: Tree, config: CPConfig) -> dict[str, BaseDistribution]:
    found: dict[str, BaseDistribution] = {
        "strategy": CategoricalDistribution(sorted(tree)),
        f"ranks|{config.strategy}": CategoricalDistribution(sorted(tree[config.strategy])),
        f"head_group|{config.strategy}|{config.ranks}": CategoricalDistribution(
            list(tree[config.strategy][config.ranks])
        ),
    }
    if config.pad_heads:
        found[_pad_key(config)] = CategoricalDistribution([True])
    if _swept(tree, config):
        layouts = tree[config.strategy][config.ranks][config.head_group]
        found[_layout_key(config)] = CategoricalDistribution(layouts)
    return found


def params_of(config: CPConfig, tree: Tree) -> dict[str, object]:
    """``config`` as the trial parameters of ``tree``'s space."""
    params: dict[str, object] = {
        "strategy": config.strategy,
        f"ranks|{config.strategy}": config.ranks,
        f"head_group|{config.strategy}|{config.ranks}": config.head_group,
    }
    if config.pad_heads:
        params[_pad_key(config)] = True
    if _swept(tree, config):
        params[_layout_key(config)] = _layout_name(config.layout)
    return params


def config_of(params: dict[str, Any]) -> CPConfig | None:
    """The configuration a trial's conditional ``params`` name (None before they are all
    sampled; no layout parameter: the default, the only one its space offers)."""
    strategy = params.get("strategy")
    ranks = params.get(f"ranks|{strategy}")
    head_group = params.get(f"head_group|{strategy}|{ranks}")
    if ranks is None or head_group is None:
        return None
    layout = params.get(f"layout|{strategy}|{ranks}|{head_group}", DEFAULT_LAYOUT)
    return CPConfig(str(strategy), int(ranks), int(head_group),
                    None if layout == DEFAULT_LAYOUT else str(layout),
                    bool(params.get(f"pad_heads|{strategy}|{ranks}|{head_group}", False)))


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
        params=config.to_dict(),  # a layout only where it is not the workload's default
        distributions={"strategy": CategoricalDistribution(STRATEGIES),
                       "ranks": IntDistribution(1, config.ranks),
                       "head_group": IntDistribution(1, config.ranks),
                       **({"layout": CategoricalDistribution(LAYOUTS)} if config.layout else {}),
                       **({"pad_heads": CategoricalDistribution([True])} if config.pad_heads else {})},
        user_attrs={"measurement_id": row.id, "label": config.label, "status": row.status,
                    "p10_ms": row.p10_ms, "p90_ms": row.p90_ms, "error": row.error,
                    "oversubscribed": row.oversubscribed, "excluded": row.excluded,
                    "measured_at": row.measured_at},
    )


def suggest(trial: optuna.Trial, tree: SearchTree) -> CPConfig:
    """The configuration ``trial`` samples from ``tree``'s conditional space."""
    strategy = trial.suggest_categorical("strategy", sorted(tree))
    ranks = trial.suggest_categorical(f"ranks|{strategy}", sorted(tree[strategy]))
    head_group = trial.suggest_categorical(f"head_group|{strategy}|{ranks}", list(tree[strategy][ranks]))
    config = CPConfig(strategy, ranks, head_group)
    if (strategy, ranks, head_group) in tree.padded:  # the one form it runs in: a parameter of one value
        config = config.with_padded_heads(trial.suggest_categorical(_pad_key(config), [True]))
    if not _swept(tree, config):
        only = tree[strategy][ranks][head_group][0]
        return config.with_layout(None if only == DEFAULT_LAYOUT else only)
    layout = trial.suggest_categorical(_layout_key(config), tree[strategy][ranks][head_group])
    return config.with_layout(None if layout == DEFAULT_LAYOUT else layout)


