"""Ring Attention: K/V blocks stream past every rank of the context group; each block's
partial attention is merged into a running result by log-sum-exp, so no rank ever holds
the whole K/V. Causal workloads use the zigzag layout, so every rank does the same work."""

from __future__ import annotations

from cptune.layout import SequenceLayout
from cptune.strategies.primitives import Partial, Primitives, Tensor


def attend(ops: Primitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor) -> Tensor:
    q_pos = layout.block_positions(layout.head_group_of(rank))
    result: Partial | None = None
    for source, block in ops.kv_stream(kv, "context"):
        result = ops.attention(q, block, q_pos, layout.block_positions(source), into=result)
    assert result is not None  # the stream always yields the rank's own block
    return result.out
