"""``Primitives`` in PyTorch: the strategies over ``torch.distributed`` process groups with
PyTorch's fused attention kernels. The torch engine's ranks time it, and ``cptune.torch``
hands the same code to a deployment.

Attention goes by token position without a mask tensor: each step is cut into as few fused
calls as its positions allow (``cptune.calls``: one per query run and step, unmasked or
square-causal), by the kernel ``_kernels`` picks, which returns the log-sum-exp; a call the
mask cuts by position (a window's far edge) runs as the fused causal call on its rows and keys
reversed where it is anti-causal, else by plain tensor ops. A step of
several calls, or one merged into an earlier step's result (the Ring), accumulates in
float32 in place: one accumulator per attention, each call's rows merged into it in one pass
(two where the call's output is 16-bit), no other row touched.

Tensors are held as the device's kernels read them fastest (``activations``): on CUDA
sequence-major in memory, as a model holds them ([batch, seq, heads, head_dim], seen as
[batch, heads, seq, head_dim]), so a deployment passes q in and takes the output back without
a copy; on the CPU heads-major. Exchanges send in the workload's
dtype (bf16 is real bfloat16 here), K and V in one message with their own KV heads (GQA/MQA):
Ulysses through ``all_to_all_single``, one pack (the cast, and the repeated KV heads of a
head group larger than them, included) and one unpack per exchange; AllGather-KV through
``all_gather_into_tensor``, the arrivals put in the order asked (position order) by the one
copy out of the receive buffer; the Ring through ``batch_isend_irecv`` into its own two
receive buffers, the next block in flight while the current one is attended to (NCCL runs it
on its own stream on a GPU, gloo on its own threads on the CPU).

The backward (``attend_grad``) runs the same calls, each by the backward of its forward kernel
(``_kernels.fused_attention_grad``) given the layer's final output and log-sum-exp over all its
keys, so a step over a subset of the keys (a Ring step) gets its exact share of dQ and the
whole dK, dV of its keys; the pieces accumulate in float32, each row and key copied where a
call first names it and added where a later one does, the rest zero. Its exchanges mirror the
mpi engine's: Ulysses' dK/dV back in float32 where replicated KV heads are summed
(``all_to_all_grad``), AllGather-KV's through ``reduce_scatter_tensor`` in float32, the Ring's
travelling gradients in float32 by ``batch_isend_irecv``, one batch a step after the blocks'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from cptune.calls import Call, attention_calls
from cptune.engines.torch._kernels import explicit, explicit_grad, fused_attention, fused_attention_grad
from cptune.masks import Mask
from cptune.strategies.primitives import HEADS, SEQ, Group, Partial
from cptune.workload import Workload

#: The torch dtype each workload dtype computes and travels in.
TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def activations(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor of ``shape`` ([..., heads, seq, head_dim]) laid out as this device's
    kernels read fastest: sequence-major on CUDA ([..., seq, heads, head_dim] in memory: what
    FlashAttention and cuDNN read natively, and how a model holds its activations), heads-major
    elsewhere (the CPU's flash kernel reads that 10-20% faster in bf16 on the development VMs)."""
    if device.type != "cuda":
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    swapped = [*shape[:-3], shape[-2], shape[-3], shape[-1]]
    return torch.empty(swapped, dtype=dtype, device=device).transpose(HEADS, SEQ)


def strategy_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's q [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim] as
    the strategies take them: q as [batch, heads, seq, head_dim] and K and V packed as one
    [2, batch, kv_heads, seq, head_dim] tensor (the message they travel in), in the layout of
    ``activations``: on CUDA q is a view and K/V one copy; elsewhere one copy each."""
    if q.device.type == "cuda":
        return q.transpose(1, 2), torch.stack([k, v]).transpose(2, 3)
    return q.transpose(1, 2).contiguous(), torch.stack([k.transpose(1, 2), v.transpose(1, 2)])


def model_output(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A strategy's output [batch, heads, seq, head_dim] as a model's [batch, seq, heads,
    head_dim] in ``dtype``: a view where it is already sequence-major in that dtype (on CUDA)."""
    return out.to(dtype).transpose(1, 2).contiguous()


def _uncovered(rows: int, calls: Sequence[Call]) -> list[tuple[int, int]]:
    """Index ranges [start, stop) of the rows no call names."""
    covered = np.zeros(rows, dtype=bool)
    for call in calls:
        covered[call.rows] = True
    change = np.flatnonzero(np.diff(np.concatenate([[0], (~covered).astype(np.int8), [0]])))
    return list(zip(change[::2].tolist(), change[1::2].tolist(), strict=True))


def accumulator(q: torch.Tensor, calls: Sequence[Call]) -> Partial:
    """The float32 partial a step of several calls accumulates in, allocated once in the
    layout of ``activations``; the rows no call names hold output 0 and log-sum-exp -inf."""
    out = activations(q.shape, torch.float32, q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for start, stop in _uncovered(q.shape[-2], calls):
        out[..., start:stop, :] = 0.0
        lse[..., start:stop] = float("-inf")
    return Partial(out, lse)


def in_float32(part: Partial) -> Partial:
    """``part`` with a float32 output to merge into in place: itself where it is one (a
    kernel's output is this rank's own), else one copy."""
    if part.out.dtype == torch.float32:
        return part
    out = activations(part.out.shape, torch.float32, part.out.device)
    out.copy_(part.out)
    return Partial(out, part.lse)


def merge_into(acc: Partial, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge a call's partial over other keys (``out``, ``lse`` for ``rows``) into the float32
    ``acc`` in place, touching only those rows: one pass over the output (two where ``out``
    is 16-bit); the log-sum-exp -inf of a row that saw nothing yet takes the call as it is."""
    acc_out, acc_lse = acc.out[..., rows, :], acc.lse[..., rows]
    total = torch.logaddexp(acc_lse, lse)
    share = torch.exp(lse - total).unsqueeze(-1)
    if out.dtype == acc_out.dtype:
        acc_out.lerp_(out, share)
    else:
        acc_out.mul_(torch.exp(acc_lse - total).unsqueeze(-1)).addcmul_(out, share)
    acc_lse.copy_(total)


def _visible(call: Call, q_pos: np.ndarray, k_pos: np.ndarray, mask: Mask) -> np.ndarray:
    """Which of a masked call's queries see which of its keys ([rows, keys])."""
    return mask.visible(q_pos[call.rows][:, None], k_pos[call.keys][None, :])


def _anti_causal(visible: np.ndarray) -> bool:
    """Whether a masked call is a window's far edge over keys at consecutive positions: its
    first rows (as many as it has keys) see exactly the keys from their own index on, the rest
    none. Its seeing rows with their keys reversed are a square causal call, which the fused
    kernel runs 2.9-3.7x faster than the explicit path a 256-row tile on the CPU (12-03)."""
    rows, keys = visible.shape
    return keys <= rows and bool(np.array_equal(visible[:keys], np.triu(np.ones((keys, keys), dtype=bool)))
                                 and not visible[keys:].any())


def _reversed(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor with its sequence axis (-2) in reverse order (a copy)."""
    return [t.flip(-2) for t in tensors]


def _far_edge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A call ``_anti_causal`` accepts: its seeing rows by the fused causal kernel on them and
    the keys reversed, the result reversed back; the rows that see nothing get output 0 and
    log-sum-exp -inf."""
    seeing = k.shape[-2]
    q_r, k_r, v_r = _reversed(q[..., :seeing, :], k, v)
    part, part_lse = fused_attention(q_r, k_r, v_r, True, scale)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    out[..., :seeing, :], lse[..., :seeing] = part.flip(-2), part_lse.flip(-1)
    return out, lse


def _far_edge_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   dout: torch.Tensor, scale: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of ``_far_edge``, by the fused causal backward reversed the same way; dQ
    of the rows that see nothing is 0."""
    seeing = k.shape[-2]
    q_r, out_r, dout_r = _reversed(q[..., :seeing, :], out[..., :seeing, :], dout[..., :seeing, :])
    k_r, v_r = _reversed(k, v)
    seen_q, grad_k, grad_v = _reversed(*fused_attention_grad(q_r, k_r, v_r, out_r, lse[..., :seeing].flip(-1),
                                                             dout_r, True, scale))
    grad_q = seen_q.new_zeros(q.shape)
    grad_q[..., :seeing, :] = seen_q
    return grad_q, grad_k, grad_v


def _call_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Call, q_pos: np.ndarray,
                    k_pos: np.ndarray, mask: Mask, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One call: by the fused kernel, or where the mask applies by position (``Call.masked``:
    a window's far edge, a share of the work ``cptune.calls`` keeps small) by the fused causal
    kernel reversed where it is anti-causal (``_far_edge``), else with plain tensor ops."""
    if not call.masked:
        return fused_attention(q, k, v, call.causal, scale)
    if _anti_causal(visible := _visible(call, q_pos, k_pos, mask)):
        return _far_edge(q, k, v, scale)
    return explicit(q, k, v, False, scale, torch.from_numpy(visible).to(q.device))


def attend(q: torch.Tensor, kv: torch.Tensor, q_pos: np.ndarray, k_pos: np.ndarray, mask: Mask,
           scale: float | None = None, into: Partial | None = None) -> Partial:
    """Attention of queries at ``q_pos`` over the keys of ``kv`` ([2, batch, kv_heads, seq,
    head_dim]) at ``k_pos`` under ``mask``, by the fused calls ``attention_calls`` plans, merged
    into ``into`` (a partial over other keys, updated in place) where given. One call over
    every row returns the kernel's own output; several accumulate in float32."""
    calls = attention_calls(q_pos, k_pos, mask)
    k, v = kv[0], kv[1]
    if into is None and len(calls) == 1 and calls[0].rows == slice(0, q.shape[-2]) and not calls[0].masked:
        call = calls[0]
        return Partial(*fused_attention(q, k[..., call.keys, :], v[..., call.keys, :], call.causal, scale))
    acc = accumulator(q, calls) if into is None else in_float32(into)
    written: set[tuple[int, int]] = set()  # rows a call of this step wrote (a call's rows: all or none)
    for call in calls:
        out, lse = _call_attention(q[..., call.rows, :], k[..., call.keys, :], v[..., call.keys, :], call,
                                   q_pos, k_pos, mask, scale)
        span = (call.rows.start, call.rows.stop)
        if into is None and span not in written:  # the rows' first call: a copy, not a merge
            written.add(span)
            acc.out[..., call.rows, :].copy_(out)
            acc.lse[..., call.rows].copy_(lse)
        else:
            merge_into(acc, call.rows, out, lse)
    return acc


def _runs(flags: np.ndarray) -> list[tuple[int, int, bool]]:
    """(start, stop, value) of each run of equal values of the boolean ``flags``."""
    edges = [0, *(np.flatnonzero(np.diff(flags.astype(np.int8))) + 1).tolist(), len(flags)]
    return [(start, stop, bool(flags[start])) for start, stop in zip(edges, edges[1:], strict=False)
            if stop > start]


def _accumulate(pieces: Sequence[tuple[torch.Tensor, torch.Tensor]], span: slice,
                written: np.ndarray) -> None:
    """Each (target, value) pair's value into its target's index range ``span`` along the
    sequence axis (-2): copied where no earlier call wrote (``written``), added where one did."""
    for start, stop, seen in _runs(written[span]):
        at = slice(span.start + start, span.start + stop)
        for target, value in pieces:
            part = value[..., start:stop, :]
            if seen:
                target[..., at, :].add_(part)
            else:
                target[..., at, :].copy_(part)
    written[span] = True


def attend_grad(q: torch.Tensor, kv: torch.Tensor, dout: torch.Tensor, saved: Partial, q_pos: np.ndarray,
                k_pos: np.ndarray, mask: Mask, scale: float | None = None,
                dq_into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``attend`` for queries at ``q_pos`` over the keys of ``kv`` ([2, batch,
    kv_heads, seq, head_dim]) at ``k_pos``, given ``saved``, the layer's final output [batch,
    heads, seq, head_dim] and float32 log-sum-exp [batch, heads, seq] over ALL its keys, and
    ``dout`` = dL/dout: (dq float32 [batch, heads, seq, head_dim], this key subset's share of
    dQ; dkv float32 like kv, the dK and dV of these keys), by the calls ``attention_calls``
    plans, each call's pieces summed into its rows and keys; rows and keys no call names get 0.
    ``dq_into`` (the same queries' share over other keys, float32): dq is added into it in
    place and it is returned. Queries at ``seq_len`` or beyond must have ``dout`` 0 (the caller
    pads with zeros): what they see then contributes nothing."""
    calls = attention_calls(q_pos, k_pos, mask)
    k, v = kv[0], kv[1]
    dq = activations(q.shape, torch.float32, q.device) if dq_into is None else dq_into
    dkv = activations(kv.shape, torch.float32, kv.device)
    # rows already holding a share (all of dq_into's) are added to, never overwritten or zeroed
    rows_written = np.full(q.shape[-2], dq_into is not None, dtype=bool)
    keys_written = np.zeros(k.shape[-2], dtype=bool)
    for call in calls:
        pieces = (q[..., call.rows, :], k[..., call.keys, :], v[..., call.keys, :],
                  saved.out[..., call.rows, :], saved.lse[..., call.rows], dout[..., call.rows, :])
        if not call.masked:
            grad_q, grad_k, grad_v = fused_attention_grad(*pieces, call.causal, scale)
        elif _anti_causal(visible := _visible(call, q_pos, k_pos, mask)):  # as its forward
            grad_q, grad_k, grad_v = _far_edge_grad(*pieces, scale)
        else:
            grad_q, grad_k, grad_v = explicit_grad(*pieces, False, scale,
                                                   torch.from_numpy(visible).to(q.device))
        _accumulate([(dq, grad_q)], call.rows, rows_written)
        _accumulate([(dkv[0], grad_k), (dkv[1], grad_v)], call.keys, keys_written)
    for grad, written in ((dq, rows_written), (dkv, keys_written)):
        for start, stop, seen in _runs(written):
            if not seen:
                grad[..., start:stop, :] = 0.0
    return dq, dkv


def pack(x: torch.Tensor, split_axis: int, members: int, wire: torch.dtype, repeat: int = 1) -> torch.Tensor:
    """``x`` cut into ``members`` chunks along ``split_axis``, chunk j first: the contiguous
    [members, ...] buffer an all-to-all sends, in ``wire`` dtype, in one copy (the cast
    included). ``repeat`` > 1: each slice of ``split_axis`` repeated that many times first,
    which gives each member one slice (Ulysses' KV heads, ``kv_replication``), in the same copy."""
    split = split_axis % x.dim()
    if repeat > 1:
        picked = torch.arange(x.shape[split] * repeat, device=x.device) // repeat
        return x.movedim(split, 0).index_select(0, picked).to(wire).unsqueeze(split + 1)
    chunks = x.unflatten(split, (members, x.shape[split] // members)).movedim(split, 0)
    send = torch.empty(chunks.shape, dtype=wire, device=x.device)
    send.copy_(chunks)
    return send


def unpack(received: torch.Tensor, axis: int) -> torch.Tensor:
    """The members' arrivals (``received[j]`` from member j) joined along ``axis`` of one
    arrival, in one copy into a tensor laid out as ``activations``."""
    members, piece = received.shape[0], list(received.shape[1:])
    axis %= len(piece)
    shape = list(piece)
    shape[axis] *= members
    joined = activations(shape, received.dtype, received.device)
    joined.unflatten(axis, (members, piece[axis])).copy_(received.movedim(0, axis))
    return joined


def exchange_all_to_all(group: dist.ProcessGroup, x: torch.Tensor, split_axis: int, concat_axis: int,
                        wire: torch.dtype, repeat: int = 1) -> torch.Tensor:
    """Member j of ``group`` gets chunk j of ``x`` along ``split_axis`` (each slice repeated
    ``repeat`` times first); the arrivals are joined along ``concat_axis``: one pack, the
    exchange and one unpack (calibration times the exchange as a strategy pays for it)."""
    send = pack(x, split_axis, dist.get_world_size(group), wire, repeat)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return unpack(received, concat_axis)


def dense(x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``x`` as a contiguous tensor with its dims permuted (no copy where it is one, as a
    sequence-major tensor is), and how to see a tensor of that layout with ``x``'s dims: what
    a collective sends and receives without a copy."""
    strides = x.stride()
    order = sorted(range(x.dim()), key=lambda d: -strides[d])
    permuted = x.permute(order)
    if not permuted.is_contiguous():
        permuted, order = x.contiguous(), list(range(x.dim()))
    back = [order.index(d) for d in range(x.dim())]
    return permuted, lambda t: t.permute(back)


#: ``all_gather_into_tensor`` under the name newer PyTorch releases give it (2.13 warns on the old one).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def exchange_all_gather(group: dist.ProcessGroup, x: torch.Tensor, axis: int, wire: torch.dtype,
                        order: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
    """Every member's ``x`` joined along ``axis``: the (member, start, stop) ranges of
    ``order`` in that order, each member's whole ``x`` in member order where None; one copy
    out of the receive buffer."""
    send, as_x = dense(x.to(wire))
    members = dist.get_world_size(group)
    received = torch.empty((members * send.shape[0], *send.shape[1:]), dtype=wire, device=send.device)
    _all_gather_single(received, send, group=group)  # the arrivals stacked along dim 0
    arrivals = [as_x(piece) for piece in received.view(members, *send.shape).unbind(0)]
    return joined_in_order(arrivals, axis, order)


def joined_in_order(arrivals: Sequence[torch.Tensor], axis: int,
                    order: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
    """The members' arrivals joined along ``axis``: the (member, start, stop) ranges of
    ``order`` in that order, or each whole in member order; one copy."""
    length = arrivals[0].shape[axis]
    pieces = order if order is not None else [(m, 0, length) for m in range(len(arrivals))]
    return torch.cat([arrivals[m].narrow(axis, start, stop - start) for m, start, stop in pieces], dim=axis)


#: ``reduce_scatter_tensor`` under the name newer PyTorch releases give it (as ``_all_gather_single``).
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def exchange_reduce_scatter(group: dist.ProcessGroup, x: torch.Tensor, axis: int,
                            order: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
    """The inverse of ``exchange_all_gather`` for a gradient: ``x`` holds every member's part
    along ``axis`` (each whole in member order, or laid out as ``order`` joins its (member,
    start, stop) ranges); each member gets the float32 sum of every member's values of its own
    part, in its own index order, laid out as ``activations``. One copy into the send buffer
    (the cast to float32 included), the parts end to end along its first dim as the collective
    takes them."""
    members = dist.get_world_size(group)
    axis %= x.dim()
    shape = list(x.shape)
    shape[axis] //= members
    received = activations(shape, torch.float32, x.device)
    dense_received, as_part = dense(received)  # what the collective writes into, seen with x's dims
    send = torch.empty((members, *dense_received.shape), dtype=torch.float32, device=x.device)
    pieces = order if order is not None else [(m, 0, shape[axis]) for m in range(members)]
    offset = 0
    for member, start, stop in pieces:
        as_part(send[member]).narrow(axis, start, stop - start).copy_(x.narrow(axis, offset, stop - start))
        offset += stop - start
    _reduce_scatter_single(dense_received, send.flatten(0, 1), group=group)
    return as_part(dense_received)


def ring_step(group: dist.ProcessGroup, send: torch.Tensor, receive: torch.Tensor,
              tag: int = 0, shift: int = 1) -> list[dist.Work]:
    """Start passing ``send`` to the member ``shift`` ahead in ``group`` and taking ``receive``
    from the one as far behind: the Ring's stream step (shift 1; a gradient's way home after
    a stream that stopped short of the whole ring: minus the steps it went). Wait on what it
    returns. ``tag``: the K/V blocks' 0, the gradients travelling beside them ``GRAD_TAG``
    (gloo matches by it; NCCL by order, the same on every rank)."""
    members, me = dist.get_world_size(group), dist.get_rank(group)
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, dist.get_global_rank(group, (me + shift) % members), group, tag),
        dist.P2POp(dist.irecv, receive, dist.get_global_rank(group, (me - shift) % members), group, tag),
    ])


#: The tag of the Ring's travelling gradients (K/V blocks go with the default, 0).
GRAD_TAG = 1


def fold_runs(x: torch.Tensor, axis: int, fold: int) -> torch.Tensor:
    """Each run of ``fold`` consecutive slices of ``axis`` summed into one, in float32, laid
    out as ``activations``."""
    axis %= x.dim()
    shape = list(x.shape)
    shape[axis] //= fold
    out = activations(shape, torch.float32, x.device)
    torch.sum(x.unflatten(axis, (shape[axis], fold)), dim=axis + 1, dtype=torch.float32, out=out)
    return out


class _Clock:
    """Seconds spent in compute and in waiting for communication on one rank: wall clock on
    the CPU, where kernels run synchronously; CUDA events on the compute stream on a GPU,
    read once the iteration is done (``totals``). Off (a deployment): nothing recorded."""

    def __init__(self, device: torch.device, on: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.on = on
        self.seconds = {"compute": 0.0, "comm": 0.0}
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {"compute": [], "comm": []}

    def start(self) -> object:
        if not self.on:
            return None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, kind: str, started: object) -> None:
        if not self.on:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events[kind].append((started, event))  # type: ignore[arg-type]
        else:
            self.seconds[kind] += time.perf_counter() - started  # type: ignore[operator]

    def totals(self) -> tuple[float, float]:
        """(compute, communication) seconds so far."""
        if self.cuda:
            torch.cuda.synchronize()
            for kind, pairs in self.events.items():
                self.seconds[kind] += sum(a.elapsed_time(b) for a, b in pairs) / 1e3
                pairs.clear()
        return self.seconds["compute"], self.seconds["comm"]


class TorchOps:
    """``Primitives`` on ``torch.distributed`` process groups, one per ``Group`` (None: the
    group is this rank alone), for tensors on one device."""

    def __init__(self, workload: Workload, groups: Mapping[str, dist.ProcessGroup | None],
                 device: torch.device, scale: float | None = None, timed: bool = True) -> None:
        self.workload = workload
        self.groups = groups
        self.wire = TORCH_DTYPES[workload.dtype]
        #: The scores' scale (None: 1 / sqrt(head_dim)).
        self.scale = scale
        #: Compute and communication apart (the engine's split); off where nobody reads it.
        self.clock = _Clock(device, timed)

    def _members(self, group: Group) -> int:
        pg = self.groups[group]
        return 1 if pg is None else dist.get_world_size(pg)

    def _shared(self, group: Group) -> dist.ProcessGroup:
        """The process group of ``group``, which has two or more members (callers check ``_members``)."""
        pg = self.groups[group]
        assert pg is not None, f"{group} group is this rank alone"
        return pg

    def attention(self, q: torch.Tensor, kv: torch.Tensor, q_pos: np.ndarray, k_pos: np.ndarray,
                  into: Partial | None = None) -> Partial:
        started = self.clock.start()
        part = attend(q, kv, q_pos, k_pos, self.workload.mask, self.scale, into)
        self.clock.stop("compute", started)
        return part

    def attention_grad(self, q: torch.Tensor, kv: torch.Tensor, dout: torch.Tensor, saved: Partial,
                       q_pos: np.ndarray, k_pos: np.ndarray,
                       dq_into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(dq, dkv) of ``attention`` over these keys given the layer's final output and
        log-sum-exp, dq added into ``dq_into`` in place where given (``attend_grad``), timed
        as compute."""
        started = self.clock.start()
        grads = attend_grad(q, kv, dout, saved, q_pos, k_pos, self.workload.mask, self.scale, dq_into)
        self.clock.stop("compute", started)
        return grads

    def all_to_all(self, x: torch.Tensor, group: Group, split_axis: int, concat_axis: int,
                   repeat: int = 1) -> torch.Tensor:
        if self._members(group) == 1:
            return x
        started = self.clock.start()
        out = exchange_all_to_all(self._shared(group), x, split_axis, concat_axis, self.wire, repeat)
        self.clock.stop("comm", started)
        return out

    def all_to_all_grad(self, x: torch.Tensor, group: Group, split_axis: int, concat_axis: int,
                        fold: int) -> torch.Tensor:
        """The inverse of ``all_to_all(..., repeat=fold)``: ``fold`` > 1, exchanged in float32
        and each run of ``fold`` slices of ``concat_axis`` summed (timed as compute); else
        ``all_to_all`` as it is (in the wire dtype, as the mpi engine)."""
        if self._members(group) == 1 or fold == 1:
            return self.all_to_all(x, group, split_axis, concat_axis)
        started = self.clock.start()
        out = exchange_all_to_all(self._shared(group), x, split_axis, concat_axis, torch.float32)
        self.clock.stop("comm", started)
        started = self.clock.start()
        out = fold_runs(out, concat_axis, fold)
        self.clock.stop("compute", started)
        return out

    def all_gather(self, x: torch.Tensor, group: Group, axis: int,
                   order: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
        if self._members(group) == 1:
            return x
        started = self.clock.start()
        out = exchange_all_gather(self._shared(group), x, axis, self.wire, order)
        self.clock.stop("comm", started)
        return out

    def reduce_scatter(self, x: torch.Tensor, group: Group, axis: int,
                       order: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
        """The inverse of ``all_gather`` for a gradient (``exchange_reduce_scatter``), float32."""
        if self._members(group) == 1:
            return x
        started = self.clock.start()
        out = exchange_reduce_scatter(self._shared(group), x, axis, order)
        self.clock.stop("comm", started)
        return out

    def narrow(self, x: torch.Tensor, axis: int, start: int, stop: int) -> torch.Tensor:
        return x.narrow(axis, start, stop - start)

    def concat(self, parts: Sequence[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.cat(list(parts), dim=axis)

    def pad(self, x: torch.Tensor, axis: int, size: int) -> torch.Tensor:
        shape = list(x.shape)
        shape[axis] = size - shape[axis]
        return torch.cat([x, x.new_zeros(shape)], dim=axis)

    def kv_stream(self, kv: torch.Tensor, group: Group,
                  steps: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Ring order: at step t hold member (me - t)'s block, pass it on to me + 1 and take
        the next from me - 1 while the caller attends to it, for ``steps`` steps after this
        rank's own block (None: round the whole ring)."""
        pg = self.groups[group]
        members = self._members(group)
        me = 0 if pg is None else dist.get_rank(pg)
        last = members - 1 if steps is None else min(steps, members - 1)
        current, as_kv = dense(kv.to(self.wire))
        # the blocks arrive in buffers of the Ring's own, never in the caller's K/V: two where
        # a block is passed on while the next arrives
        buffers = [torch.empty_like(current) for _ in range(min(2, last))]
        for step in range(last + 1):
            if step == last:  # the last block: nothing more to pass on
                yield (me - step) % members, as_kv(current)
                break
            incoming = buffers[step % 2]
            requests = ring_step(self._shared(group), current, incoming)
            yield (me - step) % members, as_kv(current)
            started = self.clock.start()
            for request in requests:
                request.wait()
            self.clock.stop("comm", started)
            current = incoming

    def kv_grad_stream(self, kv: torch.Tensor, group: Group,
                       visit: Callable[[int, torch.Tensor], torch.Tensor],
                       steps: int | None = None) -> torch.Tensor:
        """``kv_stream``'s order, each block's float32 gradient beside it, one hop behind: at
        step t the gradient of member (me - t)'s block arrives from me - 1 while this rank
        works on the block, gets this rank's share and goes on to me + 1 (at step 0 this
        rank's own block's gradient starts with its share); after the last step each gradient
        goes straight to its owner (one hop on where the stream went round the whole ring),
        and this rank's own arrives from the rank as far ahead. Two float32 buffers, one sent
        while the other receives; waits timed as communication."""
        pg = self.groups[group]
        members = self._members(group)
        last = members - 1 if steps is None else min(steps, members - 1)
        if pg is None or last == 0:  # no other block: this rank's own gradient is all there is
            return visit(0 if pg is None else dist.get_rank(pg), kv)
        stream = self.kv_stream(kv, group, last)
        member, block = next(stream)  # this rank's own block: its gradient starts here
        send, as_kv = dense(visit(member, block).to(torch.float32))
        receive = torch.empty_like(send)
        # one batch a step (NCCL gives it one request: the receive cannot be waited for alone),
        # after the blocks' batch of the step, in the same order on every rank
        in_flight = ring_step(pg, send, receive, GRAD_TAG)
        for step, (member, block) in enumerate(stream, start=1):
            share = visit(member, block)
            self._wait(in_flight)  # last step's gradient arrived, and the buffer sent is free
            as_kv(receive).add_(share)
            send, receive = receive, send
            in_flight = ring_step(pg, send, receive, GRAD_TAG, 1 if step < last else -last)
        self._wait(in_flight)
        return as_kv(receive)

    def _wait(self, requests: Sequence[dist.Work]) -> None:
        """Wait for ``requests``, the time counted as communication."""
        started = self.clock.start()
        for request in requests:
            request.wait()
        self.clock.stop("comm", started)
