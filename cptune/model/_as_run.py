"""The prior of a configuration as a framework runs it, which may differ from cptune's own
runs of it: torch's all-gather ring (xDiT, SGLang) and diffusers' ``ring_degree`` attend the
gathered keys block by block (``per_block_calls``), a ring without load balance deals out
contiguous blocks (the configuration's layout). ``cptune.frameworks`` prices what each
framework runs with it, and asks whether the evidence can tell it from cptune's pick."""

from __future__ import annotations

from dataclasses import dataclass

from cptune.config import CPConfig
from cptune.model._prior import prior_time
from cptune.model._profiles import Profile
from cptune.model._ties import decide, described_prior, structural_error_s
from cptune.workload import Workload


@dataclass(frozen=True)
class PricedAsRun:
    """The prior's latency (ms) of what a framework runs, its range (the description's figures';
    the latency itself on a calibrated host), and whether the prior cannot order it against
    cptune's pick (its figures' ranges and structural error, as ``prior_ties`` decides)."""

    latency_ms: float
    low_ms: float
    high_ms: float
    tied_with_pick: bool


def price_as_run(workload: Workload, config: CPConfig, profile: Profile, per_block_calls: bool,
                 pick: CPConfig) -> PricedAsRun:
    """``config`` on ``workload`` as run (``per_block_calls``: AllGather-KV's keys attended block
    by block, ``prior_time``), priced by ``profile``'s prior, with its tie against ``pick``."""
    ran = described_prior(workload, config, profile, per_block_calls)
    chosen = described_prior(workload, pick, profile)
    if ran is None or chosen is None:  # a calibrated host: measured rates, no range, no tie
        total = float(prior_time(workload, config, profile, per_block_calls).total_s)
        return PricedAsRun(total * 1e3, total * 1e3, total * 1e3, False)
    structural_s = structural_error_s(chosen.total_s, chosen.outside_compute + ran.outside_compute)
    tied = bool(chosen.swings) and decide(chosen.total_s, chosen.swings, ran.total_s, ran.swings, config,
                                          structural_s) is not None
    return PricedAsRun(ran.total_s * 1e3, ran.low_s * 1e3, ran.high_s * 1e3, tied)
