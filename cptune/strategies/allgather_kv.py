"""AllGather-KV: every rank of the context group gathers all K/V blocks in one collective
and attends its own queries over the whole sequence. One exchange, full K/V in memory."""

from __future__ import annotations

from cptune.layout import SequenceLayout
from cptune.strategies.primitives import SEQ, Primitives, Tensor


def attend(ops: Primitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor) -> Tensor:
    q_pos = layout.block_positions(layout.head_group_of(rank))
    everything = ops.all_gather(kv, "context", SEQ, layout.gather_order)  # in position order
    return ops.attention(q, everything, q_pos, layout.gathered_positions).out
