"""A framework's view of cptune's configurations: which it can run, and how it spells one.

Each framework takes its context-parallel choice as settings of its own (degrees, a comm
type, flags). A ``Framework`` says, for one attention shape and one ``CPConfig``, why it
cannot run it (``refusal``) and how it spells it (``spell``: the settings as it names them,
a Python snippet or flags, the launch line and what the user must also do). Every framework
here puts a Ulysses group on consecutive ranks and the context group across them, as
cptune's ``r = g * u + j`` does (tests/test_frameworks.py holds each one's own rule against
``cptune.layout``). The facts come from each framework's source at the version named in
``pinned`` (docs/frameworks.md cites the files).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cptune.config import CPConfig
from cptune.errors import CPTuneError
from cptune.workload import AttentionShape


class FrameworkError(CPTuneError, ValueError):
    """A framework that cptune does not know, or a plan or workload it cannot take."""


@dataclass(frozen=True)
class Spelling:
    """One configuration in a framework's own terms."""

    #: The framework's setting names and values, e.g. {"ring_degree": 2, "ulysses_degree": 4}.
    settings: Mapping[str, Any]
    #: A Python snippet or command-line flags, as the framework takes them.
    code: str
    #: How to start the ranks (the user's own program or model in angle brackets).
    launch: str
    #: What the user must also do for the settings to run as cptune measured them.
    needs: tuple[str, ...] = field(default=())


class Framework(ABC):
    """One framework: what it can run and how it spells a configuration."""

    #: The name ``--for`` takes.
    name: ClassVar[str]
    #: The package and version whose source the facts were read from.
    pinned: ClassVar[str]
    #: "python" (a snippet) or "flags" (command-line flags).
    form: ClassVar[str]

    @abstractmethod
    def context_refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        """Why the framework cannot run ``config`` (over more than one rank) for ``shape``."""

    @abstractmethod
    def spell_context(self, shape: AttentionShape, config: CPConfig) -> Spelling:
        """``config`` (over more than one rank) in the framework's terms."""

    def refusal(self, shape: AttentionShape, config: CPConfig) -> str | None:
        """Why the framework cannot run ``config`` for ``shape``; None when it can. One rank
        runs plain attention, which every framework does without context parallelism."""
        return None if config.ranks == 1 else self.context_refusal(shape, config)

    def spell(self, shape: AttentionShape, config: CPConfig) -> Spelling:
        """``config`` in the framework's terms; ``FrameworkError`` when it cannot run it."""
        if reason := self.refusal(shape, config):
            raise FrameworkError(f"{self.name} cannot run {config.describe()}: {reason}")
        if config.ranks == 1:
            return Spelling({}, "# no context parallelism: one rank runs plain attention",
                            "python <your program>")
        return self.spell_context(shape, config)


def heads_refusal(shape: AttentionShape, head_group: int, what: str) -> str | None:
    """Why a framework that exchanges K and V heads as it exchanges queries' (no KV head
    replication) cannot split ``shape`` over ``head_group`` ranks; None when it can."""
    if shape.kv_heads % head_group:
        return (f"{what} splits K and V heads as it splits query heads: {shape.kv_heads} KV heads "
                f"over a head group of {head_group} does not divide")
    return None


def flags(settings: Mapping[str, Any], spell_name: Mapping[str, str]) -> str:
    """``--name value`` for each setting, named as ``spell_name`` says."""
    parts = []
    for key, value in settings.items():
        shown = " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
        parts.append(f"{spell_name[key]} {shown}")
    return " ".join(parts)
