"""The configuration a framework runs at one length: the fastest it can express.

cptune ranks every configuration at a length (measured, or predicted with its interval); a
framework that cannot express the pick runs the fastest one it can, and says what that costs
against the pick and whether the evidence can tell the two apart at all (the pick's ties).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from cptune.config import CPConfig
from cptune.frameworks._framework import Framework, FrameworkError
from cptune.frameworks._registry import FRAMEWORKS
from cptune.plans import Alternative
from cptune.workload import AttentionShape


@dataclass(frozen=True)
class Substitution:
    """What ``framework`` runs at ``seq_len`` in place of cptune's ``pick``."""

    framework: str
    seq_len: int
    pick: Alternative
    #: The fastest configuration the framework runs (the pick itself when it can).
    chosen: Alternative
    #: Faster configurations the framework cannot run, each with the reason, fastest first.
    passed_over: tuple[tuple[CPConfig, str], ...]
    #: Whether ``chosen`` is the pick or one the evidence cannot tell from it.
    within_tie: bool

    @property
    def cost_pct(self) -> float:
        """How much slower ``chosen`` is than the pick, in percent of the pick (0 for the pick)."""
        return 100.0 * (self.chosen.latency_ms / self.pick.latency_ms - 1.0)

    def describe(self) -> str:
        """One line a user reads: the pick kept, or what replaced it and at what cost."""
        chosen = self.chosen.config.describe()
        if self.chosen.config == self.pick.config:
            return f"{chosen}: cptune's pick"
        tie = "within the tie" if self.within_tie else "outside the tie: the evidence separates them"
        return (f"{chosen} in place of cptune's pick, {self.pick.config.describe()} "
                f"({self.passed_over[0][1]}): {self.cost_pct:+.1f}% ({self.chosen.source} "
                f"{self.chosen.latency_ms:.4g} ms against {self.pick.source} "
                f"{self.pick.latency_ms:.4g} ms; {tie})")

    def to_dict(self) -> dict[str, object]:
        return {
            "pick": self.pick.to_dict() | {"label": self.pick.config.label},
            "cost_pct": self.cost_pct, "within_tie": self.within_tie,
            "passed_over": [{"config": c.to_dict(), "label": c.label, "reason": r}
                            for c, r in self.passed_over],
        }


def choose(
    framework: Framework, shape: AttentionShape, seq_len: int, ranked: Sequence[Alternative],
    tied: Collection[CPConfig] = (),
) -> Substitution:
    """The fastest of ``ranked`` (cptune's pick first, then every alternative, fastest first)
    that ``framework`` runs for ``shape`` at ``seq_len``; ``tied``: the configurations the
    evidence cannot tell from the pick. ``FrameworkError`` when it runs none, naming the
    frameworks that run the pick."""
    passed_over: list[tuple[CPConfig, str]] = []
    for option in ranked:
        reason = framework.refusal(shape, option.config)
        if reason is None:
            within = option.config == ranked[0].config or option.config in tied
            return Substitution(framework.name, seq_len, ranked[0], option, tuple(passed_over), within)
        passed_over.append((option.config, reason))
    pick = ranked[0].config
    others = [f.name for f in FRAMEWORKS.values() if f.refusal(shape, pick) is None]
    elsewhere = (f"{', '.join(others)} run{'s' if len(others) == 1 else ''} cptune's pick"
                 if others else "no framework cptune knows runs cptune's pick")
    raise FrameworkError(
        f"{framework.name} runs none of the {len(ranked)} configuration(s) cptune ranked for "
        f"{shape.at(seq_len).describe()} ({passed_over[0][0].describe()}: {passed_over[0][1]}): "
        f"{elsewhere}, or plain attention on one rank (rank count 1 in the space)"
    )
