"""``ContextParallelAttention``: the strategies cptune tunes, as a module a model calls.

It runs exactly what the torch engine measured (``run_strategy`` on ``TorchOps``) on the
caller's ranks: each rank passes its local shards of q, k and v in the layout the chosen
configuration names and gets its local output back. The head and context process groups
every configuration it may run needs are made once, at construction.

Masks: the layer's sliding window and sinks and joint attention's text length are given at
construction (or by the plan's shape), packed documents per call (``cu_seqlens``, as
flash-attn's varlen functions and TransformerEngine's THD format take them); every rank deals
the tokens out in the configuration's layout for that mask, and the strategies compute
exactly the unmasked work (``cptune.calls``).

It trains: where q, k or v require gradients, the forward keeps what the backward needs
(``run_forward``) and autograd runs the strategy's backward (``run_backward`` on the same
``TorchOps``: the exchanges in reverse), which hands each rank the gradients of its own q, k
and v shards. The backward is collective over the configuration's ranks, as the forward is.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from cptune.config import CPConfig
from cptune.engines.torch import TORCH_DTYPES, TorchOps, model_output, strategy_inputs
from cptune.feasibility import check_feasible
from cptune.layout import SequenceLayout, context_group_members, head_group_members, rank_groups
from cptune.masks import Documents
from cptune.plans import Plan, PlanMismatchError
from cptune.strategies import Partial, Saved, run_backward, run_forward, run_strategy
from cptune.torch._lengths import SameLength
from cptune.torch._sequence import (
    call_config,
    sequence_layout,
    shard_length,
    shard_sequence,
    unshard_sequence,
)
from cptune.workload import AttentionShape, Workload

#: Document boundaries as a call gives them: cumulative lengths from 0 (flash-attn's
#: ``cu_seqlens``, TransformerEngine's THD ``cu_seqlens_q``), a tensor or a list.
CuSeqlens = torch.Tensor | Sequence[int]

#: The process groups one configuration runs with on this rank (None: this rank alone).
RankGroups = dict[str, dist.ProcessGroup | None]


class ContextParallelAttention(torch.nn.Module):
    """Attention over a sequence split across the ranks of ``group``: each rank passes its
    local q, k, v shards (``shard`` cuts them) and gets its local output.

    ``choice`` is one ``CPConfig``, or a ``Plan`` whose configuration is picked per sequence
    length. ``shape`` is the attention layer (an ``AttentionShape``, or a ``Workload``
    standing for its shape): required with a config, checked against the plan's with a plan
    (the batch may differ: the strategies do not depend on it). ``window`` (left, right),
    ``sinks`` and ``text`` set the layer's mask (``cptune.masks``) where the shape does not
    already: a query at i sees the keys i - left .. i + right (causal: right 0) and the first
    ``sinks`` tokens of its document; ``text`` text tokens lead the sequence under joint
    attention. With a plan they must be the plan's (``PlanMismatchError``). Packed documents
    come per call (``cu_seqlens``). ``scale`` multiplies the
    scores, as ``scaled_dot_product_attention``'s does (None: 1 / sqrt(head_dim)). ``group`` is the caller's
    process group, default the world; a configuration on fewer ranks than the group runs on
    its first ``config.ranks`` ranks, and the others hold empty shards. Ranks are numbered
    by global rank within the group (for a group ``new_group`` made: the group rank).

    Construction is collective over the whole world, as ``torch.distributed.new_group`` is:
    every process builds it with the same ``choice`` and shape, each passing its own group
    (e.g. its context-parallel group in data x context parallelism). The module holds no
    parameters: build one and call it from every layer.

    It trains: where q, k or v require gradients (outside ``torch.no_grad()``), autograd
    gives each rank the gradients of its own shards, those of the unsharded layer. The
    backward is collective like the forward: every rank of the configuration must
    backpropagate through every call (a rank whose loss does not depend on a call's output
    still has to, e.g. by a loss over its tokens that may be empty), in the same order. The
    outputs at padding positions (``positions`` from ``seq_len`` on) are placeholders that
    ``unshard`` drops: no gradient flows back through them (the backward takes theirs as
    zero), so a loss over the local shard should leave them out. The parameters a rank's
    loss reaches get its share of their gradient: sum it over the group (``all_reduce``,
    as data parallelism does) for the gradient of the loss over the whole sequence.
    """

    def __init__(self, choice: CPConfig | Plan, shape: AttentionShape | Workload | None = None,
                 group: dist.ProcessGroup | None = None, scale: float | None = None, *,
                 window: Sequence[int] | None = None, sinks: int | None = None,
                 text: int | None = None) -> None:
        super().__init__()
        members = self._configure(choice, shape, group, scale, window, sinks, text)
        self._groups = _process_groups(self.configs, members, self.rank)

    @classmethod
    def _bound(cls, config: CPConfig, shape: AttentionShape, group: dist.ProcessGroup, scale: float | None,
               made: dict[tuple[int, ...], dist.ProcessGroup]) -> ContextParallelAttention:
        """A module for ``config`` on ``group`` whose head and context groups are in ``made``
        (global ranks -> group) already: built with no collective (``cptune.torch.BatchRunner``
        makes every group a batch plan needs, the same on every rank)."""
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        members = module._configure(config, shape, group, scale, None, None, None)
        taking_part = module.rank < config.ranks
        module._groups = {config: _groups_of(config, members, module.rank, made)} if taking_part else {}
        return module

    def _configure(self, choice: CPConfig | Plan, shape: AttentionShape | Workload | None,
                   group: dist.ProcessGroup | None, scale: float | None, window: Sequence[int] | None,
                   sinks: int | None, text: int | None) -> list[int]:
        """Everything but the process groups (no collective): the group's members, global ranks."""
        if not dist.is_initialized():
            raise RuntimeError("ContextParallelAttention needs torch.distributed: call "
                               "torch.distributed.init_process_group first (torchrun sets its environment)")
        self.plan = choice if isinstance(choice, Plan) else None
        #: The scores' scale, as ``scaled_dot_product_attention`` takes it (None: 1 / sqrt(head_dim)).
        self.scale = scale
        self.shape = _masked_shape(_attention_shape(choice, shape), self.plan, window, sinks, text)
        configs = [b.config for b in choice.buckets] if isinstance(choice, Plan) else [choice]
        self.configs: tuple[CPConfig, ...] = tuple(dict.fromkeys(configs))
        self.group = dist.group.WORLD if group is None else group
        assert self.group is not None  # the world exists once torch.distributed is initialized
        members = sorted(dist.get_process_group_ranks(self.group))
        #: This process's place in the layout: which shard it holds.
        self.rank = members.index(dist.get_rank())
        self.group_size = len(members)
        for config in self.configs:
            check_feasible(*_probe(self.shape, config))  # the head limits and the layout: any length
            if config.ranks > self.group_size:
                raise ValueError(f"{config.describe()} needs {config.ranks} ranks, but the group has "
                                 f"{self.group_size}: start {config.ranks} ranks (torchrun --nproc-per-node "
                                 f"{config.ranks}) or pass a larger group")
        #: Group ranks in layout order: where each rank's piece arrives in an all-gather.
        self._group_ranks = [dist.get_group_rank(self.group, g) for g in members]
        self._same_length = SameLength(self.group, self._group_ranks)
        return members

    def config_for(self, seq_len: int) -> CPConfig:
        """The configuration that runs sequences of ``seq_len`` tokens: the plan's pick (a
        ``PlanError`` beyond its longest bucket), or the one config."""
        return self.plan.select(seq_len) if self.plan is not None else self.configs[0]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype q, k and v come in: the attention shape's, which the exchanges send."""
        return TORCH_DTYPES[self.shape.dtype]

    def workload(self, seq_len: int, cu_seqlens: CuSeqlens | None = None) -> Workload:
        """The layer at ``seq_len`` tokens with its mask: the shape's, with the packed
        documents ``cu_seqlens`` bounds where given (``ValueError`` naming the fix where they
        or the mask do not fit the sequence)."""
        shape = self.shape
        if cu_seqlens is not None:
            shape = dataclasses.replace(shape, documents=document_lengths(cu_seqlens, seq_len))
        return shape.at(seq_len)

    def positions(self, seq_len: int, cu_seqlens: CuSeqlens | None = None) -> torch.Tensor:
        """The token positions this rank's shard holds, in order (int64; positions from
        ``seq_len`` on are padding; joint text every rank holds first): what
        position-dependent layers (rotary embeddings) need, as the layout's order is not
        contiguous (zigzag, striped, per document)."""
        workload, config = self.workload(seq_len, cu_seqlens), self.config_for(seq_len)
        if self.rank >= config.ranks:
            return torch.zeros(0, dtype=torch.int64)
        return torch.from_numpy(sequence_layout(workload, config).rank_positions(self.rank)).to(torch.int64)

    def shard(self, x: torch.Tensor, cu_seqlens: CuSeqlens | None = None) -> torch.Tensor:
        """This rank's shard of the full sequence ``x`` ([batch, seq_len, ...]) under the
        configuration for its length and the layout it deals this mask out in
        (``shard_sequence``; ``cu_seqlens``: the documents packed in it); empty where this
        rank takes no part."""
        if x.dim() < 2:
            raise ValueError(f"x must be [batch, seq_len, ...], got {list(x.shape)}")
        seq_len = x.shape[1]
        return shard_sequence(x, self.workload(seq_len, cu_seqlens), self.config_for(seq_len), self.rank)

    def unshard(self, local: torch.Tensor, seq_len: int, cu_seqlens: CuSeqlens | None = None) -> torch.Tensor:
        """The full sequence [batch, seq_len, ...] on every rank, from each rank's shard
        ``local`` (``unshard_sequence`` after an all-gather: collective over the group), the
        documents ``cu_seqlens`` bounds as ``shard`` was given them. Every call checks that
        every rank passed the same ``seq_len`` and documents first (one small all-gather)."""
        self._same_length.agree(seq_len, _bounds(cu_seqlens))  # before anything one rank may refuse
        workload, config = self.workload(seq_len, cu_seqlens), self.config_for(seq_len)
        length, piece = shard_length(workload, config, self.rank), shard_length(workload, config, 0)
        if local.dim() < 2 or local.shape[1] != length:
            raise ValueError(f"local must be [batch, {length}, ...]: rank {self.rank}'s shard of {seq_len} "
                             f"tokens under {config.describe()}; got {list(local.shape)}")
        # every rank sends as many rows (gloo gathers equal sizes); one that takes no part, zeros
        send = local if length else local.new_zeros((local.shape[0], piece, *local.shape[2:]))
        received = [torch.empty_like(send) for _ in range(self.group_size)]
        dist.all_gather(received, send.contiguous(), group=self.group)
        in_layout_order = [received[g] for g in self._group_ranks[: config.ranks]]
        return unshard_sequence(in_layout_order, workload, config)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int,
                cu_seqlens: CuSeqlens | None = None) -> torch.Tensor:
        """This rank's output shard [batch, local_seq, heads, head_dim] of attention over a
        sequence of ``seq_len`` tokens, from its shards ``q`` [batch, local_seq, heads,
        head_dim] and ``k``, ``v`` [batch, local_seq, kv_heads, head_dim] in the shape's dtype,
        under the layer's mask; ``cu_seqlens`` bounds the documents packed in the sequence
        (cumulative lengths from 0 to ``seq_len``; the same for every sequence of the batch),
        each query seeing its own document's keys only. Every rank of the group calls it with
        the same ``seq_len`` and ``cu_seqlens`` (checked at their first call)."""
        self._same_length.check(seq_len, _bounds(cu_seqlens))  # before anything one rank may refuse
        workload, config = self.workload(seq_len, cu_seqlens), self.config_for(seq_len)
        groups = self._groups.get(config)
        config = call_config(workload, config)
        check_feasible(workload, config)  # what depends on the length: fewer tokens than ranks, the layout
        local = shard_length(workload, config, self.rank)
        self._check_shards(q, k, v, local, seq_len, config)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if local == 0:
            if training:  # an empty output whose (empty) gradients still reach q, k and v
                idle: torch.Tensor = _NoPart.apply(q, k, v)
                return idle
            return q.new_empty((q.shape[0], 0, *q.shape[2:]))
        assert groups is not None  # a rank that takes part has its groups
        ops = TorchOps(workload, groups, q.device, self.scale, timed=False)
        layout = sequence_layout(workload, config)
        if training:
            output: torch.Tensor = _Attention.apply(q, k, v, ops, layout, self.rank)
            return output
        heads_q, kv = strategy_inputs(q, k, v)
        out = run_strategy(ops, layout, self.rank, heads_q, kv)
        return model_output(out, q.dtype)

    def _check_shards(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, local: int, seq_len: int,
                      config: CPConfig) -> None:
        """Refuse shards that are not this rank's, or in the wrong dtype."""
        batch = q.shape[0] if q.dim() else 0
        for name, tensor, heads in (("q", q, self.shape.heads), ("k", k, self.shape.kv_heads),
                                    ("v", v, self.shape.kv_heads)):
            expected = [batch, local, heads, self.shape.head_dim]
            if list(tensor.shape) != expected:
                raise ValueError(f"{name} must be {expected} (batch, rank {self.rank}'s shard of {seq_len} "
                                 f"tokens under {config.describe()}, heads, head_dim), got "
                                 f"{list(tensor.shape)}: cut the sequence with .shard(x)")
            if tensor.dtype != self.dtype:
                raise ValueError(f"{name} is {tensor.dtype} but the attention shape is {self.shape.dtype}: "
                                 f"pass {self.dtype} tensors (the exchanges send {self.shape.dtype})")

    def extra_repr(self) -> str:
        choice = (f"plan of {len(self.plan.buckets)} buckets up to {self.plan.max_seq_len} tokens"
                  if self.plan is not None else self.configs[0].describe())
        return f"{self.shape.describe()}; {choice}; rank {self.rank} of {self.group_size}"


def _bounds(cu_seqlens: CuSeqlens | None) -> tuple[object, ...]:
    """``cu_seqlens`` as the values given (unchecked: what the ranks compare before any of them
    may refuse them); empty for none."""
    if cu_seqlens is None:
        return ()
    return tuple(cu_seqlens.tolist()) if isinstance(cu_seqlens, torch.Tensor) else tuple(cu_seqlens)


def document_lengths(cu_seqlens: CuSeqlens, seq_len: int) -> Documents:
    """The packed documents ``cu_seqlens`` bounds (cumulative lengths 0, n0, n0 + n1, ...,
    ``seq_len``: flash-attn's and TransformerEngine's THD boundaries) as their lengths;
    ``ValueError`` naming the fix for boundaries that do not cut this sequence into documents."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor of document boundaries, one set for "
                             f"every sequence of the batch (a THD batch is batch 1), got {cu_seqlens.dtype} "
                             f"of shape {list(cu_seqlens.shape)}")
        bounds = [int(b) for b in cu_seqlens.tolist()]
    else:
        bounds = list(cu_seqlens)
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
            raise ValueError(f"cu_seqlens must hold integer document boundaries, got {bounds!r}")
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and end at the sequence's length ({seq_len}): the "
                         f"documents' cumulative lengths, [0, n0, n0 + n1, ..., {seq_len}]; got {bounds}")
    if bounds[-1] != seq_len:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]}, but the sequence holds {seq_len} tokens: its "
                         f"documents must cover the whole sequence (cu_seqlens[-1] == seq_len; pack padding "
                         f"into a document of its own)")
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if any(n <= 0 for n in lengths):
        at = next(i for i, n in enumerate(lengths) if n <= 0)
        raise ValueError(f"cu_seqlens must increase: document {at} runs from {bounds[at]} to "
                         f"{bounds[at + 1]} (an empty or backward document); drop repeated boundaries")
    return Documents.of(lengths) if len(lengths) > 1 else Documents()


def _masked_shape(shape: AttentionShape, plan: Plan | None, window: Sequence[int] | None, sinks: int | None,
                  text: int | None) -> AttentionShape:
    """``shape`` with the mask's parts given (None: the shape's); with a plan, refused
    (``PlanMismatchError``) where they are not the plan's: its picks were made for its mask."""
    if window is not None and any(isinstance(n, int) and n < 0 for n in window):
        raise ValueError(f"window: {list(window)} has a negative side (flash-attn's -1, no limit); cptune's "
                         f"window is [left, right], two token counts: leave window out for none, and for "
                         f"(left, -1) under a causal mask pass [left, 0]")
    given = {name: value for name, value in (("window", window), ("sinks", sinks), ("text", text))
             if value is not None}
    masked = dataclasses.replace(shape, **given)  # type: ignore[arg-type]  # validated by AttentionShape
    if plan is not None and masked != shape:
        raise PlanMismatchError(f"the plan was tuned for {shape.describe()}, not {masked.describe()}: export "
                                f"a plan for this mask (cptune export with --window, --sinks or --text)")
    return masked


def _probe(shape: AttentionShape, config: CPConfig) -> tuple[Workload, CPConfig]:
    """A workload of ``shape`` that its mask fits (packed documents left out: they come per
    call), and the configuration that runs it: what construction checks ``config`` against
    for what does not depend on the length (the head limits, the layout)."""
    window = max(shape.window, default=0)
    length = max(config.ranks, shape.text + config.ranks, window + 1, shape.sinks + 1)
    workload = dataclasses.replace(shape, documents=Documents()).at(length)
    return workload, call_config(workload, config)


class _Attention(torch.autograd.Function):
    """One rank's attention with its backward: ``run_forward`` keeping ``Saved`` (Q and K/V as
    the context strategy held them, its output and log-sum-exp), then ``run_backward`` on the
    same ``TorchOps`` from the output's gradient, zero on padding rows."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ops: TorchOps,
                layout: SequenceLayout, rank: int) -> torch.Tensor:
        heads_q, kv = strategy_inputs(q, k, v)
        out, saved = run_forward(ops, layout, rank, heads_q, kv)
        ctx.save_for_backward(saved.q, saved.kv, saved.result.out, saved.result.lse)
        ctx.ops, ctx.layout, ctx.rank = ops, layout, rank  # the backward runs the same exchanges
        return model_output(out, q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved_q, saved_kv, out, lse = ctx.saved_tensors
        ops: TorchOps = ctx.ops
        layout: SequenceLayout = ctx.layout
        rank: int = ctx.rank
        dtype = dout.dtype
        dq, dkv = run_backward(ops, layout, rank, Saved(saved_q, saved_kv, Partial(out, lse)),
                               _strategy_grad(dout, layout, rank))
        dk, dv = model_output(dkv[0], dtype), model_output(dkv[1], dtype)
        return model_output(dq, dtype), dk, dv, None, None, None


class _NoPart(torch.autograd.Function):
    """The output of a rank that takes no part (its shards are empty), joined to q, k and v:
    their gradients are empty, so the layers that made them get zero gradients, as on the
    ranks that take part (a sum of gradients over the group then finds the same parameters
    on every rank)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx.kv_shape = k.shape
        return q.new_empty(q.shape)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
        empty_kv = dout.new_zeros(ctx.kv_shape)
        return dout.new_zeros(dout.shape), empty_kv, empty_kv.clone()


def _strategy_grad(dout: torch.Tensor, layout: SequenceLayout, rank: int) -> torch.Tensor:
    """The output's gradient [batch, local_seq, heads, head_dim] as the strategies take it,
    [batch, heads, local_seq, head_dim] laid out as ``strategy_inputs`` lays q out (a view of
    sequence-major memory on CUDA, heads-major elsewhere), zero on padding rows: the
    backward's kernels require it (a padding query attends to keys a real one never sees)."""
    padding = torch.from_numpy(layout.rank_positions(rank) >= layout.workload.seq_len)
    if bool(padding.any()):
        dout = dout.masked_fill(padding.to(dout.device)[None, :, None, None], 0.0)
    heads = dout.contiguous().transpose(1, 2)  # contiguous: autograd may hand an expanded gradient
    return heads if dout.device.type == "cuda" else heads.contiguous()


def _attention_shape(choice: CPConfig | Plan, shape: AttentionShape | Workload | None) -> AttentionShape:
    """The attention shape the module serves: ``shape``, or the plan's (refusing a shape
    the plan was not tuned for; the batch may differ)."""
    if isinstance(shape, Workload):
        shape = shape.shape
    if not isinstance(choice, Plan):
        if shape is None:
            raise ValueError("with a CPConfig, name the attention shape: "
                             "ContextParallelAttention(config, AttentionShape(heads, kv_heads, head_dim, "
                             "batch, dtype, causal))")
        return shape
    if shape is not None and dataclasses.replace(shape, batch=choice.shape.batch) != choice.shape:
        raise PlanMismatchError(f"the plan was tuned for {choice.shape.describe()}, not "
                                f"{shape.describe()}: export a plan for this shape (cptune export)")
    return choice.shape


def _process_groups(configs: tuple[CPConfig, ...], members: list[int],
                    rank: int) -> dict[CPConfig, RankGroups]:
    """This rank's head and context groups for each configuration it takes part in.

    ``new_group`` is collective over the world, so every process makes every group that any
    process's configurations need, in one order: the processes first share their groups'
    members (global ranks, ``members`` is this one's) and configurations."""
    mine = [members, [[c.strategy, c.ranks, c.head_group] for c in configs]]
    needed: set[tuple[int, ...]] = set()
    for their_members, their_configs in _gathered_json(mine):
        for fields in their_configs:
            needed |= config_group_ranks(CPConfig(*fields), their_members)
    made = {ranks: dist.new_group(list(ranks)) for ranks in sorted(needed)}
    return {config: _groups_of(config, members, rank, made) for config in configs if rank < config.ranks}


def config_group_ranks(config: CPConfig, members: Sequence[int]) -> set[tuple[int, ...]]:
    """The head and context groups of more than one rank that ``config`` runs with on the
    processes ``members`` (global ranks, in layout order), as global ranks."""
    heads, context = rank_groups(config)
    return {tuple(members[r] for r in group) for group in (*heads, *context) if len(group) > 1}


def _groups_of(config: CPConfig, members: Sequence[int], rank: int,
               made: dict[tuple[int, ...], dist.ProcessGroup]) -> RankGroups:
    """Layout rank ``rank``'s head and context groups under ``config`` from ``made``."""

    def process_group(layout_ranks: list[int]) -> dist.ProcessGroup | None:
        return None if len(layout_ranks) == 1 else made[tuple(members[r] for r in layout_ranks)]

    return {"heads": process_group(head_group_members(rank, config.head_group)),
            "context": process_group(context_group_members(rank, config.head_group, config.ranks))}


def _gathered_json(value: object) -> list:
    """Every process's ``value`` (JSON data), in rank order: exchanged as bytes, so nothing
    a peer sends is ever unpickled (``all_gather_object`` would)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device))
    longest = int(max(size.item() for size in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: len(data)] = data
    received = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(received, padded)
    return [json.loads(bytes(got[: int(size.item())].cpu().tolist()))
            for got, size in zip(received, sizes, strict=True)]
