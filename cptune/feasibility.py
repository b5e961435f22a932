"""Which (workload, configuration) pairs can run, and why the others cannot."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from cptune.config import STRATEGIES, CPConfig
from cptune.cost import peak_bytes
from cptune.errors import InfeasibleConfigError
from cptune.layout import head_refusal, heads_as_run, kv_replication, layout_choices, layout_refusal
from cptune.workload import Workload

__all__ = ["LISTED_INFEASIBLE", "MAX_CONFIGS", "ConfigSplit", "Excluded", "candidate_configs",
           "check_feasible", "closest_to_fitting", "enumerate_configs", "feasibility", "fits_memory",
           "format_bytes", "head_groups_that_fit", "kv_replication", "split_configs"]


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
    if (heads := head_refusal(workload, config)) is not None:
        reasons.append(heads[1])
    elif (kv := heads_as_run(workload, config).kv_heads) % u and u % kv:
        reasons.append(
            f"{kv} KV heads and a head group of {u} do not divide each other: "
            f"Ulysses needs kv_heads % head_group == 0 (each rank gets whole KV heads) or "
            f"head_group % kv_heads == 0 (KV heads replicated head_group / kv_heads times)"
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
    if not reasons and not fits_memory(workload, config, memory_limit):
        assert memory_limit is not None
        need = format_bytes(peak_bytes(workload, config))
        reasons.append(f"needs about {need} per rank, over the limit of {format_bytes(memory_limit)}; use "
                       f"more ranks or a shorter sequence")
    return reasons


def fits_memory(workload: Workload, config: CPConfig, memory_limit: int | None) -> bool:
    """Whether ``config``'s analytic peak activation memory per rank fits ``memory_limit`` bytes
    (None: no limit)."""
    return memory_limit is None or peak_bytes(workload, config) <= memory_limit


def closest_to_fitting(workload: Workload, configs: Sequence[CPConfig],
                       memory_limit: Callable[[int], int | None]) -> str:
    """Why none of ``configs`` (each runnable but for memory) fits in ``memory_limit(ranks)``
    bytes per rank, in words: the one that needs the least memory in all, and its reason."""
    closest = min(configs, key=lambda c: peak_bytes(workload, c) * c.ranks)
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


def _checked(strategies: tuple[str, ...]) -> tuple[str, ...]:
    """``strategies``, each once in the order given; ``ValueError`` naming the allowed ones
    when none or an unknown one is given."""
    strategies = tuple(dict.fromkeys(strategies))
    unknown = set(strategies) - set(STRATEGIES)
    if unknown or not strategies:
        raise ValueError(
            f"strategies must name some of {', '.join(STRATEGIES)}, got {list(strategies) or 'none'}"
        )
    return strategies


def _configs_of(n: int, strategies: tuple[str, ...], head_groups: Collection[int],
                heads: int | None = None) -> list[CPConfig]:
    """The distinct configurations on exactly ``n`` ranks whose head group is one of
    ``head_groups``, ascending: one rank is plain local attention (listed once, as "ring" when
    allowed), and a context strategy whose head group spans all ranks is pure Ulysses (listed
    as "ulysses"). Given ``heads``, a head group that does not divide them is listed in the one
    form it can run in, padded (``CPConfig.pad_heads``)."""
    if n == 1:
        return [CPConfig("ring" if "ring" in strategies else strategies[0], 1)]
    groups = _dividing(n, head_groups)
    configs = []
    for strategy in strategies:
        if strategy == "ulysses":
            configs += [CPConfig("ulysses", n, pad_heads=_pads(heads, n))] if n in groups else []
        else:
            configs += [CPConfig(strategy, n, u, pad_heads=_pads(heads, u)) for u in groups if u < n]
    return configs


def _dividing(n: int, head_groups: Collection[int]) -> list[int]:
    """The members of ``head_groups`` that divide ``n``, ascending: found by trying each, or each
    divisor of ``n`` where those are fewer (``head_groups`` then a set, for a quick look-up)."""
    if len(head_groups) <= math.isqrt(n) or not isinstance(head_groups, (set, frozenset)):
        return sorted(u for u in head_groups if n % u == 0)
    return [u for u in _divisors(n) if u in head_groups]


def _pads(heads: int | None, head_group: int) -> bool:
    """Whether a configuration of ``head_group`` pads ``heads`` (None: no workload, none padded)."""
    return heads is not None and heads % head_group != 0


def candidate_configs(max_ranks: int, strategies: tuple[str, ...] = STRATEGIES,
                      min_ranks: int = 1, heads: int | None = None) -> list[CPConfig]:
    """Every distinct configuration on min_ranks..max_ranks ranks, feasible or not (as
    ``_configs_of`` lists them, padded where a head group does not divide ``heads``): every
    combination, for a few ranks. ``split_configs`` and ``enumerate_configs`` build only those
    a workload can run."""
    if not 1 <= min_ranks <= max_ranks:
        raise ValueError(f"need 1 <= min_ranks <= max_ranks, got {min_ranks} and {max_ranks}")
    strategies = _checked(strategies)
    return [c for n in range(min_ranks, max_ranks + 1)
            for c in _configs_of(n, strategies, _divisors(n), heads)]


def head_groups_that_fit(workload: Workload, limit: int) -> tuple[int, ...]:
    """The head groups up to ``limit``, ascending, that split ``workload``'s heads and KV heads
    as Ulysses needs (``feasibility``): whole heads on each rank, and whole or replicated KV
    heads; a head group that does not divide the heads, padded (``cptune.layout.padded_heads``),
    up to the heads (a larger one leaves ranks without a real head) and at most ``MAX_CONFIGS``
    (no configuration cptune weighs holds more). The dividing ones are found by trying each up
    to ``limit`` or each divisor of the heads, whichever is fewer."""
    heads, kv = workload.heads, workload.kv_heads
    tried = range(1, limit + 1) if limit <= math.isqrt(heads) else (d for d in _divisors(heads) if d <= limit)
    dividing = [u for u in tried if heads % u == 0 and (kv % u == 0 or u % kv == 0)]
    padded = [u for u in range(2, min(limit, heads, MAX_CONFIGS) + 1)
              if heads % u and _head_kind(workload, u) is None]
    return tuple(sorted(dividing + padded))


#: The most configurations, and the most rank counts, ``enumerate_configs`` and
#: ``split_configs`` weigh at once: more than any recommendation weighs (every count up to
#: 16,384 ranks of a 24-head model: about 82 thousand), and built in about a second.
MAX_CONFIGS = 250_000
#: How many configurations that cannot run ``split_configs`` lists one by one with their
#: reasons; the rest it counts by reason (``Excluded``).
LISTED_INFEASIBLE = 1000


def _check_size(workload: Workload, min_ranks: int, max_ranks: int, strategies: tuple[str, ...],
                fits: tuple[int, ...], counts: int) -> None:
    """``ValueError`` in one line when the ``counts`` rank counts looked at, or the
    configurations on min_ranks..max_ranks whose head group fits on no more ranks than tokens
    (those the enumeration builds), are more than ``MAX_CONFIGS``."""
    top = min(max_ranks, workload.seq_len)
    context = sum(s != "ulysses" for s in strategies)
    built = len(fits) + context * sum(max(0, top // u - (min_ranks - 1) // u) for u in fits if u <= top)
    if counts > MAX_CONFIGS or built > MAX_CONFIGS:
        raise ValueError(
            f"{min_ranks:,}..{max_ranks:,} ranks give {workload.describe()} {max(counts, built):,} or more "
            f"configurations to weigh, more than the {MAX_CONFIGS:,} cptune weighs at once: name fewer ranks"
        )


@dataclass(frozen=True)
class Excluded:
    """Configurations that cannot run for one reason, counted rather than listed: how many,
    the first of them and its first reason (``feasibility``'s)."""

    count: int
    first: CPConfig
    reason: str

    def describe(self) -> str:
        """E.g. "118,012 more cannot run, like ring on 3: Ulysses limit: ..."."""
        return f"{self.count:,} more cannot run, like {self.first.label} on {self.first.ranks}: {self.reason}"

    def to_dict(self) -> dict[str, object]:
        return {"count": self.count, "first": {**self.first.to_dict(), "label": self.first.label},
                "reason": self.reason}


@dataclass(frozen=True)
class ConfigSplit:
    """The configurations on a range of rank counts: those a workload can run, in
    ``candidate_configs``' order; the first that cannot (up to ``LISTED_INFEASIBLE``), each
    with every reason; and the rest that cannot, counted by why (``Excluded``, most first)."""

    feasible: tuple[CPConfig, ...]
    infeasible: dict[CPConfig, list[str]]
    excluded: tuple[Excluded, ...]


def _kind(workload: Workload, config: CPConfig) -> str:
    """Why ``config`` (a head group dividing its ranks) cannot run, as ``feasibility``'s first
    reason: "heads", "kv_heads", "seq_len" or "memory"."""
    if (kind := _head_kind(workload, config.head_group)) is not None:
        return kind
    return "seq_len" if workload.seq_len < config.ranks else "memory"


def _head_kind(workload: Workload, head_group: int) -> str | None:
    """Why a head group of ``head_group`` (padded where it does not divide the heads) cannot
    split ``workload``'s heads or K/V heads, as ``_kind`` names it; None when it can."""
    config = CPConfig("ring", head_group, head_group, pad_heads=_pads(workload.heads, head_group))
    if (refusal := head_refusal(workload, config)) is not None:
        return refusal[0]
    kv = heads_as_run(workload, config).kv_heads
    return "kv_heads" if kv % head_group and head_group % kv else None


def _divisor_counts(ranks: Sequence[int]) -> list[int]:
    """How many divisors each of the ascending ``ranks`` has: one by one for a few, else by a
    sieve up to the largest."""
    if len(ranks) < 64:
        return [len(_divisors(n)) for n in ranks]
    counts = np.zeros(ranks[-1] + 1, dtype=np.int64)
    for k in range(1, ranks[-1] + 1):
        counts[k::k] += 1
    return [int(counts[n]) for n in ranks]


def split_configs(workload: Workload, ranks: Sequence[int], strategies: tuple[str, ...] = STRATEGIES,
                  memory_limit: Callable[[int], int | None] | None = None,
                  listed: int = LISTED_INFEASIBLE) -> ConfigSplit:
    """Every configuration of ``candidate_configs`` on each of the rank counts ``ranks``
    (ascending), split into those ``workload`` can run (within ``memory_limit(ranks)`` bytes per
    rank, when given) and those it cannot (``ConfigSplit``). Its cost follows the configurations
    that can run: once ``listed`` that cannot are listed, only those whose head group fits
    (``head_groups_that_fit``) are built and checked, and the others counted in closed form (of
    n's divisors below n, those neither fitting nor refused for their K/V heads are refused for
    their heads). ``ValueError`` beyond ``MAX_CONFIGS``."""
    if not ranks or ranks[0] < 1:
        raise ValueError(f"need rank counts of at least 1, got {ranks!r}")
    strategies = _checked(strategies)
    min_ranks, max_ranks = ranks[0], ranks[-1]
    fits = head_groups_that_fit(workload, max_ranks)
    _check_size(workload, min_ranks, max_ranks, strategies, fits, len(ranks))
    if not isinstance(ranks, range) and any(a >= b for a, b in zip(ranks, ranks[1:], strict=False)):
        raise ValueError(f"need ascending rank counts, got {list(ranks)}")
    context = sum(s != "ulysses" for s in strategies)
    ulysses = "ulysses" in strategies
    feasible: list[CPConfig] = []
    infeasible: dict[CPConfig, list[str]] = {}
    counted: dict[str, tuple[int, CPConfig]] = {}  # by kind: how many, the first

    def count(kind: str, how_many: int, n: int, first: CPConfig | None = None) -> None:
        """Count ``how_many`` more of ``kind`` on ``n`` ranks, ``first`` (else n's first of the
        kind) the first of them when they are the kind's first."""
        if how_many:
            before, earliest = counted.get(kind) or (0, first or next(
                c for c in _configs_of(n, strategies, _divisors(n), workload.heads)
                if _kind(workload, c) == kind))
            counted[kind] = (before + how_many, earliest)

    divisor_counts: dict[int, int] = {}
    fitting = frozenset(fits)
    # head groups refused for their K/V heads: none is larger than the heads (``head_refusal``)
    kv_refused = frozenset(u for u in range(1, min(max_ranks, workload.heads, MAX_CONFIGS) + 1)
                           if _head_kind(workload, u) == "kv_heads")
    for index, n in enumerate(ranks):
        limit = None if memory_limit is None else memory_limit(n)
        if n == 1 or len(infeasible) < listed:  # every configuration of n, each checked
            every = _configs_of(n, strategies, _divisors(n), workload.heads)
            for config in (laid for c in every for laid in _laid(workload, c)):
                if not (reasons := feasibility(workload, config, limit)):
                    feasible.append(config)
                elif len(infeasible) < listed:
                    infeasible[config] = reasons
                else:
                    count(_kind(workload, config), 1, n, config)
            continue
        if not divisor_counts:  # those of the rank counts left
            divisor_counts = dict(zip(ranks[index:], _divisor_counts(ranks[index:]), strict=True))
        head_groups = divisor_counts[n] - 1  # those of a context strategy: below n
        configs = _configs_of(n, strategies, fitting, workload.heads)  # those whose head group fits
        fit_below = len(_dividing(n, fitting)) - (n in fitting)
        kv_below = len(_dividing(n, kv_refused)) - (n in kv_refused)
        whole = _head_kind(workload, n) if ulysses else None  # pure Ulysses' head group of all n ranks
        count("heads", context * (head_groups - fit_below - kv_below) + (whole == "heads"), n)
        count("kv_heads", context * kv_below + (whole == "kv_heads"), n)
        if n > workload.seq_len:
            count("seq_len", len(configs), n)
            continue
        for config in configs:  # whose head group fits on ranks that hold a token each
            if not fits_memory(workload, config, limit):
                count("memory", 1, n, config)
                continue
            feasible.append(config)
            feasible += [c for c in _laid(workload, config)[1:] if not feasibility(workload, c, limit)]
    excluded = sorted((Excluded(how_many, first, feasibility(
        workload, first, None if memory_limit is None else memory_limit(first.ranks))[0])
        for how_many, first in counted.values()), key=lambda e: -e.count)
    return ConfigSplit(tuple(feasible), infeasible, tuple(excluded))


def enumerate_configs(
    workload: Workload,
    max_ranks: int,
    strategies: tuple[str, ...] = STRATEGIES,
    memory_limit: int | None = None,
) -> list[CPConfig]:
    """Every feasible configuration on 1..max_ranks ranks, each distinct computation once
    (see ``candidate_configs``), in each layout the workload's mask offers
    (``cptune.layout.layout_choices``: the default first). Only those whose head group fits,
    on no more ranks than tokens, are built: the cost follows what can run, whatever
    ``max_ranks``; ``ValueError`` in one line beyond ``MAX_CONFIGS``."""
    if max_ranks < 1:
        raise ValueError(f"need max_ranks >= 1, got {max_ranks}")
    strategies = _checked(strategies)
    top = min(max_ranks, workload.seq_len)
    fits = head_groups_that_fit(workload, top)
    ranks = range(1, top + 1) if any(s != "ulysses" for s in strategies) else sorted({1, *fits})
    _check_size(workload, 1, max_ranks, strategies, fits, len(ranks))
    fitting = frozenset(fits)
    return [laid for n in ranks for c in _configs_of(n, strategies, fitting, workload.heads)
            for laid in _laid(workload, c)
            if not feasibility(workload, laid, memory_limit)]


def _laid(workload: Workload, config: CPConfig) -> list[CPConfig]:
    """``config`` in each layout ``workload``'s mask offers (``layout_choices``), the default first."""
    choices = layout_choices(workload, config)
    return [config] if choices == (None,) else [config.with_layout(layout) for layout in choices]
