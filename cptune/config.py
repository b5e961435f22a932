"""A point of the search space: which CP strategy, over how many ranks, with which head group."""

from __future__ import annotations

from dataclasses import dataclass

from cptune.workload import check_positive_int

#: The context strategies. A head group u > 1 puts Ulysses inside groups of u ranks and
#: the named strategy across the ranks / u groups; "ulysses" alone means u = ranks.
STRATEGIES: tuple[str, ...] = ("allgather_kv", "ring", "ulysses")

#: The label of every one-rank configuration.
LOCAL = "local"
_TITLES = {"allgather_kv": "AllGather-KV", "ring": "Ring", "ulysses": "Ulysses"}


@dataclass(frozen=True, init=False)
class CPConfig:
    """``strategy`` over ``ranks`` ranks; ``head_group`` is the Ulysses degree u (heads are
    split over groups of u ranks by all-to-all). Defaults: u = ranks for "ulysses", else 1;
    ``head_group`` reads the resolved value."""

    strategy: str
    ranks: int
    head_group: int

    def __init__(self, strategy: str, ranks: int, head_group: int | None = None) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        check_positive_int("ranks", ranks)
        if head_group is None:
            head_group = ranks if strategy == "ulysses" else 1
        check_positive_int("head_group", head_group)
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "ranks", int(ranks))
        object.__setattr__(self, "head_group", int(head_group))

    @property
    def context_degree(self) -> int:
        """How many head groups split the sequence between them (ranks / head_group)."""
        return self.ranks // self.head_group

    @property
    def label(self) -> str:
        """Short name, e.g. "ring", "ulysses", "ulysses2xring2"; "local" on one rank, where
        every strategy is plain attention (the one name tables, plans and reports use)."""
        if self.ranks == 1:
            return LOCAL
        if self.strategy == "ulysses" or self.head_group == 1:
            return self.strategy
        return f"ulysses{self.head_group}x{self.strategy}{self.context_degree}"

    def describe(self) -> str:
        """A sentence a user reads, e.g. "2-way Ulysses x 2-way Ring on 4 ranks"."""
        if self.ranks == 1:
            return f"{LOCAL} attention on 1 rank"
        if self.strategy == "ulysses" or self.head_group == 1:
            return f"{_TITLES[self.strategy]} on {self.ranks} ranks"
        return (
            f"{self.head_group}-way Ulysses x {self.context_degree}-way "
            f"{_TITLES[self.strategy]} on {self.ranks} ranks"
        )

    def to_dict(self) -> dict[str, object]:
        return {"strategy": self.strategy, "ranks": self.ranks, "head_group": self.head_group}
