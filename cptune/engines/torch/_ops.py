"""``Primitives`` in PyTorch: the strategies over ``torch.distributed`` process groups with
PyTorch's fused attention kernels. The torch engine's ranks time it, and ``cptune.torch``
hands the same code to a deployment.

Attention goes by token position without a mask tensor: each call is cut into pieces a
fused kernel runs unmasked or with its own causal mask (``attention_pieces``), and the
pieces' partials are merged by log-sum-exp. So the kernel is always one that returns the
log-sum-exp (``fused_attention``): on the CPU ``_scaled_dot_product_flash_attention_for_cpu``
(what ``scaled_dot_product_attention`` itself runs there), on CUDA the FlashAttention-2
kernel for 16-bit inputs and the memory-efficient one for float32, an explicit float32
computation elsewhere. ``kernel_name`` says which runs.

Exchanges send in the workload's dtype (bf16 is real bfloat16 here), K and V in one
message and with their own KV heads (GQA/MQA): Ulysses through ``all_to_all_single``,
AllGather-KV through ``all_gather_into_tensor``, the Ring through ``batch_isend_irecv``
with the next block in flight while the current one is attended to (NCCL runs it on its own
stream on a GPU, gloo on its own threads on the CPU).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from cptune.layout import position_runs
from cptune.strategies.primitives import HEADS, Group, Partial
from cptune.workload import Workload

#: The torch dtype each workload dtype computes and travels in.
TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Piece(NamedTuple):
    """Keys ``keys`` (an index range) of one query run, attended unmasked or with the causal
    mask aligned at both ranges' first position."""

    keys: slice
    causal: bool


class QueryRun(NamedTuple):
    """Queries ``rows`` (an index range) and the key pieces they attend to."""

    rows: slice
    pieces: tuple[Piece, ...]


def _runs(positions: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """(first index, stop index, first position) of each run of consecutive positions."""
    return tuple((start, stop, int(positions[start])) for start, stop in position_runs(positions))


@functools.lru_cache(maxsize=256)
def _plan(q_runs: tuple, k_runs: tuple, causal: bool, seq_len: int) -> tuple[QueryRun, ...]:
    keys = []
    for start, stop, first in k_runs:
        real = min(stop - start, seq_len - first)  # padding keys sit at the end of a run
        if real > 0:
            keys.append((start, start + real, first))
    plan = []
    for q_start, q_stop, q_first in q_runs:
        # cut the query run where a key run starts inside it: queries before that position
        # see none of its keys, those from it on see them through an aligned causal mask
        cuts = {q_start, q_stop}
        if causal:
            last = q_first + q_stop - q_start - 1
            cuts |= {q_start + first - q_first for _, _, first in keys if q_first < first <= last}
        edges = sorted(cuts)
        for rows_start, rows_stop in zip(edges, edges[1:], strict=False):
            first_q = q_first + rows_start - q_start
            last_q = first_q + rows_stop - rows_start - 1
            pieces = []
            for k_start, k_stop, first_k in keys:
                if not causal or first_k + (k_stop - k_start) - 1 <= first_q:
                    pieces.append(Piece(slice(k_start, k_stop), False))
                elif first_k <= first_q:  # straddles the diagonal: the past unmasked, then the diagonal
                    split = k_start + first_q - first_k
                    if split > k_start:
                        pieces.append(Piece(slice(k_start, split), False))
                    pieces.append(Piece(slice(split, min(k_stop, split + last_q - first_q + 1)), True))
                # else: the whole key run lies in these queries' future
            plan.append(QueryRun(slice(rows_start, rows_stop), tuple(pieces)))
    return tuple(plan)


def attention_pieces(
    q_pos: np.ndarray, k_pos: np.ndarray, causal: bool, seq_len: int
) -> tuple[QueryRun, ...]:
    """Queries at ``q_pos`` over keys at ``k_pos`` as runs of queries, each with the key
    pieces it attends to: unmasked, or causal with both ranges starting at one position
    (the upper-left alignment every fused kernel's ``is_causal`` uses), never a mask
    tensor. Keys at ``seq_len`` or beyond (padding) are left out; queries are not."""
    return _plan(_runs(q_pos), _runs(k_pos), causal, seq_len)


def kernel_name(device: torch.device, dtype: torch.dtype) -> str:
    """The attention kernel ``fused_attention`` runs for ``dtype`` inputs on ``device``."""
    if device.type == "cpu":
        return "flash_for_cpu"
    if device.type == "cuda":
        return "cuda_flash" if dtype in (torch.float16, torch.bfloat16) else "cuda_efficient"
    return "explicit"


TensorPair = tuple[torch.Tensor, torch.Tensor]


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> TensorPair:
    """Attention and log-sum-exp in float32 with plain tensor ops (no fused kernel here)."""
    groups = q.shape[HEADS] // k.shape[HEADS]
    k, v = k.repeat_interleave(groups, dim=HEADS).float(), v.repeat_interleave(groups, dim=HEADS).float()
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(
            torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse[..., None]) @ v).to(q.dtype), lse


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> TensorPair:
    """softmax(q k^T / sqrt(d) [+ upper-left causal mask]) v and its float32 log-sum-exp
    [batch, heads, seq], by the kernel ``kernel_name`` names; ``k`` and ``v`` may have
    fewer (KV) heads than ``q``."""
    name = kernel_name(q.device, q.dtype)
    if name == "flash_for_cpu":  # takes GQA heads as they are
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    if name == "explicit":
        return _explicit(q, k, v, causal)
    groups = q.shape[HEADS] // k.shape[HEADS]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=HEADS), v.repeat_interleave(groups, dim=HEADS)
    if name == "cuda_flash":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
        return out, lse
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
    return out, lse[..., : q.shape[-2]]  # its log-sum-exp rows are padded to a multiple of 32


def merge_partials(acc: Partial | None, part: Partial) -> Partial:
    """The online-softmax merge of two partials over disjoint keys, in float32; rows that
    saw no key (log-sum-exp -inf) take the other side as it is."""
    if acc is None:
        return Partial(part.out.float(), part.lse)
    top = torch.maximum(acc.lse, part.lse)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    mine, theirs = torch.exp(acc.lse - top), torch.exp(part.lse - top)
    total = mine + theirs
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = acc.out * (mine / safe)[..., None] + part.out.float() * (theirs / safe)[..., None]
    return Partial(out, top + torch.log(total))


def attend(q: torch.Tensor, kv: torch.Tensor, q_pos: np.ndarray, k_pos: np.ndarray, causal: bool,
           seq_len: int) -> Partial:
    """Attention of queries at ``q_pos`` over the keys of ``kv`` ([2, batch, kv_heads, seq,
    head_dim]) at ``k_pos``, by pieces (``attention_pieces``) merged by log-sum-exp."""
    outs, lses = [], []
    for run in attention_pieces(q_pos, k_pos, causal, seq_len):
        rows = q[..., run.rows, :]
        merged: Partial | None = None
        for piece in run.pieces:
            k, v = kv[0][..., piece.keys, :], kv[1][..., piece.keys, :]
            part = Partial(*fused_attention(rows, k, v, piece.causal))
            merged = part if merged is None else merge_partials(merged, part)
        if merged is None:  # no key is visible to these queries
            lse = torch.full(rows.shape[:-1], float("-inf"), device=q.device)
            merged = Partial(torch.zeros_like(rows), lse)
        outs.append(merged.out)
        lses.append(merged.lse)
    if len(outs) == 1:
        return Partial(outs[0], lses[0])
    # a run of one piece keeps the kernel's dtype, a merged one is float32
    dtype = torch.float32 if len({o.dtype for o in outs}) > 1 else outs[0].dtype
    return Partial(torch.cat([o.to(dtype) for o in outs], dim=-2), torch.cat(lses, dim=-1))


def in_send_order(x: torch.Tensor, split_axis: int, members: int, wire: torch.dtype) -> torch.Tensor:
    """``x`` cut into ``members`` chunks along ``split_axis``, chunk j first: the contiguous
    [members, ...] buffer an all-to-all sends, in ``wire`` dtype (one copy, cast included)."""
    split = split_axis % x.dim()
    chunked = x.reshape(*x.shape[:split], members, x.shape[split] // members, *x.shape[split + 1:])
    return chunked.movedim(split, 0).to(wire).contiguous()


def out_of_receive_order(received: torch.Tensor, axis: int) -> torch.Tensor:
    """The members' arrivals (``received[j]`` from member j) joined along ``axis`` of one arrival."""
    axis %= received.dim() - 1
    shape = list(received.shape[1:])
    shape[axis] *= received.shape[0]
    return received.movedim(0, axis).reshape(shape)


def exchange_all_to_all(group: dist.ProcessGroup, x: torch.Tensor, split_axis: int, concat_axis: int,
                        wire: torch.dtype) -> torch.Tensor:
    """Member j of ``group`` gets chunk j of ``x`` along ``split_axis``; the arrivals are
    joined along ``concat_axis``, the copies into send order and out of receive order
    included (calibration times the exchange as a strategy pays for it)."""
    send = in_send_order(x, split_axis, dist.get_world_size(group), wire)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return out_of_receive_order(received, concat_axis)


#: ``all_gather_into_tensor`` under the name newer PyTorch releases give it (2.13 warns on the old one).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def exchange_all_gather(
    group: dist.ProcessGroup, x: torch.Tensor, axis: int, wire: torch.dtype
) -> torch.Tensor:
    """Every member's ``x`` joined along ``axis`` in member order."""
    send = x.to(wire).contiguous()
    members = dist.get_world_size(group)
    received = torch.empty((members * send.shape[0], *send.shape[1:]), dtype=wire, device=send.device)
    _all_gather_single(received, send, group=group)  # the arrivals stacked along dim 0
    return out_of_receive_order(received.view(members, *send.shape), axis)


def ring_step(group: dist.ProcessGroup, send: torch.Tensor, receive: torch.Tensor) -> list[dist.Work]:
    """Start passing ``send`` to the next member of ``group`` and taking ``receive`` from the
    previous one: the Ring's stream step (wait on what it returns)."""
    members, me = dist.get_world_size(group), dist.get_rank(group)
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, dist.get_global_rank(group, (me + 1) % members), group),
        dist.P2POp(dist.irecv, receive, dist.get_global_rank(group, (me - 1) % members), group),
    ])


class _Clock:
    """Seconds spent in compute and in waiting for communication on one rank: wall clock on
    the CPU, where kernels run synchronously; CUDA events on the compute stream on a GPU,
    read once the iteration is done (``totals``)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = {"compute": 0.0, "comm": 0.0}
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {"compute": [], "comm": []}

    def start(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, kind: str, started: object) -> None:
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
                 device: torch.device) -> None:
        self.workload = workload
        self.groups = groups
        self.wire = TORCH_DTYPES[workload.dtype]
        self.clock = _Clock(device)

    def _members(self, group: Group) -> int:
        pg = self.groups[group]
        return 1 if pg is None else dist.get_world_size(pg)

    def _shared(self, group: Group) -> dist.ProcessGroup:
        """The process group of ``group``, which has two or more members (callers check ``_members``)."""
        pg = self.groups[group]
        assert pg is not None, f"{group} group is this rank alone"
        return pg

    def attention(self, q: torch.Tensor, kv: torch.Tensor, q_pos: np.ndarray, k_pos: np.ndarray) -> Partial:
        started = self.clock.start()
        part = attend(q, kv, q_pos, k_pos, self.workload.causal, self.workload.seq_len)
        self.clock.stop("compute", started)
        return part

    def merge(self, acc: Partial | None, part: Partial) -> Partial:
        started = self.clock.start()
        merged = merge_partials(acc, part)
        self.clock.stop("compute", started)
        return merged

    def repeat_heads(self, kv: torch.Tensor, times: int) -> torch.Tensor:
        started = self.clock.start()
        repeated = kv.repeat_interleave(times, dim=HEADS)
        self.clock.stop("compute", started)
        return repeated

    def all_to_all(self, x: torch.Tensor, group: Group, split_axis: int, concat_axis: int) -> torch.Tensor:
        if self._members(group) == 1:
            return x
        started = self.clock.start()
        out = exchange_all_to_all(self._shared(group), x, split_axis, concat_axis, self.wire)
        self.clock.stop("comm", started)
        return out

    def all_gather(self, x: torch.Tensor, group: Group, axis: int) -> torch.Tensor:
        if self._members(group) == 1:
            return x
        started = self.clock.start()
        out = exchange_all_gather(self._shared(group), x, axis, self.wire)
        self.clock.stop("comm", started)
        return out

    def kv_stream(self, kv: torch.Tensor, group: Group) -> Iterator[tuple[int, torch.Tensor]]:
        """Ring order: at step t hold member (me - t)'s block, pass it on to me + 1 and take
        the next from me - 1 while the caller attends to it."""
        pg = self.groups[group]
        members = self._members(group)
        me = 0 if pg is None else dist.get_rank(pg)
        current = kv.to(self.wire).contiguous()
        incoming = torch.empty_like(current) if members > 1 else current
        for step in range(members):
            requests = ring_step(self._shared(group), current, incoming) if step < members - 1 else []
            yield (me - step) % members, current
            if requests:
                started = self.clock.start()
                for request in requests:
                    request.wait()
                self.clock.stop("comm", started)
                current, incoming = incoming, current
