"""AllGather-KV: every rank of the context group gathers all K/V blocks in one collective
and attends its own queries over the whole sequence. One exchange, full K/V in memory.
Backward: K/V gathered again (the forward keeps only the rank's own block, as Megatron's
all-gather CP does), the local backward over the whole sequence, and a reduce-scatter that
sums every rank's gradient of each block onto its owner."""

from __future__ import annotations

from cptune.layout import SequenceLayout
from cptune.strategies.primitives import SEQ, Partial, Primitives, Tensor, TrainingPrimitives


def attend(ops: Primitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor) -> Partial:
    q_pos = layout.block_positions(layout.head_group_of(rank))
    everything = ops.all_gather(kv, "context", SEQ, layout.gather_order)  # in position order
    return ops.attention(q, everything, q_pos, layout.gathered_positions)


def attend_grad(ops: TrainingPrimitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor,
                saved: Partial, dout: Tensor) -> tuple[Tensor, Tensor]:
    q_pos = layout.block_positions(layout.head_group_of(rank))
    everything = ops.all_gather(kv, "context", SEQ, layout.gather_order)
    dq, d_everything = ops.attention_grad(q, everything, dout, saved, q_pos, layout.gathered_positions)
    return dq, ops.reduce_scatter(d_everything, "context", SEQ, layout.gather_order)
