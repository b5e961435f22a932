"""A plan in a framework's terms: per bucket, the settings of the fastest configuration the
framework runs, what that costs against cptune's pick, and the launch line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cptune.config import CPConfig
from cptune.frameworks._choice import Pricer, Substitution, choose
from cptune.frameworks._framework import Framework, FrameworkError, Runs, Spelling
from cptune.frameworks._registry import get_framework
from cptune.plans import Alternative, Bucket, Plan
from cptune.workload import Workload

if TYPE_CHECKING:
    from cptune.model import MeasuredHost, Profile, Recommendation

#: Engines whose measurements stand for a framework's ranks: PyTorch's (gloo or NCCL). A
#: description's prior stands for the GPUs it describes.
FRAMEWORK_ENGINES = ("torch",)


@dataclass(frozen=True)
class FrameworkBucket:
    """One bucket of a plan as ``framework`` runs it."""

    bucket: Bucket
    substitution: Substitution
    spelling: Spelling

    def to_dict(self) -> dict[str, Any]:
        return {"min_seq_len": self.bucket.min_seq_len, "max_seq_len": self.bucket.max_seq_len,
                "seq_len": self.bucket.seq_len, **_answer(self.substitution, self.spelling)}


@dataclass(frozen=True)
class FrameworkPlan:
    """``plan`` as ``framework`` takes it, bucket by bucket."""

    framework: Framework
    plan: Plan
    buckets: tuple[FrameworkBucket, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "framework": self.framework.name, "pinned": self.framework.pinned, "form": self.framework.form,
            "shape": self.plan.shape.to_dict(), "hardware": vars(self.plan.hardware).copy(),
            "buckets": [b.to_dict() for b in self.buckets],
        }


@dataclass(frozen=True)
class FrameworkPick:
    """One workload's recommendation as ``framework`` runs it (``cptune recommend --for``)."""

    framework: Framework
    substitution: Substitution
    spelling: Spelling

    def to_dict(self) -> dict[str, Any]:
        return {"framework": self.framework.name, "pinned": self.framework.pinned,
                **_answer(self.substitution, self.spelling)}


def _answer(substitution: Substitution, spelling: Spelling) -> dict[str, Any]:
    """What runs (its configuration, latency, interval and source), spelled the framework's
    way, and what it costs against cptune's pick: one length's answer as JSON data."""
    chosen = substitution.chosen
    return {
        "config": chosen.config.to_dict(), "label": chosen.config.label, "latency_ms": chosen.latency_ms,
        "interval_ms": list(chosen.interval_ms), "source": chosen.source,
        "settings": dict(spelling.settings), "code": spelling.code, "launch": spelling.launch,
        "needs": list(spelling.needs), **substitution.to_dict(),
    }


def check_engine(framework: Framework, engine: str | None, where: str = "this host") -> None:
    """``FrameworkError`` unless evidence from ``engine`` (None: a description's prior, which
    stands for the GPUs it describes) stands for the PyTorch ranks ``framework`` runs."""
    if engine is not None and engine not in FRAMEWORK_ENGINES:
        raise FrameworkError(
            f"the {engine} engine's evidence on {where} does not stand for {framework.name}'s PyTorch ranks: "
            f"search and export with --backend torch there, or name a GPU's description (--hardware NAME)"
        )


def pricer(workload: Workload, pick: CPConfig, profile: Profile | MeasuredHost | None) -> Pricer | None:
    """What prices a framework's own run of a configuration at ``workload`` (``Runs``): the
    prior on ``profile`` (``cptune.model.price_as_run``), tied with ``pick`` where its evidence
    cannot order the two; None without a profile that predicts (a host measured, not calibrated)."""
    from cptune.model import CalibratedProfile, DescribedProfile, price_as_run

    if not isinstance(profile, CalibratedProfile | DescribedProfile):
        return None

    def price(runs: Runs) -> tuple[Alternative, bool]:
        priced = price_as_run(workload, runs.config, profile, runs.per_block_calls, pick)
        return (Alternative(runs.config, priced.latency_ms, (priced.low_ms, priced.high_ms), "prior"),
                priced.tied_with_pick)
    return price


def plan_profile(plan: Plan) -> Profile | MeasuredHost | None:
    """The profile a described plan was tuned on (its description by name), to price what a
    framework runs; None for a host's plan (the caller passes the host's own)."""
    if plan.hardware.kind != "described" or plan.hardware.name is None:
        return None
    from cptune.model import hardware_profile

    return hardware_profile(plan.hardware.name)


def for_recommendation(recommendation: Recommendation, name: str, engine: str | None,
                       profile: Profile | MeasuredHost | None = None) -> FrameworkPick:
    """``recommendation`` as framework ``name`` runs it: the fastest of its candidates as the
    framework runs them, spelled its way. ``engine``: whose ranks measured the hardware (None for
    a description); ``profile``: the hardware's, which prices what a framework runs otherwise
    than cptune (without it such a configuration is passed over)."""
    framework = get_framework(name)
    check_engine(framework, engine, recommendation.hardware)
    ranked = [Alternative(c.config, c.latency_ms, (c.low_ms, c.high_ms), c.source)
              for c in recommendation.candidates]
    workload = recommendation.workload
    per_node = None if profile is None else profile.ranks_per_node
    substitution = choose(framework, workload.shape, workload.seq_len, ranked, recommendation.tied,
                          pricer(workload, recommendation.config, profile), per_node)
    spelling = framework.spell(workload.shape, substitution.chosen.config, workload.seq_len, per_node)
    return FrameworkPick(framework, substitution, spelling)


def for_framework(plan: Plan, name: str, profile: Profile | MeasuredHost | None = None) -> FrameworkPlan:
    """``plan`` in the terms of framework ``name`` (``cptune.frameworks.FRAMEWORKS``): per
    bucket the fastest configuration as the framework runs it, from the plan's own ranking (its
    pick, then its alternatives), spelled as the framework spells it. ``profile``: the
    hardware's (default: a described plan's description), which prices what the framework runs
    otherwise than cptune. ``FrameworkError`` for an unknown framework, a plan measured by an
    engine a framework does not run, or a bucket the framework can express nothing of."""
    framework = get_framework(name)
    if plan.hardware.kind == "host":
        check_engine(framework, plan.hardware.engine, plan.hardware.description)
    profile = profile if profile is not None else plan_profile(plan)
    per_node = plan.launch.ranks_per_node if plan.launch.nodes > 1 else None
    buckets = []
    for bucket in plan.buckets:
        pick = Alternative(bucket.config, bucket.latency_ms, bucket.interval_ms, bucket.source)
        ranked = [pick, *(bucket.alternatives or _tied_as_ranked(bucket))]
        substitution = choose(framework, plan.shape, bucket.seq_len, ranked, bucket.tied,
                              pricer(plan.shape.at(bucket.seq_len), bucket.config, profile), per_node)
        spelling = framework.spell(plan.shape, substitution.chosen.config, bucket.seq_len, per_node)
        buckets.append(FrameworkBucket(bucket, substitution, spelling))
    return FrameworkPlan(framework, plan, tuple(buckets))


def _tied_as_ranked(bucket: Bucket) -> list[Alternative]:
    """A plan written before buckets kept their alternatives: its tied configurations, at the
    pick's latency (the evidence cannot tell them apart)."""
    return [Alternative(c, bucket.latency_ms, bucket.interval_ms, bucket.source) for c in bucket.tied]
