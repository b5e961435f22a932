"""The configuration a framework runs at one length: the fastest it can express.

cptune ranks every configuration at a length (measured, or predicted with its interval); a
framework that cannot express the pick runs the fastest one it can, and says what that costs
against the pick and whether the evidence can tell the two apart at all (the pick's ties).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from cptune.config import CPConfig
from cptune.frameworks._framework import Framework, FrameworkError, Runs
from cptune.frameworks._registry import FRAMEWORKS
from cptune.plans import Alternative
from cptune.workload import AttentionShape

#: Prices what a framework runs (``Runs``) where cptune's ranking does not hold it: its
#: latency as run, and whether the evidence cannot tell it from cptune's pick.
Pricer = Callable[[Runs], tuple[Alternative, bool]]


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
    #: What the framework runs for ``chosen.config`` (``chosen``'s latency is that of it).
    runs: Runs | None = field(default=None)

    @property
    def as_cptune_runs(self) -> bool:
        """Whether the framework runs ``chosen`` as cptune runs and prices it."""
        return self.runs is None or self.runs.same_as(self.chosen.config)

    @property
    def cost_pct(self) -> float:
        """How much slower ``chosen`` is than the pick, in percent of the pick (0 for the pick)."""
        return 100.0 * (self.chosen.latency_ms / self.pick.latency_ms - 1.0)

    def describe(self) -> str:
        """One line a user reads: the pick kept, or what replaced it and at what cost."""
        chosen = self.chosen.config.describe()
        if self.runs is not None and not self.as_cptune_runs:
            chosen += f" as {self.framework} runs it ({self.runs.what})"
        if self.chosen.config == self.pick.config and self.as_cptune_runs:
            return f"{chosen}: cptune's pick"
        tie = "within the tie" if self.within_tie else "outside the tie: the evidence separates them"
        instead = ("" if self.chosen.config == self.pick.config else
                   f" in place of cptune's pick, {self.pick.config.describe()} ({self.passed_over[0][1]})")
        return (f"{chosen}{instead}: {self.cost_pct:+.1f}% ({self.chosen.source} "
                f"{self.chosen.latency_ms:.4g} ms against {self.pick.source} "
                f"{self.pick.latency_ms:.4g} ms; {tie})")

    def to_dict(self) -> dict[str, object]:
        return {
            "pick": self.pick.to_dict() | {"label": self.pick.config.label},
            "runs": None if self.runs is None else {
                "config": self.runs.config.to_dict(), "label": self.runs.config.label,
                "per_block_calls": self.runs.per_block_calls, "what": self.runs.what or None},
            "cost_pct": self.cost_pct, "within_tie": self.within_tie,
            "passed_over": [{"config": c.to_dict(), "label": c.label, "reason": r}
                            for c, r in self.passed_over],
        }


def choose(
    framework: Framework, shape: AttentionShape, seq_len: int, ranked: Sequence[Alternative],
    tied: Collection[CPConfig] = (), price: Pricer | None = None, per_node: int | None = None,
) -> Substitution:
    """The fastest of ``ranked`` (cptune's pick first, then every alternative, fastest first)
    as ``framework`` runs it for ``shape`` at ``seq_len``; ``tied``: the configurations the
    evidence cannot tell from the pick. Where the framework runs a configuration otherwise
    than cptune (``Framework.runs``), it is priced as run: by the ranking where that holds
    what runs, else by ``price`` (the prior's latency of what runs, and whether it is tied with
    the pick); without ``price`` such a configuration is passed over. ``per_node``: ranks per
    node (None: one node), for what the framework cannot start across nodes or cut at this
    length (``Framework.placed_refusal``). ``FrameworkError`` when
    it runs none, naming the frameworks that run the pick."""
    pick = ranked[0]
    by_config = {option.config: option for option in ranked}
    refused: list[tuple[Alternative, str]] = []
    options: list[tuple[Alternative, Runs, bool]] = []  # as run, what runs, within the tie
    seen: set[tuple[CPConfig, bool]] = set()
    for option in ranked:
        reason = framework.refusal(shape, option.config)
        if reason is None and option.config.ranks > 1:
            reason = framework.placed_refusal(shape, option.config, seq_len, per_node)
        if reason is not None:
            refused.append((option, reason))
            continue
        runs = framework.runs(shape, option.config, seq_len)
        if (runs.config, runs.per_block_calls) in seen:  # the same settings' run, already priced
            continue
        seen.add((runs.config, runs.per_block_calls))
        known = by_config.get(runs.config) if not runs.per_block_calls else None
        if known is not None:
            ran = Alternative(option.config, known.latency_ms, known.interval_ms, known.source)
            within = runs.config == pick.config or runs.config in tied
        elif price is not None:
            ran, within = price(runs)
            ran = Alternative(option.config, ran.latency_ms, ran.interval_ms, ran.source)
        else:
            refused.append((option, f"{runs.what}; not priced as run without the hardware's profile"))
            continue
        options.append((ran, runs, within))
        if ran.latency_ms > option.latency_ms:  # cptune's own run of it was faster
            refused.append((option, f"{runs.what}: {ran.latency_ms:.4g} ms as run"))
    if options:
        chosen, runs, within = min(options, key=lambda entry: entry[0].latency_ms)
        order = {option.config: i for i, option in reversed(list(enumerate(ranked)))}
        ahead = (chosen.latency_ms, order[chosen.config])  # ranked ahead of it, as run
        passed_over = tuple((o.config, r) for o, r in sorted(refused, key=lambda e: (e[0].latency_ms,
                                                                                    order[e[0].config]))
                            if (o.latency_ms, order[o.config]) < ahead)
        return Substitution(framework.name, seq_len, pick, chosen, passed_over, within, runs)
    others = [f.name for f in FRAMEWORKS.values() if f.refusal(shape, pick.config) is None]
    elsewhere = (f"{', '.join(others)} run{'s' if len(others) == 1 else ''} cptune's pick"
                 if others else "no framework cptune knows runs cptune's pick")
    first, reason = refused[0]
    raise FrameworkError(
        f"{framework.name} runs none of the {len(ranked)} configuration(s) cptune ranked for "
        f"{shape.at(seq_len).describe()} ({first.config.describe()}: {reason}): "
        f"{elsewhere}, or plain attention on one rank (rank count 1 in the space)"
    )
