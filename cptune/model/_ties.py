"""How sure the prior is on described hardware: each configuration's range from its figures'
ranges, and the ties a recommendation reports where those ranges and the prior's own
structural error leave two configurations' order open."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from cptune.config import CPConfig
from cptune.hardware import HardwareDescription
from cptune.model._prior import prior_time
from cptune.model._profiles import DescribedProfile, Profile
from cptune.workload import Workload


class FigureSwing(NamedTuple):
    """The prior latency (s) of one configuration with one figure of its description at the
    low and at the high end of the range its source allows, the others at their values (a
    named tuple: a cluster's recommendation makes one per figure of thousands of configurations)."""

    figure: str
    at_low_s: float
    at_high_s: float


def figure_swings(workload: Workload, config: CPConfig, profile: Profile) -> tuple[FigureSwing, ...]:
    """One ``FigureSwing`` per uncertain figure of a described profile; none for a calibrated
    host (its rates are measured, not quoted with a range)."""
    described = described_prior(workload, config, profile)
    return () if described is None else described.swings


@dataclass(frozen=True)
class DescribedPrior:
    """The prior of one configuration on a description: its total (s), each uncertain
    figure's swing, and the range they allow (``prior_range``; empty swings: the total)."""

    total_s: float
    swings: tuple[FigureSwing, ...]
    low_s: float
    high_s: float
    #: ``PriorTime.outside_compute`` at the figures' values.
    outside_compute: float


def described_prior(workload: Workload, config: CPConfig, profile: Profile) -> DescribedPrior | None:
    """``DescribedPrior`` of ``config`` on a described profile (None on a calibrated host),
    worked out once per configuration and description: what a recommendation's intervals
    and ties read."""
    if not isinstance(profile, DescribedProfile):
        return None
    return _described_prior(workload, config, profile.description)


@functools.lru_cache(maxsize=65536)  # pure; intervals and ties ask for the same configurations
def _described_prior(workload: Workload, config: CPConfig,
                     description: HardwareDescription) -> DescribedPrior:
    """One evaluation of the prior over every figure at each end of its range and at its
    value (``HardwareDescription.spread``: numpy arrays of variants, each variant the same
    arithmetic as alone)."""
    keys, spread = _spread(description)
    prior = prior_time(workload, config, spread)
    totals: list[float] = np.asarray(prior.total_s).tolist()  # arrays over the variants
    swings = tuple(map(FigureSwing, keys, totals[0::2], totals[1::2]))  # (low, high) of each figure
    return DescribedPrior(totals[-1], swings, *prior_range(totals[-1], swings),
                          outside_compute=float(np.asarray(prior.outside_compute)[-1]))


@functools.lru_cache(maxsize=64)
def _spread(description: HardwareDescription) -> tuple[tuple[str, ...], DescribedProfile]:
    """The uncertain figures of ``description`` and the profile of its ``spread`` over them."""
    keys = tuple(key for key, figure in description.figures.items() if figure.uncertain)
    return keys, DescribedProfile(description.spread(keys))


def prior_range(total_s: float, swings: tuple[FigureSwing, ...]) -> tuple[float, float]:
    """(low, high) seconds of a prior latency ``total_s`` from its figures' swings: each
    figure's largest move down and up, added in quadrature (the figures' sources are
    independent). One pass, no generator: it runs for every configuration a recommendation weighs."""
    down = up = 0.0
    for _, at_low, at_high in swings:
        lower, higher = at_low - total_s, at_high - total_s
        if lower > higher:
            lower, higher = higher, lower
        if lower < 0.0:
            down += lower**2
        if higher > 0.0:
            up += higher**2
    return max(total_s - down**0.5, 0.0), total_s + up**0.5


#: The prior's own error in ordering two configurations, beyond what its figures' ranges
#: allow: how far the log of its latency ratio was off on the published development set (the
#: pick's lead overstated), per unit of the two configurations' shares of predicted time spent
#: outside attention compute (communication, memory-bound steps, launches: the mechanisms the
#: prior is least sure of). Estimated, the 2% a pick may miss by aside, as the largest such
#: error over every pair of published configurations of all development-set machines
#: (``benchmarks/published_prior.py --structural``: 0.363, set by the 4x A100 PCIe table at
#: 16K tokens, where Ulysses over both CPU sockets beat the pick by more than the prior allowed;
#: the confidence table scores each machine with the estimate made without it).
STRUCTURAL_ERROR = 0.37
#: The same for a training step (forward + backward), estimated the same way on the published
#: training development set (``benchmarks/published_train.py``: 21 FlashAttention-4 comparisons
#: on 8x H100, a pick right within the 3% its source treats as a tie).
STRUCTURAL_ERROR_TRAIN = 0.21
#: ``Tie.figure`` when the figures' ranges settle the order and only the structural error leaves
#: it open.
STRUCTURE = "structure"


@dataclass(frozen=True)
class Tie:
    """Two configurations whose order the prior cannot settle: within the figures' ranges and
    its own structural error ``other`` can be faster than the pick; ``figure`` at its ``end``
    ("low" or "high") moves the difference most in ``other``'s favour, or ``figure`` is
    ``STRUCTURE`` (``end`` "") where the figures alone would have settled it; ``movers``: every
    figure whose range moves it in ``other``'s favour."""

    other: CPConfig
    figure: str
    end: str
    movers: frozenset[str] = frozenset()

    @property
    def structural(self) -> bool:
        """Whether only the prior's own error leaves the order open (the figures settle it)."""
        return self.figure == STRUCTURE


def structural_error_s(pick_s: float, outside_compute: float, error: float = STRUCTURAL_ERROR) -> float:
    """Seconds of a pick's lead (its prior ``pick_s``) the prior's structural error can take
    away from another configuration: ``error`` x ``outside_compute`` (the two configurations'
    ``PriorTime.outside_compute``, summed), as a log ratio."""
    return pick_s * math.expm1(error * outside_compute)


def decide(pick_s: float, pick: tuple[FigureSwing, ...], other_s: float,
           other: tuple[FigureSwing, ...], other_config: CPConfig, structural_s: float = 0.0) -> Tie | None:
    """A ``Tie`` when the pick's lead over ``other`` (``other_s - pick_s``) is within what the
    figures' ranges allow (their moves of the difference) and the structural error
    (``structural_s`` seconds), in quadrature, else None."""
    lead = other_s - pick_s
    moves = {
        (a.figure, end): (getattr(b, f"at_{end}_s") - getattr(a, f"at_{end}_s")) - lead
        for a, b in zip(pick, other, strict=True) for end in ("low", "high")
    }
    against = {figure: min(0.0, *(moves[(figure, end)] for end in ("low", "high")))
               for figure in {a.figure for a in pick}}
    figures = sum(m**2 for m in against.values())
    if lead - (figures + structural_s**2) ** 0.5 > 0:
        return None
    movers = frozenset(figure for figure, move in against.items() if move < 0)
    if lead - figures**0.5 > 0:
        return Tie(other_config, STRUCTURE, "", movers)
    (figure, end), _ = min(moves.items(), key=lambda item: item[1])
    return Tie(other_config, figure, end, movers)


def prior_ties(
    workload: Workload, pick: CPConfig, others: Sequence[CPConfig], profile: Profile,
    structural: float | None = None,
) -> tuple[Tie, ...]:
    """The configurations of ``others`` whose order against ``pick`` the prior does not settle:
    within the description's figure ranges and the prior's own ``structural`` error
    (None: ``STRUCTURAL_ERROR``, ``STRUCTURAL_ERROR_TRAIN`` for a training step; none on a
    calibrated host, whose rates are measured). Only those
    whose range comes within that error of the pick's are examined. What ``recommend``
    reports as tied with a prior-only pick, and what the published-benchmark check scores."""
    if structural is None:
        structural = STRUCTURAL_ERROR_TRAIN if workload.training else STRUCTURAL_ERROR
    chosen = described_prior(workload, pick, profile)
    if chosen is None or not chosen.swings:
        return ()
    ties = []
    for config in others:
        other = described_prior(workload, config, profile)
        assert other is not None
        structural_s = structural_error_s(chosen.total_s, chosen.outside_compute + other.outside_compute,
                                          structural)
        reaches = other.low_s <= chosen.high_s + structural_s
        if reaches and (tie := decide(chosen.total_s, chosen.swings, other.total_s, other.swings, config,
                                      structural_s)) is not None:
            ties.append(tie)
    return tuple(ties)
