"""A plan's per-batch policy (``cptune.plans.BatchPolicy``): written from a mix's costs, so a
deployment solves each batch from its loaded plan (``plan_batch(plan, lengths)``) with no
database, and read back as the costs the solver takes."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from cptune.config import STRATEGIES
from cptune.mixes._costs import MixCosts, mix_costs
from cptune.mixes._mix import LengthMix
from cptune.plans import BatchPolicy, Plan, PlanError, PolicyCurve
from cptune.workload import AttentionShape


def batch_policy(costs: MixCosts) -> BatchPolicy:
    """The batch policy of ``costs``: its undominated configurations' curves with all ranks busy
    (the only ones the per-batch solver uses, so it plans every batch as it would from ``costs``)."""
    curves = tuple(
        PolicyCurve(costs.configs[i],
                    tuple(None if not math.isfinite(v) else float(v) for v in costs.shared_ms[i]),
                    int(costs.alone_max[i]), int(costs.shared_max[i]))
        for i in costs.undominated.tolist())
    return BatchPolicy(costs.ranks, tuple(int(x) for x in costs.grid), curves)


def mix_policy(shape: AttentionShape, lengths: Sequence[int] | LengthMix, ranks: int | None = None,
               hardware: str | None = None, db: str | None = None, strategies: Sequence[str] = STRATEGIES,
               backend: str = "mpi", figures: Mapping[str, float] | None = None,
               nccl_path: str | None = None) -> BatchPolicy:
    """The batch policy for batches of ``lengths`` (``mix_costs``, same arguments) that
    ``cptune.plans.export.export_plan(..., batch_policy=)`` writes into a plan."""
    mix = lengths if isinstance(lengths, LengthMix) else LengthMix.of(lengths)
    return batch_policy(mix_costs(shape, mix, ranks, hardware, db, strategies, backend, figures, nccl_path))


def policy_costs(plan: Plan) -> MixCosts:
    """The ``MixCosts`` of ``plan``'s batch policy, built once per loaded plan (not every step);
    ``PlanError`` when it carries none."""
    if plan.batch_policy is None:
        raise PlanError(f"{plan.source or 'this plan'} carries no batch policy: export it with "
                        f"cptune export --batch-lengths FILE")
    return _costs(plan.batch_policy, plan.shape, plan.hardware.description, plan.hardware.fingerprint)


@functools.lru_cache(maxsize=16)
def _costs(policy: BatchPolicy, shape: AttentionShape, hardware: str, fingerprint: str) -> MixCosts:
    shared = np.array([[np.nan if v is None else v for v in c.ms] for c in policy.curves], dtype=np.float64)
    alone = np.full(shared.shape, np.nan)  # a policy carries what batches cost, not a group alone
    return MixCosts(shape, policy.ranks, hardware, fingerprint, tuple(c.config for c in policy.curves),
                    np.array(policy.grid, dtype=np.int64), alone, np.full(shared.shape, "", dtype=object),
                    np.array([c.alone_max for c in policy.curves], dtype=np.int64),
                    np.array([c.shared_max for c in policy.curves], dtype=np.int64), shared)
