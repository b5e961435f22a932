"""Build a plan from recommendations: one bucket per tuned sequence length.

Kept apart from loading, which a deployment does: this side brings the cost model
(scikit-learn, SQLAlchemy), loading needs only json and jsonschema.

A length between two tuned lengths a < b falls in the bucket of the nearer one by ratio
(the boundary is sqrt(a * b)): attention cost grows with S^2, so the closer workload in
cost is the closer one on a log scale. Lengths above the longest tuned one are refused by
``Plan.bucket``: the plan has no evidence there.

A bucket lists the configurations tied with its pick (``Recommendation.tied``: measured ones
the noise cannot separate from it, or a description's alternatives its figures cannot order);
the launch starts as many ranks as the largest listed configuration uses, so any of them runs.

With a ``batch_policy`` (``cptune.mixes.mix_policy``: the cost curves over the lengths of the
batches to come, of the configurations the per-batch solver can use) the plan carries it, so a
deployment plans each batch (``cptune.mixes.plan_batch(plan, lengths)``) without a database;
the launch then starts the policy's ranks too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from cptune.config import STRATEGIES
from cptune.errors import CPTuneError
from cptune.model import CalibratedProfile, DescribedProfile, MeasuredHost, hardware_profile, recommend
from cptune.plans._plan import Alternative, BatchPolicy, Bucket, Plan, PlanHardware, launch_for
from cptune.version import __version__
from cptune.workload import Workload


def bucket_bounds(seq_lens: Sequence[int]) -> list[tuple[int, int]]:
    """(min, max) lengths served by each tuned length of ascending ``seq_lens``: contiguous
    from 1 to the longest, split at the geometric mean of neighbours."""
    bounds = []
    start = 1
    for here, after in zip(seq_lens, [*seq_lens[1:], None], strict=True):
        end = here if after is None else math.isqrt(here * after)
        bounds.append((start, end))
        start = end + 1
    return bounds


def export_plan(
    workloads: Sequence[Workload],
    ranks: int | None = None,
    hardware: str | None = None,
    db: str | None = None,
    strategies: Sequence[str] = STRATEGIES,
    backend: str = "mpi",
    figures: Mapping[str, float] | None = None,
    nccl_path: str | None = None,
    nodes: int | None = None,
    batch_policy: BatchPolicy | None = None,
) -> Plan:
    """A plan for ``workloads`` (one attention shape at several sequence lengths): the
    ``recommend`` pick at each length (same ``ranks``, ``hardware``, ``db``, ``strategies``)
    with its evidence, and the launch of as many ranks as the largest pick uses. ``backend``:
    the engine whose view of this host ``hardware`` None means, ``figures`` a description's
    figures measured on the machine and ``nccl_path`` the path NCCL takes there, ``nodes`` a
    calibrated cluster read for that many nodes sharing ``ranks`` (``recommend``);
    ``batch_policy``: the plan carries it (module docstring)."""
    if not workloads:
        raise CPTuneError("a plan needs at least one sequence length")
    shape = workloads[0].shape
    if other := next((w for w in workloads if w.shape != shape), None):
        raise CPTuneError(f"a plan is for one attention shape; got {workloads[0].describe()} and "
                          f"{other.describe()}: export one plan per shape")
    if batch_policy is not None and nodes is not None:
        raise CPTuneError("a batch policy is read on the hardware's own ranks, not a calibrated cluster of "
                          "--nodes: leave out --nodes or --batch-lengths")
    profile = hardware_profile(hardware, db, backend, figures, nccl_path, nodes, ranks)
    lengths = sorted({w.seq_len for w in workloads})
    buckets = []
    for seq_len, (low, high) in zip(lengths, bucket_bounds(lengths), strict=True):
        pick = recommend(shape.at(seq_len), ranks, hardware, db, strategies, backend, figures, nccl_path,
                         nodes)
        # the pick's measurements first, then those it was judged against; none when predicted
        ids = [i for c in pick.candidates for i in c.measurement_ids]
        evidence = tuple(ids) if pick.source == "measured" else ()
        ranked = tuple(Alternative(c.config, c.latency_ms, (c.low_ms, c.high_ms), c.source)
                       for c in pick.alternatives)
        decided_by = None if pick.tiers is None else pick.tiers.describe()
        buckets.append(Bucket(low, high, seq_len, pick.config, pick.latency_ms, pick.interval_ms,
                              pick.source, evidence, pick.tied, ranked, decided_by))
    # every listed configuration, tied alternatives too, can run within the launch
    used = max(c.ranks for b in buckets for c in b.contenders)
    if batch_policy is not None:
        used = max(used, batch_policy.ranks)
    if isinstance(profile, DescribedProfile):
        description = profile.description
        plan_hardware = PlanHardware(profile.fingerprint, profile.describe(), "described", description.name)
        launch = launch_for(used, description.ranks_per_node, gpus=True)
    else:
        assert isinstance(profile, CalibratedProfile | MeasuredHost)
        engine = profile.calibration.engine if isinstance(profile, CalibratedProfile) else backend
        plan_hardware = PlanHardware(profile.fingerprint, profile.describe(), "host", None, engine)
        launch = launch_for(used, profile.ranks_per_node or used, gpus=profile.hardware.gpu_count > 0)
    return Plan(
        hardware=plan_hardware, shape=shape, buckets=tuple(buckets), launch=launch,
        cptune_version=__version__, created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        batch_policy=batch_policy,
    )
