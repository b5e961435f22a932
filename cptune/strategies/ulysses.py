"""DeepSpeed Ulysses: all-to-all turns sequence shards into head shards, every rank attends
over its group's whole block for heads / u heads, and a second all-to-all turns the output
back. Its exchanges also wrap the hybrids: Ulysses inside a head group, Ring or
AllGather-KV across groups. Backward: four more all-to-alls, the output's gradient in, dQ
and dK/dV (one message) out, around the local backward.

Padded heads (``CPConfig.pad_heads``): zero heads are appended to Q (and to K/V where
``cptune.layout.padded_heads`` says) before the first exchange, computed and moved as real
ones, and dropped after the exchange back: the output and the gradients are the real heads'
alone. A zero query head's output and gradients never reach a real head's (its dout is zero).
"""

from __future__ import annotations

from cptune.layout import SequenceLayout, heads_as_run, kv_replication
from cptune.strategies.primitives import HEADS, SEQ, Partial, Primitives, Tensor, TrainingPrimitives


def to_heads(ops: Primitives, layout: SequenceLayout, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
    """Sequence shards -> head shards inside the head group. KV heads fewer than the group
    are replicated on the way, so each rank still gets the KV head its query heads read."""
    if layout.head_group == 1:
        return q, kv
    run = heads_as_run(layout.workload, layout.config)
    if run is not layout.workload:
        q = ops.pad(q, HEADS, run.heads)
        kv = kv if run.kv_heads == layout.workload.kv_heads else ops.pad(kv, HEADS, run.kv_heads)
    copies = kv_replication(run, layout.head_group)
    return ops.all_to_all(q, "heads", HEADS, SEQ), ops.all_to_all(kv, "heads", HEADS, SEQ, repeat=copies)


def _real(ops: Primitives, layout: SequenceLayout, x: Tensor, heads: int) -> Tensor:
    """``x`` without the padded heads beyond ``heads`` (as it is where none are padded)."""
    return ops.narrow(x, HEADS, 0, heads) if layout.config.pad_heads else x


def to_sequence(ops: Primitives, layout: SequenceLayout, out: Tensor) -> Tensor:
    """Head shards -> sequence shards: the inverse of ``to_heads`` for the output."""
    if layout.head_group == 1:
        return out
    return _real(ops, layout, ops.all_to_all(out, "heads", SEQ, HEADS), layout.workload.heads)


def output_grad_to_heads(ops: Primitives, layout: SequenceLayout, dout: Tensor) -> Tensor:
    """The output's gradient, sequence shards -> head shards, as Q travels (zero on padded heads)."""
    if layout.head_group == 1:
        return dout
    if layout.config.pad_heads:
        dout = ops.pad(dout, HEADS, heads_as_run(layout.workload, layout.config).heads)
    return ops.all_to_all(dout, "heads", HEADS, SEQ)


def grads_to_sequence(ops: TrainingPrimitives, layout: SequenceLayout, dq: Tensor,
                      dkv: Tensor) -> tuple[Tensor, Tensor]:
    """Head shards -> sequence shards for the gradients: dQ as the output goes back, dK/dV
    by the inverse of ``to_heads``' exchange, the copies of a replicated KV head summed."""
    if layout.head_group == 1:
        return dq, dkv
    copies = kv_replication(heads_as_run(layout.workload, layout.config), layout.head_group)
    dq = ops.all_to_all(dq, "heads", SEQ, HEADS)
    dkv = ops.all_to_all_grad(dkv, "heads", SEQ, HEADS, fold=copies)
    return (_real(ops, layout, dq, layout.workload.heads),
            _real(ops, layout, dkv, layout.workload.kv_heads))


def attend(ops: Primitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor) -> Partial:
    """Pure Ulysses: after ``to_heads`` the rank holds the whole sequence for its heads."""
    positions = layout.block_positions(layout.head_group_of(rank))
    return ops.attention(q, kv, positions, positions)


def attend_grad(ops: TrainingPrimitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor,
                saved: Partial, dout: Tensor) -> tuple[Tensor, Tensor]:
    """Pure Ulysses' backward: the local backward over its heads' whole sequence."""
    positions = layout.block_positions(layout.head_group_of(rank))
    return ops.attention_grad(q, kv, dout, saved, positions, positions)
