"""Which (workload, configuration) pairs can run, and why the others cannot."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

from cptune.config import STRATEGIES, CPConfig
from cptune.cost import analytic_cost
from cptune.errors import InfeasibleConfigError
from cptune.layout import kv_replication, layout_choices, layout_refusal
from cptune.workload import Workload

__all__ = ["candidate_configs", "check_feasible", "closest_to_fitting", "enumerate_configs", "feasibility",
           "format_bytes", "kv_replication"]


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': a size a person reads at a glance."""
    size, unit = float(n), "B"
    for larger in ("KiB", "MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, found up to its square root."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@functools.lru_cache(maxsize=1024)  # the same few for every configuration of a cluster
def _head_groups_that_fit(heads: int, limit: int) -> str:
    """The head groups up to ``limit`` that split ``heads`` evenly, listed."""
    return ", ".join(str(d) for d in _divisors(limit) if heads % d == 0)


def feasibility(workload: Workload, config: CPConfig, memory_limit: int | None = None) -> list[str]:
    """Every reason ``config`` cannot run ``workload``, in words a user acts on; empty when
    it can. ``memory_limit`` (bytes per rank), when given, is checked against the analytic
    peak activation memory."""
    reasons: list[str] = []
    n, u = config.ranks, config.head_group
    if n % u:
        fits = ", ".join(map(str, _divisors(n)))
        reasons.append(
            f"head group {u} does not divide {n} ranks: Ulysses groups must tile the ranks "
            f"(head groups that fit: {fits})"
        )
    if config.strategy == "ulysses" and u != n:
        reasons.append(
            f"pure Ulysses uses all {n} ranks as one head group (head_group={n}, not {u}); "
            f"for {u}-way Ulysses across groups name the context strategy: "
            f"CPConfig('ring', {n}, {u}) or CPConfig('allgather_kv', {n}, {u})"
        )
    if (refusal := layout_refusal(workload, config)) is not None:
        reasons.append(refusal)
    elif config.layout == "replicated_text" and u > 1:
        reasons.append("layout replicated_text: the text tokens each rank holds are not split by heads for "
                       "Ulysses yet; replicate the text with head_group 1, or deal it out with the image "
                       "(the default layout)")
    elif config.layout == "replicated_text" and workload.training:
        reasons.append("layout replicated_text: the backward of replicated text tokens (their K/V gradients "
                       "summed over ranks, their queries' counted once) is not written yet; train with the "
                       "text dealt out with the image (the default layout)")
    if workload.seq_len < n:
        reasons.append(
            f"seq_len {workload.seq_len} is shorter than {n} ranks: every rank needs at least "
            f"one token; use at most {workload.seq_len} rank{'s' if workload.seq_len != 1 else ''}"
        )
    if memory_limit is not None and not reasons:
        need = analytic_cost(workload, config).peak_bytes
        if need > memory_limit:
            reasons.append(
                f"needs about {format_bytes(need)} per rank, over the limit of "
                f"{format_bytes(memory_limit)}; use more ranks or a shorter sequence"
            )
    return reasons


def closest_to_fitting(workload: Workload, configs: Sequence[CPConfig],
                       memory_limit: Callable[[int], int | None]) -> str:
    """Why none of ``configs`` (each runnable but for memory) fits in ``memory_limit(ranks)``
    bytes per rank, in words: the one that needs the least memory in all, and its reason."""
    closest = min(configs, key=lambda c: analytic_cost(workload, c).peak_bytes * c.ranks)
    reason = feasibility(workload, closest, memory_limit(closest.ranks))
    return f"the closest, {closest.describe()}, {reason[0] if reason else 'fits'}"


def check_feasible(workload: Workload, config: CPConfig, memory_limit: int | None = None) -> None:
    """Raise ``InfeasibleConfigError`` listing every reason ``config`` cannot run."""
    reasons = feasibility(workload, config, memory_limit)
    if reasons:
        listed = "".join(f"\n  - {r}" for r in reasons)
        raise InfeasibleConfigError(
            f"{config.describe()} cannot run {workload.describe()}:{listed}", reasons
        )


def candidate_configs(max_ranks: int, strategies: tuple[str, ...] = STRATEGIES,
                      min_ranks: int = 1) -> list[CPConfig]:
    """Every distinct configuration on min_ranks..max_ranks ranks, feasible or not: one rank
    is plain local attention (listed once, as "ring" when allowed), and a context strategy
    whose head group spans all ranks is pure Ulysses (listed as "ulysses")."""
    if not 1 <= min_ranks <= max_ranks:
        raise ValueError(f"need 1 <= min_ranks <= max_ranks, got {min_ranks} and {max_ranks}")
    strategies = tuple(dict.fromkeys(strategies))  # each name once, in the order given
    unknown = set(strategies) - set(STRATEGIES)
    if unknown or not strategies:
        raise ValueError(
            f"strategies must name some of {', '.join(STRATEGIES)}, got {list(strategies) or 'none'}"
        )
    one_rank = "ring" if "ring" in strategies else strategies[0]
    configs = []
    for n in range(min_ranks, max_ranks + 1):
        for strategy in strategies:
            if n == 1:
                configs += [CPConfig(strategy, 1)] if strategy == one_rank else []
            elif strategy == "ulysses":
                configs.append(CPConfig("ulysses", n))
            else:
                configs += [CPConfig(strategy, n, u) for u in _divisors(n) if u < n]
    return configs


def enumerate_configs(
    workload: Workload,
    max_ranks: int,
    strategies: tuple[str, ...] = STRATEGIES,
    memory_limit: int | None = None,
) -> list[CPConfig]:
    """Every feasible configuration on 1..max_ranks ranks, each distinct computation once
    (see ``candidate_configs``), in each layout the workload's mask offers
    (``cptune.layout.layout_choices``: the default first)."""
    return [laid for c in candidate_configs(max_ranks, strategies)
            for laid in (c.with_layout(layout) for layout in layout_choices(workload, c))
            if not feasibility(workload, laid, memory_limit)]
