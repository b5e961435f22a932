"""The mpi engine on one rank: ``Primitives`` on MPI communicators with numpy math, and the
calibration ops that time its collectives, its kernel and the kernel's memory-bound steps.

Imported by a rank (``cptune.engines._worker``) on its first request for the mpi engine.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from cptune.calls import any_seen
from cptune.config import CPConfig
from cptune.engines import _protocol as protocol
from cptune.engines._worker import time_each
from cptune.engines.mpi import _kernels as kernels
from cptune.layout import SequenceLayout
from cptune.masks import Mask
from cptune.strategies import run_backward, run_forward
from cptune.strategies.primitives import HEADS, SEQ, Group, Partial
from cptune.workload import Workload

if TYPE_CHECKING:
    from cptune.engines._worker import Worker

def in_send_order(x: np.ndarray, split_axis: int, members: int, wire: np.dtype) -> np.ndarray:
    """``x`` cut into ``members`` chunks along ``split_axis``, chunk j first: the contiguous
    [members, ...] buffer an all-to-all sends, in ``wire`` dtype. A contiguous ``x`` is cast
    first, as the kernel casts (``kernels.cast``: float32 to float16 compiled): NumPy's cast
    of the reordered view took 7.4 ms of Ulysses' output at 4 heads x 16K x d64, the cast
    then the copy 3.3. A strided one is cast in the copy, so it is not copied twice."""
    if x.flags.c_contiguous:
        x = kernels.cast(x, wire)
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


def exchange_reduce_scatter(comm: MPI.Comm, x: np.ndarray, axis: int,
                            order: Sequence[tuple[int, int, int]] | None = None) -> np.ndarray:
    """The inverse of ``exchange_all_gather`` for a gradient: ``x`` holds every member's part
    along ``axis`` (in member order, or laid out as ``order`` joins them); each member gets
    the float32 sum of every member's values of its own part. The copy into send order
    included."""
    n = comm.Get_size()
    axis %= x.ndim
    if order is None:
        send = in_send_order(x, axis, n, np.dtype(np.float32))
    else:
        # where each (member, start, stop) range sits in x: in order's sequence, end to end
        offsets = np.cumsum([0] + [stop - start for _, start, stop in order]).tolist()
        placed = sorted(zip(order, offsets, strict=False))  # by member, then by its own index
        parts = [np.concatenate([x.take(range(offset, offset + stop - start), axis=axis)
                                 for (owner, start, stop), offset in placed if owner == member], axis=axis)
                 for member in range(n)]
        send = np.ascontiguousarray(np.stack(parts), dtype=np.float32)
    received = np.empty(send.shape[1:], dtype=np.float32)
    comm.Reduce_scatter_block([send, MPI.FLOAT], [received, MPI.FLOAT], op=MPI.SUM)
    return received


def exchange_all_gather(comm: MPI.Comm, x: np.ndarray, axis: int, wire: np.dtype,
                        order: Sequence[tuple[int, int, int]] | None = None) -> np.ndarray:
    """Every member's ``x`` joined along ``axis`` in member order, or the (member, start,
    stop) ranges of ``order`` in that order; the copy out of receive order included (see
    ``exchange_all_to_all``)."""
    send = np.ascontiguousarray(x, dtype=wire)
    received = np.empty((comm.Get_size(), *send.shape), dtype=wire)
    comm.Allgather([send, MPI.BYTE], [received, MPI.BYTE])
    if order is None:
        return out_of_receive_order(received, axis)
    axis %= send.ndim
    pieces = [received[m].take(range(start, stop), axis=axis) for m, start, stop in order]
    return np.concatenate(pieces, axis=axis)


#: The tag of the Ring's travelling gradients (K/V blocks go with the default, 0).
_GRAD_TAG = 1


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

    def attention(self, q: np.ndarray, kv: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                  into: Partial | None = None) -> Partial:
        if not any_seen(q_pos, k_pos, self.workload.mask):  # no kernel call: nothing here is seen
            if into is not None:
                return into
            batch, heads, rows, dim = q.shape
            return Partial(np.zeros((batch, heads, rows, dim), np.float32),
                           np.full((batch, heads, rows), -np.inf, np.float32))
        start = time.perf_counter()
        out, lse = kernels.attention(
            q, kv, q_pos, k_pos,
            mask=self.workload.mask,
            threads=self.threads,
            poll=self._poll if self._in_flight else None,
        )
        if into is not None:
            out, lse = kernels.merge(into, (out, lse), self.threads)
        self.compute_s += time.perf_counter() - start
        return Partial(out, lse)

    def attention_grad(self, q: np.ndarray, kv: np.ndarray, dout: np.ndarray, saved: Partial,
                       q_pos: np.ndarray, k_pos: np.ndarray,
                       dq_into: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        if not any_seen(q_pos, k_pos, self.workload.mask):  # no kernel call: these keys add nothing
            dq = np.zeros(q.shape, np.float32) if dq_into is None else dq_into
            return dq, np.zeros(kv.shape, np.float32)
        start = time.perf_counter()
        dq, dkv = kernels.attention_grad(
            q, kv, saved.out, saved.lse, dout, q_pos, k_pos,
            mask=self.workload.mask, threads=self.threads,
        )
        if dq_into is not None:
            dq = np.add(dq_into, dq, out=dq_into)
        self.compute_s += time.perf_counter() - start
        return dq, dkv

    def all_to_all(self, x: np.ndarray, group: Group, split_axis: int, concat_axis: int,
                   repeat: int = 1) -> np.ndarray:
        comm = self.comms[group]
        if comm.Get_size() == 1:
            return x
        if repeat > 1:  # a copy of its own here, timed as compute as before
            start = time.perf_counter()
            x = np.repeat(x, repeat, axis=split_axis)
            self.compute_s += time.perf_counter() - start
        start = time.perf_counter()
        out = exchange_all_to_all(comm, x, split_axis, concat_axis, self.wire)
        self.comm_s += time.perf_counter() - start
        return out

    def all_to_all_grad(self, x: np.ndarray, group: Group, split_axis: int, concat_axis: int,
                        fold: int) -> np.ndarray:
        comm = self.comms[group]
        if comm.Get_size() == 1 or fold == 1:
            return self.all_to_all(x, group, split_axis, concat_axis)
        start = time.perf_counter()
        out = exchange_all_to_all(comm, x, split_axis, concat_axis, np.dtype(np.float32))  # summed: float32
        self.comm_s += time.perf_counter() - start
        start = time.perf_counter()
        axis = concat_axis % out.ndim
        out = out.reshape(out.shape[:axis] + (out.shape[axis] // fold, fold) + out.shape[axis + 1:]).sum(
            axis=axis + 1, dtype=np.float32)
        self.compute_s += time.perf_counter() - start
        return out

    def reduce_scatter(self, x: np.ndarray, group: Group, axis: int,
                       order: Sequence[tuple[int, int, int]] | None = None) -> np.ndarray:
        comm = self.comms[group]
        if comm.Get_size() == 1:
            return x
        start = time.perf_counter()
        out = exchange_reduce_scatter(comm, x, axis, order)
        self.comm_s += time.perf_counter() - start
        return out

    def all_gather(self, x: np.ndarray, group: Group, axis: int,
                   order: Sequence[tuple[int, int, int]] | None = None) -> np.ndarray:
        comm = self.comms[group]
        if comm.Get_size() == 1:
            return x
        start = time.perf_counter()
        out = exchange_all_gather(comm, x, axis, self.wire, order)
        self.comm_s += time.perf_counter() - start
        return out

    def narrow(self, x: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, stop)
        return x[tuple(index)]

    def concat(self, parts: Sequence[np.ndarray], axis: int) -> np.ndarray:
        return np.concatenate(parts, axis=axis)

    def pad(self, x: np.ndarray, axis: int, size: int) -> np.ndarray:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, size - x.shape[axis])
        return np.pad(x, widths)

    def kv_stream(self, kv: np.ndarray, group: Group,
                  steps: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """Ring order: at step t hold member (me - t)'s block, pass it on to me + 1 and take
        the next from me - 1 while the caller attends to it (progressed by ``_poll``), for
        ``steps`` steps after this rank's own block (None: round the whole ring)."""
        comm = self.comms[group]
        n, me = comm.Get_size(), comm.Get_rank()
        last = n - 1 if steps is None else min(steps, n - 1)
        current = np.ascontiguousarray(kv, dtype=self.wire)
        # the blocks arrive in buffers of the Ring's own, never in the caller's K/V
        buffers = [np.empty_like(current) for _ in range(min(2, last))]
        for step in range(last + 1):
            if step < last:
                incoming = buffers[step % 2]
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
                current = incoming


    def kv_grad_stream(self, kv: np.ndarray, group: Group, visit: Callable[[int, np.ndarray], np.ndarray],
                       steps: int | None = None) -> np.ndarray:
        """``kv_stream``'s order, each block's float32 gradient beside it: at step t the
        gradient of member (me - t)'s block arrives from me - 1 while this rank works on the
        block, gets this rank's share and goes on to me + 1; after the last step each
        gradient goes straight to its owner (one hop on where the stream went round the
        whole ring), and this rank's own arrives from the rank as far ahead."""
        comm = self.comms[group]
        n, me = comm.Get_size(), comm.Get_rank()
        last = n - 1 if steps is None else min(steps, n - 1)
        if last == 0:  # no other block: this rank's own gradient is all there is
            return visit(me, kv)
        receive = np.empty(kv.shape, np.float32)
        sending: list[MPI.Request] = []
        arriving: list[MPI.Request] = []
        for step, (member, block) in enumerate(self.kv_stream(kv, group, last)):
            share = np.ascontiguousarray(visit(member, block), dtype=np.float32)
            if step == 0:  # this rank's own block: its gradient starts here
                send = share
            else:
                self._wait(arriving)
                np.add(receive, share, out=receive)
                self._wait(sending)  # the buffer sent last step is free to receive into
                send, receive = receive, send
            ahead, behind = (last, -last) if step == last else (-1, 1)  # the last: home to its owner
            sending = [comm.Isend([send, MPI.FLOAT], dest=(me - ahead) % n, tag=_GRAD_TAG)]
            arriving = [comm.Irecv([receive, MPI.FLOAT], source=(me - behind) % n, tag=_GRAD_TAG)]
        self._wait([*sending, *arriving])
        return receive

    def _wait(self, requests: list[MPI.Request]) -> None:
        """Wait for ``requests``, the time counted as communication."""
        start = time.perf_counter()
        MPI.Request.Waitall(requests)
        self.comm_s += time.perf_counter() - start


class RankTask:
    """One configuration on this rank: its inputs, communicators and how to run it (a
    training workload's forward and backward, from the output's gradient it was given)."""

    def __init__(self, header: dict, arrays: list[np.ndarray], comms: dict[str, MPI.Comm], rank: int) -> None:
        self.threads = int(header["threads"])
        self.workload = Workload(**header["workload"])
        self.config = CPConfig(**header["config"])
        self.layout = SequenceLayout(self.workload, self.config)
        self.comms = comms
        self.rank = rank
        q, k, v, *dout = arrays  # [batch, seq, heads, head_dim] in the wire dtype
        self.q = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
        self.kv = np.ascontiguousarray(np.stack([k, v]).transpose(0, 1, 3, 2, 4))
        self.dout = np.ascontiguousarray(dout[0].transpose(0, 2, 1, 3)) if self.workload.training else None
        self.input_bytes = self.q.nbytes + self.kv.nbytes + (0 if self.dout is None else self.dout.nbytes)

    def iteration(self) -> tuple[list[np.ndarray], MpiOps, float]:
        """One run: its outputs [batch, heads, seq, head_dim] (the output; a training run's
        dQ, dK and dV after it), the ops that timed it and the forward's wall seconds."""
        ops = MpiOps(self.workload, self.comms, self.threads)
        start = time.perf_counter()
        out, saved = run_forward(ops, self.layout, self.rank, self.q, self.kv)
        out = kernels.cast(out, self.workload.wire_dtype, self.threads)
        forward_s = time.perf_counter() - start
        if self.dout is None:
            return [out], ops, forward_s
        dq, dkv = run_backward(ops, self.layout, self.rank, saved, self.dout)
        return [out, dq, dkv[0], dkv[1]], ops, forward_s

    def run_once(self) -> protocol.Message:
        """Run once, tracing allocations: the output shard (and gradients) and the peak bytes
        held, a training run's saved activations included."""
        tracemalloc.start()
        tracemalloc.reset_peak()
        try:
            outputs, _, _ = self.iteration()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return {"peak_bytes": self.input_bytes + peak}, [x.transpose(0, 2, 1, 3) for x in outputs]

    def time(self, warmup: int, repeats: int) -> protocol.Message:
        """Per timed iteration: wall, compute and communication seconds on this rank (and a
        training run's forward wall seconds). All ranks start each iteration together
        (barrier) so the slowest rank's wall time is the iteration's latency."""
        comm = self.comms["all"]
        timings = np.zeros((repeats, 3 if self.dout is None else 4), dtype=np.float64)
        for i in range(warmup + repeats):
            comm.Barrier()
            start = time.perf_counter()
            _, ops, forward_s = self.iteration()
            wall = time.perf_counter() - start
            if i >= warmup:
                timings[i - warmup] = (wall, ops.compute_s, ops.comm_s, forward_s)[: timings.shape[1]]
        return {}, [timings]


class BatchTask:
    """This rank's part of a batch plan: the groups take consecutive blocks of the first
    ``header["ranks"]`` ranks in order (``cptune.torch.BatchRunner``'s rule), each on a
    communicator of its own, and this rank runs its group's sequences one after another, each
    a ``RankTask`` of the group's configuration on those communicators (none on an idle rank).
    ``arrays``: each of its sequences' inputs in turn (q, k, v; a training run's output
    gradient after them)."""

    def __init__(self, header: dict, arrays: list[np.ndarray], worker: Worker) -> None:
        ranks, me = int(header["ranks"]), worker.rank
        configs = [CPConfig(**g["config"]) for g in header["groups"]]
        starts = np.cumsum([0] + [c.ranks for c in configs]).tolist()
        mine = next((i for i, c in enumerate(configs) if starts[i] <= me < starts[i] + c.ranks), None)
        comms = worker.block_comms(ranks, tuple(c.ranks for c in configs), mine,
                                   configs[mine].head_group if mine is not None else 1)
        #: Every rank of the plan starts each timed iteration here together.
        self.barrier = worker.prefix[ranks - 1]
        self.tasks: list[RankTask] = []
        if mine is not None:
            group = header["groups"][mine]
            each = len(arrays) // max(1, len(group["workloads"]))
            for j, workload in enumerate(group["workloads"]):
                task_header = {"threads": header["threads"], "workload": workload, "config": group["config"]}
                inputs = arrays[j * each:(j + 1) * each]
                self.tasks.append(RankTask(task_header, inputs, comms, me - starts[mine]))

    def run_once(self) -> protocol.Message:
        """Each of this rank's sequences once: their output shards (and gradients) in turn, and
        the most bytes any of them held."""
        replies = [task.run_once() for task in self.tasks]
        peak = max((int(header["peak_bytes"]) for header, _ in replies), default=0)
        return {"peak_bytes": peak}, [x for _, outputs in replies for x in outputs]

    def time(self, warmup: int, repeats: int) -> protocol.Message:
        """Per timed iteration, this rank's wall seconds from the plan's shared barrier to the
        end of its last sequence: the slowest rank's is the batch's makespan. A rank done early
        waits for the next iteration asleep (``_sleeping_barrier``), not spinning on a core the
        groups still running share."""
        timings = np.zeros((repeats, 1), dtype=np.float64)
        for i in range(warmup + repeats):
            _sleeping_barrier(self.barrier)
            start = time.perf_counter()
            for task in self.tasks:
                task.iteration()
            if i >= warmup:
                timings[i - warmup, 0] = time.perf_counter() - start
        return {}, [timings]


#: Seconds a rank waiting at ``_sleeping_barrier`` sleeps between looks: short beside a batch
#: plan's makespan (milliseconds), long enough to leave its core to the ranks computing.
BARRIER_NAP_S = 1e-4


def _sleeping_barrier(comm: MPI.Comm) -> None:
    """A barrier over ``comm`` whose waiting ranks sleep: MPICH's own spins, and on a host
    whose ranks outnumber its cores a rank spinning there takes a core from one computing
    (a batch plan's groups end at different times; the first done would slow the rest)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(BARRIER_NAP_S)


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
    """The kernel on random inputs of ``shape`` (heads, seq_q, seq_k, head_dim, causal), or its
    backward where ``shape["backward"]`` (from the forward's output and log-sum-exp); causal
    queries sit at the last seq_q key positions, a diagonal block."""
    rng = np.random.default_rng(0)
    h, sq, sk, d = shape["heads"], shape["seq_q"], shape["seq_k"], shape["head_dim"]
    causal = bool(shape.get("causal", False))
    q = rng.standard_normal((1, h, sq, d), dtype=np.float32)
    kv = rng.standard_normal((2, 1, h, sk, d), dtype=np.float32)
    q_pos, k_pos, mask = np.arange(sk - sq, sk), np.arange(sk), Mask(sk, causal)
    if not shape.get("backward"):
        return lambda: kernels.attention(q, kv, q_pos, k_pos, mask=mask, threads=threads)
    out, lse = kernels.attention(q, kv, q_pos, k_pos, mask=mask, threads=threads)
    dout = rng.standard_normal(out.shape, dtype=np.float32)
    return lambda: kernels.attention_grad(q, kv, out, lse, dout, q_pos, k_pos, mask=mask,
                                          threads=threads)


def _step_case(step: dict[str, Any], threads: int) -> Callable[[], object]:
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


def _time_collective(worker: Worker, header: dict) -> protocol.Message:
    ranks, group = header["ranks"], header["group"]
    if header.get("along", "heads") == "heads":
        comms = worker.comms_for(ranks, group)
        members = comms["heads"]
    else:  # strided, as the context groups of head groups of ranks / group
        comms = worker.comms_for(ranks, ranks // group)
        members = comms["context"]
    cases = [_collective(header["kind"], members, chunk) for chunk in header["chunks"]]
    return {}, [time_each(cases, comms["all"], header["warmup"], header["repeats"])]


def _time_attention(worker: Worker, header: dict) -> protocol.Message:
    threadpool_limits(limits=1, user_api="blas")
    cases = [_attention_case(shape, header["threads"]) for shape in header["shapes"]]
    barrier = worker.prefix[header["ranks"] - 1]
    return {}, [time_each(cases, barrier, header["warmup"], header["repeats"])]


def _time_steps(worker: Worker, header: dict) -> protocol.Message:
    cases = [_step_case(step, header["threads"]) for step in header["steps"]]
    barrier = worker.prefix[header["ranks"] - 1]
    return {}, [time_each(cases, barrier, header["warmup"], header["repeats"])]


def _time_waits(worker: Worker, header: dict) -> protocol.Message:
    """Seconds [case, iteration] this rank spent inside each blocking exchange, per exchange:
    for each group size g, one group of the first g ranks runs ``calls`` times the kernel on
    ``shape`` and then an all-gather of ``chunk`` bytes per peer, while the other ranks run
    the kernel throughout; then the same group's all-gathers in a row with every other rank
    idle. 0 on a rank outside the group. Each iteration starts at a sleeping barrier, as a
    batch plan's does."""
    threadpool_limits(limits=1, user_api="blas")
    ranks, calls = int(header["ranks"]), int(header["calls"])
    warmup, repeats = int(header["warmup"]), int(header["repeats"])
    comm = worker.prefix[ranks - 1]
    me = comm.Get_rank()
    compute = _attention_case(header["shape"], int(header["threads"]))
    timings = np.zeros((2 * len(header["groups"]), repeats))
    for j, g in enumerate(header["groups"]):
        group = comm.Split(0 if me < g else MPI.UNDEFINED, me)
        exchange = _collective("all_gather", group, int(header["chunk"])) if me < g else None
        for c, beside in enumerate((True, False)):
            for i in range(warmup + repeats):
                _sleeping_barrier(comm)
                inside = 0.0
                if exchange is not None:
                    for _ in range(calls):
                        if beside:
                            compute()
                        start = time.perf_counter()
                        exchange()
                        inside += time.perf_counter() - start
                elif beside:  # computing throughout the group's exchanges (twice as many calls)
                    for _ in range(2 * calls):
                        compute()
                if i >= warmup:
                    timings[2 * j + c, i - warmup] = inside / calls
        if group != MPI.COMM_NULL:
            group.Free()
    return {}, [timings]


#: The mpi engine's calibration ops, by request name.
OPS: dict[str, Callable[[Worker, dict], protocol.Message]] = {
    "time_collective": _time_collective, "time_attention": _time_attention, "time_steps": _time_steps,
    "time_waits": _time_waits,
}
