"""Which tokens each rank holds, and which ranks talk to which.

Ranks are numbered ``r = g * u + j``: head group ``g`` (of ``c = ranks / u``) holds one
*context block* of the sequence, and its ``u`` members (j = 0..u-1) each start with a
contiguous piece of that block. Ulysses' all-to-all inside a head group gives every member
the whole block for ``heads / u`` heads; the context strategy (Ring or AllGather-KV) then
runs across the ``c`` ranks that share the same ``j``.

The sequence is padded at the end to a length every split divides (padding keys are masked,
padding queries dropped). Causal workloads split over more than one context block use the
zigzag (load-balanced) order: the sequence is cut into ``2c`` chunks and block ``g`` holds
chunks ``g`` and ``2c - 1 - g``, so every block has the same share of the causal triangle.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from cptune.config import CPConfig
from cptune.workload import Workload

#: Groups of global ranks that run one collective at once.
Groups = Sequence[tuple[int, ...]]


def rank_at(group: int, member: int, head_group: int) -> int:
    """The rank of ``member`` j of head group g: ``r = g * u + j`` (the one place this
    numbering is written)."""
    return group * head_group + member


def rank_coordinates(rank: int, head_group: int) -> tuple[int, int]:
    """(head group g, member j) of ``rank``: the inverse of ``rank_at``."""
    return divmod(rank, head_group)


def head_group_members(rank: int, head_group: int) -> list[int]:
    """The ranks that exchange heads with ``rank`` (Ulysses all-to-all), in order."""
    group, _ = rank_coordinates(rank, head_group)
    return [rank_at(group, j, head_group) for j in range(head_group)]


def context_group_members(rank: int, head_group: int, ranks: int) -> list[int]:
    """The ranks that exchange K/V with ``rank`` (Ring / AllGather-KV), in order."""
    _, member = rank_coordinates(rank, head_group)
    return [rank_at(g, member, head_group) for g in range(ranks // head_group)]


@dataclass(frozen=True)
class RankGroups(Sequence[tuple[int, ...]]):
    """One configuration's head groups (``along="heads"``: the ``ranks / head_group``
    consecutive blocks of ``head_group`` ranks) or context groups (``along="context"``: the
    ``head_group`` groups of ranks ``j, j + u, j + 2u, ...``), every group once, in order.
    Held as the rule, not the members: a cluster's configuration costs the same to name
    whatever its size, and what it moves over a topology can be worked out from the rule
    (``cptune.hardware.traffic``). Members are computed when a group is read."""

    along: str
    ranks: int
    head_group: int

    def __post_init__(self) -> None:
        if self.along not in ("heads", "context"):
            raise ValueError(f"along must be 'heads' or 'context', got {self.along!r}")
        if self.ranks < 1 or self.head_group < 1 or self.ranks % self.head_group:
            raise ValueError(f"head group {self.head_group} must divide {self.ranks} ranks")

    @property
    def size(self) -> int:
        """Members per group."""
        return self.head_group if self.along == "heads" else self.ranks // self.head_group

    def __len__(self) -> int:
        return self.ranks // self.size

    def __getitem__(self, index: int) -> tuple[int, ...]:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(f"group {index} of {len(self)}")
        index %= len(self)
        if self.along == "heads":
            return tuple(head_group_members(rank_at(index, 0, self.head_group), self.head_group))
        return tuple(context_group_members(index, self.head_group, self.ranks))

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return (self[i] for i in range(len(self)))


def rank_groups(config: CPConfig) -> tuple[RankGroups, RankGroups]:
    """(head groups, context groups) of ``config`` as global ranks, every group once."""
    return (RankGroups("heads", config.ranks, config.head_group),
            RankGroups("context", config.ranks, config.head_group))


def kv_replication(workload: Workload, head_group: int) -> int:
    """How many copies of each KV head the Ulysses all-to-all needs: 1 when the KV heads
    split evenly over the head group, head_group / kv_heads when the group is larger than
    the KV heads (GQA/MQA: each rank then gets one replicated KV head, as DeepSpeed does)."""
    if workload.kv_heads % head_group == 0:
        return 1
    return head_group // workload.kv_heads


def position_runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Index ranges [start, stop) over which positions increase by exactly one."""
    breaks = (np.flatnonzero(np.diff(positions) != 1) + 1).tolist()
    edges = [0, *breaks, len(positions)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


class SequenceLayout:
    """Token positions per rank and the two communication groups of each rank."""

    def __init__(self, workload: Workload, config: CPConfig) -> None:
        self.workload = workload
        self.config = config
        self.ranks = config.ranks
        self.head_group = config.head_group
        self.context_degree = config.context_degree
        self.zigzag = workload.causal and self.context_degree > 1
        granularity = math.lcm(self.ranks, 2 * self.context_degree) if self.zigzag else self.ranks
        self.padded_len = -(-workload.seq_len // granularity) * granularity

    def block_ranges(self, group: int) -> list[tuple[int, int]]:
        """The position ranges [start, stop) context block ``group`` holds, in order: one,
        or two zigzag chunks. Arithmetic only, so the analytic cost of any length is free."""
        c, n = self.context_degree, self.padded_len
        if not self.zigzag:
            size = n // c
            return [(group * size, (group + 1) * size)]
        chunk = n // (2 * c)
        return [(group * chunk, (group + 1) * chunk), ((2 * c - 1 - group) * chunk, (2 * c - group) * chunk)]

    @functools.cached_property
    def _blocks(self) -> list[np.ndarray]:
        """Token positions of every context block (what running a configuration needs),
        read-only: a plan of attention calls made for them holds while they live."""
        return [_read_only(np.concatenate([np.arange(start, stop) for start, stop in self.block_ranges(g)]))
                for g in range(self.context_degree)]

    def block_positions(self, group: int) -> np.ndarray:
        """Token positions of context block ``group`` (what each of its ranks holds after
        the Ulysses all-to-all), in the order the ranks hold them."""
        return self._blocks[group]

    @functools.cached_property
    def gather_order(self) -> tuple[tuple[int, int, int], ...]:
        """(member, start, stop): the index ranges of each context block that, joined in this
        order, hold every position in increasing order (the zigzag halves of each block
        apart): the order an all-gather across head groups puts the keys in."""
        pieces = sorted((int(block[start]), member, start, stop)
                        for member, block in enumerate(self._blocks) for start, stop in position_runs(block))
        return tuple((member, start, stop) for _, member, start, stop in pieces)

    @functools.cached_property
    def gathered_positions(self) -> np.ndarray:
        """Positions of the keys an all-gather in ``gather_order`` holds: 0 .. padded_len - 1
        (read-only)."""
        pieces = [self._blocks[member][start:stop] for member, start, stop in self.gather_order]
        return _read_only(np.concatenate(pieces))

    def rank_positions(self, rank: int) -> np.ndarray:
        """Token positions rank ``rank`` holds before any exchange (a copy of its own)."""
        group, member = rank_coordinates(rank, self.head_group)
        piece = self.padded_len // self.ranks
        return self._blocks[group][member * piece : (member + 1) * piece].copy()

    def head_group_of(self, rank: int) -> int:
        return rank_coordinates(rank, self.head_group)[0]

    def head_group_ranks(self, rank: int) -> list[int]:
        """The ranks that exchange heads with ``rank`` (Ulysses all-to-all), in order."""
        return head_group_members(rank, self.head_group)

    def context_group_ranks(self, rank: int) -> list[int]:
        """The ranks that exchange K/V with ``rank`` (Ring / AllGather-KV), in order."""
        return context_group_members(rank, self.head_group, self.ranks)

    def real_query_positions(self, group: int) -> np.ndarray:
        """Positions of block ``group`` that are real tokens (not padding)."""
        block = self._blocks[group]
        return block[block < self.workload.seq_len]
