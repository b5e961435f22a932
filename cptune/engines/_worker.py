"""One rank of the engines' worker pool (run by mpiexec, never by users).

Each rank connects to the driver's socket, then serves tasks until told to exit: "run"
receives a configuration and this rank's input shard, runs it once with the engine the
request names (``RANK_TASKS``: every engine's ranks live in this one supervised pool) and
returns its output shard; "time" repeats the same run with warm-up and returns
per-iteration timings. "time_collective", "time_attention" and "time_steps" time one
collective over a sweep of message sizes, the attention kernel on a few shapes, or the
kernel's memory-bound steps (the work over a query block a Ring step repeats), for
calibration. Ranks that a task
does not use wait on their socket, asleep. A watchdog exits the rank as soon as the driver
process is gone, whatever the rank is doing.

Each rank fixes its allocator as it starts (``steady_allocator``): left to itself, glibc's malloc
decides from what a process freed earlier whether an iteration's arrays come from reused
heap or from fresh pages that fault on first touch, so one configuration's latency
depended on what its rank ran before it.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import select
import socket
import sys
import threading
import time
import traceback
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from cptune.config import CPConfig
from cptune.engines import _numpy_kernels as kernels
from cptune.engines import _protocol as protocol
from cptune.layout import SequenceLayout
from cptune.strategies import run_strategy
from cptune.strategies.primitives import HEADS, SEQ, Group, Partial
from cptune.workload import Workload


def _exit_when_gone(pid: int) -> None:
    """Block until process ``pid`` exits, then end this process at once."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(3)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll()
    os._exit(3)


#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Blocks up to this size come from the heap: glibc's largest mmap threshold.
STEADY_MMAP_THRESHOLD = 32 * 2**20
#: Free memory kept at the top of the heap between iterations instead of returned to the
#: system (mallopt's largest, 2 GiB); a task's end returns it (``release_free_memory``).
STEADY_TRIM_THRESHOLD = 2**31 - 1


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def steady_allocator() -> bool:
    """Make a timed iteration's allocations independent of the rank's history; False where
    the C library is not glibc (nothing to fix there).

    glibc serves a block above its mmap threshold with fresh pages, which fault on first
    touch (about 3 us per 4 KiB page on the VMs here), returns the heap's top to the system
    once more than twice that threshold lies free there, and raises the threshold whenever
    an mmapped block is freed. So whether an iteration's arrays fault depended on what the
    rank had freed before: in one pool the same AllGather-KV iteration faulted 1248 pages
    per iteration in one round and none in the next, 15% of its latency, and Ulysses looked
    6-7% faster than AllGather-KV, which the prior puts level. Fixed thresholds (which also stop
    the raising) keep freed blocks up to 32 MiB for the next iteration, as a steady-state
    deployment's caching allocator does; larger ones are mmapped every time alike."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, STEADY_TRIM_THRESHOLD))


def release_free_memory() -> None:
    """Return the heap's free memory to the system (after a task: an idle rank holds none)."""
    if (trim := getattr(_libc(), "malloc_trim", None)) is not None:
        trim(0)


def in_send_order(x: np.ndarray, split_axis: int, members: int, wire: np.dtype) -> np.ndarray:
    """``x`` cut into ``members`` chunks along ``split_axis``, chunk j first: the contiguous
    [members, ...] buffer an all-to-all sends, in ``wire`` dtype (one copy, cast included)."""
    split = split_axis % x.ndim
    chunked = x.reshape(x.shape[:split] + (members, x.shape[split] // members) + x.shape[split + 1 :])
    return np.ascontiguousarray(np.moveaxis(chunked, split, 0), dtype=wire)


def out_of_receive_order(received: np.ndarray, axis: int) -> np.ndarray:
    """The members' arrivals (``received[j]`` from member j) joined along ``axis`` of one
    arrival: a copy, unless every dim before ``axis`` is 1 (then a view)."""
    axis %= received.ndim - 1
    shape = list(received.shape[1:])
    shape[axis] *= received.shape[0]
    return np.moveaxis(received, 0, axis).reshape(shape)


def exchange_all_to_all(comm: MPI.Comm, x: np.ndarray, split_axis: int, concat_axis: int,
                        wire: np.dtype) -> np.ndarray:
    """Member j gets chunk j of ``x`` along ``split_axis``; the arrivals are joined along
    ``concat_axis``. With the copies into send order and out of receive order: the
    exchange as a strategy pays for it, which calibration times too."""
    send = in_send_order(x, split_axis, comm.Get_size(), wire)
    received = np.empty_like(send)
    comm.Alltoall([send, MPI.BYTE], [received, MPI.BYTE])
    return out_of_receive_order(received, concat_axis)


def exchange_all_gather(comm: MPI.Comm, x: np.ndarray, axis: int, wire: np.dtype) -> np.ndarray:
    """Every member's ``x`` joined along ``axis`` in member order, the copy out of receive
    order included (see ``exchange_all_to_all``)."""
    send = np.ascontiguousarray(x, dtype=wire)
    received = np.empty((comm.Get_size(), *send.shape), dtype=wire)
    comm.Allgather([send, MPI.BYTE], [received, MPI.BYTE])
    return out_of_receive_order(received, axis)


class MpiOps:
    """``Primitives`` on MPI communicators with numpy math; times compute and communication
    separately (``compute_s``, ``comm_s``: seconds this rank spent in each, communication
    counting only the time it waited, not transfers hidden behind compute)."""

    def __init__(self, workload: Workload, comms: dict[str, MPI.Comm], threads: int) -> None:
        self.workload = workload
        self.threads = threads
        self.wire = workload.wire_dtype
        self.comms = comms
        self.compute_s = 0.0
        self.comm_s = 0.0
        self._in_flight: list[MPI.Request] = []

    def _poll(self) -> None:
        MPI.Request.Testall(self._in_flight)

    def attention(self, q: np.ndarray, kv: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray) -> Partial:
        start = time.perf_counter()
        out, lse = kernels.attention(
            q, kv, q_pos, k_pos,
            causal=self.workload.causal,
            seq_len=self.workload.seq_len,
            threads=self.threads,
            poll=self._poll if self._in_flight else None,
        )
        self.compute_s += time.perf_counter() - start
        return Partial(out, lse)

    def merge(self, acc: Partial | None, part: Partial) -> Partial:
        start = time.perf_counter()
        merged = Partial(*kernels.merge(acc, part, self.threads))
        self.compute_s += time.perf_counter() - start
        return merged

    def repeat_heads(self, kv: np.ndarray, times: int) -> np.ndarray:
        start = time.perf_counter()
        repeated = np.repeat(kv, times, axis=HEADS)
        self.compute_s += time.perf_counter() - start
        return repeated

    def all_to_all(self, x: np.ndarray, group: Group, split_axis: int, concat_axis: int) -> np.ndarray:
        comm = self.comms[group]
        if comm.Get_size() == 1:
            return x
        start = time.perf_counter()
        out = exchange_all_to_all(comm, x, split_axis, concat_axis, self.wire)
        self.comm_s += time.perf_counter() - start
        return out

    def all_gather(self, x: np.ndarray, group: Group, axis: int) -> np.ndarray:
        comm = self.comms[group]
        if comm.Get_size() == 1:
            return x
        start = time.perf_counter()
        out = exchange_all_gather(comm, x, axis, self.wire)
        self.comm_s += time.perf_counter() - start
        return out

    def kv_stream(self, kv: np.ndarray, group: Group) -> Iterator[tuple[int, np.ndarray]]:
        """Ring order: at step t hold member (me - t)'s block, pass it on to me + 1 and take
        the next from me - 1 while the caller attends to it (progressed by ``_poll``)."""
        comm = self.comms[group]
        n, me = comm.Get_size(), comm.Get_rank()
        current = np.ascontiguousarray(kv, dtype=self.wire)
        incoming = np.empty_like(current) if n > 1 else current
        for step in range(n):
            if step < n - 1:
                self._in_flight = [
                    comm.Irecv([incoming, MPI.BYTE], source=(me - 1) % n),
                    comm.Isend([current, MPI.BYTE], dest=(me + 1) % n),
                ]
            yield (me - step) % n, current
            if self._in_flight:
                start = time.perf_counter()
                MPI.Request.Waitall(self._in_flight)
                self._in_flight = []
                self.comm_s += time.perf_counter() - start
                current, incoming = incoming, current


class RankTask:
    """One configuration on this rank: its inputs, communicators and how to run it."""

    def __init__(self, header: dict, arrays: list[np.ndarray], comms: dict[str, MPI.Comm], rank: int) -> None:
        self.threads = int(header["threads"])
        self.workload = Workload(**header["workload"])
        self.config = CPConfig(**header["config"])
        self.layout = SequenceLayout(self.workload, self.config)
        self.comms = comms
        self.rank = rank
        q, k, v = arrays  # [batch, seq, heads, head_dim] in the wire dtype
        self.q = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
        self.kv = np.ascontiguousarray(np.stack([k, v]).transpose(0, 1, 3, 2, 4))
        self.input_bytes = self.q.nbytes + self.kv.nbytes

    def iteration(self) -> tuple[np.ndarray, MpiOps]:
        ops = MpiOps(self.workload, self.comms, self.threads)
        out = run_strategy(ops, self.layout, self.rank, self.q, self.kv)
        return kernels.cast(out, self.workload.wire_dtype, self.threads), ops

    def run_once(self) -> protocol.Message:
        """Run once, tracing allocations: the output shard and the peak bytes held."""
        tracemalloc.start()
        tracemalloc.reset_peak()
        try:
            out, _ = self.iteration()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return {"peak_bytes": self.input_bytes + peak}, [out.transpose(0, 2, 1, 3)]

    def time(self, warmup: int, repeats: int) -> protocol.Message:
        """Per timed iteration: wall, compute and communication seconds on this rank. All
        ranks start each iteration together (barrier) so the slowest rank's wall time is the
        iteration's latency."""
        comm = self.comms["all"]
        timings = np.zeros((repeats, 3), dtype=np.float64)
        for i in range(warmup + repeats):
            comm.Barrier()
            start = time.perf_counter()
            _, ops = self.iteration()
            wall = time.perf_counter() - start
            if i >= warmup:
                timings[i - warmup] = (wall, ops.compute_s, ops.comm_s)
        return {}, [timings]


#: Heads of the K/V tensor calibration exchanges: a chunk is K and V of this many heads,
#: each a run of sequence rows of one byte.
_CHUNK_HEADS = 4


def _collective(kind: str, comm: MPI.Comm, chunk: int) -> Callable[[], object]:
    """One ``kind`` collective over ``comm`` as the strategies use it, ``chunk`` bytes per
    peer (rounded down to whole rows of its ``2 * _CHUNK_HEADS`` runs): all-to-all and
    all-gather send a chunk to each of the n - 1 others through the engine's own exchange,
    its copies into send order and out of receive order included; the Ring's stream step
    ("p2p") passes one chunk to the next rank while taking one from the previous, and copies
    nothing."""
    n, me = comm.Get_size(), comm.Get_rank()
    # shaped as a strategy's K/V block [K and V, heads, seq, 1 byte], so both copies move runs
    # of one sequence block (with leading dims of 1 they would be views)
    rows = max(1, chunk // (2 * _CHUNK_HEADS))
    if kind == "all_to_all":
        tensor = np.ones((2, _CHUNK_HEADS * n, rows, 1), np.uint8)
        return lambda: exchange_all_to_all(comm, tensor, HEADS, SEQ, tensor.dtype)
    if kind == "all_gather":
        block = np.ones((2, _CHUNK_HEADS, rows, 1), np.uint8)
        return lambda: exchange_all_gather(comm, block, SEQ, block.dtype)
    if kind == "p2p":
        send, received = np.ones(chunk, np.uint8), np.empty(chunk, np.uint8)
        return lambda: MPI.Request.Waitall([
            comm.Irecv([received, MPI.BYTE], source=(me - 1) % n),
            comm.Isend([send, MPI.BYTE], dest=(me + 1) % n),
        ])
    raise ValueError(f"unknown collective {kind!r}")


def _attention_case(shape: dict[str, int], threads: int) -> Callable[[], object]:
    """The kernel on random inputs of ``shape`` (heads, seq_q, seq_k, head_dim, causal); causal
    queries sit at the last seq_q key positions, a diagonal block."""
    rng = np.random.default_rng(0)
    h, sq, sk, d = shape["heads"], shape["seq_q"], shape["seq_k"], shape["head_dim"]
    causal = bool(shape.get("causal", False))
    q = rng.standard_normal((1, h, sq, d), dtype=np.float32)
    kv = rng.standard_normal((2, 1, h, sk, d), dtype=np.float32)
    q_pos, k_pos = np.arange(sk - sq, sk), np.arange(sk)
    return lambda: kernels.attention(q, kv, q_pos, k_pos, causal=causal, seq_len=sk, threads=threads)


def _step_case(step: dict[str, object], threads: int) -> Callable[[], object]:
    """One memory-bound step of the kernel on a random block of ``step``'s heads, rows and
    head_dim: "query" prepares a query block in wire dtype ``step["wire"]``
    (``kernels.prepare_query``), "merge" merges a float32 block's output into a running one
    (``kernels.merge``)."""
    rng = np.random.default_rng(0)
    heads, rows = int(step["heads"]), int(step["rows"])
    block = rng.standard_normal((1, heads, rows, int(step["head_dim"])), dtype=np.float32)
    if step["kind"] == "query":
        q = block.astype(np.dtype(str(step["wire"])))
        return lambda: kernels.prepare_query(q, threads)
    if step["kind"] == "merge":
        lse = rng.standard_normal((1, heads, rows), dtype=np.float32)
        running = (block.copy(), lse.copy())
        return lambda: kernels.merge(running, (block, lse), threads)
    raise ValueError(f"unknown step {step['kind']!r}")


def _time_each(
    cases: Sequence[Callable[[], object]], barrier: MPI.Comm, warmup: int, repeats: int
) -> np.ndarray:
    """Seconds [case, iteration] on this rank; every iteration starts at a barrier."""
    timings = np.zeros((len(cases), repeats))
    for c, case in enumerate(cases):
        for i in range(warmup + repeats):
            barrier.Barrier()
            start = time.perf_counter()
            case()
            if i >= warmup:
                timings[c, i - warmup] = time.perf_counter() - start
    return timings


#: Modules holding the rank side (a ``RankTask`` class) of engines other than "mpi", imported
#: on a rank's first run of that engine, so a rank loads only what its runs need.
RANK_TASKS: dict[str, str] = {"onnx": "cptune.engines._onnx_rank"}


def _task_class(engine: str) -> type:
    """The ``RankTask`` of ``engine``: built from a "run" request's header, arrays, the group
    communicators and this rank; it answers ``run_once()`` and ``time(warmup, repeats)``."""
    if engine == "mpi":
        return RankTask
    if engine not in RANK_TASKS:
        raise RuntimeError(f"unknown engine {engine!r}")
    return importlib.import_module(RANK_TASKS[engine]).RankTask


class Worker:
    """The serving loop of one rank."""

    def __init__(self, sock: socket.socket) -> None:
        self.world = MPI.COMM_WORLD
        self.sock = sock
        self.allocator = "steady" if steady_allocator() else "system default"
        self.rank = self.world.Get_rank()
        # A communicator for each task size: the first r ranks. Made once, collectively.
        self.prefix = [
            self.world.Split(0 if self.rank < r else MPI.UNDEFINED, self.rank)
            for r in range(1, self.world.Get_size() + 1)
        ]
        self.group_comms: dict[tuple[int, int], dict[str, MPI.Comm]] = {}
        self.task: Any = None  # the last run's RankTask, of whichever engine

    def hello(self) -> None:
        protocol.send(self.sock, {
            "rank": self.rank,
            "pid": os.getpid(),
            "parent_pid": os.getppid(),
            "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
            "allocator": self.allocator,
        })

    def comms_for(self, ranks: int, head_group: int) -> dict[str, MPI.Comm]:
        """The first ``ranks`` ranks ("all"), their head groups of ``head_group`` consecutive
        ranks ("heads") and the context groups across them ("context")."""
        key = (ranks, head_group)
        if key not in self.group_comms:
            comm = self.prefix[ranks - 1]
            u = head_group
            self.group_comms[key] = {
                "all": comm,
                "heads": comm.Split(self.rank // u, self.rank),
                "context": comm.Split(self.rank % u, self.rank),
            }
        return self.group_comms[key]

    def handle(self, header: dict, arrays: list[np.ndarray]) -> protocol.Message:
        if header["op"] == "run":
            threadpool_limits(limits=1, user_api="blas")  # the kernel threads over heads
            config = CPConfig(**header["config"])
            comms = self.comms_for(config.ranks, config.head_group)
            self.task = _task_class(header["engine"])(header, arrays, comms, self.rank)
            return self.task.run_once()
        if header["op"] == "time":
            if self.task is None:
                raise RuntimeError("'time' before any 'run'")
            return self.task.time(header["warmup"], header["repeats"])
        if header["op"] == "time_collective":
            comms = self.comms_for(header["ranks"], header["group"])
            cases = [_collective(header["kind"], comms["heads"], chunk) for chunk in header["chunks"]]
            return {}, [_time_each(cases, comms["all"], header["warmup"], header["repeats"])]
        if header["op"] == "time_attention":
            threadpool_limits(limits=1, user_api="blas")
            cases = [_attention_case(shape, header["threads"]) for shape in header["shapes"]]
            barrier = self.prefix[header["ranks"] - 1]
            return {}, [_time_each(cases, barrier, header["warmup"], header["repeats"])]
        if header["op"] == "time_steps":
            cases = [_step_case(step, header["threads"]) for step in header["steps"]]
            barrier = self.prefix[header["ranks"] - 1]
            return {}, [_time_each(cases, barrier, header["warmup"], header["repeats"])]
        raise RuntimeError(f"unknown op {header['op']!r}")

    def serve(self) -> None:
        self.hello()
        while True:
            header, arrays = protocol.receive(self.sock)
            if header["op"] == "exit":
                return
            try:
                reply, out = self.handle(header, arrays)
                protocol.send(self.sock, {"ok": True, **reply}, out)
                if header["op"] != "run":  # a run's timing comes next and reuses its memory
                    release_free_memory()
            except MemoryError:
                protocol.send(self.sock, {"ok": False, "kind": "out_of_memory", "error": "out of memory"})
            except Exception as exc:  # reported to the driver, which stops the pool
                lines = traceback.format_exception(exc)
                protocol.send(self.sock, {"ok": False, "kind": "error", "error": "".join(lines[-6:])})


    def close(self) -> None:
        """Release what this rank holds once served (nothing on the CPU)."""


def main(argv: list[str] | None = None, worker: type[Worker] = Worker) -> None:
    """Serve as one rank of the pool with ``worker``: this engine's, or an engine's subclass
    of it (the TensorRT ranks)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True, help="the driver's Unix socket")
    parser.add_argument("--driver-pid", type=int, required=True)
    args = parser.parse_args(argv)
    threading.Thread(target=_exit_when_gone, args=(args.driver_pid,), daemon=True).start()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.socket)
    rank = worker(sock)
    try:
        rank.serve()
        rank.close()
    except ConnectionError:
        os._exit(3)  # the driver went away: nothing left to report to
    sys.stdout.flush()
    os._exit(0)  # skip MPI_Finalize: it waits for every rank, and the driver is done


if __name__ == "__main__":
    main()
