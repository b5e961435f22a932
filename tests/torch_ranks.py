"""Every configuration on N gloo ranks through the strategies on ``TorchOps``, as the torch
engine's ranks run them (tests/test_torch_engine.py launches it with ``python -m
torch.distributed.run --standalone --nproc-per-node N torch_ranks.py``).

Each configuration (MHA, GQA and MQA; causal and not; a length that needs padding) runs twice
on the same input tensors, as the engine's timed iterations do after its checked run, and
each run's output is compared with the float64 reference. The fused kernel calls are counted
for each attention step (one ``TorchOps.attention``). Rank 0 prints one JSON line:
{"world": N, "cases": [{"config", "workload", "errors": [first run, second run], "calls":
[[calls per step, on rank r] for each rank r]}]}.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.distributed as dist

from cptune.engines.torch import _ops
from cptune.engines.torch._worker import group_members
from cptune.feasibility import enumerate_configs
from cptune.layout import SequenceLayout, context_group_members, head_group_members
from cptune.reference import make_inputs, reference_attention, relative_error
from cptune.strategies import run_strategy
from cptune.workload import Workload

SEQ_LEN = 37  # pads under every split of 2-4 ranks


def counting() -> list[int]:
    """Count the fused kernel calls of each ``TorchOps.attention`` (a step) from now on."""
    steps: list[int] = []
    kernel, attention = _ops.fused_attention, _ops.TorchOps.attention

    def counted_kernel(*args: object, **kwargs: object) -> object:
        steps[-1] += 1
        return kernel(*args, **kwargs)

    def counted_attention(self: _ops.TorchOps, *args: object, **kwargs: object) -> object:
        steps.append(0)
        return attention(self, *args, **kwargs)

    _ops.fused_attention = counted_kernel  # type: ignore[assignment]
    _ops.TorchOps.attention = counted_attention  # type: ignore[method-assign]
    return steps


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {members: dist.new_group(list(members)) for members in group_members(world)}
    steps = counting()
    cases = []
    for causal in (False, True):
        for kv_heads in (4, 2, 1):
            workload = Workload(seq_len=SEQ_LEN, heads=4, kv_heads=kv_heads, head_dim=8, dtype="fp32",
                                causal=causal)
            q, k, v = make_inputs(workload)
            reference = reference_attention(workload, q, k, v)
            for config in enumerate_configs(workload, world):
                if config.ranks != world:
                    continue
                layout = SequenceLayout(workload, config)
                positions = layout.rank_positions(rank)
                real = positions < SEQ_LEN
                taken = np.minimum(positions, SEQ_LEN - 1)  # padding rows: any token, masked
                shard_q, shard_k, shard_v = (torch.from_numpy(x[:, taken]) for x in (q, k, v))
                local_q = shard_q.transpose(1, 2).contiguous()
                kv = torch.stack([shard_k, shard_v]).transpose(2, 3).contiguous()
                mine = {
                    "heads": head_group_members(rank, config.head_group),
                    "context": context_group_members(rank, config.head_group, config.ranks),
                }
                ops_groups = {name: groups[tuple(m)] if len(m) > 1 else None for name, m in mine.items()}
                errors, calls = [], []
                for _ in range(2):  # the same tensors twice, as timed iterations reuse them
                    del steps[:]
                    ops = _ops.TorchOps(workload, ops_groups, torch.device("cpu"))
                    out = run_strategy(ops, layout, rank, local_q, kv).float().transpose(1, 2).numpy()
                    error = relative_error(out[:, real], reference[:, positions[real]])
                    errors.append(max(e.item() for e in _gathered(error)))
                    calls = list(steps)
                cases.append({"config": config.label, "workload": workload.describe(), "errors": errors,
                              "calls": [list(map(int, c)) for c in _gathered_lists(calls, world)]})
    if rank == 0:
        print(json.dumps({"world": world, "cases": cases}))
    dist.destroy_process_group()


def _gathered(value: float) -> torch.Tensor:
    """Every rank's ``value``."""
    mine = torch.tensor([value], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.cat(every)


def _gathered_lists(values: list[int], world: int) -> list[list[int]]:
    """Every rank's list of counts (padded with -1 to the longest)."""
    length = torch.tensor([len(values)])
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    longest = int(max(x.item() for x in lengths))
    mine = torch.full((longest,), -1, dtype=torch.int64)
    mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [[int(x) for x in row if x >= 0] for row in (t.tolist() for t in every)]


if __name__ == "__main__":
    main()
