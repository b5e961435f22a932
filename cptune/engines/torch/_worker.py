"""One rank of the torch engine (run by mpiexec or by the driver, never by users).

The serving loop and its socket to the driver are the shared ``RankServer``'s
(``cptune.engines._worker``); MPI plays no part but starting the processes. A pool's ranks
join one ``torch.distributed`` world (gloo on the CPU, NCCL with one GPU per rank by local
rank on a GPU node) through a TCPStore the driver holds, and make, all together, every
process group a configuration or a calibration of up to that many ranks uses
(``torch.distributed.new_group`` is collective over the world; a task reaches only the ranks
it runs on). Ranks the user launched with torchrun join the same way: rank 0 started by the
driver, the others serving from their own cptune (``serve_launched``; the driver's side is
``_launch``).

"run" receives a configuration and this rank's shard, runs the strategy once on ``TorchOps``
and returns its output shard; "time" repeats it: each iteration starts at a barrier of its
ranks (after the device is idle), wall time by CUDA events on a GPU, the compute and
communication split from ``TorchOps``' clock. A training workload's "run" (``TrainTask``)
also gets the output's gradient, runs the forward and the backward and returns the output
and the gradients of Q, K and V; its "time" adds the forward's wall time. "time_collective"
and "time_attention" are the calibration ops. A run's and an attention timing's reply name
what they ran with (``TorchRank.ran_with``): the kernels, the process group, on a GPU cuDNN and
NCCL.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cptune.config import CPConfig
from cptune.engines import _protocol as protocol
from cptune.engines._worker import (
    RankServer,
    connect_to_driver,
    kill_when_gone,
    serve_until_done,
)
from cptune.engines.torch._frameworks import CALLS
from cptune.engines.torch._implementations import IMPLEMENTATIONS, refusal
from cptune.engines.torch._kernels import CHOOSER, software
from cptune.engines.torch._launch import (
    Launched,
    driver_address,
    launched_ranks,
    launched_world,
)
from cptune.engines.torch._ops import (
    TORCH_DTYPES,
    TorchOps,
    attend,
    attend_grad,
    exchange_all_gather,
    exchange_all_to_all,
    ring_step,
    strategy_inputs,
)
from cptune.layout import SequenceLayout, context_group_members, head_group_members
from cptune.masks import Mask
from cptune.strategies import Saved, run_backward, run_forward, run_strategy
from cptune.strategies.primitives import HEADS, SEQ
from cptune.workload import Workload

#: How long a rank waits on the driver's store (for the others to join).
STORE_TIMEOUT = datetime.timedelta(hours=1)
#: Heads of the K/V tensor calibration exchanges (as the mpi engine's calibration).
_CHUNK_HEADS = 4


def group_members(world: int) -> list[tuple[int, ...]]:
    """Every group of two or more ranks a task on up to ``world`` ranks uses, once each in
    one order: the first r ranks, and each configuration's head and context groups."""
    found: dict[tuple[int, ...], None] = {}
    for ranks in range(2, world + 1):
        found[tuple(range(ranks))] = None
        for head_group in (u for u in range(1, ranks + 1) if ranks % u == 0):
            for rank in range(ranks):
                heads = head_group_members(rank, head_group)
                for members in (heads, context_group_members(rank, head_group, ranks)):
                    if len(members) > 1:
                        found[tuple(members)] = None
    return list(found)


def rss_bytes(field: str) -> int:
    """``VmHWM`` (peak) or ``VmRSS`` (now) of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Start a new peak resident size for this process (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def local_device(local_rank: int) -> torch.device:
    """This rank's GPU: its local rank modulo the GPUs it sees, so that a launcher giving each
    task one visible GPU (``srun --gpus-per-task=1``: every task sees its own as GPU 0) works
    as well as one showing them all."""
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def join_world(store: dist.Store, rank: int, size: int, local_rank: int) -> tuple[torch.device, str]:
    """Join the ``torch.distributed`` world rendezvousing in ``store`` as ``rank`` of ``size``:
    NCCL with this rank's GPU (``local_device``) where PyTorch sees CUDA, gloo on the CPU
    otherwise. Returns this rank's device and the backend."""
    if torch.cuda.is_available():
        device = local_device(local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    return device, backend


def store_at(address: str, prefix: str) -> dist.Store:
    """The driver's key-value store at host:port ``address``, keys under ``prefix``."""
    host, _, port = address.rpartition(":")
    return dist.PrefixStore(prefix, dist.TCPStore(host, int(port), is_master=False, timeout=STORE_TIMEOUT))


class TorchRank(RankServer):
    """The serving loop of one torch rank, in the world it joined (``join_world``), with
    every process group a task may use."""

    def __init__(self, sock: socket.socket, device: torch.device, backend: str) -> None:
        super().__init__(sock, dist.get_rank())
        self.device, self.backend = device, backend
        self.groups = {tuple(m): dist.new_group(list(m)) for m in group_members(dist.get_world_size())}
        self.task: RankTask | None = None

    def hello_facts(self) -> dict[str, str]:
        return {"mpi_library": f"torch.distributed {self.backend}"}

    def ran_with(self) -> dict[str, str]:
        """The kernels that ran since the chooser was last asked (on a GPU, those its probe
        chose), this world's process group and on a GPU the cuDNN and NCCL versions: what a
        run's or an attention timing's reply tells the driver."""
        return {"kernel": CHOOSER.take_used(), "process_group": self.backend, **software()}

    def group(self, members: Sequence[int]) -> dist.ProcessGroup | None:
        """The process group of ``members`` (None: this rank alone)."""
        return None if len(members) == 1 else self.groups[tuple(members)]

    def sync(self) -> None:
        """Wait for this rank's device to finish what was queued."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self, ranks: int) -> None:
        """All of the first ``ranks`` ranks here, their devices idle."""
        self.sync()
        if ranks > 1:
            dist.barrier(group=self.groups[tuple(range(ranks))])

    def handle(self, header: dict, arrays: list[np.ndarray]) -> protocol.Message:
        op = header["op"]
        if op == "run":
            torch.set_num_threads(int(header["threads"]))
            task = (FrameworkTask if header.get("implementation")
                    else TrainTask if Workload(**header["workload"]).training else RankTask)
            self.task = task(self, header, arrays)
            return self.task.run_once()
        if op == "time":
            if self.task is None:
                raise RuntimeError("'time' before any 'run'")
            return self.task.time(header["warmup"], header["repeats"])
        if op == "time_collective":
            return {}, [self.time_each(header["ranks"], self._collectives(header), header)]
        if op == "time_attention":
            torch.set_num_threads(int(header["threads"]))
            CHOOSER.take_used()
            cases = [self._attention(shape) for shape in header["shapes"]]
            timings = self.time_each(header["ranks"], cases, header)
            return self.ran_with(), [timings]
        raise RuntimeError(f"unknown op {op!r}")

    def time_each(self, ranks: int, cases: Sequence[Callable[[], object]], header: dict) -> np.ndarray:
        """Seconds [case, iteration] on this rank, every iteration started at a barrier and
        timed until the device is done."""
        warmup, repeats = header["warmup"], header["repeats"]
        timings = np.zeros((len(cases), repeats))
        for c, case in enumerate(cases):
            for i in range(warmup + repeats):
                self.barrier(ranks)
                start = time.perf_counter()
                case()
                self.sync()
                if i >= warmup:
                    timings[c, i - warmup] = time.perf_counter() - start
        return timings

    def _collectives(self, header: dict) -> list[Callable[[], object]]:
        """One ``kind`` collective per chunk size, in groups of ``group`` consecutive ranks,
        as ``TorchOps`` runs it: all-to-all and all-gather with their copies into send order
        and out of receive order, the Ring's stream step as one send and one receive."""
        kind, ranks, group = header["kind"], header["ranks"], header["group"]
        if header.get("along", "heads") == "heads":
            pg = self.group(head_group_members(self.rank, group))
        else:  # strided, as the context groups of head groups of ranks / group
            pg = self.group(context_group_members(self.rank, ranks // group, ranks))
        assert pg is not None, "collectives are timed in groups of two or more ranks"
        members = dist.get_world_size(pg)
        cases: list[Callable[..., object]] = []  # lambdas binding their tensors as defaults
        for chunk in header["chunks"]:
            rows = max(1, int(chunk) // (2 * _CHUNK_HEADS))
            if kind == "all_to_all":
                shape = (2, _CHUNK_HEADS * members, rows, 1)
                tensor = torch.ones(shape, dtype=torch.uint8, device=self.device)
                cases.append(lambda t=tensor: exchange_all_to_all(pg, t, HEADS, SEQ, t.dtype))
            elif kind == "all_gather":
                block = torch.ones((2, _CHUNK_HEADS, rows, 1), dtype=torch.uint8, device=self.device)
                cases.append(lambda b=block: exchange_all_gather(pg, b, SEQ, b.dtype))
            elif kind == "p2p":
                send = torch.ones(int(chunk), dtype=torch.uint8, device=self.device)
                received = torch.empty_like(send)
                cases.append(lambda s=send, r=received: [w.wait() for w in ring_step(pg, s, r)])
            else:
                raise ValueError(f"unknown collective {kind!r}")
        return cases

    def _attention(self, shape: dict[str, int]) -> Callable[[], object]:
        """The kernel on random inputs of ``shape`` (heads, seq_q, seq_k, head_dim, causal) as
        ``TorchOps`` runs it, or its backward where ``shape["backward"]``; causal queries sit
        at the last seq_q key positions. float32 on
        the CPU, bfloat16 on a GPU (what each serves in)."""
        h, sq, sk, d = shape["heads"], shape["seq_q"], shape["seq_k"], shape["head_dim"]
        causal = bool(shape.get("causal", False))
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        generator = torch.Generator(device=self.device).manual_seed(0)
        q = torch.randn((1, h, sq, d), generator=generator, device=self.device).to(dtype)
        kv = torch.randn((2, 1, h, sk, d), generator=generator, device=self.device).to(dtype)
        q_pos, k_pos, mask = np.arange(sk - sq, sk), np.arange(sk), Mask(sk, causal)
        if not shape.get("backward"):
            return lambda: attend(q, kv, q_pos, k_pos, mask)
        saved = attend(q, kv, q_pos, k_pos, mask)
        dout = torch.randn(saved.out.shape, generator=generator, device=self.device).to(dtype)
        return lambda: attend_grad(q, kv, dout, saved, q_pos, k_pos, mask)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankTask:
    """One configuration on this rank: its inputs on the device, its groups, and how to run it."""

    def __init__(self, rank: TorchRank, header: dict, arrays: list[np.ndarray]) -> None:
        self.rank = rank
        self.workload = Workload(**header["workload"])
        self.config = CPConfig(**header["config"])
        self.layout = SequenceLayout(self.workload, self.config)
        me = rank.rank
        self.groups = {
            "heads": rank.group(head_group_members(me, self.config.head_group)),
            "context": rank.group(context_group_members(me, self.config.head_group, self.config.ranks)),
        }
        dtype = TORCH_DTYPES[self.workload.dtype]
        q, k, v = (torch.from_numpy(a).to(rank.device, dtype) for a in arrays)  # [batch, seq, heads, dim]
        self.q, self.kv = strategy_inputs(q, k, v)  # as a deployment passes them
        self.input_bytes = self.q.nbytes + self.kv.nbytes

    def iteration(self) -> tuple[torch.Tensor, TorchOps | None]:
        """One run: the output shard [batch, heads, seq, head_dim] and the ops whose clock
        split it (None: no split)."""
        ops = TorchOps(self.workload, self.groups, self.rank.device)
        out = run_strategy(ops, self.layout, self.rank.rank, self.q, self.kv)
        return out.to(TORCH_DTYPES[self.workload.dtype]), ops

    def run_once(self) -> protocol.Message:
        """Run once: the output shard (float32, [batch, seq, heads, head_dim]), the peak bytes
        held (device memory on a GPU; on the CPU the resident growth over the inputs, which
        the allocator may round up), the kernels that ran (on a GPU, chosen by their probe on
        this first run, and the cuDNN and NCCL versions)."""
        CHOOSER.take_used()
        device = self.rank.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            baseline = rss_bytes("VmRSS")
            measured = reset_peak_rss()
        outputs = self.outputs()
        self.rank.sync()
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = self.input_bytes + (max(0, rss_bytes("VmHWM") - baseline) if measured else 0)
        shards = [out.transpose(1, 2).float().cpu().numpy() for out in outputs]
        return {"peak_bytes": int(peak), **self.rank.ran_with()}, shards

    def outputs(self) -> list[torch.Tensor]:
        """One run's tensors to return, [batch, heads, seq, head_dim] each: the output."""
        out, _ = self.iteration()
        return [out]

    def time(self, warmup: int, repeats: int) -> protocol.Message:
        """Per timed iteration: wall, compute and communication seconds on this rank; every
        iteration starts at a barrier, its wall time ends when this rank's device is done."""
        timings = np.zeros((repeats, 3), dtype=np.float64)
        cuda = self.rank.device.type == "cuda"
        for i in range(warmup + repeats):
            self.rank.barrier(self.config.ranks)
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            else:
                start = time.perf_counter()
            _, ops = self.iteration()
            if cuda:
                end.record()
                end.synchronize()
                wall = begin.elapsed_time(end) / 1e3
            else:
                wall = time.perf_counter() - start
            if i >= warmup:
                timings[i - warmup] = (wall, *(ops.clock.totals() if ops else (np.nan, np.nan)))
        return {}, [timings]


class FrameworkTask(RankTask):
    """A framework's own attention (``_frameworks``, named by the header's "implementation")
    on this rank's contiguous shard, in place of the strategy: no compute and communication
    split (the framework's calls are not on ``TorchOps``' clock)."""

    def __init__(self, rank: TorchRank, header: dict, arrays: list[np.ndarray]) -> None:
        super().__init__(rank, header, arrays)
        self.name = header["implementation"]
        problem = refusal(self.name, self.workload, self.config)
        if problem:
            raise ValueError(problem)
        dtype = TORCH_DTYPES[self.workload.dtype]
        self.qkv = [torch.from_numpy(a).to(rank.device, dtype).contiguous() for a in arrays]

    def iteration(self) -> tuple[torch.Tensor, TorchOps | None]:
        q, k, v = self.qkv
        out = CALLS[self.name](q, k, v, self.groups["heads"], self.groups["context"], self.workload.causal)
        return out.to(TORCH_DTYPES[self.workload.dtype]), None

    def run_once(self) -> protocol.Message:
        """``RankTask.run_once``, the reply naming the implementation that ran."""
        header, shards = super().run_once()
        return {**header, "implementation": IMPLEMENTATIONS[self.name].label(self.rank.device.type)}, shards


def held_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the storage behind ``tensors``, each storage once (views share theirs)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class TrainTask(RankTask):
    """One configuration's training run on this rank: the forward (``run_forward``, keeping
    what the backward needs) and the backward (``run_backward``) from the output's gradient,
    the run's fourth array (zero on padding rows)."""

    def __init__(self, rank: TorchRank, header: dict, arrays: list[np.ndarray]) -> None:
        super().__init__(rank, header, arrays[:3])
        dout = torch.from_numpy(arrays[3]).to(rank.device, TORCH_DTYPES[self.workload.dtype])
        # [batch, heads, seq, head_dim] as q: a view on CUDA, one copy elsewhere (strategy_inputs)
        self.dout = dout.transpose(1, 2) if rank.device.type == "cuda" else dout.transpose(1, 2).contiguous()
        self.input_bytes += self.dout.nbytes
        self.held_bytes = self.input_bytes

    def forward(self, ops: TorchOps) -> tuple[torch.Tensor, Saved]:
        """The forward: this rank's output shard in the workload's dtype, and what the backward needs."""
        out, saved = run_forward(ops, self.layout, self.rank.rank, self.q, self.kv)
        return out.to(TORCH_DTYPES[self.workload.dtype]), saved

    def backward(self, ops: TorchOps, saved: Saved) -> tuple[torch.Tensor, torch.Tensor]:
        """The backward: this rank's shards of dQ and of dK/dV (packed as K/V)."""
        return run_backward(ops, self.layout, self.rank.rank, saved, self.dout)

    def outputs(self) -> list[torch.Tensor]:
        """The output, dQ, dK and dV; the peak ``run_once`` reads covers the forward's saved
        tensors, held through the backward (``held_bytes``: at least them)."""
        ops = TorchOps(self.workload, self.groups, self.rank.device)
        out, saved = self.forward(ops)
        dq, dkv = self.backward(ops, saved)
        self.held_bytes = held_bytes([self.q, self.kv, self.dout, saved.q, saved.kv, *saved.result,
                                      out, dq, dkv])
        return [out, dq, dkv[0], dkv[1]]

    def run_once(self) -> protocol.Message:
        """``RankTask.run_once`` for the forward and the backward; on the CPU, whose resident
        growth misses what the allocator had at hand, the peak is at least the inputs, the
        forward's saved tensors and the gradients, all held at the backward's end."""
        header, shards = super().run_once()
        if self.rank.device.type != "cuda":
            header["peak_bytes"] = max(int(header["peak_bytes"]), self.held_bytes)
        return header, shards

    def time(self, warmup: int, repeats: int) -> protocol.Message:
        """Per timed iteration: wall (forward and backward), compute and communication
        seconds on this rank, and the forward's wall time; every iteration starts at a
        barrier, its wall times end when this rank's device is done with each part."""
        timings = np.zeros((repeats, 4), dtype=np.float64)
        cuda = self.rank.device.type == "cuda"
        for i in range(warmup + repeats):
            self.rank.barrier(self.config.ranks)
            ops = TorchOps(self.workload, self.groups, self.rank.device)
            if cuda:
                begin, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                begin.record()
            else:
                start = time.perf_counter()
            _, saved = self.forward(ops)
            if cuda:
                middle.record()
            else:
                forward = time.perf_counter() - start
            self.backward(ops, saved)
            if cuda:
                end.record()
                end.synchronize()
                wall, forward = begin.elapsed_time(end) / 1e3, begin.elapsed_time(middle) / 1e3
            else:
                wall = time.perf_counter() - start
            del saved
            if i >= warmup:
                timings[i - warmup] = (wall, *ops.clock.totals(), forward)
        return {}, [timings]


def serve_launched(launch: Launched) -> None:
    """Serve as launched rank ``launch.rank`` > 0 once the driver needs it; returns (and the
    process exits) when the driver never does."""
    driver = driver_address(launch)
    if driver is None:
        return
    # the token is shown in this rank's hello; the driver's machine says whose host lock to take
    address, os.environ[protocol.TOKEN_VARIABLE], os.environ[protocol.DRIVER_MACHINE_VARIABLE] = driver
    device, backend = join_world(launched_world(launch), launch.rank, launch.size, launch.local_rank)
    serve_until_done(TorchRank(connect_to_driver(address), device, backend))


def main(argv: list[str] | None = None) -> None:
    """One rank of a pool mpiexec started (its rank in PMI_RANK), or rank 0 of a world the
    user launched with torchrun, started by the driver (``_launch``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="the driver's Unix socket or tcp://host:port (ranks mpiexec started)")
    where.add_argument("--driver", help="the driver's tcp://host:port (rank 0 of launched ranks)")
    parser.add_argument("--driver-pid", type=int, required=True)
    args = parser.parse_args(argv)
    if args.socket:
        rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
        store = store_at(os.environ["CPTUNE_TORCH_STORE"], os.environ["CPTUNE_TORCH_WORLD"])
        device, backend = join_world(store, rank, size, int(os.environ.get("MPI_LOCALRANKID", rank)))
        sock = connect_to_driver(args.socket, args.driver_pid)
    else:  # rank 0 of ranks the user launched: the others join from their own cptune (serve_launched)
        kill_when_gone(args.driver_pid)
        launch = launched_ranks()
        assert launch is not None and launch.rank == 0
        device, backend = join_world(launched_world(launch), 0, launch.size, launch.local_rank)
        sock = protocol.connection(args.driver)
    serve_until_done(TorchRank(sock, device, backend))


if __name__ == "__main__":
    main()
