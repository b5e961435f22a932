"""CP strategies, one module each, written once against ``Primitives``.

Every configuration runs the same three steps: Ulysses' all-to-all into head shards (a
no-op for head group 1), the context strategy across head groups, and the all-to-all back.
"""

from __future__ import annotations

from collections.abc import Callable

from cptune.layout import SequenceLayout
from cptune.strategies import allgather_kv, ring, ulysses
from cptune.strategies.primitives import HEADS, SEQ, Group, Partial, Primitives, Tensor

ContextAttention = Callable[[Primitives, SequenceLayout, int, Tensor, Tensor], Tensor]

CONTEXT_ATTENTION: dict[str, ContextAttention] = {
    "allgather_kv": allgather_kv.attend,
    "ring": ring.attend,
    "ulysses": ulysses.attend,
}


def run_strategy(ops: Primitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor) -> Tensor:
    """One attention layer on ``rank``: its sequence shard of Q and K/V in, its sequence
    shard of the output out."""
    q, kv = ulysses.to_heads(ops, layout, q, kv)
    out = CONTEXT_ATTENTION[layout.config.strategy](ops, layout, rank, q, kv)
    return ulysses.to_sequence(ops, layout, out)


__all__ = ["HEADS", "SEQ", "Group", "Partial", "Primitives", "Tensor", "run_strategy"]
