"""The few operations a strategy is written against; every engine supplies them.

Tensors are laid out ``q: [batch, heads, seq, head_dim]`` and K/V packed as
``kv: [2, batch, kv_heads, seq, head_dim]`` (one message moves both), so the heads axis is
``HEADS = -3`` and the sequence axis ``SEQ = -2`` in either. Collectives send in the
workload's wire dtype. Token positions are static (``cptune.layout``), so an engine that
builds a graph ahead of time (TensorRT) can turn masks into constants.

TensorRT 11 has no point-to-point layer, so ``kv_stream`` is the one primitive whose
implementation differs most: MPI passes blocks round a ring with send/recv, overlapped with
the attention on the current block; a collective-only engine broadcasts one block per step
(order does not matter: the masks go by position and the merge is commutative).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

HEADS = -3
SEQ = -2

#: "heads": the ranks of one Ulysses head group; "context": the ranks, one per head group,
#: that split the sequence between them (Ring / AllGather-KV).
Group = Literal["heads", "context"]

Tensor = Any  # numpy.ndarray on the MPI engine; a network tensor on graph engines


class Partial(NamedTuple):
    """Attention over a subset of the keys: the normalised output and the log-sum-exp of
    the scores, which is all a later merge with other key subsets needs."""

    out: Tensor  # [batch, heads, seq, head_dim]
    lse: Tensor  # [batch, heads, seq]


class Primitives(Protocol):
    """What an engine provides to run a strategy on one rank."""

    def attention(self, q: Tensor, kv: Tensor, q_pos: np.ndarray, k_pos: np.ndarray,
                  into: Partial | None = None) -> Partial:
        """Attention of queries at ``q_pos`` over keys at ``k_pos`` (causal and padding
        masks by position), GQA heads mapped by group; merged (online softmax) with ``into``,
        an earlier result of the same queries over other keys, where given. The engine may
        update ``into`` in place and fuse the merge with the attention."""

    def all_to_all(self, x: Tensor, group: Group, split_axis: int, concat_axis: int,
                   repeat: int = 1) -> Tensor:
        """Cut ``split_axis`` into one chunk per group member, send chunk j to member j, and
        concatenate what arrives along ``concat_axis`` in member order. ``repeat`` > 1: each
        slice of ``split_axis`` is repeated that many times first (Ulysses' KV heads for a head
        group larger than them), so the engine may do it in the same copy as the send order."""

    def all_gather(self, x: Tensor, group: Group, axis: int,
                   order: Sequence[tuple[int, int, int]] | None = None) -> Tensor:
        """Concatenate every member's ``x`` along ``axis`` in member order; or, given
        ``order``, its (member, start, stop) index ranges along ``axis`` in that order (the
        layout's ``gather_order``: every position in increasing order)."""

    def kv_stream(self, kv: Tensor, group: Group) -> Iterator[tuple[int, Tensor]]:
        """Yield ``(member, kv block of that member)`` once for each member of ``group``, in
        the engine's order (the MPI engine: this rank's own first, then round the ring; a
        graph: member order, the same on every rank); the engine may move the next block
        while the caller works on the current one."""
