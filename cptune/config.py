"""A point of the search space: which CP strategy, over how many ranks, with which head group."""

from __future__ import annotations

from dataclasses import dataclass

from cptune.workload import check_positive_int

#: The context strategies. A head group u > 1 puts Ulysses inside groups of u ranks and
#: the named strategy across the ranks / u groups; "ulysses" alone means u = ranks.
STRATEGIES: tuple[str, ...] = ("allgather_kv", "ring", "ulysses")

#: How the tokens are dealt out to the context blocks (``cptune.layout``, which says what each
#: does and which a workload's mask offers): a tuned part of a configuration, as the strategy
#: is. None in a configuration means the workload's default (``cptune.layout.default_layout``:
#: zigzag for a causal mask without a window, else contiguous).
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag", "striped", "doc_zigzag", "doc_whole", "replicated_text")
_LAYOUT_TITLES = {"contiguous": "contiguous", "zigzag": "zigzag", "striped": "striped",
                  "doc_zigzag": "per-document zigzag", "doc_whole": "whole documents",
                  "replicated_text": "text replicated"}

#: The label of every one-rank configuration.
LOCAL = "local"
_TITLES = {"allgather_kv": "AllGather-KV", "ring": "Ring", "ulysses": "Ulysses"}


@dataclass(frozen=True, init=False)
class CPConfig:
    """``strategy`` over ``ranks`` ranks; ``head_group`` is the Ulysses degree u (heads are
    split over groups of u ranks by all-to-all); ``layout`` how the tokens are dealt out
    (``LAYOUTS``; None: the workload's default); ``pad_heads``: zero heads pad the query
    heads (and K/V heads where needed) up to a multiple of u for Ulysses' exchange and are
    dropped after it (``cptune.layout.padded_heads``), the only form in which a head group
    that does not divide the heads runs. Defaults: u = ranks for "ulysses", else 1;
    ``head_group`` reads the resolved value."""

    strategy: str
    ranks: int
    head_group: int
    layout: str | None
    pad_heads: bool

    def __init__(self, strategy: str, ranks: int, head_group: int | None = None,
                 layout: str | None = None, pad_heads: bool = False) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        check_positive_int("ranks", ranks)
        if head_group is None:
            head_group = ranks if strategy == "ulysses" else 1
        check_positive_int("head_group", head_group)
        if layout is not None and layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if not isinstance(pad_heads, bool):
            raise ValueError(f"pad_heads must be True or False, got {pad_heads!r}")
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "ranks", int(ranks))
        object.__setattr__(self, "head_group", int(head_group))
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "pad_heads", pad_heads)
        # hashed once: every cache of the prior is keyed by the configuration
        object.__setattr__(self, "_hash", hash((strategy, self.ranks, self.head_group, layout, pad_heads)))

    def __hash__(self) -> int:
        return self.__dict__["_hash"]  # type: ignore[no-any-return]

    @property
    def context_degree(self) -> int:
        """How many head groups split the sequence between them (ranks / head_group)."""
        return self.ranks // self.head_group

    @property
    def label(self) -> str:
        """Short name, e.g. "ring", "ulysses", "ulysses2xring2", "ring+contiguous" (a layout
        other than the workload's default after a "+"), "ulysses+padded" (padded heads);
        "local" on one rank, where every strategy is plain attention (the one name tables,
        plans and reports use)."""
        if self.ranks == 1:
            return LOCAL
        layout = (f"+{self.layout}" if self.layout else "") + ("+padded" if self.pad_heads else "")
        if self.strategy == "ulysses" or self.head_group == 1:
            return self.strategy + layout
        return f"ulysses{self.head_group}x{self.strategy}{self.context_degree}{layout}"

    def describe(self) -> str:
        """A sentence a user reads, e.g. "2-way Ulysses x 2-way Ring on 4 ranks", "Ring on 2
        ranks, contiguous"."""
        if self.ranks == 1:
            return f"{LOCAL} attention on 1 rank"
        layout = ((f", {_LAYOUT_TITLES[self.layout]}" if self.layout else "")
                  + (", heads padded" if self.pad_heads else ""))
        if self.strategy == "ulysses" or self.head_group == 1:
            return f"{_TITLES[self.strategy]} on {self.ranks} ranks{layout}"
        return (
            f"{self.head_group}-way Ulysses x {self.context_degree}-way "
            f"{_TITLES[self.strategy]} on {self.ranks} ranks{layout}"
        )

    def with_layout(self, layout: str | None) -> CPConfig:
        """This configuration with its tokens dealt out by ``layout``."""
        return CPConfig(self.strategy, self.ranks, self.head_group, layout, self.pad_heads)

    def with_padded_heads(self, pad_heads: bool = True) -> CPConfig:
        """This configuration with its heads padded to a multiple of the head group, or not."""
        return CPConfig(self.strategy, self.ranks, self.head_group, self.layout, pad_heads)

    def to_dict(self) -> dict[str, object]:
        """Plain JSON; the layout only where it is not the default and ``pad_heads`` only where
        set, so a configuration of neither reads as before they existed. ``CPConfig(**to_dict())``
        is the same one."""
        return ({"strategy": self.strategy, "ranks": self.ranks, "head_group": self.head_group}
                | ({"layout": self.layout} if self.layout else {})
                | ({"pad_heads": True} if self.pad_heads else {}))
