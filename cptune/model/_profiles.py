"""What the prior knows of a hardware: how fast it computes, moves bytes and exchanges them.

A ``Profile`` answers the prior's questions for one hardware and engine: a calibrated host
from its measured rates (``CalibratedProfile``, ``cptune calibrate``), a described one from
its description's figures (``DescribedProfile``: datasheets and published microbenchmarks).
Both answer the same questions, so the prior (``_prior``) has one shape for both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

from cptune.calibration import Calibration
from cptune.cost import FP32_BYTES, MERGE_FP32_PASSES
from cptune.errors import CPTuneError
from cptune.hardware import Hardware, HardwareDescription, tier_of
from cptune.layout import Groups
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

    def key_preparation_s(self, workload: Workload, ranks: int, elements: float, flops: float,
                          work_per_call: float) -> float:
        """Seconds one of ``ranks`` ranks spends preparing the ``elements`` K and V elements its
        kernel calls read (``flops`` executed, ``work_per_call`` a call) beyond what the
        attention rate at that work already holds: a kernel that makes each call's keys float32
        with their norms before any score (the numpy kernel) pays it per key read, whether its
        queries see the key or not. 0 where the kernel streams keys inside its tiles."""

    def exchange_wait_s(self, ranks: int, group: int) -> float:
        """Seconds one blocking exchange in a group of ``group`` ranks costs beyond its own time
        after a stretch of compute, ``ranks`` ranks busy at once: where ranks share cores, it
        completes only once its members run together, while ranks beside them compute; 0 where
        each rank has cores or a device of its own."""

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
    collective at the rates its tier measured. Read ``beside`` others, every configuration is
    priced with that many ranks busy at once (a batch plan's groups run side by side)."""

    calibration: Calibration
    #: (nodes, ranks per node) it is read for, when not the measured cluster's own.
    shape: tuple[int, int] | None = field(default=None, kw_only=True)
    #: Ranks computing at once whatever a configuration's own count (``beside``); 0: its own.
    busy: int = field(default=0, kw_only=True)

    def beside(self, busy: int) -> CalibratedProfile:
        """This host with ``busy`` of its ranks computing at once: each rate read at the rank
        count calibrated nearest the larger of a configuration's ranks and ``busy``. The
        calibration timed every rank count with all its ranks busy, each with its share of the
        cores (``cptune.measurement.threads_per_rank``), which is how a group of a batch plan
        runs beside the others; on a host whose ranks share its cores a rank alone runs
        several times faster (on this project's 2-core host: one rank with both cores against
        one of four sharing them)."""
        return dataclasses.replace(self, busy=busy)

    def _at_once(self, ranks: int) -> int:
        return max(ranks, self.busy)

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
            if self.position_calls:
                return 0.0  # that engine's merges (``_fused_merges``) are not timed apart: in its rates
            elements = nbytes / (MERGE_FP32_PASSES * FP32_BYTES + wire.itemsize)
            return elements * self.calibration.step_seconds("merge", self._at_once(ranks), "float32")
        if step == "requery":
            per_element = self.calibration.step_seconds("query", self._at_once(ranks), wire.name)
            return nbytes / wire.itemsize * per_element
        # permutes: inside the mpi engine's calibrated all-to-all and all-gather, which are
        # timed with their copies (a TensorRT calibration does not time its transposes yet);
        # GQA replication: not calibrated
        return 0.0

    @property
    def charges_ring_steps(self) -> bool:
        return bool(self.calibration.steps)

    def key_preparation_s(self, workload: Workload, ranks: int, elements: float, flops: float,
                          work_per_call: float) -> float:
        """At the calibrated cost per element of preparing a query block (the same pass: cast
        to float32, a norm per row), in the workload's wire dtype, less the float32 keys the
        rate's shapes prepared for as much work (``Calibration.key_elements_per_flop``); 0
        where the calibration timed no steps."""
        if self.attention_kernel != "numpy" or not self.calibration.steps:
            return 0.0
        step, at_once = self.calibration.step_seconds, self._at_once(ranks)
        held = flops * self.calibration.key_elements_per_flop(at_once, workload.head_dim, workload.causal,
                                                              work_per_call)
        return (elements * step("query", at_once, workload.wire_dtype.name)
                - held * step("query", at_once, "float32"))

    @property
    def launch_s(self) -> float:
        return 0.0  # inside the measured per-call latencies and rates

    @property
    def attention_call_s(self) -> float:
        return 0.0  # inside the attention rate measured at the work per call

    def exchange_wait_s(self, ranks: int, group: int) -> float:
        """As the calibration timed it with as many ranks busy at once
        (``Calibration.exchange_wait``); 0 from a calibration that timed none (its ranks had
        cores of their own, or it was stored before)."""
        return self.calibration.exchange_wait(self._at_once(ranks), group)

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
        """The host, when it was calibrated and the kernel(s) its attention was timed with (the
        rates this prior reads describe those), and the shape it is read for."""
        read_as = "" if self.shape is None else (f", read for {self.shape[0]} nodes x {self.shape[1]} ranks "
                                                  f"from its tiers")
        timed = self.calibration.timed_kernels
        kernels = f", attention timed with {timed}" if timed else ""
        busy = f", {self.busy} ranks busy at once" if self.busy else ""
        return (f"{self.hardware.describe()} (calibrated {self.calibration.measured_at}{kernels}{read_as}"
                f"{busy})")

    def attention_rate(self, workload: Workload, ranks: int, flops: float) -> float:
        at_once = self._at_once(ranks)
        return self.calibration.attention_rate(at_once, workload.head_dim, workload.causal, flops)

    def collective_time(self, kind: str, ranks: int, groups: Groups, nbytes: float, calls: int) -> float:
        """At the rates of the calibrated groups of this size whose traffic crossed the same
        tier as ``groups`` (``cptune.hardware.tier_of``)."""
        if kind == "reduce_scatter":  # not timed: all-gather's bytes to the same peers, reversed
            kind = "all_gather"
        fit = self.calibration.collective(kind, self._at_once(ranks), len(groups[0]),
                                          tier_of(groups, self.ranks_per_node))
        return calls * fit.latency_s + nbytes / fit.bandwidth

    def ring_call_s(self, workload: Workload, ranks: int) -> float:
        if not self.charges_ring_steps:
            return 0.0
        return self.calibration.call_seconds(self._at_once(ranks), workload.head_dim, workload.causal)

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

    def exchange_wait_s(self, ranks: int, group: int) -> float:
        return 0.0  # each rank its own device: none is parked while the others compute

    def key_preparation_s(self, workload: Workload, ranks: int, elements: float, flops: float,
                          work_per_call: float) -> float:
        return 0.0  # a fused kernel reads K and V inside its tiles: in its rate

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
