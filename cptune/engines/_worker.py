"""One rank of an engine's worker pool (run by mpiexec, never by users).

Each rank connects to the driver's socket, then serves requests until told to exit. A
request names its engine; the rank side of that engine's tasks (``EngineSpec.rank_task``: a
``RankTask`` and the engine's calibration ``OPS``) is imported on the rank's first request
for it, so every engine whose ranks need nothing more live in this one supervised loop.
"run" receives a configuration and this rank's input shard, runs it once and returns its
output shard; "time" repeats the last run with warm-up and returns per-iteration timings;
any other op is the engine's (calibration: one collective over a sweep of message sizes,
the attention kernel on a few shapes, ...). Ranks that a task does not use wait on their
socket, asleep. A watchdog process kills the rank as soon as the driver process is gone,
whatever the rank is doing (even blocked in native code that holds the GIL). An engine
whose ranks hold state of their own between requests (the TensorRT engine's GPUs)
subclasses ``Worker`` and runs its own module.

Each rank fixes its allocator as it starts (``steady_allocator``): left to itself, glibc's malloc
decides from what a process freed earlier whether an iteration's arrays come from reused
heap or from fresh pages that fault on first touch, so one configuration's latency
depended on what its rank ran before it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from cptune.config import CPConfig
from cptune.engines import _protocol as protocol
from cptune.engines import engine_spec
from cptune.guard import read_cpu
from cptune.hostlock import hold_for_life
from cptune.layout import rank_coordinates
from cptune.measurement import machine_id, process_stat


def kill_when_gone(driver: int) -> None:
    """SIGKILL this process as soon as process ``driver`` exits, from a watchdog process
    forked for it. A watchdog thread needs the GIL to act, and a rank blocked in native
    code that holds it (TensorRT's ``set_communicator`` waits for its peers so) would starve
    it forever. The watchdog touches nothing of the rank's and ends with it."""
    rank = os.getpid()
    if os.fork():
        return
    try:
        watched = {os.pidfd_open(driver): True, os.pidfd_open(rank): False}
        poller = select.poll()
        for fd in watched:
            poller.register(fd, select.POLLIN)
        if any(watched[fd] for fd, _ in poller.poll()):
            os.kill(rank, signal.SIGKILL)
    except ProcessLookupError:  # the driver is already gone (or the rank: then nothing to do)
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank, signal.SIGKILL)
    finally:
        os._exit(0)


#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
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
    6-7% faster than AllGather-KV, which the prior puts level. No block mapped on its own
    (``M_MMAP_MAX`` 0) and a high trim threshold keep every freed block for the next
    iteration, as a steady-state deployment's caching allocator does. A fixed 32 MiB
    threshold, glibc's largest, left the larger blocks faulting every time: a rank's float32
    keys and values at 8 heads x 16K x d64 are 33.5 MB each, and its masked call over them
    faulted 550-1220 pages a call with that threshold, 1 without (0.85-1.0x the time, two
    interleaved processes each)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, STEADY_TRIM_THRESHOLD))


def release_free_memory() -> None:
    """Return the heap's free memory to the system (after a task: an idle rank holds none)."""
    if (trim := getattr(_libc(), "malloc_trim", None)) is not None:
        trim(0)


def time_each(
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



def claim_node() -> str | None:
    """As the first rank of a node on another machine than the driver's, take that machine's
    host lock for this rank's life; who holds it instead, when another cptune does (the
    driver then names the node and stops). Every other rank: None (the driver's host lock
    covers its own machine)."""
    local = os.environ.get("MPI_LOCALRANKID", os.environ.get("LOCAL_RANK", "0"))
    driver = os.environ.get(protocol.DRIVER_MACHINE_VARIABLE)
    if local != "0" or not driver or driver == machine_id():
        return None
    return hold_for_life(driver)


def node_reading() -> dict[str, Any]:
    """This node's CPU accounts for the contention guard (``cptune.guard.CpuReading`` as
    JSON), its ranks' CPU time as ours: every child of this rank's parent (the node's MPI
    proxy or torchrun agent), and the parent."""
    parent = os.getppid()
    ranks = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
             if (stat := process_stat(pid)) is not None and len(stat[1]) > 1 and stat[1][1] == str(parent)]
    reading = read_cpu([parent, *ranks])
    ours = {f"{pid}:{tid}": seconds for (pid, tid), seconds in reading.ours_s.items()}
    return {"wall_s": reading.wall_s, "cpus": reading.cpus, "idle_s": reading.idle_s, "ours_s": ours,
            "cpu_set": reading.cpu_set}


def rank_side(engine: str) -> ModuleType:
    """The module of ``engine``'s rank side (``EngineSpec.rank_task``), imported once."""
    module = engine_spec(engine).rank_task
    if module is None:
        raise RuntimeError(f"the {engine} engine's ranks run a worker of their own")
    return importlib.import_module(module)


class RankServer:
    """The serving loop of one rank on its socket to the driver: hello, then one reply per
    request until "exit". A subclass says who it is (``hello_facts``) and what it does
    (``handle``)."""

    def __init__(self, sock: socket.socket, rank: int) -> None:
        self.sock = sock
        self.rank = rank
        self.allocator = "steady" if steady_allocator() else "system default"
        self.busy = claim_node()

    def hello_facts(self) -> dict[str, str]:
        """What the driver records of the ranks' software: the MPI library (or launcher)."""
        return {"mpi_library": ""}

    def hello(self) -> None:
        protocol.send(self.sock, {"rank": self.rank, "pid": os.getpid(), "parent_pid": os.getppid(),
                                  "machine": machine_id(), "allocator": self.allocator,
                                  "busy": self.busy,
                                  "token": os.environ.get(protocol.TOKEN_VARIABLE, ""), **self.hello_facts()})

    def handle(self, header: dict, arrays: list[np.ndarray]) -> protocol.Message:
        raise NotImplementedError

    def serve(self) -> None:
        self.hello()
        while True:
            header, arrays = protocol.receive(self.sock)
            if header["op"] == "exit":
                return
            try:
                out: list[np.ndarray] = []
                if header["op"] == "node_load":  # any engine's ranks: the contention guard's
                    reply = node_reading()
                else:
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


class Worker(RankServer):
    """The serving loop of one MPI rank: the engines' rank sides on MPI communicators."""

    def __init__(self, sock: socket.socket) -> None:
        self.world = MPI.COMM_WORLD
        super().__init__(sock, self.world.Get_rank())
        # A communicator for each task size: the first r ranks. Made once, collectively.
        self.prefix = [
            self.world.Split(0 if self.rank < r else MPI.UNDEFINED, self.rank)
            for r in range(1, self.world.Get_size() + 1)
        ]
        self.group_comms: dict[tuple[int, int], dict[str, MPI.Comm]] = {}
        self.block_cuts: dict[tuple[int, tuple[int, ...]], MPI.Comm] = {}
        self.group_comms_of_blocks: dict[tuple[int, tuple[int, ...], int], dict[str, MPI.Comm]] = {}
        self.task: Any = None  # the last run's RankTask, of whichever engine

    def hello_facts(self) -> dict[str, str]:
        return {"mpi_library": MPI.Get_library_version().strip().splitlines()[0]}

    def comms_for(self, ranks: int, head_group: int) -> dict[str, MPI.Comm]:
        """The first ``ranks`` ranks ("all"), their head groups of ``head_group`` ranks
        ("heads") and the context groups across them ("context"), numbered as
        ``cptune.layout`` numbers them."""
        key = (ranks, head_group)
        if key not in self.group_comms:
            comm = self.prefix[ranks - 1]
            group, member = rank_coordinates(self.rank, head_group)
            self.group_comms[key] = {
                "all": comm,
                "heads": comm.Split(group, self.rank),
                "context": comm.Split(member, self.rank),
            }
        return self.group_comms[key]

    def block_comms(self, ranks: int, sizes: tuple[int, ...], block: int | None,
                    head_group: int) -> dict[str, MPI.Comm]:
        """The communicators of block ``block`` (None: this rank is in none) when the first
        ``ranks`` ranks are cut into consecutive blocks of ``sizes``: the block ("all"), its
        head groups of ``head_group`` ranks and the context groups across them, numbered within
        the block as ``cptune.layout`` numbers them. The cut is made once per ``sizes``,
        collectively over the first ``ranks``; a block's groups once per head group, over the
        block (its ranks share its history)."""
        cut = (ranks, sizes)
        if cut not in self.block_cuts:
            starts = np.cumsum([0, *sizes]).tolist()
            color = next((i for i in range(len(sizes)) if starts[i] <= self.rank < starts[i + 1]),
                         MPI.UNDEFINED)
            self.block_cuts[cut] = self.prefix[ranks - 1].Split(color, self.rank)
        if block is None:
            return {}
        key = (ranks, sizes, head_group)
        if key not in self.group_comms_of_blocks:
            comm = self.block_cuts[cut]
            group, member = rank_coordinates(comm.Get_rank(), head_group)
            self.group_comms_of_blocks[key] = {"all": comm, "heads": comm.Split(group, comm.Get_rank()),
                                               "context": comm.Split(member, comm.Get_rank())}
        return self.group_comms_of_blocks[key]

    def handle(self, header: dict, arrays: list[np.ndarray]) -> protocol.Message:
        op = header["op"]
        if op == "time":
            if self.task is None:
                raise RuntimeError("'time' before any 'run'")
            return self.task.time(header["warmup"], header["repeats"])
        side = rank_side(header["engine"])
        if op == "run":
            threadpool_limits(limits=1, user_api="blas")  # the kernels thread over heads
            config = CPConfig(**header["config"])
            comms = self.comms_for(config.ranks, config.head_group)
            self.task = side.RankTask(header, arrays, comms, self.rank)
            return self.task.run_once()
        if op == "run_batch":  # a batch plan's groups side by side (the mpi engine's BatchTask)
            threadpool_limits(limits=1, user_api="blas")
            self.task = side.BatchTask(header, arrays, self)
            return self.task.run_once()
        if op not in side.OPS:
            raise RuntimeError(f"unknown op {op!r}")
        return side.OPS[op](self, header)


def main(argv: list[str] | None = None, worker: Callable[[socket.socket], RankServer] = Worker) -> None:
    """Serve as one rank of the pool with ``worker``: this loop, or an engine's own (the
    TensorRT and torch ranks)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True, help="the driver's Unix socket, or tcp://host:port")
    parser.add_argument("--driver-pid", type=int, required=True)
    args = parser.parse_args(argv)
    serve_until_done(worker(connect_to_driver(args.socket, args.driver_pid)))


def connect_to_driver(address: str, driver_pid: int | None = None) -> socket.socket:
    """The connection to the driver at ``address`` (``protocol.connection``), this rank set
    to end with the driver: by its pid ``driver_pid`` on the driver's host (a Unix socket), by
    the connection closing from another node (TCP)."""
    if address.startswith(protocol.TCP_SCHEME):
        sock = protocol.connection(address)
        sock.settimeout(None)
        exit_when_driver_closes(sock)
        return sock
    if driver_pid is None:
        raise ValueError("a rank on the driver's host watches the driver's pid: give driver_pid")
    kill_when_gone(driver_pid)
    return protocol.unix_connection(Path(address))


def exit_when_driver_closes(sock: socket.socket) -> None:
    """Watch ``sock``, the connection to the driver, from a daemon thread and end this
    process as soon as the driver closes it (a rank on another node cannot watch the
    driver's pid)."""
    threading.Thread(target=_exit_when_closed, args=(sock,), daemon=True).start()


def _exit_when_closed(sock: socket.socket) -> None:
    """End this process as soon as the driver closes its connection, whatever the rank is
    doing (a rank stuck in a collective would never read the close)."""
    while True:
        readable, _, _ = select.select([sock], [], [], 0.5)
        if readable:
            try:
                if sock.recv(1, socket.MSG_PEEK) == b"":
                    os._exit(0)
            except OSError:
                os._exit(0)
            time.sleep(0.5)  # a request waits for the serving loop: look again later


def serve_until_done(rank: RankServer) -> None:
    """Serve, then end this process without MPI_Finalize (it waits for every rank, and the
    driver is done); at once when the driver went away."""
    try:
        rank.serve()
        rank.close()
    except ConnectionError:
        os._exit(3)  # the driver went away: nothing left to report to
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
