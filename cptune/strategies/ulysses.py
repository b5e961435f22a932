"""DeepSpeed Ulysses: all-to-all turns sequence shards into head shards, every rank attends
over its group's whole block for heads / u heads, and a second all-to-all turns the output
back. Its exchanges also wrap the hybrids: Ulysses inside a head group, Ring or
AllGather-KV across groups. Backward: four more all-to-alls, the output's gradient in, dQ
and dK/dV (one message) out, around the local backward."""

from __future__ import annotations

from cptune.feasibility import kv_replication
from cptune.layout import SequenceLayout
from cptune.strategies.primitives import HEADS, SEQ, Partial, Primitives, Tensor, TrainingPrimitives


def to_heads(ops: Primitives, layout: SequenceLayout, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
    """Sequence shards -> head shards inside the head group. KV heads fewer than the group
    are replicated on the way, so each rank still gets the KV head its query heads read."""
    if layout.head_group == 1:
        return q, kv
    copies = kv_replication(layout.workload, layout.head_group)
    return ops.all_to_all(q, "heads", HEADS, SEQ), ops.all_to_all(kv, "heads", HEADS, SEQ, repeat=copies)


def to_sequence(ops: Primitives, layout: SequenceLayout, out: Tensor) -> Tensor:
    """Head shards -> sequence shards: the inverse of ``to_heads`` for the output."""
    if layout.head_group == 1:
        return out
    return ops.all_to_all(out, "heads", SEQ, HEADS)


def output_grad_to_heads(ops: Primitives, layout: SequenceLayout, dout: Tensor) -> Tensor:
    """The output's gradient, sequence shards -> head shards, as Q travels."""
    return dout if layout.head_group == 1 else ops.all_to_all(dout, "heads", HEADS, SEQ)


def grads_to_sequence(ops: TrainingPrimitives, layout: SequenceLayout, dq: Tensor,
                      dkv: Tensor) -> tuple[Tensor, Tensor]:
    """Head shards -> sequence shards for the gradients: dQ as the output goes back, dK/dV
    by the inverse of ``to_heads``' exchange, the copies of a replicated KV head summed."""
    if layout.head_group == 1:
        return dq, dkv
    copies = kv_replication(layout.workload, layout.head_group)
    return ops.all_to_all(dq, "heads", SEQ, HEADS), ops.all_to_all_grad(dkv, "heads", SEQ, HEADS, fold=copies)


def attend(ops: Primitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor) -> Partial:
    """Pure Ulysses: after ``to_heads`` the rank holds the whole sequence for its heads."""
    positions = layout.block_positions(layout.head_group_of(rank))
    return ops.attention(q, kv, positions, positions)


def attend_grad(ops: TrainingPrimitives, layout: SequenceLayout, rank: int, q: Tensor, kv: Tensor,
                saved: Partial, dout: Tensor) -> tuple[Tensor, Tensor]:
    """Pure Ulysses' backward: the local backward over its heads' whole sequence."""
    positions = layout.block_positions(layout.head_group_of(rank))
    return ops.attention_grad(q, kv, dout, saved, positions, positions)
