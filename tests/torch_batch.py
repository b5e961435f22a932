"""``cptune.torch.BatchRunner`` on gloo ranks (tests/test_torch_batch.py launches it with
``python -m torch.distributed.run --standalone --nproc-per-node 4 torch_batch.py``).

Three steps of batch plans (groups of several sizes and configurations, one group of all
ranks, the first plan again) in one world: every rank runs its group's sequences, forward
and backward, and every sequence's output and dQ, dK, dV are put together and compared with
unsharded attention in float64 (``torch_masks.reference``). Then one rank passes a perturbed
plan, which every rank must refuse. Rank 0 prints one JSON line: {"world", "steps": [{"errors":
{sequence: [out, dq, dk, dv, out against a mask one token off]}, "groups_made"}], "perturbed"}.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch_masks import dense_mask, reference, relative_error

from cptune.config import CPConfig
from cptune.mixes import BatchPlan, Group
from cptune.torch import BatchRunner
from cptune.workload import AttentionShape

SHAPE = AttentionShape(4, 2, 8, 1, "fp32", True)
LENGTHS = (40, 17, 30, 9, 25)
MIXED = BatchPlan(LENGTHS, 4, (Group(CPConfig("ring", 2), (0, 3), 2.0),
                               Group(CPConfig("allgather_kv", 1), (1,), 1.0),
                               Group(CPConfig("ulysses", 1), (2, 4), 1.5)), 2.0, "fast")
ONE_GROUP = BatchPlan(LENGTHS, 4, (Group(CPConfig("ring", 4, 2), (0, 1, 2, 3, 4), 3.0),), 3.0, "one group")
#: Three groups and an idle rank.
IDLE = BatchPlan(LENGTHS, 4, (Group(CPConfig("ulysses", 2), (0, 1, 2), 2.0),
                              Group(CPConfig("ring", 1), (3, 4), 1.0)), 2.0, "fast")


def step(runner: BatchRunner, plan: BatchPlan, seed: int) -> dict[str, object]:
    """Every sequence of ``plan`` run by its group (forward and backward): each one's errors."""
    part = runner.part(plan)
    errors: dict[int, list[float]] = {}
    for s in part.sequences:
        generator = torch.Generator().manual_seed(seed * 100 + s)  # the same on every rank of the group
        n = plan.lengths[s]
        q = torch.randn(1, n, 4, 8, generator=generator, dtype=torch.float64)
        k, v = torch.randn(2, 1, n, 2, 8, generator=generator, dtype=torch.float64)
        dout = torch.randn(q.shape, generator=generator, dtype=torch.float64)
        exact = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = reference(*exact, dense_mask(n, True, None, 0, None))
        (expected * dout).sum().backward()
        local = [part.shard(t.float(), s).requires_grad_() for t in (q, k, v)]
        out = part(*local, s)
        out.backward(part.shard(dout.float(), s))
        got = [part.unshard(out.detach(), s), *(part.unshard(t.grad, s) for t in local)]  # type: ignore[arg-type]
        wanted = [expected.detach(), *(t.grad for t in exact)]
        errors[s] = [relative_error(g, w) for g, w in zip(got, wanted, strict=True)]  # type: ignore[arg-type]
        # the check can fail: the same output against a mask one token off (the first query
        # seeing the second key too)
        off = dense_mask(n, True, None, 0, None)
        off[0, 1] = True
        errors[s].append(relative_error(got[0], reference(q, k, v, off)))
    everyone: list[dict[int, list[float]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, errors)
    merged = {s: e for mine in everyone for s, e in (mine or {}).items()}
    idle: list[bool | None] = [None] * dist.get_world_size()
    dist.all_gather_object(idle, part.group is None)
    return {"errors": merged, "groups_made": runner.groups_made, "idle": idle}


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    runner = BatchRunner(SHAPE)
    steps = [step(runner, plan, seed) for seed, plan in enumerate((MIXED, ONE_GROUP, IDLE, MIXED))]
    perturbed = MIXED if dist.get_rank() else BatchPlan(
        LENGTHS, 4, (Group(CPConfig("ring", 2), (0, 3, 1), 2.0),
                     Group(CPConfig("ulysses", 1), (2, 4), 1.5)), 2.0, "fast")
    try:
        runner.part(perturbed)
        said = "not refused"
    except ValueError as refused:
        said = str(refused)
    refusals: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(refusals, said)
    if dist.get_rank() == 0:
        print(json.dumps({"world": dist.get_world_size(), "steps": steps, "perturbed": refusals}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
