"""Physical terms of running a configuration: compute, traffic, steps and memory per rank.

These counts are exact properties of the strategy and the layout, not timings; the cost
model turns them into time with measured rates. All figures are per rank; where ranks
differ (padding, causal blocks) the busiest rank's figure is reported.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from cptune._position_work import blocks_work, counted_by_position
from cptune.config import CPConfig
from cptune.layout import SequenceLayout, heads_as_run, kv_replication
from cptune.workload import Workload

FP32_BYTES = 4
#: Rows of the score matrix the numpy kernel holds at once (its query block size).
SCORE_BLOCK_ROWS = 128

#: Collective kinds traffic is counted under. The Ring's K/V stream step is "p2p" (send/recv)
#: on engines with point-to-point, and "broadcast" (one per step, the step's source as root)
#: on engines without it (TensorRT has no point-to-point layer): each engine says which
#: (``cptune.engines.EngineSpec.stream``).
COLLECTIVES: tuple[str, ...] = ("all_to_all", "all_gather", "p2p", "broadcast", "reduce_scatter")
#: The kinds of the Ring's stream step: each step moves one block (bus-bandwidth factor 1).
STREAM_KINDS: tuple[str, ...] = ("p2p", "broadcast")
#: The backward's FLOPs per forward FLOP of a fused attention kernel (FlashAttention-2's
#: and the numpy kernel's): the backward recomputes Q K^T and runs four more GEMMs (dV, dP,
#: dQ, dK) where the forward runs two: 10 * head_dim per visible pair against 4.
BACKWARD_FLOPS_RATIO = 2.5
#: Kernels one fused attention backward call launches beyond the one a forward call does:
#: FlashAttention's backward runs a preprocess kernel (the rows' dot(dO, O)) and a
#: postprocess one (dQ's float32 accumulator to the output) around its main kernel
#: (flash-attention's ``flash_bwd_launch_template.h``: ``flash_bwd_dot_do_o_kernel``,
#: ``flash_bwd_convert_dq_kernel``).
BACKWARD_CALL_KERNELS = 2
#: Kernels the torch engine's ``attend_grad`` launches per call beside it: each call's dQ, dK
#: and dV shares added into their float32 accumulators (``_accumulate``).
GRAD_ACCUMULATE_KERNELS = 3


def collectives_with(stream: str) -> tuple[str, ...]:
    """The collective kinds a configuration uses when its Ring streams by ``stream``
    (what a calibration of such an engine times)."""
    check_stream(stream)
    return "all_to_all", "all_gather", stream


def check_stream(stream: str) -> None:
    """Raise ``ValueError`` unless ``stream`` is one of ``STREAM_KINDS``."""
    if stream not in STREAM_KINDS:
        raise ValueError(f"stream must be one of {', '.join(STREAM_KINDS)}, got {stream!r}")


#: Memory-bound steps whose device-memory traffic is counted; "grad" only in a training
#: step's backward (its gradients accumulated in float32 and cast back, ``_backward_steps``).
MEMORY_STEPS: tuple[str, ...] = ("permute", "replicate", "merge", "requery", "grad")
#: Kernels counted per rank: attention calls, the memory-bound steps that run as kernels of
#: their own (a requery is the attention call's own read) and the Ring's sends and receives
#: (launched by the rank every step, unlike a collective's one call).
KERNELS: tuple[str, ...] = ("attention", "permute", "replicate", "merge", "stream")
#: The Ring's merge of one block's output into the running output on an engine that merges
#: block by block (the mpi engine's numpy merge, a TensorRT graph's), counted as the
#: online-softmax update of ring-flash-attn (used by yunchang and xDiT) runs it eagerly: cast the
#: block's output to fp32 (read w, write 4 bytes per element), out - block (read 8, write 4),
#: scale by sigmoid(lse difference) (read 4, write 4), subtract from out (read 8, write 4), and
#: the same on the log-sum-exp: 6 kernels, 36 + w bytes per output element. A calibration prices
#: it per element (``StepCost``), so only the element count reaches the prior there.
MERGE_KERNELS = 6
MERGE_FP32_PASSES = 9


class _FusedMerge(NamedTuple):
    """One merge of a call's partial into a float32 accumulator on an engine that runs the
    fused calls ``cptune.calls`` plans (the torch engine's ``merge_into``, which ``cptune.torch``
    deploys): bytes per output element and per row of each head (its log-sum-exp), kernels."""

    element_bytes: int
    row_bytes: int
    kernels: int


def _fused_merge(wire_bytes: int) -> _FusedMerge:
    """``_FusedMerge`` of a call whose output is ``wire_bytes`` wide, as ``merge_into`` runs it.
    Per output element: one pass where the output is float32 (lerp: read the accumulator and
    the output, write the accumulator: 12 bytes), two where it is 16-bit (scale the accumulator,
    8; add the output's share, 8 + w). Per row: the total log-sum-exp (logaddexp: read 8, write
    4), the call's share (subtract, exp: 20), the accumulator's where 16-bit (20 more), each share
    read by the pass it weighs (4 each), the total copied into the accumulator (8): 44 or 68
    bytes; 5 or 8 kernels."""
    if wire_bytes == FP32_BYTES:
        return _FusedMerge(3 * FP32_BYTES, 44, 5)
    return _FusedMerge(4 * FP32_BYTES + wire_bytes, 68, 8)


def _fused_merges(workload: Workload, config: CPConfig, block_tokens: int,
                  local_heads: int, ring_steps: int | None = None) -> tuple[int, int]:
    """Bytes and kernels of the busiest rank's merges where attention runs as the fused calls
    ``cptune.calls`` plans (``analytic_cost``'s ``position_calls``), as the torch engine's
    ``attend`` makes them. A step of one call over every row is the kernel's own output: one
    rank, Ulysses and unmasked AllGather-KV merge nothing. Otherwise the result accumulates in
    float32 and is cast back to the wire dtype at the end (w != 4): by a pass of its own, or
    inside the pack of Ulysses' exchange back, which then reads 4 bytes an element, not w.
    - Ring: its own block's output copied to float32 at the second step (w != 4), then each
      other block's call merged in (``_fused_merge``): rank c - 1 merges all its rows each time
      (causal: the others' queries of their first chunk see none of a later block). Unmasked,
      blocks of padding only have no call: a rank holding such a block starts from 0 and -inf
      (one write each) and merges every block with a real key.
    - causal AllGather-KV (zigzag): per query chunk the keys before it, then its square
      diagonal. Each chunk's first call is copied into the accumulator (output and log-sum-exp,
      two kernels); a diagonal after keys before it is merged: over all the rows of every rank
      but the first (whose first chunk has no keys before it), in two merges on a rank of two
      non-adjacent chunks (c > 2: four calls), in one on the last (its chunks adjoin).
    A workload counted by position (``cptune._position_work``) gives the Ring's ``ring_steps``
    with a call: each one after the first merged over all the block's rows (a document's rows
    merge less where a step holds none of their keys: an upper bound there); AllGather-KV's
    merges are counted as the causal zigzag's."""
    c, w = config.context_degree, workload.wire_dtype.itemsize
    if c == 1 or (config.strategy == "allgather_kv" and not workload.causal):
        return 0, 0
    outputs = workload.batch * block_tokens * local_heads  # rows of the rank's block, every head

    def passes(element_bytes: int, row_bytes: int) -> int:
        return outputs * (element_bytes * workload.head_dim + row_bytes)

    merge, wide = _fused_merge(w), w == FP32_BYTES
    cast_back = 0 if wide else passes(FP32_BYTES - w if config.head_group > 1 else FP32_BYTES + w, 0)
    cast_kernels = 0 if wide or config.head_group > 1 else 1
    if config.strategy == "allgather_kv":
        first_calls = passes(FP32_BYTES + w, 2 * FP32_BYTES)  # each chunk's first call, copied in
        kernels = 2 * 2 + (2 if c > 2 else 1) * merge.kernels
        return first_calls + passes(merge.element_bytes, merge.row_bytes) + cast_back, kernels + cast_kernels
    real = c if workload.causal else min(c, -(-workload.seq_len // block_tokens))  # blocks with a real key
    if ring_steps is not None:
        if ring_steps == 1:  # one call over the block: the kernel's own output
            return 0, 0
        c = real = ring_steps
    merged = passes(merge.element_bytes, merge.row_bytes)
    if real == c:
        to_fp32 = 0 if wide else passes(FP32_BYTES + w, 0)
        kernels = (0 if wide else 1) + (c - 1) * merge.kernels
        return to_fp32 + (c - 1) * merged + cast_back, kernels + cast_kernels
    zeroed = passes(FP32_BYTES, FP32_BYTES)
    return zeroed + real * merged + cast_back, 2 + real * merge.kernels + cast_kernels


class BlockCalls(NamedTuple):
    """The busiest rank's attention calls and merges where AllGather-KV's gathered keys are
    attended block by block (``block_calls``)."""

    calls: int
    #: Bytes through device memory of the merges, and their kernels.
    merge_bytes: int
    merge_kernels: int


def block_calls(workload: Workload, config: CPConfig) -> BlockCalls:
    """AllGather-KV's gathered keys attended block by block, as torch's
    ``_templated_ring_attention`` with its all-gather rotater (xDiT's and SGLang's ring) and
    diffusers' ``ring_degree`` run them: after the same all-gather, one call per K/V block the
    busiest rank sees (c; under a causal mask without load balance the last of c contiguous
    blocks sees all c), each after the first merged eagerly into a float32 output as
    ``_SDPAMerger`` and diffusers do (the update ring-flash-attn runs: MERGE_FP32_PASSES * 4 + w
    bytes per output element, MERGE_KERNELS kernels). What ``analytic_cost`` counts otherwise
    (FLOPs, the all-gather, the rest) is the same. Forward AllGather-KV only."""
    if config.strategy != "allgather_kv" or workload.training:
        raise ValueError("block_calls counts a forward AllGather-KV's keys attended block by block")
    workload = heads_as_run(workload, config)
    z = _sizes(workload, config)
    c = config.context_degree
    elements = workload.batch * z.block_tokens * z.local_heads * workload.head_dim
    per_element = MERGE_FP32_PASSES * FP32_BYTES + workload.wire_dtype.itemsize
    return BlockCalls(c, (c - 1) * elements * per_element, (c - 1) * MERGE_KERNELS)


@dataclass(frozen=True)
class AnalyticCost:
    """Per-rank physical terms of one (workload, config) pair."""

    padded_seq_len: int
    #: Attention FLOPs of the busiest rank: 4 * head_dim per visible (query, key) pair and
    #: head (2 for QK^T, 2 for PV); softmax and masked pairs are not counted. A training
    #: workload's include its backward's (``backward_flops``).
    flops: int
    #: Bytes each rank sends, by collective kind, in the workload's wire dtype.
    bytes_sent: dict[str, int]
    #: Communication rounds (latency terms) by collective kind.
    comm_steps: dict[str, int]
    #: Estimated peak bytes of activations live at once on one rank.
    peak_bytes: int
    #: Copies of each KV head sent through the Ulysses all-to-all (1 = none replicated).
    kv_replication: int
    #: Bytes the busiest rank moves through device memory in memory-bound steps, by step
    #: (MEMORY_STEPS): the permutes around each all-to-all, the K/V replication for GQA, the
    #: merges of partial outputs (the Ring's; with ``position_calls`` causal AllGather-KV's
    #: too) and the Ring's re-reads of the query block.
    memory_bytes: dict[str, int]
    #: Kernels the busiest rank launches, by what they do (KERNELS); collectives not counted.
    kernels: dict[str, int]
    #: A training workload's backward FLOPs (``BACKWARD_FLOPS_RATIO`` times the forward's);
    #: 0 for a forward one.
    backward_flops: int = 0
    #: A training workload's backward memory-bound bytes by step (MEMORY_STEPS) and kernels
    #: by what they do (KERNELS, "stream" its sends and receives), beyond those of its
    #: attention calls (``_backward_steps``); empty for a forward one.
    backward_memory_bytes: dict[str, int] = field(default_factory=dict)
    backward_kernels: dict[str, int] = field(default_factory=dict)
    #: Of ``backward_memory_bytes`` and ``backward_kernels``, what each Ring step repeats
    #: (its accumulations, sends and receives: hidden behind the step or not, as its compute
    #: and transfer allow), the rest before or after the Ring's stream.
    backward_ring_bytes: int = 0
    backward_ring_kernels: int = 0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _visible_pairs(layout: SequenceLayout, group: int) -> int:
    """(query, key) pairs block ``group``'s real queries attend to, counted in closed form
    (no position arrays: any length costs the same).

    Non-causal: every real query sees all ``seq_len`` real keys. Causal: the query at
    position p sees keys 0..p, so p + 1 pairs; over real positions a..a+r-1 that sums to
    r * a + r * (r + 1) / 2."""
    seq_len = layout.workload.seq_len
    pairs = 0
    for start, stop in layout.block_ranges(group):
        real = max(0, min(stop, seq_len) - start)  # padding sits at the end
        pairs += real * start + real * (real + 1) // 2 if layout.workload.causal else real * seq_len
    return pairs


def busiest_block_pairs(layout: SequenceLayout) -> int:
    """The most (query, key) pairs any context block's real queries attend to
    (``_visible_pairs``), from at most eight blocks whatever the context degree c.

    Padding sits at the end, so without zigzag block 0 is the busiest unmasked; under a causal
    mask a contiguous block sees every key before it, so the last holding a real token is (a
    ring without load balance: rank r computes r + 1 of c blocks). With zigzag block g
    holds chunks g and 2c - 1 - g of L positions; a chunk's pairs grow with its index up to
    the chunk i0 where the real tokens end, which holds some, and those after it hold none.
    Over the blocks whose second chunk is padding the pairs grow with g; over those whose two
    chunks are both real they are equal; over those whose first chunk is padding they shrink
    with g: the busiest is one of the blocks where these regions meet."""
    c = layout.context_degree
    if not layout.zigzag:
        if not layout.workload.causal or layout.layout != "contiguous":
            return _visible_pairs(layout, 0)
        last_real = (layout.workload.seq_len - 1) // (layout.padded_len // c)
        return _visible_pairs(layout, min(c - 1, last_real))
    ends = layout.workload.seq_len // (layout.padded_len // (2 * c))  # i0
    near = {0, c - 1, ends - 1, ends, ends + 1, 2 * c - 2 - ends, 2 * c - 1 - ends, 2 * c - ends}
    return max(_visible_pairs(layout, g) for g in near if 0 <= g < c)


def analytic_cost(workload: Workload, config: CPConfig, stream: str = "p2p",
                  position_calls: bool = False) -> AnalyticCost:
    """Count the physical work of ``config`` on ``workload`` with the Ring's stream step
    made of ``stream`` (``STREAM_KINDS``) and, with ``position_calls``, attention run as the
    fused calls ``cptune.calls`` plans and merged as the torch engine merges them (see
    ``AnalyticCost``: engines differ only in these).

    With N ranks, head group u, context degree c = N / u, padded length S, batch B, heads H,
    KV heads K (K' = K * replication after Ulysses), head_dim D and wire width w bytes:
    - FLOPs: 4 * B * D * (H / u) * visible pairs of the busiest context block.
    - all-to-all (u > 1): Q, K/V in and O out; a rank keeps 1/u of each and sends the rest:
      (u - 1) / u * B * (S / N) * (2H + 2K') * D * w.
    - all-gather (AllGather-KV, c > 1): each rank's K/V block reaches the c - 1 others:
      (c - 1) * 2 * B * (S / c) * (K' / u) * D * w, in one step.
    - p2p (Ring, c > 1, engines with point-to-point): the same volume, in c - 1 steps of
      one block each.
    - broadcast (Ring, c > 1, engines without): c steps, each broadcasting one block from
      its source (the step's root) to the c - 1 others: c blocks, bus-bandwidth factor 1.
    - device memory (memory-bound steps): each all-to-all'd tensor is permuted into send
      order and out of receive order, read and written each time: 4 * B * (S / N) *
      (2H + 2K') * D * w; GQA replication reads the K/V heads and writes their K' copies;
      each Ring step after the first merges the block's output into the fp32 running output
      (MERGE_FP32_PASSES * 4 + w bytes per output element of the block) and reads its query
      block again ("requery": w bytes per element; the numpy kernel converts it to scaled
      fp32 each call), work one call over all keys does once. With ``position_calls`` the
      merges are the torch engine's instead (``_fused_merges``): the Ring's and causal
      AllGather-KV's, per call and row they touch, their copies into the fp32 accumulator and
      its cast back.
    - kernels: one attention call (c for the Ring, block by block), a permute before and
      after each of the 3 all-to-alls, one replication, MERGE_KERNELS per Ring merge (with
      ``position_calls``: the torch engine's merges' kernels) and a send and a receive per p2p
      step (one call per broadcast step).
    - peak: inputs and output in wire dtype, Ulysses receive buffers, the K/V held during
      attention (all c blocks for AllGather-KV, current + incoming for Ring), fp32 output
      accumulators (two for Ring's merge) and one fp32 score block of SCORE_BLOCK_ROWS rows.

    A training workload adds its backward (gradients summed across ranks travel in fp32):
    - FLOPs: ``BACKWARD_FLOPS_RATIO`` times the forward's.
    - all-to-all (u > 1): dO in and dQ out (as Q), dK/dV out (as K/V, in fp32 where
      replicated KV heads are summed): 3 more steps.
    - all-gather (AllGather-KV): K/V gathered again; reduce-scatter: each rank's fp32 dK/dV
      of the c - 1 other blocks, in one step.
    - p2p (Ring): the K/V blocks again (c - 1 steps) and each block's fp32 gradient, c steps
      (the last brings it home).
    - peak: the output's gradient, the saved output (fp32) and log-sum-exp, dQ in fp32 and
      the fp32 dK/dV buffers (the Ring's two in flight; AllGather-KV's whole sequence).
    - memory-bound steps and kernels beyond the attention calls' own: ``backward_memory_bytes``,
      ``backward_kernels`` and, of them, what each Ring step repeats (``_backward_steps``).
    """
    # one cache entry however passed; padded heads counted as the real ones they are run as
    return _analytic_cost(heads_as_run(workload, config), config, stream, position_calls)


def _add_backward(bytes_sent: dict[str, int], steps: dict[str, int], config: CPConfig, stream: str,
                  workload: Workload, rank_tokens: int, kv_sent: int, rep: int, kv_block: int,
                  reach: int) -> None:
    """The backward's exchanges added to a training workload's counts (see ``analytic_cost``);
    ``kv_block`` the bytes of the part of a block the exchanges move, ``reach`` how far round
    the Ring streams (c - 1 unmasked)."""
    u, c = config.head_group, config.context_degree
    b, h, d, w = workload.batch, workload.heads, workload.head_dim, workload.wire_dtype.itemsize
    if u > 1:
        kv_width = w if rep == 1 else FP32_BYTES
        bytes_sent["all_to_all"] += (u - 1) * b * rank_tokens * (2 * h * w + 2 * kv_sent * kv_width) * d // u
        steps["all_to_all"] += 3  # dO in; dQ and packed dK/dV out
    grad_block = kv_block // w * FP32_BYTES
    if c > 1 and config.strategy == "allgather_kv" and reach:
        bytes_sent["all_gather"] += (c - 1) * kv_block
        steps["all_gather"] += 1
        bytes_sent["reduce_scatter"] = (c - 1) * grad_block
        steps["reduce_scatter"] = 1
    elif c > 1 and config.strategy == "ring" and reach:
        # the K/V blocks again, each gradient passed on beside them, then straight home
        bytes_sent[stream] += reach * kv_block + (reach + 1) * grad_block
        steps[stream] += reach + (reach + 1)


class _BackwardSteps(NamedTuple):
    """``AnalyticCost``'s backward memory-bound bytes and kernels (see ``_backward_steps``)."""

    memory: dict[str, int]
    kernels: dict[str, int]
    ring_bytes: int
    ring_kernels: int


def _backward_steps(workload: Workload, config: CPConfig, z: _Sizes) -> _BackwardSteps:
    """The backward's memory-bound steps and kernels outside its attention calls, as the torch
    engine's backward runs them (``attend_grad``, ``kv_grad_stream``, Ulysses' exchanges back):
    - permute (u > 1): the backward's three all-to-alls (dO in; dQ and dK/dV out) each packed
      and unpacked, as the forward's: 4 * B * (S / N) * (2H + 2K') * D * w; six kernels.
    - replicate (replicated KV heads): dK/dV's K' copies exchanged in float32 and folded into K
      heads: read 4 * K', write 4 * K per token and head_dim; one kernel.
    - grad: each attention call's dQ, dK and dV shares (w wide) added into float32
      accumulators: read w, read and write 4 per element of the rank's query block (dQ) and of
      the keys it attends to (dK/dV: the Ring's block each step, AllGather-KV's gathered
      sequence); the Ring's arriving gradient plus the step's share (read 4 + 4, write 4 per
      K/V element, c - 1 steps, one kernel each); dQ and dK/dV cast back to w at the end
      (read 4, write w; inside Ulysses' pack where there is one). The Ring's per-step part is
      ``ring_bytes`` (c steps' dQ and dK/dV shares and c - 1 additions).
    - stream (Ring): a send and a receive per step for the K/V blocks (c - 1) and the
      gradients (c, the last one home).
    The attention calls' own kernels (``BACKWARD_CALL_KERNELS``, ``GRAD_ACCUMULATE_KERNELS``
    each) are counted by the prior, which knows the calls."""
    b, h, d, w = workload.batch, workload.heads, workload.head_dim, workload.wire_dtype.itemsize
    u, c = config.head_group, config.context_degree
    memory = dict.fromkeys(MEMORY_STEPS, 0)
    kernels = dict.fromkeys(KERNELS, 0)
    if u > 1:
        memory["permute"] = 4 * b * z.rank_tokens * (2 * h + 2 * z.kv_sent) * d * w
        kernels["permute"] = 6
    if z.rep > 1:
        memory["replicate"] = b * z.rank_tokens * (z.kv_sent + workload.kv_heads) * d * FP32_BYTES
        kernels["replicate"] = 1
    q_elements = b * z.block_tokens * z.local_heads * d
    kv_elements = z.kv_block // w
    accumulate = w + 2 * FP32_BYTES
    cast_back = 0 if u > 1 else (FP32_BYTES + w) * (q_elements + kv_elements)
    ring_bytes = ring_kernels = 0
    if config.strategy == "ring" and c > 1:
        ring_bytes = c * accumulate * (q_elements + kv_elements) + (c - 1) * 3 * FP32_BYTES * kv_elements
        ring_kernels = (c - 1) + 2 * (c - 1) + 2 * c
        memory["grad"] = ring_bytes + cast_back
        kernels["stream"] = 2 * (c - 1) + 2 * c
        kernels["merge"] = c - 1
    else:
        keys = c * kv_elements if config.strategy == "allgather_kv" else kv_elements
        memory["grad"] = accumulate * (q_elements + keys) + cast_back
    kernels["merge"] += 0 if u > 1 else 2  # the casts back
    return _BackwardSteps(memory, kernels, ring_bytes, ring_kernels)


def _backward_peak(config: CPConfig, workload: Workload, block_tokens: int, local_heads: int, kv_block: int,
                   rank_tokens: int) -> int:
    """What a training run holds beyond the forward's peak (see ``analytic_cost``)."""
    b, d, w = workload.batch, workload.head_dim, workload.wire_dtype.itemsize
    c = config.context_degree
    per_head_rows = b * block_tokens * local_heads
    dout = b * rank_tokens * workload.heads * d * w
    saved = per_head_rows * (d + 1) * FP32_BYTES  # the output and its log-sum-exp
    dq = per_head_rows * d * FP32_BYTES
    grad_block = kv_block // w * FP32_BYTES
    dkv = (c * grad_block if config.strategy == "allgather_kv" else 2 * grad_block) + grad_block
    return dout + saved + dq + dkv


class _Sizes(NamedTuple):
    """What one rank of a configuration holds and sends, in tokens, heads and bytes: the
    quantities every count of ``analytic_cost`` (and ``peak_bytes``) is made of."""

    layout: SequenceLayout
    rep: int
    kv_sent: int
    local_heads: int
    rank_tokens: int
    block_tokens: int
    kv_block: int
    #: Bytes of the part of a block its exchanges move (``SequenceLayout.shared``: all of it,
    #: all but replicated tokens, or a Ring's halo).
    shared_block: int
    #: Blocks back round the context group some block's queries see (``SequenceLayout.reach``).
    reach: int


def _sizes(workload: Workload, config: CPConfig) -> _Sizes:
    layout = SequenceLayout(workload, config)
    u, c = config.head_group, config.context_degree
    s = layout.padded_len
    b, d, w = workload.batch, workload.head_dim, workload.wire_dtype.itemsize
    rep = kv_replication(workload, u) if u > 1 else 1
    kv_sent = workload.kv_heads * rep
    local_kv_heads = kv_sent // u if u > 1 else workload.kv_heads
    per_token = 2 * b * local_kv_heads * d * w
    if not counted_by_position(workload, config):
        block_tokens = s // c
        return _Sizes(layout, rep, kv_sent, workload.heads // u, s // config.ranks, block_tokens,
                      per_token * block_tokens, per_token * block_tokens, c - 1)
    block_tokens = len(layout.block_positions(0))  # every block of a layout holds as many
    shared = len(layout.shared_positions(0)) if c > 1 else block_tokens
    return _Sizes(layout, rep, kv_sent, workload.heads // u, len(layout.rank_positions(0)), block_tokens,
                  per_token * block_tokens, per_token * shared, layout.reach)


def _peak(workload: Workload, config: CPConfig, z: _Sizes) -> int:
    """``AnalyticCost.peak_bytes`` of ``config`` (sizes ``z``): see ``analytic_cost``."""
    b, h, d, w = workload.batch, workload.heads, workload.head_dim, workload.wire_dtype.itemsize
    u, c = config.head_group, config.context_degree
    inputs = b * z.rank_tokens * (h + 2 * workload.kv_heads) * d * w
    output = b * z.rank_tokens * h * d * w
    exchanged = b * z.block_tokens * z.local_heads * d * w + z.kv_block if u > 1 else 0
    ring = config.strategy == "ring" and c > 1
    # the Ring: its own block and the next one coming in; AllGather-KV: every block it gathers
    held_kv = z.kv_block + (z.shared_block if ring else (c - 1) * z.shared_block * (z.reach > 0))
    accumulators = (2 if ring else 1) * b * z.block_tokens * z.local_heads * d * FP32_BYTES
    score_keys = z.block_tokens if ring else z.layout.padded_len
    scores = min(SCORE_BLOCK_ROWS, z.block_tokens) * score_keys * FP32_BYTES
    peak = inputs + output + exchanged + held_kv + accumulators + scores
    if workload.training:
        peak += _backward_peak(config, workload, z.block_tokens, z.local_heads, z.kv_block, z.rank_tokens)
    return peak


@functools.lru_cache(maxsize=65536)  # pure, small: what feasibility checks of every configuration it builds
def peak_bytes(workload: Workload, config: CPConfig) -> int:
    """``analytic_cost(workload, config).peak_bytes``, without counting the rest: what a memory
    limit is checked against, for configurations that may never be costed."""
    workload = heads_as_run(workload, config)
    return _peak(workload, config, _sizes(workload, config))


@functools.lru_cache(maxsize=65536)  # a Ring's and an AllGather-KV's of one head group share it
def _busiest_pairs(workload: Workload, ranks: int, head_group: int, layout: str | None) -> int:
    """``busiest_block_pairs`` of the layout every strategy of ``ranks``, ``head_group`` and
    ``layout`` shares."""
    return busiest_block_pairs(SequenceLayout(workload, CPConfig("ring", ranks, head_group, layout)))


def ring_calling_steps(workload: Workload, config: CPConfig) -> int:
    """The Ring's steps the busiest block of a workload counted by position makes a kernel
    call on (``cptune._position_work``): each block some of its queries see a key of, as far
    round as the layout reaches."""
    return max(len(block.steps) for block in blocks_work(workload, config))


def attention_flops(workload: Workload, config: CPConfig) -> int:
    """``analytic_cost(workload, config).flops`` of the forward (a training workload's forward
    alone), without counting the rest: what the prior's compute needs of a fused kernel. A
    workload counted by position (``cptune._position_work``): its busiest block's real
    queries' seen pairs, each once."""
    workload = heads_as_run(workload, config)
    forward = workload.in_mode("forward") if workload.training else workload  # the same pairs either way
    u = config.head_group
    if counted_by_position(forward, config):
        pairs = max(block.useful_pairs for block in blocks_work(forward, config))
    else:
        pairs = _busiest_pairs(forward, config.ranks, u, config.layout)
    return 4 * workload.batch * workload.head_dim * (workload.heads // u) * pairs


@functools.lru_cache(maxsize=65536)  # pure, small: a cluster's recommendation weighs thousands
def _analytic_cost(workload: Workload, config: CPConfig, stream: str, position_calls: bool) -> AnalyticCost:
    if workload.training:  # its forward's counts (the prior asks for them too), and the backward's
        return _with_backward(workload, config, stream, _analytic_cost(workload.in_mode("forward"), config,
                                                                       stream, position_calls))
    z = _sizes(workload, config)
    u, c = config.head_group, config.context_degree
    s = z.layout.padded_len
    b, h, d, w = workload.batch, workload.heads, workload.head_dim, workload.wire_dtype.itemsize
    rep, kv_sent, local_heads = z.rep, z.kv_sent, z.local_heads
    rank_tokens, block_tokens, shared_block = z.rank_tokens, z.block_tokens, z.shared_block

    by_position = counted_by_position(workload, config)
    flops = attention_flops(workload, config)

    bytes_sent = dict.fromkeys(COLLECTIVES, 0)
    steps = dict.fromkeys(COLLECTIVES, 0)
    if u > 1:
        bytes_sent["all_to_all"] = (u - 1) * b * rank_tokens * (2 * h + 2 * kv_sent) * d * w // u
        steps["all_to_all"] = 3  # Q, packed K/V, O
    if c > 1 and config.strategy == "allgather_kv" and z.reach:  # none where no block sees another's
        bytes_sent["all_gather"] = (c - 1) * shared_block
        steps["all_gather"] = 1
    elif c > 1 and config.strategy == "ring":
        check_stream(stream)
        # p2p: as far round as the layout reaches; a broadcast per member, whatever it reaches
        stream_steps = z.reach if stream == "p2p" else c
        bytes_sent[stream] = stream_steps * shared_block
        steps[stream] = stream_steps

    ring = config.strategy == "ring" and c > 1
    peak = _peak(workload, config, z)
    # the Ring's kernel calls: one per step whose keys the block's queries see
    ring_steps = (ring_calling_steps(workload, config) if by_position else c) if ring else 1

    memory = dict.fromkeys(MEMORY_STEPS, 0)
    kernels = dict.fromkeys(KERNELS, 0)
    kernels["attention"] = ring_steps
    if u > 1:
        memory["permute"] = 4 * b * rank_tokens * (2 * h + 2 * kv_sent) * d * w
        kernels["permute"] = 2 * steps["all_to_all"]
    if rep > 1:
        memory["replicate"] = 2 * b * rank_tokens * (workload.kv_heads + kv_sent) * d * w
        kernels["replicate"] = 1
    if ring:
        merges = ring_steps - 1
        memory["merge"] = merges * b * block_tokens * local_heads * d * (MERGE_FP32_PASSES * FP32_BYTES + w)
        memory["requery"] = merges * b * block_tokens * local_heads * d * w
        kernels["merge"] = merges * MERGE_KERNELS
        kernels["stream"] = 2 * steps["p2p"] + steps["broadcast"]
    if position_calls:
        memory["merge"], kernels["merge"] = _fused_merges(workload, config, block_tokens, local_heads,
                                                          ring_steps if by_position else None)

    return AnalyticCost(
        padded_seq_len=s,
        flops=flops,
        bytes_sent=bytes_sent,
        comm_steps=steps,
        peak_bytes=peak,
        kv_replication=rep,
        memory_bytes=memory,
        kernels=kernels,
    )


def _with_backward(workload: Workload, config: CPConfig, stream: str, forward: AnalyticCost) -> AnalyticCost:
    """A training ``workload``'s counts: its ``forward``'s with the backward's added (see
    ``analytic_cost``)."""
    z = _sizes(workload, config)
    bytes_sent, steps = dict(forward.bytes_sent), dict(forward.comm_steps)
    _add_backward(bytes_sent, steps, config, stream, workload, z.rank_tokens, z.kv_sent, z.rep,
                  z.shared_block, z.reach)
    backward = _backward_steps(workload, config, z)
    backward_flops = int(BACKWARD_FLOPS_RATIO * forward.flops)
    return dataclasses.replace(
        forward, flops=forward.flops + backward_flops, backward_flops=backward_flops, bytes_sent=bytes_sent,
        comm_steps=steps, peak_bytes=peak_bytes(workload, config), backward_memory_bytes=backward.memory,
        backward_kernels=backward.kernels, backward_ring_bytes=backward.ring_bytes,
        backward_ring_kernels=backward.ring_kernels)
