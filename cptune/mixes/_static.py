"""The static answer for a length mix: the one configuration with the lowest expected time per
sequence over the mix, with its tail, and the bucketed plan (``cptune.plans``) tuned at lengths
spread over the mix, timed over the same sequences.

A sequence's time is ``MixCosts.times`` at its own length; the expectation and the 90th and
99th percentiles weigh each length by how many sequences of the mix have it. A configuration
that cannot hold some sequence of the mix is not a single answer for it; the plan runs each
length in its bucket's configuration, and a length its bucket's configuration cannot hold (a
shorter tuned length's pick, over a rank's memory) is named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cptune.config import STRATEGIES, CPConfig
from cptune.mixes._costs import MixCosts, mix_costs
from cptune.mixes._mix import LengthMix, MixError, weighted_quantile
from cptune.plans import Plan
from cptune.plans.export import export_plan
from cptune.workload import AttentionShape

#: How many lengths the bucketed plan is tuned at, at most.
PLAN_BUCKETS = 8


@dataclass(frozen=True)
class MixTime:
    """A way to run a mix, timed over its sequences: expected ms per sequence, and the 90th and
    99th percentile; ``measured_share`` the share of the sequences whose time is a measurement
    (their length measured in that configuration)."""

    mean_ms: float
    p90_ms: float
    p99_ms: float
    measured_share: float

    def to_dict(self) -> dict[str, float]:
        return {"mean_ms": self.mean_ms, "p90_ms": self.p90_ms, "p99_ms": self.p99_ms,
                "measured_share": self.measured_share}


@dataclass(frozen=True)
class MixRecommendation:
    """The static answer for ``mix``: every configuration that holds all of it, by expected time
    (``ranked``, the pick first), and the bucketed ``plan`` with its time over the mix;
    ``unheld`` the lengths the plan's bucket configurations cannot hold."""

    mix: LengthMix
    costs: MixCosts
    ranked: tuple[tuple[CPConfig, MixTime], ...]
    plan: Plan
    plan_time: MixTime
    unheld: tuple[int, ...]

    @property
    def config(self) -> CPConfig | None:
        """The single configuration to run (None when none holds every sequence)."""
        return self.ranked[0][0] if self.ranked else None

    @property
    def time(self) -> MixTime | None:
        return self.ranked[0][1] if self.ranked else None

    def to_dict(self) -> dict[str, object]:
        return {
            "mix": {"sequences": self.mix.size, "shortest": self.mix.shortest, "longest": self.mix.longest,
                    "describe": self.mix.describe()},
            "hardware": self.costs.hardware, "fingerprint": self.costs.fingerprint,
            "config": None if self.config is None else {**self.config.to_dict(), "label": self.config.label},
            "time": None if self.time is None else self.time.to_dict(),
            "ranked": [{**c.to_dict(), "label": c.label, **t.to_dict()} for c, t in self.ranked],
            "plan": {"seq_lens": [b.seq_len for b in self.plan.buckets],
                     "buckets": [b.to_dict() for b in self.plan.buckets], **self.plan_time.to_dict(),
                     "unheld": list(self.unheld)},
        }


def _time(ms: np.ndarray, counts: np.ndarray, measured: np.ndarray) -> MixTime:
    return MixTime(float(ms @ counts / counts.sum()), weighted_quantile(ms, counts, 0.9),
                   weighted_quantile(ms, counts, 0.99), float(counts[measured].sum() / counts.sum()))


def _measured(costs: MixCosts, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Whether each length of ``values`` is a grid length measured in the configuration of the
    matching entry of ``rows``."""
    at = np.searchsorted(costs.grid, values)
    on_grid = (at < len(costs.grid)) & (costs.grid[np.minimum(at, len(costs.grid) - 1)] == values)
    return on_grid & (costs.sources[rows, np.minimum(at, len(costs.grid) - 1)] == "measured")


def tuned_lengths(grid: np.ndarray, buckets: int = PLAN_BUCKETS) -> list[int]:
    """At most ``buckets`` of the ``grid`` lengths, evenly spaced through it, the longest included."""
    step = max(1, -(-len(grid) // buckets))
    return sorted(int(x) for x in grid[::-1][::step])


def recommend_mix(shape: AttentionShape, mix: LengthMix, ranks: int | None = None,
                  hardware: str | None = None, db: str | None = None,
                  strategies: Sequence[str] = STRATEGIES, backend: str = "mpi",
                  figures: Mapping[str, float] | None = None, nccl_path: str | None = None,
                  buckets: int = PLAN_BUCKETS) -> MixRecommendation:
    """The configuration of ``shape`` with the lowest expected time per sequence over ``mix``
    (exactly ``ranks`` ranks, or any count up to the hardware's when None, as ``recommend``)
    and the plan of ``buckets`` buckets tuned over it; the other arguments as ``recommend``'s."""
    costs = mix_costs(shape, mix, ranks, hardware, db, strategies, backend, figures, nccl_path)
    values, counts = mix.histogram()
    ms = costs.times(values, shared=False)
    rows = [i for i, c in enumerate(costs.configs) if (ranks is None or c.ranks == ranks)
            and np.isfinite(ms[i]).all()]
    timed = [(costs.configs[i], _time(ms[i], counts, _measured(costs, np.full(values.size, i), values)))
             for i in rows]
    timed.sort(key=lambda pair: pair[1].mean_ms)
    plan = export_plan([shape.at(n) for n in tuned_lengths(costs.grid, buckets)], ranks, hardware, db,
                       strategies, backend, figures, nccl_path)
    picks = np.array([costs.configs.index(plan.bucket(int(v)).config) for v in values])
    plan_ms = ms[picks, np.arange(values.size)]
    unheld = tuple(int(v) for v in values[~np.isfinite(plan_ms)])
    held = np.isfinite(plan_ms)
    if not held.any():
        raise MixError("the bucketed plan holds none of the mix's lengths in memory: give more ranks")
    plan_time = _time(plan_ms[held], counts[held], _measured(costs, picks, values)[held])
    return MixRecommendation(mix, costs, tuple(timed), plan, plan_time, unheld)
