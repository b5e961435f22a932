"""Ring Attention: K/V blocks stream past every rank of the context group; each block's
partial attention is merged into a running result by log-sum-exp, so no rank ever holds
the whole K/V. Causal workloads use the zigzag layout, so every rank does the same work.
Backward: the blocks stream past again, each rank adds its share of dQ from every block and
its gradient of the block to the one travelling with it, which reaches the block's owner
after the last rank (ring-flash-attn's and TransformerEngine's p2p backward)."""

from __future__ import annotations

from cptune.layout import SequenceLayout
from cptune.strategies.primitives import Partial, Primitives, Tensor, TrainingPrimitives


def attend(ops: Primitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor) -> Partial:
    q_pos = layout.block_positions(layout.head_group_of(rank))
    result: Partial | None = None
    for source, block in ops.kv_stream(kv, "context"):
        result = ops.attention(q, block, q_pos, layout.block_positions(source), into=result)
    assert result is not None  # the stream always yields the rank's own block
    return result


def attend_grad(ops: TrainingPrimitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor,
                saved: Partial, dout: Tensor) -> tuple[Tensor, Tensor]:
    q_pos = layout.block_positions(layout.head_group_of(rank))
    dq: Tensor | None = None

    def visit(source: int, block: Tensor) -> Tensor:
        nonlocal dq
        dq, dkv = ops.attention_grad(q, block, dout, saved, q_pos, layout.block_positions(source), dq_into=dq)
        return dkv

    dkv = ops.kv_grad_stream(kv, "context", visit)
    assert dq is not None  # the stream always visits the rank's own block
    return dq, dkv
