"""CP strategies, one module each, written once against ``Primitives``.

Every configuration runs the same three steps: Ulysses' all-to-all into head shards (a
no-op for head group 1), the context strategy across head groups, and the all-to-all back.
Training runs them forward (``run_forward``, keeping what the backward needs) and then
backward (``run_backward``): the output's gradient into head shards, each context
strategy's backward, and the gradients of Q, K and V back to sequence shards.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from cptune.layout import SequenceLayout
from cptune.strategies import allgather_kv, ring, ulysses
from cptune.strategies.primitives import HEADS, SEQ, Group, Partial, Primitives, Tensor, TrainingPrimitives


class ContextStrategy(Protocol):
    """A context strategy's module: its forward and its backward on one rank, over the
    ranks that share its context groups (after Ulysses' exchange)."""

    def attend(self, ops: Primitives, layout: SequenceLayout, rank: int, q: Tensor,
               kv: Tensor) -> Partial: ...

    def attend_grad(self, ops: TrainingPrimitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor,
                    saved: Partial, dout: Tensor) -> tuple[Tensor, Tensor]: ...


CONTEXT_STRATEGIES: dict[str, ContextStrategy] = {
    "allgather_kv": allgather_kv,
    "ring": ring,
    "ulysses": ulysses,
}


class Saved(NamedTuple):
    """What a rank keeps from its forward for the backward: Q and K/V as the context
    strategy held them (head shards after Ulysses' exchange) and the attention's output
    with its log-sum-exp there (FlashAttention keeps the same)."""

    q: Tensor
    kv: Tensor
    result: Partial


def run_strategy(ops: Primitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor) -> Tensor:
    """One attention layer on ``rank``: its sequence shard of Q and K/V in, its sequence
    shard of the output out."""
    return run_forward(ops, layout, rank, q, kv)[0]


def run_forward(ops: Primitives, layout: SequenceLayout, rank: int, q: Tensor,
                kv: Tensor) -> tuple[Tensor, Saved]:
    """``run_strategy``, and what ``run_backward`` needs of it."""
    q, kv = ulysses.to_heads(ops, layout, q, kv)
    result = CONTEXT_STRATEGIES[layout.config.strategy].attend(ops, layout, rank, q, kv)
    return ulysses.to_sequence(ops, layout, result.out), Saved(q, kv, result)


def run_backward(ops: TrainingPrimitives, layout: SequenceLayout, rank: int, saved: Saved,
                 dout: Tensor) -> tuple[Tensor, Tensor]:
    """The layer's backward on ``rank``: its sequence shard of the output's gradient in
    (zero on padding rows), its shards of dQ [batch, heads, seq, head_dim] and of dK/dV
    [2, batch, kv_heads, seq, head_dim] out."""
    dout = ulysses.output_grad_to_heads(ops, layout, dout)
    strategy = CONTEXT_STRATEGIES[layout.config.strategy]
    dq, dkv = strategy.attend_grad(ops, layout, rank, saved.q, saved.kv, saved.result, dout)
    return ulysses.grads_to_sequence(ops, layout, dq, dkv)


__all__ = ["HEADS", "SEQ", "Group", "Partial", "Primitives", "Saved", "Tensor", "TrainingPrimitives",
           "run_backward", "run_forward", "run_strategy"]
