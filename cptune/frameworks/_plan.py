"""A plan in a framework's terms: per bucket, the settings of the fastest configuration the
framework runs, what that costs against cptune's pick, and the launch line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cptune.frameworks._choice import Substitution, choose
from cptune.frameworks._framework import Framework, FrameworkError, Spelling
from cptune.frameworks._registry import get_framework
from cptune.plans import Alternative, Bucket, Plan

if TYPE_CHECKING:
    from cptune.model import Recommendation

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


def for_recommendation(recommendation: Recommendation, name: str, engine: str | None) -> FrameworkPick:
    """``recommendation`` as framework ``name`` runs it: the fastest of its candidates the
    framework can express, spelled its way. ``engine``: whose ranks measured the hardware
    (None for a description)."""
    framework = get_framework(name)
    check_engine(framework, engine, recommendation.hardware)
    ranked = [Alternative(c.config, c.latency_ms, (c.low_ms, c.high_ms), c.source)
              for c in recommendation.candidates]
    workload = recommendation.workload
    substitution = choose(framework, workload.shape, workload.seq_len, ranked, recommendation.tied)
    return FrameworkPick(framework, substitution, framework.spell(workload.shape, substitution.chosen.config))


def for_framework(plan: Plan, name: str) -> FrameworkPlan:
    """``plan`` in the terms of framework ``name`` (``cptune.frameworks.FRAMEWORKS``): per
    bucket the fastest configuration the framework runs, from the plan's own ranking (its
    pick, then its alternatives), spelled as the framework spells it. ``FrameworkError`` for
    an unknown framework, a plan measured by an engine a framework does not run, or a bucket
    the framework can express nothing of."""
    framework = get_framework(name)
    if plan.hardware.kind == "host":
        check_engine(framework, plan.hardware.engine, plan.hardware.description)
    buckets = []
    for bucket in plan.buckets:
        pick = Alternative(bucket.config, bucket.latency_ms, bucket.interval_ms, bucket.source)
        ranked = [pick, *(bucket.alternatives or _tied_as_ranked(bucket))]
        substitution = choose(framework, plan.shape, bucket.seq_len, ranked, bucket.tied)
        spelling = framework.spell(plan.shape, substitution.chosen.config)
        buckets.append(FrameworkBucket(bucket, substitution, spelling))
    return FrameworkPlan(framework, plan, tuple(buckets))


def _tied_as_ranked(bucket: Bucket) -> list[Alternative]:
    """A plan written before buckets kept their alternatives: its tied configurations, at the
    pick's latency (the evidence cannot tell them apart)."""
    return [Alternative(c, bucket.latency_ms, bucket.interval_ms, bucket.source) for c in bucket.tied]
