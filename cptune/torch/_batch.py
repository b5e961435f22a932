"""A batch plan (``cptune.mixes.BatchPlan``) run on the world's ranks: its groups side by side.

The plan's groups take consecutive blocks of world ranks in the plan's order (group 0 the
first ``config.ranks`` ranks, group 1 the next, ...; ranks left over idle). Each group runs
its sequences one after another, each as one call of a ``ContextParallelAttention`` in the
group's configuration on the group's ranks, as the solver prices them (a group's time is its
sequences' sum). The process groups are made as a plan first needs them and kept: every
block, and every head and context group a block's configuration runs with, once for the
runner's life, so a training loop whose per-batch plans reuse a few group shapes makes no
group after its first steps. ``new_group`` is collective over the world, so every rank makes
the same groups in the same order: every rank passes the same plan (checked).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from cptune.config import CPConfig
from cptune.torch._attention import ContextParallelAttention, config_group_ranks
from cptune.workload import AttentionShape, Workload

if TYPE_CHECKING:  # a deployment runs plans without importing the solver and its model
    from cptune.mixes import BatchPlan


@dataclass(frozen=True)
class BatchPart:
    """This rank's part of a batch plan: ``group`` (its index in ``plan.groups``, None on an
    idle rank) and the module that runs the group's sequences (None on an idle rank). The
    sequences are the plan's indices: ``shard`` cuts a full sequence for this rank, the call
    runs one, ``unshard`` puts its output (or a gradient) back together."""

    plan: BatchPlan
    group: int | None
    attention: ContextParallelAttention | None

    @property
    def sequences(self) -> tuple[int, ...]:
        """The sequences this rank's group runs, in the order it runs them (none when idle)."""
        return () if self.group is None else self.plan.groups[self.group].sequences

    @property
    def config(self) -> CPConfig | None:
        """The configuration this rank's group runs (None when idle)."""
        return None if self.group is None else self.plan.groups[self.group].config

    def _module(self, sequence: int) -> ContextParallelAttention:
        if self.attention is None or sequence not in self.sequences:
            raise ValueError(f"sequence {sequence} is not run by this rank's group (it runs "
                             f"{list(self.sequences)}): call each rank with its part's sequences")
        return self.attention

    def shard(self, x: torch.Tensor, sequence: int) -> torch.Tensor:
        """This rank's shard of sequence ``sequence`` (``x``: [batch, its length, ...]) in
        the group's layout."""
        length = self.plan.lengths[sequence]
        if x.dim() < 2 or x.shape[1] != length:
            raise ValueError(f"sequence {sequence} holds {length} tokens: x must be [batch, {length}, ...], "
                             f"got {list(x.shape)}")
        return self._module(sequence).shard(x)

    def unshard(self, local: torch.Tensor, sequence: int) -> torch.Tensor:
        """Sequence ``sequence`` whole, from each rank of the group's shard ``local``
        (collective over the group)."""
        return self._module(sequence).unshard(local, self.plan.lengths[sequence])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sequence: int) -> torch.Tensor:
        """This rank's output shard of sequence ``sequence`` from its q, k, v shards
        (``ContextParallelAttention.forward``: collective over the group; it trains)."""
        return self._module(sequence)(q, k, v, self.plan.lengths[sequence])


class BatchRunner:
    """Runs batch plans of one attention layer (``shape``; batch 1 per sequence, as a length
    mix lists its sequences) on the world's ranks: ``part(plan)`` each step, called by every
    rank with the same plan, gives this rank's ``BatchPart``. ``scale`` as
    ``ContextParallelAttention``'s. Needs ``torch.distributed`` initialised."""

    def __init__(self, shape: AttentionShape | Workload, scale: float | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("BatchRunner needs torch.distributed: call "
                               "torch.distributed.init_process_group first (torchrun sets its environment)")
        self.shape = shape.shape if isinstance(shape, Workload) else shape
        self.scale = scale
        self._made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._modules: dict[tuple[tuple[int, ...], CPConfig], ContextParallelAttention] = {}

    @property
    def groups_made(self) -> int:
        """How many process groups this runner has made so far (each once)."""
        return len(self._made)

    def part(self, plan: BatchPlan) -> BatchPart:
        """This rank's part of ``plan``: collective over the world (every rank passes the same
        plan, else ``ValueError`` on every rank naming the ranks that differ), making the
        process groups the plan needs that this runner has not made yet."""
        world, rank = dist.get_world_size(), dist.get_rank()
        _same_plan(plan)
        if sum(g.config.ranks for g in plan.groups) > plan.ranks:
            raise ValueError(f"the plan's groups need more than its {plan.ranks} ranks: solve the batch "
                             f"again")
        if plan.ranks > world:
            raise ValueError(f"the plan is for {plan.ranks} ranks, but the world has {world}: solve the "
                             f"batch for at most {world} ranks")
        blocks = _blocks([g.config for g in plan.groups])
        needed: set[tuple[int, ...]] = set()
        for block, config in zip(blocks, (g.config for g in plan.groups), strict=True):
            needed |= {block, *config_group_ranks(config, block)}
        for ranks in sorted(needed - self._made.keys()):  # the same order on every rank
            self._made[ranks] = dist.new_group(list(ranks))
        for index, (block, group) in enumerate(zip(blocks, plan.groups, strict=True)):
            if rank in block:
                key = (block, group.config)
                if key not in self._modules:
                    self._modules[key] = ContextParallelAttention._bound(
                        group.config, self.shape, self._made[block], self.scale, self._made)
                return BatchPart(plan, index, self._modules[key])
        return BatchPart(plan, None, None)


def _blocks(configs: Sequence[CPConfig]) -> list[tuple[int, ...]]:
    """The world ranks of each group: consecutive blocks in the plan's order."""
    blocks, start = [], 0
    for config in configs:
        blocks.append(tuple(range(start, start + config.ranks)))
        start += config.ranks
    return blocks


def _same_plan(plan: BatchPlan) -> None:
    """Return when every rank passed ``plan`` (its lengths and groups), ``ValueError`` on
    every rank otherwise: ranks that made different groups would wait on each other forever."""
    digest = hashlib.sha256(json.dumps(
        [list(plan.lengths), plan.ranks, [[g.config.to_dict(), list(g.sequences)] for g in plan.groups]],
        sort_keys=True).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:7], "big")], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        mine = mine.cuda()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    seen = [int(g.item()) for g in gathered]
    if len(set(seen)) > 1:
        by = {d: [str(r) for r, e in enumerate(seen) if e == d] for d in dict.fromkeys(seen)}
        said = ", ".join(f"one by rank(s) {' '.join(ranks)}" for ranks in by.values())
        raise ValueError(f"the ranks passed {len(by)} different batch plans ({said}): every rank must pass "
                         f"the same plan, solved from the same batch")
