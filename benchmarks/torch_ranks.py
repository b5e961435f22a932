"""Every configuration on N ranks through the strategies on ``TorchOps``, as the torch engine's
ranks run them, over gloo: on the CPU, or with CUDA tensors on GPUs the ranks may share (NCCL
refuses two ranks on one GPU; gloo carries CUDA tensors). A correctness run: its exchange
times are not NCCL's and nothing is stored. Launch it with

    python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/torch_ranks.py [--device cuda]

(``tests/test_torch_engine.py`` runs it on 2-4 CPU ranks; ``gpu_check.py`` on 2 and 4 ranks
sharing one GPU, where the Ring's send/recv and AllGather-KV's all-gather go through host
copies, ``staging_through_the_host``, and the all-to-all takes the CUDA tensors). Each
configuration (MHA, GQA and MQA; causal and not; each ``--dtypes``; a length that needs
padding) runs twice on the same input tensors, as the engine's timed iterations do after its
checked run, and each run's output is compared with the float64 reference. The fused kernel
calls are counted for each attention step (one ``TorchOps.attention``). Rank 0 prints one
JSON line: {"world": N, "device": ..., "cases": [{"config", "workload", "errors": [first run,
second run, with ``--train`` a training step's output and gradients] (the largest relative
error on any rank), "calls": [[calls per step] for each
rank], "failed": null or the error}]}.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from cptune.config import CPConfig
from cptune.engines.torch import _ops
from cptune.engines.torch._worker import group_members, local_device
from cptune.feasibility import enumerate_configs
from cptune.layout import SequenceLayout, context_group_members, head_group_members
from cptune.reference import (
    make_inputs,
    make_output_gradient,
    reference_attention,
    reference_gradients,
    relative_error,
)
from cptune.strategies import run_backward, run_forward, run_strategy
from cptune.workload import Workload


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


class _Staged:
    """A point-to-point step run on host copies: waiting on it copies what arrived back."""

    def __init__(self, works: list, arrived: torch.Tensor, receive: torch.Tensor) -> None:
        self.works, self.arrived, self.receive = works, arrived, receive

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.receive.copy_(self.arrived)


def staging_through_the_host() -> None:
    """Run the Ring's send/recv and AllGather-KV's all-gather on host copies of the GPU
    tensors (gloo's point-to-point and all-gather-into-tensor may not take CUDA tensors); the
    all-to-all takes them as they are. The copies are the harness's, not the engine's."""
    ring_step, gather, scatter = _ops.ring_step, _ops._all_gather_single, _ops._reduce_scatter_single

    def staged_ring_step(group: dist.ProcessGroup, send: torch.Tensor, receive: torch.Tensor,
                         tag: int = 0, shift: int = 1) -> list:
        arrived = torch.empty(receive.shape, dtype=receive.dtype)
        return [_Staged(ring_step(group, send.cpu(), arrived, tag, shift), arrived, receive)]

    def staged_gather(received: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup) -> None:
        arrived = torch.empty(received.shape, dtype=received.dtype)
        gather(arrived, send.cpu(), group=group)
        received.copy_(arrived)

    def staged_scatter(received: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup) -> None:
        arrived = torch.empty(received.shape, dtype=received.dtype)
        scatter(arrived, send.cpu(), group=group)
        received.copy_(arrived)

    _ops.ring_step = staged_ring_step  # type: ignore[assignment]
    _ops._all_gather_single = staged_gather  # type: ignore[assignment]
    _ops._reduce_scatter_single = staged_scatter  # type: ignore[assignment]


def workloads(seq_len: int, heads: int, head_dim: int, dtypes: Sequence[str]) -> list[Workload]:
    """MHA, GQA (half the heads as KV heads) and MQA, causal and not, in each dtype."""
    return [Workload(seq_len=seq_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                     causal=causal)
            for dtype in dtypes for causal in (False, True) for kv_heads in (heads, max(1, heads // 2), 1)]


def run_case(workload: Workload, config: CPConfig, inputs: tuple[np.ndarray, ...],
             references: tuple[np.ndarray, ...], groups: dict, device: torch.device,
             steps: list[int]) -> tuple[list[float], list[int]]:
    """``config`` twice on the same tensors: each run's relative error on this rank, and the
    calls of each step of the last run; given the output's gradient (a 4th input, and the
    reference gradients after the reference output), a training step after them: its largest
    relative error of the output and dQ, dK, dV on this rank."""
    rank = dist.get_rank()
    layout = SequenceLayout(workload, config)
    positions = layout.rank_positions(rank)
    real = positions < workload.seq_len
    taken = np.minimum(positions, workload.seq_len - 1)  # padding rows: any token, masked
    dtype = _ops.TORCH_DTYPES[workload.dtype]
    q, k, v, *dout = (torch.from_numpy(x[:, taken]).to(device, dtype) for x in inputs)
    heads_q, kv = _ops.strategy_inputs(q, k, v)
    members = {"heads": head_group_members(rank, config.head_group),
               "context": context_group_members(rank, config.head_group, config.ranks)}
    ops_groups = {name: groups[tuple(m)] if len(m) > 1 else None for name, m in members.items()}
    errors = []
    for _ in range(2):  # the same tensors twice, as timed iterations reuse them
        del steps[:]
        ops = _ops.TorchOps(workload, ops_groups, device)
        out = _ops.model_output(run_strategy(ops, layout, rank, heads_q, kv), torch.float32).cpu().numpy()
        errors.append(relative_error(out[:, real], references[0][:, positions[real]]))
    calls = list(steps)
    if dout:
        ops = _ops.TorchOps(workload, ops_groups, device)
        out, saved = run_forward(ops, layout, rank, heads_q, kv)
        grad = dout[0].masked_fill(torch.from_numpy(~real).to(device)[None, :, None, None], 0.0)  # padding: 0
        dq, dkv = run_backward(ops, layout, rank, saved, grad.transpose(1, 2).contiguous())
        trained = [_ops.model_output(x, torch.float32).cpu().numpy() for x in (out, dq, dkv[0], dkv[1])]
        errors.append(max(relative_error(x[:, real], expected[:, positions[real]])
                          for x, expected in zip(trained, references, strict=True)))
    return errors, calls


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: every rank's GPU is its "
                        "local rank modulo the GPUs it sees")
    parser.add_argument("--seq-len", type=int, default=37, help="tokens (default 37: pads under any split)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--dtypes", default="fp32", help="comma-separated (default fp32)")
    parser.add_argument("--train", action="store_true", help="also a training step of each configuration: "
                        "its output and gradients of Q, K and V against the float64 reference")
    parser.add_argument("--stage", action="store_true", help="send/recv and all-gather through host copies "
                        "(always with --device cuda; on the CPU: to try the staging itself)")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = args.device == "cuda"
    device = local_device(int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda or args.stage:
        staging_through_the_host()
    groups = {members: dist.new_group(list(members)) for members in group_members(world)}
    steps = counting()
    cases = []
    for workload in workloads(args.seq_len, args.heads, args.head_dim, args.dtypes.split(",")):
        inputs: tuple[np.ndarray, ...] = make_inputs(workload)
        references: tuple[np.ndarray, ...] = (reference_attention(workload, *inputs),)
        if args.train:
            dout = make_output_gradient(workload)
            references += reference_gradients(workload, *inputs, dout)
            inputs += (dout,)
        for config in enumerate_configs(workload, world):
            if config.ranks != world:
                continue
            case: dict = {"config": config.label, "workload": workload.describe(), "failed": None}
            try:
                errors, calls = run_case(workload, config, inputs, references, groups, device, steps)
            except Exception as error:  # noqa: BLE001 - reported, the next configuration runs
                errors, calls = [float("nan")] * (3 if args.train else 2), []
                case["failed"] = f"{type(error).__name__}: {error}"
            case["errors"] = [max(e.item() for e in _gathered([x])) for x in errors]
            case["calls"] = _gathered_lists(calls, world)
            cases.append(case)
    if rank == 0:
        print(json.dumps({"world": world, "device": str(device), "cases": cases}), flush=True)
    dist.destroy_process_group()


def _gathered(values: list[float]) -> torch.Tensor:
    """Every rank's ``values``."""
    mine = torch.tensor(values, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.cat(every)


def _gathered_lists(values: list[int], world: int) -> list[list[int]]:
    """Every rank's list of counts."""
    length = torch.tensor([len(values)])
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    mine = torch.full((int(max(x.item() for x in lengths)),), -1, dtype=torch.int64)
    mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [[int(x) for x in row.tolist() if x >= 0] for row in every]


if __name__ == "__main__":
    main()
