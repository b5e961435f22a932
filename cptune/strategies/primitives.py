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

Training adds the backward (``TrainingPrimitives``): ``attention_grad`` (the kernel's
backward for one key subset, from the forward's final output and log-sum-exp),
``reduce_scatter`` (the inverse of ``all_gather``), ``kv_grad_stream`` (the Ring's K/V
blocks again, each with its gradient travelling beside it back to its owner) and
``all_to_all_grad`` (Ulysses' exchange back, replicated KV heads summed). Gradients that
are summed across ranks travel in float32; those an exchange only moves, in the wire dtype,
as activations do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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
        """Attention of queries at ``q_pos`` over keys at ``k_pos`` (the workload's mask and
        padding by position), GQA heads mapped by group; merged (online softmax) with
        ``into``, an earlier result of the same queries over other keys, where given. The
        engine may update ``into`` in place and fuse the merge with the attention, and makes
        no kernel call where no query sees a key (``cptune.calls.any_seen``)."""

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

    def kv_stream(self, kv: Tensor, group: Group, steps: int | None = None) -> Iterator[tuple[int, Tensor]]:
        """Yield ``(member, kv block of that member)`` for this rank's own block and the
        ``steps`` members before it round the ring (None: every member), once each, in the
        engine's order (the MPI engine: this rank's own first, then round the ring, stopping
        after ``steps``; a graph: every member in member order, the same on every rank); the
        engine may move the next block while the caller works on the current one."""

    def narrow(self, x: Tensor, axis: int, start: int, stop: int) -> Tensor:
        """The index range [start, stop) of ``x`` along ``axis`` (a view where the engine has them)."""

    def concat(self, parts: Sequence[Tensor], axis: int) -> Tensor:
        """``parts`` joined along ``axis``."""

    def pad(self, x: Tensor, axis: int, size: int) -> Tensor:
        """``x`` with zero slices appended along ``axis`` up to ``size`` (Ulysses' padded heads)."""


class TrainingPrimitives(Primitives, Protocol):
    """What an engine that trains provides besides: the backward's operations."""

    def attention_grad(self, q: Tensor, kv: Tensor, dout: Tensor, saved: Partial, q_pos: np.ndarray,
                       k_pos: np.ndarray, dq_into: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The backward of ``attention`` over these keys, from ``saved`` (the layer's final
        output and log-sum-exp, over every key) and ``dout``, the output's gradient (zero on
        padding rows): (dq, dkv), dq [batch, heads, seq, head_dim] this key subset's share of
        Q's gradient, added into ``dq_into`` (the same queries' share over other keys) where
        given, the engine may in place; dkv [2, batch, kv_heads, keys, head_dim] the
        gradient of these keys' K and V from these queries, float32."""

    def all_to_all_grad(self, x: Tensor, group: Group, split_axis: int, concat_axis: int,
                        fold: int) -> Tensor:
        """The inverse of ``all_to_all(..., repeat=fold)`` for a gradient: the exchange, then
        each run of ``fold`` slices of ``concat_axis`` summed into one (float32; sent in
        float32 where ``fold`` > 1, else as ``all_to_all`` sends)."""

    def reduce_scatter(self, x: Tensor, group: Group, axis: int,
                       order: Sequence[tuple[int, int, int]] | None = None) -> Tensor:
        """The inverse of ``all_gather`` for a gradient: ``x`` holds every member's part along
        ``axis`` (in member order, or laid out as ``order`` joins them); the members' ``x``
        are summed in float32 and each gets its own part back, in its own order."""

    def kv_grad_stream(self, kv: Tensor, group: Group, visit: Callable[[int, Tensor], Tensor],
                       steps: int | None = None) -> Tensor:
        """The Ring's backward exchange: each member's K/V block passes by as in
        ``kv_stream`` (``steps`` as there) and ``visit(member, block)`` returns this rank's
        gradient of it ([2, ...] like the block, float32); each block's gradient travels
        beside it, summed on every rank it passes, and arrives at its owner once all have
        added theirs (straight back from the last, where ``steps`` stops short of the whole
        ring). Returns the gradient of this rank's own block."""
