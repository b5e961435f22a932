"""Ring Attention: K/V blocks stream past every rank of the context group; each block's
partial attention is merged into a running result by log-sum-exp, so no rank ever holds
the whole K/V. Causal workloads use the zigzag layout, so every rank does the same work.
Backward: the blocks stream past again, each rank adds its share of dQ from every block and
its gradient of the block to the one travelling with it, which reaches the block's owner
after the last rank (ring-flash-attn's and TransformerEngine's p2p backward)."""

from __future__ import annotations

from cptune.layout import SequenceLayout
from cptune.strategies.primitives import SEQ, Partial, Primitives, Tensor, TrainingPrimitives


def _shared(ops: Primitives, layout: SequenceLayout, kv: Tensor) -> Tensor:
    """What of this rank's block the stream moves (``SequenceLayout.shared``)."""
    part = layout.shared
    if part == slice(0, None):
        return kv
    return ops.narrow(kv, SEQ, part.start, len(layout.block_positions(0)))


def attend(ops: Primitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor) -> Partial:
    """The rank's own block whole, then the shared part of each block as far round the ring
    as some block's queries reach (``SequenceLayout.reach``); where none of this rank's queries
    sees a block's keys the engine makes no kernel call for it (the decision is the engine's,
    at run time: a graph engine's ranks share one graph)."""
    group = layout.head_group_of(rank)
    q_pos = layout.block_positions(group)
    shared = _shared(ops, layout, kv)
    result: Partial | None = None
    for source, block in ops.kv_stream(shared, "context", layout.reach):
        if source == group:  # the block as streamed where the stream moves it whole
            result = ops.attention(q, block if shared is kv else kv, q_pos, q_pos, into=result)
        else:  # an engine makes no kernel call where none of these queries sees a key
            result = ops.attention(q, block, q_pos, layout.shared_positions(source), into=result)
    assert result is not None  # the stream always yields the rank's own block
    return result


def attend_grad(ops: TrainingPrimitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor,
                saved: Partial, dout: Tensor) -> tuple[Tensor, Tensor]:
    group = layout.head_group_of(rank)
    q_pos = layout.block_positions(group)
    shared = _shared(ops, layout, kv)
    dq: Tensor | None = None
    kept: Tensor | None = None  # the gradient of the part of this rank's block the stream leaves home

    def visit(source: int, block: Tensor) -> Tensor:
        nonlocal dq, kept
        if source == group:
            dq, dkv = ops.attention_grad(q, kv, dout, saved, q_pos, q_pos, dq_into=dq)
            if shared is kv:
                return dkv
            start = layout.shared.start
            kept = ops.narrow(dkv, SEQ, 0, start)
            return ops.narrow(dkv, SEQ, start, len(q_pos))
        k_pos = layout.shared_positions(source)
        dq, dkv = ops.attention_grad(q, block, dout, saved, q_pos, k_pos, dq_into=dq)
        return dkv

    dkv = ops.kv_grad_stream(shared, "context", visit, layout.reach)
    assert dq is not None  # the stream always visits the rank's own block
    return dq, dkv if kept is None else ops.concat([kept, dkv], SEQ)
