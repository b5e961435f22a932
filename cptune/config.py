"""A point of the search space: which CP strategy, over how many ranks, with which head group."""

from __future__ import annotations

from dataclasses import dataclass

from cptune.workload import _check_positive_int

#: The context strategies. A head group u > 1 puts Ulysses inside groups of u ranks and
#: the named strategy across the ranks / u groups; "ulysses" alone means u = ranks.
STRATEGIES: tuple[str, ...] = ("allgather_kv", "ring", "ulysses")

_TITLES = {"allgather_kv": "AllGather-KV", "ring": "Ring", "ulysses": "Ulysses"}


@dataclass(frozen=True)
class CPConfig:
    """``strategy`` over ``ranks`` ranks; ``head_group`` is the Ulysses degree u (heads are
    split over groups of u ranks by all-to-all). Defaults: u = ranks for "ulysses", else 1."""

    strategy: str
    ranks: int
    head_group: int | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        _check_positive_int("ranks", self.ranks)
        if self.head_group is None:
            object.__setattr__(self, "head_group", self.ranks if self.strategy == "ulysses" else 1)
        _check_positive_int("head_group", self.head_group)
        object.__setattr__(self, "ranks", int(self.ranks))
        object.__setattr__(self, "head_group", int(self.head_group))

    @property
    def context_degree(self) -> int:
        """How many head groups split the sequence between them (ranks / head_group)."""
        return self.ranks // self.head_group

    @property
    def label(self) -> str:
        """Short name, e.g. "ring", "ulysses", "ulysses2xring2"."""
        if self.strategy == "ulysses" or self.head_group == 1:
            return self.strategy
        return f"ulysses{self.head_group}x{self.strategy}{self.context_degree}"

    def describe(self) -> str:
        """A sentence a user reads, e.g. "2-way Ulysses x 2-way Ring on 4 ranks"."""
        if self.ranks == 1:
            return f"{_TITLES[self.strategy]} on 1 rank (local attention)"
        if self.strategy == "ulysses" or self.head_group == 1:
            return f"{_TITLES[self.strategy]} on {self.ranks} ranks"
        return (
            f"{self.head_group}-way Ulysses x {self.context_degree}-way "
            f"{_TITLES[self.strategy]} on {self.ranks} ranks"
        )

    def to_dict(self) -> dict[str, object]:
        return {"strategy": self.strategy, "ranks": self.ranks, "head_group": self.head_group}
