"""AllGather-KV: every rank of the context group gathers all K/V blocks in one collective
and attends its own queries over the whole sequence. One exchange, full K/V in memory;
none where no block's queries see another's keys (documents kept whole on their blocks),
and replicated tokens (joint attention's text on every rank) are not gathered again.
Backward: K/V gathered again (the forward keeps only the rank's own block, as Megatron's
all-gather CP does), the local backward over the whole sequence, and a reduce-scatter that
sums every rank's gradient of each block onto its owner."""

from __future__ import annotations

import numpy as np

from cptune.layout import SequenceLayout
from cptune.strategies.primitives import SEQ, Partial, Primitives, Tensor, TrainingPrimitives


def _gathered(ops: Primitives, layout: SequenceLayout, rank: int, kv: Tensor) -> tuple[Tensor, np.ndarray]:
    """Every key this rank's queries may see, in position order, and their positions."""
    if layout.reach == 0:
        return kv, layout.block_positions(layout.head_group_of(rank))
    kept = layout.replicated
    shared = kv if not kept else ops.narrow(kv, SEQ, kept, len(layout.block_positions(0)))
    everything = ops.all_gather(shared, "context", SEQ, layout.gather_order)  # in position order
    if kept:
        everything = ops.concat([ops.narrow(kv, SEQ, 0, kept), everything], SEQ)
    return everything, layout.gathered_positions


def attend(ops: Primitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor) -> Partial:
    q_pos = layout.block_positions(layout.head_group_of(rank))
    everything, k_pos = _gathered(ops, layout, rank, kv)
    return ops.attention(q, everything, q_pos, k_pos)


def attend_grad(ops: TrainingPrimitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor,
                saved: Partial, dout: Tensor) -> tuple[Tensor, Tensor]:
    assert not layout.replicated, "feasibility refuses training with replicated tokens"
    q_pos = layout.block_positions(layout.head_group_of(rank))
    everything, k_pos = _gathered(ops, layout, rank, kv)
    dq, d_everything = ops.attention_grad(q, everything, dout, saved, q_pos, k_pos)
    if layout.reach == 0:
        return dq, d_everything
    return dq, ops.reduce_scatter(d_everything, "context", SEQ, layout.gather_order)
