"""The physical prior: a configuration's latency from its analytic terms and the hardware's rates.

``analytic_cost`` counts what a configuration does (FLOPs, bytes per collective, bytes through
device memory, kernels, steps); a ``Profile`` says how fast a hardware does each. A calibrated
host measured its rates (``cptune calibrate``); a described one has them from a topology file
(datasheets and published benchmarks). Both answer the same questions, so the prior has one
shape for both. It carries predictions where no measurement reaches: longer sequences, more
ranks, hardware that is only calibrated or only described.

    compute     = FLOPs the busiest rank's kernel executes (masked pairs it computes
                  included: ``computed_flops``) / attention rate per rank (at the work per
                  kernel call and head_dim: small blocks and small head_dims run slower;
                  the Ring's calls together count as one call where the profile charges
                  what each of its steps repeats, ``charges_ring_steps``, each call beyond
                  the first adding its fixed cost, ``ring_call_s``)
                  + attention calls x the fixed cost of one call however little its work
                  (one per step, or the fused calls ``cptune.calls`` plans where the profile's
                  engine cuts them by position, ``position_calls``)
                  (a described GPU's ``attention_call_us``, from a microbenchmark of the
                  kernel; a calibrated host's rate at the work per call already holds it)
    memory      = bytes of the memory-bound steps (permutes, GQA replication, the Ring's
                  merges and query re-reads) / device-memory bandwidth; on a calibrated
                  host, the Ring's merges and query preparations at their measured cost per
                  element (the others are not calibrated and count 0)
    overhead    = kernels launched outside the Ring's steps x the fixed cost of one launch
    all-to-all  = 3 calls (Q, K/V, O) x latency + bytes sent x time per byte  (head groups)
    all-gather  = latency + bytes sent x time per byte                          (context groups)
                  (time per byte: the slowest tier the traffic crosses, by its share of it)
    Ring        = c blocks; while a block's K/V streams in, compute on the block in hand runs
                  slower (overlap_slowdown, for as long as the transfer runs) and the step
                  waits for the slower of the two; the host launches a step's kernels while
                  the device runs them, so a step's launches cost only what the device hides not:
                  (c - 1) * max(block + slowdown * min(block, transfer) + merge + requery,
                                the step's launches, transfer) + last block
                  (p2p. An engine without point-to-point broadcasts every block, its own
                  included: c steps, the one beyond c - 1 hides behind nothing; the profile
                  says which: a calibration's engine spec, ``Profile.stream``)
    latency     = compute + memory + overhead + all-to-all + all-gather + the Ring's exposed time

A training step is that of its forward, then its backward's (``_backward_time``; the
memory-bound steps and launches stay the forward's, as ``analytic_cost`` counts them):
    compute     = BACKWARD_FLOPS_RATIO x the forward's FLOPs / (its rate x the hardware's
                  ``backward_speed``) + attention calls x the fixed cost of one call
    exchanges   = those ``analytic_cost`` adds: Ulysses' 3 more all-to-alls, AllGather-KV's
                  gather again and reduce-scatter (a calibrated host reads it at its
                  all-gather's rates: the same bytes to the same peers), the Ring's
                  (c - 1) * max(block + slowdown * min(block, step), step) + block + home,
                  a step bringing the next K/V block and passing a gradient on, home the
                  last gradient's way back
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from cptune.calibration import Calibration
from cptune.calls import busiest_calls
from cptune.config import CPConfig
from cptune.cost import BACKWARD_FLOPS_RATIO, COLLECTIVES, FP32_BYTES, MERGE_FP32_PASSES, analytic_cost
from cptune.errors import CPTuneError
from cptune.hardware import TIERS, Hardware, HardwareDescription, tier_of
from cptune.kernels import check_kernel, computed_pairs
from cptune.layout import Groups, SequenceLayout, rank_groups
from cptune.workload import Workload


class UnpredictedModeError(CPTuneError, ValueError):
    """The hardware's rates do not predict a training step: its calibration did not time the
    backward, or its description gives no backward speed."""


def check_predicts(workload: Workload, profile: Profile) -> None:
    """``UnpredictedModeError`` before anything is weighed, where ``profile`` cannot predict
    ``workload`` (a training step on hardware whose backward speed is not known)."""
    if workload.training:
        profile.backward_speed(workload)


#: How the published benchmarks' Ring implementations (ring-flash-attn, used by yunchang and
#: xDiT) stream K/V: NCCL send/recv. A described hardware's prior streams so.
DESCRIBED_STREAM = "p2p"


class Profile(Protocol):
    """How fast one hardware computes attention, moves bytes through device memory, launches
    kernels and runs each collective."""

    @property
    def fingerprint(self) -> str: ...

    @property
    def max_ranks(self) -> int: ...

    def memory_limit(self, ranks: int) -> int | None:
        """Bytes per rank a configuration of ``ranks`` ranks may hold, or None when not limited."""

    def memory_time(self, step: str, nbytes: float, workload: Workload, ranks: int) -> float:
        """Seconds one of ``ranks`` ranks spends on memory-bound step ``step``
        (``cptune.cost.MEMORY_STEPS``) moving ``nbytes`` of ``workload``."""

    @property
    def charges_ring_steps(self) -> bool:
        """Whether ``memory_time`` charges what each Ring step repeats (its merge and query
        re-read): then the Ring's attention is rated as one call over all its keys, not at
        the work of one block, which would count those per-call costs twice."""

    @property
    def launch_s(self) -> float:
        """Seconds one kernel launch costs beyond its work (0 when inside measured rates)."""

    @property
    def attention_call_s(self) -> float:
        """Seconds one attention call costs however little its work (0 when inside measured
        rates)."""

    def ring_call_s(self, workload: Workload, ranks: int) -> float:
        """Where ``charges_ring_steps`` rates the Ring's calls together as one call and the
        rate holds one call's fixed cost (a calibrated host's, measured a call at a time), the
        fixed cost each call beyond the first adds; 0 where the calls are rated one by one or
        ``attention_call_s`` counts every call's."""

    @property
    def overlap_slowdown(self) -> float:
        """The share of its speed compute loses while communication runs beside it."""

    @property
    def attention_kernel(self) -> str:
        """The attention kernel the hardware runs (``cptune.kernels.ATTENTION_KERNELS``):
        what ``computed_flops`` counts as its work."""

    @property
    def stream(self) -> str:
        """What the Ring's K/V stream step is made of there (``cptune.cost.STREAM_KINDS``)."""

    @property
    def position_calls(self) -> bool:
        """Whether attention runs as the fused calls ``cptune.calls`` plans (the torch engine,
        and ``cptune.torch`` where a plan deploys) rather than one call per step."""

    def describe(self) -> str: ...

    @property
    def ranks_per_node(self) -> int | None:
        """Ranks per node on hardware of several nodes (ranks fill them in order); None on one."""

    def attention_rate(self, workload: Workload, ranks: int, flops: float) -> float:
        """Attention FLOP/s of one rank doing ``flops`` of work per call when ``ranks`` ranks
        compute at once."""

    def collective_time(self, kind: str, ranks: int, groups: Groups, nbytes: float, calls: int) -> float:
        """Seconds of ``calls`` calls of collective ``kind`` in which each rank of ``groups``
        (all running at once, ``ranks`` ranks in all) sends ``nbytes`` in total."""

    def backward_speed(self, workload: Workload, flops: float | None = None) -> float:
        """The attention backward's FLOP rate as a share of the forward's (its FLOPs counted
        as ``BACKWARD_FLOPS_RATIO`` times the forward's), for calls of ``flops`` forward FLOPs
        each where it depends on their size; ``UnpredictedModeError`` where not known."""


@dataclass(frozen=True)
class StoredHost:
    """A host the database holds (``Hardware``), calibrated or not. ``memory_bytes``: the
    host's memory, which all its ranks share (known for this machine only)."""

    hardware: Hardware
    memory_bytes: int | None = field(default=None, kw_only=True)

    @property
    def fingerprint(self) -> str:
        return self.hardware.fingerprint

    def memory_limit(self, ranks: int) -> int | None:
        """Each of ``ranks`` ranks' share of the host's memory, or None when not known."""
        return None if self.memory_bytes is None else self.memory_bytes // ranks


@dataclass(frozen=True)
class CalibratedProfile(StoredHost):
    """A host with a stored calibration (measured rates). A cluster's may be read for
    ``nodes`` x ``ranks_per_node`` it never ran (``resized``): the same nodes and links, each
    collective at the rates its tier measured."""

    calibration: Calibration
    #: (nodes, ranks per node) it is read for, when not the measured cluster's own.
    shape: tuple[int, int] | None = field(default=None, kw_only=True)

    def resized(self, nodes: int, ranks_per_node: int) -> CalibratedProfile:
        """This calibrated cluster read for ``nodes`` x ``ranks_per_node`` ranks; ``ValueError``
        for a host of one node, or one whose calibration never crossed nodes."""
        if self.hardware.nodes == 1 or "network" not in self.calibration.tiers:
            raise ValueError(f"{self.hardware.describe()} is one node: only a calibrated cluster (cptune "
                             f"calibrate --hosts) can be read for other nodes x ranks per node")
        if nodes < 2 or ranks_per_node < 1:
            raise ValueError(f"a cluster has 2 nodes or more of a rank or more, not {nodes}x{ranks_per_node}")
        return dataclasses.replace(self, shape=(nodes, ranks_per_node))

    @property
    def fingerprint(self) -> str:
        """The measured hardware's; read at another shape, another one (its measurements
        ran at the measured shape, so none of them answers for this one)."""
        if self.shape is None:
            return self.hardware.fingerprint
        return f"{self.hardware.fingerprint}@{self.shape[0]}x{self.shape[1]}"

    @property
    def max_ranks(self) -> int:
        if self.shape is not None:
            return self.shape[0] * self.shape[1]
        return self.calibration.max_ranks

    @property
    def ranks_per_node(self) -> int | None:
        return self.shape[1] if self.shape is not None else self.hardware.ranks_per_node

    def memory_time(self, step: str, nbytes: float, workload: Workload, ranks: int) -> float:
        wire = workload.wire_dtype
        if step == "merge":
            elements = nbytes / (MERGE_FP32_PASSES * FP32_BYTES + wire.itemsize)
            return elements * self.calibration.step_seconds("merge", ranks, "float32")
        if step == "requery":
            return nbytes / wire.itemsize * self.calibration.step_seconds("query", ranks, wire.name)
        # permutes: inside the mpi engine's calibrated all-to-all and all-gather, which are
        # timed with their copies (a TensorRT calibration does not time its transposes yet);
        # GQA replication: not calibrated
        return 0.0

    @property
    def charges_ring_steps(self) -> bool:
        return bool(self.calibration.steps)

    @property
    def launch_s(self) -> float:
        return 0.0  # inside the measured per-call latencies and rates

    @property
    def attention_call_s(self) -> float:
        return 0.0  # inside the attention rate measured at the work per call

    @property
    def overlap_slowdown(self) -> float:
        return 0.0  # not calibrated: no measurement runs compute beside communication

    @property
    def attention_kernel(self) -> str:
        return self.calibration.kernel

    @property
    def stream(self) -> str:
        return self.calibration.spec.stream

    @property
    def position_calls(self) -> bool:
        return self.calibration.spec.position_calls

    def describe(self) -> str:
        read_as = "" if self.shape is None else (f", read for {self.shape[0]} nodes x {self.shape[1]} ranks "
                                                  f"from its tiers")
        return f"{self.hardware.describe()} (calibrated {self.calibration.measured_at}{read_as})"

    def attention_rate(self, workload: Workload, ranks: int, flops: float) -> float:
        return self.calibration.attention_rate(ranks, workload.head_dim, workload.causal, flops)

    def collective_time(self, kind: str, ranks: int, groups: Groups, nbytes: float, calls: int) -> float:
        """At the rates of the calibrated groups of this size whose traffic crossed the same
        tier as ``groups`` (``cptune.hardware.tier_of``)."""
        if kind == "reduce_scatter":  # not timed: all-gather's bytes to the same peers, reversed
            kind = "all_gather"
        fit = self.calibration.collective(kind, ranks, len(groups[0]), tier_of(groups, self.ranks_per_node))
        return calls * fit.latency_s + nbytes / fit.bandwidth

    def ring_call_s(self, workload: Workload, ranks: int) -> float:
        if not self.charges_ring_steps:
            return 0.0
        return self.calibration.call_seconds(ranks, workload.head_dim, workload.causal)

    def backward_speed(self, workload: Workload, flops: float | None = None) -> float:
        try:
            return self.calibration.backward_speed(workload.head_dim, workload.causal, flops)
        except ValueError as exc:
            raise UnpredictedModeError(str(exc)) from None


@dataclass(frozen=True)
class DescribedProfile:
    """Hardware known from a description file: rates from datasheets and benchmarks."""

    description: HardwareDescription

    @property
    def fingerprint(self) -> str:
        return self.description.fingerprint

    @property
    def max_ranks(self) -> int:
        return self.description.max_ranks

    def memory_limit(self, ranks: int) -> int | None:
        return self.description.memory_bytes  # each rank has a device of its own

    def memory_time(self, step: str, nbytes: float, workload: Workload, ranks: int) -> float:
        return nbytes / self.description.figure("device.memory_gbps")

    @property
    def charges_ring_steps(self) -> bool:
        return True  # and its attention rate does not depend on the work per call

    @property
    def launch_s(self) -> float:
        return self.description.figure("device.launch_us")

    @property
    def attention_call_s(self) -> float:
        return self.description.figure("device.attention_call_us")

    def ring_call_s(self, workload: Workload, ranks: int) -> float:
        return 0.0  # every call's is attention_call_s

    @property
    def overlap_slowdown(self) -> float:
        return self.description.figure("device.overlap_slowdown")

    @property
    def attention_kernel(self) -> str:
        return "fused"  # the published benchmarks' FlashAttention kernels

    @property
    def stream(self) -> str:
        return DESCRIBED_STREAM

    @property
    def position_calls(self) -> bool:
        return True  # what a plan deploys there: cptune.torch

    def describe(self) -> str:
        return self.description.describe()

    @property
    def ranks_per_node(self) -> int | None:
        return self.description.ranks_per_node if self.description.nodes > 1 else None

    def attention_rate(self, workload: Workload, ranks: int, flops: float) -> float:
        """Per (query, key) pair and head the kernel does 4 * head_dim GEMM FLOPs and one
        exponential, which run on separate units one after the other: small head_dims spend
        a larger share of their time on the exponential."""
        matmul = self.description.matmul_flops(workload.dtype)
        if matmul is None:
            raise ValueError(
                f"{self.description.source} gives no {workload.dtype} attention rate; add it under "
                f"[device] matmul_tflops"
            )
        exponentials = self.description.figure("device.softmax_tops")
        return 1.0 / (1.0 / matmul + 1.0 / (4 * workload.head_dim * exponentials))

    def collective_time(self, kind: str, ranks: int, groups: Groups, nbytes: float, calls: int) -> float:
        latency, per_byte = self.description.exchange(kind, groups)
        return calls * latency + nbytes * per_byte

    def backward_speed(self, workload: Workload, flops: float | None = None) -> float:
        if "device.backward_speed" not in self.description.figures:
            raise UnpredictedModeError(f"{self.description.source} gives no attention backward speed, so it "
                                       f"predicts no training step; add it under [device] backward_speed")
        return self.description.figure("device.backward_speed")


@dataclass(frozen=True)
class PriorTime:
    """The prior's latency of one configuration, in seconds, split by what it is spent on."""

    compute_s: float
    all_to_all_s: float
    all_gather_s: float
    ring_exposed_s: float
    #: Memory-bound steps: permutes, GQA replication, the Ring's merges.
    memory_s: float = 0.0
    #: Fixed cost of the kernels launched.
    overhead_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.all_to_all_s + self.all_gather_s + self.ring_exposed_s
                + self.memory_s + self.overhead_s)

    @property
    def outside_compute(self) -> float:
        """The share of the total spent outside attention compute (communication, memory-bound
        steps, launches): where the prior's mechanisms are least sure (``STRUCTURAL_ERROR``)."""
        return (self.total_s - self.compute_s) / self.total_s

    @property
    def comm_s(self) -> float:
        """Communication not hidden behind compute."""
        return self.all_to_all_s + self.all_gather_s + self.ring_exposed_s

    def __add__(self, other: PriorTime) -> PriorTime:
        """Both one after the other (a training step: the forward, then the backward)."""
        return PriorTime(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))


#: Longest padded sequence whose numpy-kernel work ``computed_flops`` counts block by block
#: (well under a second of counting); longer ones waste under rows_per_block / length.
EXACT_KERNEL_WORK_TOKENS = 2**20


@functools.lru_cache(maxsize=65536)  # pure; the prior asks for the same pairs often
def computed_flops(workload: Workload, config: CPConfig, kernel: str) -> int:
    """Attention FLOPs the busiest rank's ``kernel`` executes (4 * head_dim per computed
    (query, key) pair and head). A fused kernel: ``analytic_cost``'s useful FLOPs. The numpy
    kernel also computes the masked pairs inside each query row block that straddles the
    causal diagonal (``computed_pairs``): up to half a block's rows per query, so a short
    causal sequence costs up to 1.5x its useful work. Each rank attends its context block to
    every block: in one call over the keys in position order (AllGather-KV, Ulysses, one rank)
    or one call per block (Ring).
    Counted exactly up to ``EXACT_KERNEL_WORK_TOKENS``; beyond, the masked share is below
    0.1% and the useful FLOPs stand for it."""
    check_kernel(kernel)
    cost = analytic_cost(workload, config)
    if kernel == "fused" or not workload.causal or cost.padded_seq_len > EXACT_KERNEL_WORK_TOKENS:
        return cost.flops
    layout = SequenceLayout(workload, config)

    def runs(group: int) -> list[tuple[int, int]]:
        return [(start, stop - start) for start, stop in layout.block_ranges(group)]

    blocks = range(config.context_degree)
    calls = ([runs(j) for j in blocks] if config.strategy == "ring"
             else [sorted(run for j in blocks for run in runs(j))])  # gathered in position order
    pairs = max(
        sum(computed_pairs(runs(g), keys, workload.causal, workload.seq_len) for keys in calls)
        for g in blocks
    )
    return 4 * workload.batch * workload.head_dim * (workload.heads // config.head_group) * pairs


def prior_time(workload: Workload, config: CPConfig, profile: Profile) -> PriorTime:
    """The physical prior of ``config`` on ``workload`` on ``profile``'s hardware and engine
    (see the module docstring). A description's figures may be numpy arrays of variants
    (``HardwareDescription.spread``, how its ranges are evaluated at once), so every step is
    elementwise: ``np.maximum``/``np.minimum``, never ``max``/``min``. A training step is its
    forward followed by its backward (``_backward_time``)."""
    if workload.training:
        forward = _forward_time(workload.in_mode("forward"), config, profile)
        return forward + _backward_time(workload, config, profile)
    return _forward_time(workload, config, profile)


def _forward_time(workload: Workload, config: CPConfig, profile: Profile) -> PriorTime:
    cost = analytic_cost(workload, config, profile.stream)
    n, u, c = config.ranks, config.head_group, config.context_degree
    one_per_step = cost.kernels["attention"]
    calls = busiest_calls(SequenceLayout(workload, config)) if profile.position_calls else one_per_step
    flops = computed_flops(workload, config, profile.attention_kernel)
    work_per_call = flops if profile.charges_ring_steps else flops / calls
    compute = flops / profile.attention_rate(workload, n, work_per_call) + calls * profile.attention_call_s
    if calls > 1:  # the lookup is the prior's hot path; one call adds nothing
        compute += (calls - 1) * profile.ring_call_s(workload, n)
    memory = {step: profile.memory_time(step, nbytes, workload, n) if nbytes else 0.0
              for step, nbytes in cost.memory_bytes.items()}
    launch = profile.launch_s
    kernels = sum(cost.kernels.values()) + calls - one_per_step
    heads, context = rank_groups(config)

    all_to_all = 0.0
    if u > 1:
        all_to_all = profile.collective_time("all_to_all", n, heads, cost.bytes_sent["all_to_all"],
                                             cost.comm_steps["all_to_all"])
    all_gather = 0.0
    if cost.comm_steps["all_gather"]:
        all_gather = profile.collective_time("all_gather", n, context, cost.bytes_sent["all_gather"], 1)
    ring_exposed = 0.0
    # the Ring's stream, as the profile's engine expresses it (send/recv, or a broadcast per step)
    stream = profile.stream
    if steps := cost.comm_steps[stream]:
        transfer = profile.collective_time(stream, n, context, cost.bytes_sent[stream] / steps, 1)
        block = compute / c
        overlapped = c - 1  # steps hidden behind the attention on the block in hand
        ring_kernels = calls + cost.kernels["merge"] + cost.kernels["stream"]
        step_launches = (ring_kernels - 1) / overlapped
        # the host launches a step's kernels while the device runs them: the larger of the two
        per_step = (memory["merge"] + memory["requery"]) / overlapped
        busy = np.maximum(block + profile.overlap_slowdown * np.minimum(block, transfer) + per_step,
                          step_launches * launch)
        # a step beyond those (a broadcast of the rank's own block) has nothing to hide behind
        ring = ((steps - overlapped) * transfer + overlapped * np.maximum(busy, transfer)
                + np.maximum(block, launch))
        ring_exposed = ring - compute - memory["merge"] - memory["requery"]
        kernels -= ring_kernels
    return PriorTime(compute, all_to_all, all_gather, ring_exposed, memory_s=sum(memory.values()),
                     overhead_s=launch * kernels)


def _backward_time(workload: Workload, config: CPConfig, profile: Profile) -> PriorTime:
    """The backward of a training ``workload`` (see the module docstring): the exchanges
    ``analytic_cost`` adds to its forward's, and the attention backward at the forward's
    rate times the hardware's ``backward_speed``."""
    forward = workload.in_mode("forward")
    train = analytic_cost(workload, config, profile.stream)
    alone = analytic_cost(forward, config, profile.stream)
    sent = {kind: train.bytes_sent[kind] - alone.bytes_sent[kind] for kind in COLLECTIVES}
    steps = {kind: train.comm_steps[kind] - alone.comm_steps[kind] for kind in COLLECTIVES}
    n, c = config.ranks, config.context_degree
    calls = (busiest_calls(SequenceLayout(forward, config)) if profile.position_calls
             else alone.kernels["attention"])
    forward_flops = computed_flops(forward, config, profile.attention_kernel)
    # each call at the rate of its own work: no step of the backward's Ring is charged apart
    # (a calibrated host's merges and query re-reads are the forward's), so what each of its
    # calls repeats is in the rate of a call that size
    per_call = forward_flops / calls
    rate = profile.attention_rate(forward, n, per_call) * profile.backward_speed(forward, per_call)
    compute = BACKWARD_FLOPS_RATIO * forward_flops / rate + calls * profile.attention_call_s
    heads, context = rank_groups(config)
    all_to_all = 0.0
    if steps["all_to_all"]:
        all_to_all = profile.collective_time("all_to_all", n, heads, sent["all_to_all"], steps["all_to_all"])
    all_gather = 0.0
    for kind in ("all_gather", "reduce_scatter"):
        if steps[kind]:
            all_gather += profile.collective_time(kind, n, context, sent[kind], steps[kind])
    ring_exposed = 0.0
    if steps["p2p"]:
        kv_block = alone.bytes_sent["p2p"] / (c - 1)
        grad_block = (sent["p2p"] - (c - 1) * kv_block) / c
        # each of c - 1 steps brings the next K/V block and passes the gradient of the one in
        # hand on, behind the backward of the block in hand; the last gradient goes home after
        step = profile.collective_time("p2p", n, context, kv_block + grad_block, 2)
        home = profile.collective_time("p2p", n, context, grad_block, 1)
        block = compute / c
        busy = block + profile.overlap_slowdown * np.minimum(block, step)
        ring_exposed = (c - 1) * np.maximum(busy, step) + block + home - compute
    elif steps["broadcast"]:
        raise ValueError("the backward's Ring is modelled on point-to-point streams only: no engine without "
                         "them trains")
    return PriorTime(compute, all_to_all, all_gather, ring_exposed)


def tier_split(workload: Workload, config: CPConfig, profile: Profile) -> dict[str, float]:
    """The prior's seconds of ``config`` by where they go: "compute" (attention, memory-bound
    steps, launches) and each link tier its exchanges cross (``cptune.hardware.TIERS``):
    Ulysses' all-to-all over its head groups' tier, the context exchange over theirs."""
    time = prior_time(workload, config, profile)
    heads, context = rank_groups(config)
    split = dict.fromkeys(("compute", *TIERS), 0.0)
    split["compute"] = float(time.compute_s + time.memory_s + time.overhead_s)
    split[tier_of(heads, profile.ranks_per_node)] += float(time.all_to_all_s)
    split[tier_of(context, profile.ranks_per_node)] += float(time.all_gather_s + time.ring_exposed_s)
    return split


# --------------------------------------------------------------------------- what is known


@dataclass(frozen=True)
class FigureSwing:
    """The prior latency (s) of one configuration with one figure of its description at the
    low and at the high end of the range its source allows, the others at their values."""

    figure: str
    at_low_s: float
    at_high_s: float


def figure_swings(workload: Workload, config: CPConfig, profile: Profile) -> tuple[FigureSwing, ...]:
    """One ``FigureSwing`` per uncertain figure of a described profile; none for a calibrated
    host (its rates are measured, not quoted with a range)."""
    described = described_prior(workload, config, profile)
    return () if described is None else described.swings


@dataclass(frozen=True)
class DescribedPrior:
    """The prior of one configuration on a description: its total (s), each uncertain
    figure's swing, and the range they allow (``prior_range``; empty swings: the total)."""

    total_s: float
    swings: tuple[FigureSwing, ...]
    low_s: float
    high_s: float
    #: ``PriorTime.outside_compute`` at the figures' values.
    outside_compute: float


def described_prior(workload: Workload, config: CPConfig, profile: Profile) -> DescribedPrior | None:
    """``DescribedPrior`` of ``config`` on a described profile (None on a calibrated host),
    worked out once per configuration and description: what a recommendation's intervals
    and ties read."""
    if not isinstance(profile, DescribedProfile):
        return None
    return _described_prior(workload, config, profile.description)


@functools.lru_cache(maxsize=65536)  # pure; intervals and ties ask for the same configurations
def _described_prior(workload: Workload, config: CPConfig,
                     description: HardwareDescription) -> DescribedPrior:
    """One evaluation of the prior over every figure at each end of its range and at its
    value (``HardwareDescription.spread``: numpy arrays of variants, each variant the same
    arithmetic as alone)."""
    keys, spread = _spread(description)
    prior = prior_time(workload, config, spread)
    totals: list[float] = np.asarray(prior.total_s).tolist()  # arrays over the variants
    swings = tuple(FigureSwing(key, totals[2 * i], totals[2 * i + 1]) for i, key in enumerate(keys))
    return DescribedPrior(totals[-1], swings, *prior_range(totals[-1], swings),
                          outside_compute=float(np.asarray(prior.outside_compute)[-1]))


@functools.lru_cache(maxsize=64)
def _spread(description: HardwareDescription) -> tuple[tuple[str, ...], DescribedProfile]:
    """The uncertain figures of ``description`` and the profile of its ``spread`` over them."""
    keys = tuple(key for key, figure in description.figures.items() if figure.uncertain)
    return keys, DescribedProfile(description.spread(keys))


def prior_range(total_s: float, swings: tuple[FigureSwing, ...]) -> tuple[float, float]:
    """(low, high) seconds of a prior latency ``total_s`` from its figures' swings: each
    figure's largest move down and up, added in quadrature (the figures' sources are
    independent)."""
    down = sum(min(0.0, s.at_low_s - total_s, s.at_high_s - total_s) ** 2 for s in swings) ** 0.5
    up = sum(max(0.0, s.at_low_s - total_s, s.at_high_s - total_s) ** 2 for s in swings) ** 0.5
    return max(total_s - down, 0.0), total_s + up


#: The prior's own error in ordering two configurations, beyond what its figures' ranges
#: allow: how far the log of its latency ratio was off on the published development set (the
#: pick's lead overstated), per unit of the two configurations' shares of predicted time spent
#: outside attention compute (communication, memory-bound steps, launches: the mechanisms the
#: prior is least sure of). Estimated, the 2% a pick may miss by aside, as the largest such
#: error over every pair of published configurations of all development-set machines
#: (``benchmarks/published_prior.py --structural``: 0.363, set by the 4x A100 PCIe table at
#: 16K tokens, where Ulysses over both CPU sockets beat the pick by more than the prior allowed;
#: the confidence table scores each machine with the estimate made without it).
STRUCTURAL_ERROR = 0.37
#: ``Tie.figure`` when the figures' ranges settle the order and only the structural error leaves
#: it open.
STRUCTURE = "structure"


@dataclass(frozen=True)
class Tie:
    """Two configurations whose order the prior cannot settle: within the figures' ranges and
    its own structural error ``other`` can be faster than the pick; ``figure`` at its ``end``
    ("low" or "high") moves the difference most in ``other``'s favour, or ``figure`` is
    ``STRUCTURE`` (``end`` "") where the figures alone would have settled it; ``movers``: every
    figure whose range moves it in ``other``'s favour."""

    other: CPConfig
    figure: str
    end: str
    movers: frozenset[str] = frozenset()

    @property
    def structural(self) -> bool:
        """Whether only the prior's own error leaves the order open (the figures settle it)."""
        return self.figure == STRUCTURE


def structural_error_s(pick_s: float, outside_compute: float, error: float = STRUCTURAL_ERROR) -> float:
    """Seconds of a pick's lead (its prior ``pick_s``) the prior's structural error can take
    away from another configuration: ``error`` x ``outside_compute`` (the two configurations'
    ``PriorTime.outside_compute``, summed), as a log ratio."""
    return pick_s * math.expm1(error * outside_compute)


def decide(pick_s: float, pick: tuple[FigureSwing, ...], other_s: float,
           other: tuple[FigureSwing, ...], other_config: CPConfig, structural_s: float = 0.0) -> Tie | None:
    """A ``Tie`` when the pick's lead over ``other`` (``other_s - pick_s``) is within what the
    figures' ranges allow (their moves of the difference) and the structural error
    (``structural_s`` seconds), in quadrature, else None."""
    lead = other_s - pick_s
    moves = {
        (a.figure, end): (getattr(b, f"at_{end}_s") - getattr(a, f"at_{end}_s")) - lead
        for a, b in zip(pick, other, strict=True) for end in ("low", "high")
    }
    against = {figure: min(0.0, *(moves[(figure, end)] for end in ("low", "high")))
               for figure in {a.figure for a in pick}}
    figures = sum(m**2 for m in against.values())
    if lead - (figures + structural_s**2) ** 0.5 > 0:
        return None
    movers = frozenset(figure for figure, move in against.items() if move < 0)
    if lead - figures**0.5 > 0:
        return Tie(other_config, STRUCTURE, "", movers)
    (figure, end), _ = min(moves.items(), key=lambda item: item[1])
    return Tie(other_config, figure, end, movers)


def prior_ties(
    workload: Workload, pick: CPConfig, others: Sequence[CPConfig], profile: Profile,
    structural: float = STRUCTURAL_ERROR,
) -> tuple[Tie, ...]:
    """The configurations of ``others`` whose order against ``pick`` the prior does not settle:
    within the description's figure ranges and the prior's own ``structural`` error
    (``STRUCTURAL_ERROR``; none on a calibrated host, whose rates are measured). Only those
    whose range comes within that error of the pick's are examined. What ``recommend``
    reports as tied with a prior-only pick, and what the published-benchmark check scores."""
    chosen = described_prior(workload, pick, profile)
    if chosen is None or not chosen.swings:
        return ()
    ties = []
    for config in others:
        other = described_prior(workload, config, profile)
        assert other is not None
        structural_s = structural_error_s(chosen.total_s, chosen.outside_compute + other.outside_compute,
                                          structural)
        reaches = other.low_s <= chosen.high_s + structural_s
        if reaches and (tie := decide(chosen.total_s, chosen.swings, other.total_s, other.swings, config,
                                      structural_s)) is not None:
            ties.append(tie)
    return tuple(ties)
