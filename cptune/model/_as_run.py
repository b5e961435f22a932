"""The prior of a configuration as a framework runs it, which may differ from cptune's own
runs of it: torch's all-gather ring (xDiT, SGLang) and diffusers' ``ring_degree`` attend the
gathered keys block by block (``per_block_calls``: ``cptune.cost.block_calls``), a ring without
load balance deals out contiguous blocks (the configuration's layout, which the prior prices as
it is). ``cptune.frameworks`` prices what each framework runs with it, and asks whether the
evidence can tell it from cptune's pick. Kept apart from ``_prior``: the block-by-block run is
AllGather-KV's prior with its attention calls, merges and launches replaced."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from cptune.calls import busiest_calls
from cptune.config import CPConfig
from cptune.cost import analytic_cost, block_calls
from cptune.layout import SequenceLayout
from cptune.model._prior import PriorTime, computed_flops, prior_time
from cptune.model._profiles import DescribedProfile, Profile
from cptune.model._ties import (
    DescribedPrior,
    FigureSwing,
    _spread,
    decide,
    described_prior,
    prior_range,
    structural_error_s,
)
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


def prior_as_run(workload: Workload, config: CPConfig, profile: Profile, per_block_calls: bool) -> PriorTime:
    """``prior_time`` of ``config`` as run. ``per_block_calls`` (AllGather-KV, forward): the
    gathered keys attended in c calls and merged eagerly (``block_calls``) where cptune's prior
    counts one call (or the fused calls ``cptune.calls`` plans): its compute at the work per
    call and c calls' fixed costs, the eager merges in place of the fused ones, and their
    launches; the all-gather and the rest as AllGather-KV's. Elementwise, as ``prior_time``."""
    base = prior_time(workload, config, profile)
    if not per_block_calls:
        return base
    n = config.ranks
    blocks = block_calls(workload, config)
    counted = analytic_cost(workload, config, profile.stream, profile.position_calls)
    calls = (busiest_calls(SequenceLayout(workload, config)) if profile.position_calls
             else counted.kernels["attention"])
    flops = computed_flops(workload, config, profile.attention_kernel)

    def compute(k: int) -> float:  # ``_prior``'s compute of ``k`` calls
        per_call = flops if profile.charges_ring_steps else flops / k
        time = flops / profile.attention_rate(workload, n, per_call) + k * profile.attention_call_s
        return time + (k - 1) * profile.ring_call_s(workload, n) if k > 1 else time

    def merging(nbytes: float) -> float:
        return profile.memory_time("merge", nbytes, workload, n) if nbytes else 0.0

    launches = blocks.calls + blocks.merge_kernels - calls - counted.kernels["merge"]
    return dataclasses.replace(
        base,
        compute_s=base.compute_s - compute(calls) + compute(blocks.calls),
        memory_s=base.memory_s - merging(counted.memory_bytes["merge"]) + merging(blocks.merge_bytes),
        overhead_s=base.overhead_s + profile.launch_s * launches,
    )


def _described_as_run(workload: Workload, config: CPConfig, profile: Profile,
                      per_block_calls: bool) -> DescribedPrior | None:
    """``described_prior`` of ``config`` as run (None on a calibrated host)."""
    if not isinstance(profile, DescribedProfile):
        return None
    if not per_block_calls:
        return described_prior(workload, config, profile)
    keys, spread = _spread(profile.description)
    prior = prior_as_run(workload, config, spread, per_block_calls)
    totals: list[float] = np.asarray(prior.total_s).tolist()  # arrays over the variants
    swings = tuple(FigureSwing(key, totals[2 * i], totals[2 * i + 1]) for i, key in enumerate(keys))
    return DescribedPrior(totals[-1], swings, *prior_range(totals[-1], swings),
                          outside_compute=float(np.asarray(prior.outside_compute)[-1]))


def price_as_run(workload: Workload, config: CPConfig, profile: Profile, per_block_calls: bool,
                 pick: CPConfig) -> PricedAsRun:
    """``config`` on ``workload`` as run (``prior_as_run``), priced by ``profile``'s prior, with
    its tie against ``pick``."""
    ran = _described_as_run(workload, config, profile, per_block_calls)
    chosen = described_prior(workload, pick, profile)
    if ran is None or chosen is None:  # a calibrated host: measured rates, no range, no tie
        total = float(prior_as_run(workload, config, profile, per_block_calls).total_s)
        return PricedAsRun(total * 1e3, total * 1e3, total * 1e3, False)
    structural_s = structural_error_s(chosen.total_s, chosen.outside_compute + ran.outside_compute)
    tied = bool(chosen.swings) and decide(chosen.total_s, chosen.swings, ran.total_s, ran.swings, config,
                                          structural_s) is not None
    return PricedAsRun(ran.total_s * 1e3, ran.low_s * 1e3, ran.high_s * 1e3, tied)
