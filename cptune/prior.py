"""The physical prior: a configuration's latency from its analytic terms and the hardware's rates.

``analytic_cost`` counts what a configuration does (FLOPs, bytes per collective, steps);
a ``Profile`` says how fast a hardware does it. A calibrated host measured its rates
(``cptune calibrate``); a described one has them from a topology file (datasheets and
published benchmarks). The prior is what carries predictions where no measurement reaches:
longer sequences, more ranks, hardware that is only calibrated or only described.

    compute     = FLOPs of the busiest rank / attention rate per rank (at the work per kernel
                  call: calibrated rates fall for small blocks)
    all-to-all  = 3 calls (Q, K/V, O) x latency + bytes sent / bandwidth   (head group)
    all-gather  = latency + bytes sent / bandwidth                         (context group)
    Ring        = c - 1 stream steps, each overlapped with attention on the block in hand:
                  compute / c + (c - 1) * max(compute / c, latency + block bytes / bandwidth)
                  (p2p; with broadcasts, engines without point-to-point, the first of c steps
                  is exposed too)
    latency     = compute + all-to-all + all-gather + the Ring's exposed communication
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cptune.calibration import Calibration
from cptune.config import CPConfig
from cptune.cost import STREAM_KINDS, analytic_cost
from cptune.hardware import Hardware, HardwareDescription
from cptune.workload import Workload


class Profile(Protocol):
    """How fast one hardware computes attention and runs each collective."""

    @property
    def fingerprint(self) -> str: ...

    @property
    def max_ranks(self) -> int: ...

    def memory_limit(self, ranks: int) -> int | None:
        """Bytes per rank a configuration of ``ranks`` ranks may hold, or None when not limited."""

    def describe(self) -> str: ...

    def attention_rate(self, workload: Workload, ranks: int, flops: float) -> float:
        """Attention FLOP/s of one rank doing ``flops`` of work when ``ranks`` ranks compute
        at once."""

    def collective(self, kind: str, ranks: int, members: list[int]) -> tuple[float, float]:
        """(latency s, bandwidth B/s) of collective ``kind`` among global ranks ``members``
        while ``ranks`` ranks run."""


@dataclass(frozen=True)
class CalibratedProfile:
    """A host with a stored calibration (measured rates). ``memory_bytes``: the host's
    memory, which all its ranks share (known for this machine only)."""

    hardware: Hardware
    calibration: Calibration
    memory_bytes: int | None = None

    @property
    def fingerprint(self) -> str:
        return self.hardware.fingerprint

    @property
    def max_ranks(self) -> int:
        return self.calibration.max_ranks

    def memory_limit(self, ranks: int) -> int | None:
        return None if self.memory_bytes is None else self.memory_bytes // ranks

    def describe(self) -> str:
        return f"{self.hardware.describe()} (calibrated {self.calibration.measured_at})"

    def attention_rate(self, workload: Workload, ranks: int, flops: float) -> float:
        return self.calibration.attention_rate(ranks, workload.head_dim, workload.causal, flops)

    def collective(self, kind: str, ranks: int, members: list[int]) -> tuple[float, float]:
        fit = self.calibration.collective(kind, ranks, len(members))
        return fit.latency_s, fit.bandwidth


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

    def describe(self) -> str:
        return self.description.describe()

    def attention_rate(self, workload: Workload, ranks: int, flops: float) -> float:
        rates = self.description.attention_flops
        if workload.dtype not in rates:
            raise ValueError(
                f"{self.description.source} gives no {workload.dtype} attention rate "
                f"(has {', '.join(sorted(rates))}); add it under [device] attention_tflops"
            )
        return rates[workload.dtype]

    def collective(self, kind: str, ranks: int, members: list[int]) -> tuple[float, float]:
        link = self.description.link(members)
        return link.latency, link.bandwidth


@dataclass(frozen=True)
class PriorTime:
    """The prior's latency of one configuration, in seconds, split by what it is spent on."""

    compute_s: float
    all_to_all_s: float
    all_gather_s: float
    ring_exposed_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.all_to_all_s + self.all_gather_s + self.ring_exposed_s

    @property
    def comm_s(self) -> float:
        return self.total_s - self.compute_s


def prior_time(workload: Workload, config: CPConfig, profile: Profile, engine: str = "mpi") -> PriorTime:
    """The physical prior of ``config`` on ``workload`` as ``engine`` runs it (see the module
    docstring). The groups are those of rank 0: ranks 0..u-1 share heads, ranks 0, u, 2u, ...
    the context."""
    cost = analytic_cost(workload, config, engine)
    n, u, c = config.ranks, config.head_group, config.context_degree
    ring = config.strategy == "ring"
    per_call = cost.flops / c if ring else cost.flops  # the Ring attends block by block
    compute = cost.flops / profile.attention_rate(workload, n, per_call)

    def comm(kind: str, members: list[int], nbytes: float, calls: int) -> float:
        latency, bandwidth = profile.collective(kind, n, members)
        return calls * latency + nbytes / bandwidth

    heads, context = list(range(u)), list(range(0, n, u))
    all_to_all = comm("all_to_all", heads, cost.bytes_sent["all_to_all"], 3) if u > 1 else 0.0
    all_gather = 0.0
    if cost.comm_steps["all_gather"]:
        all_gather = comm("all_gather", context, cost.bytes_sent["all_gather"], 1)
    ring_exposed = 0.0
    for kind in STREAM_KINDS:  # the Ring's stream step, however the engine expresses it
        if steps := cost.comm_steps[kind]:
            step = comm(kind, context, cost.bytes_sent[kind] / steps, 1)
            block = compute / c
            # c - 1 steps hide behind the previous block's attention; a step beyond those
            # (a broadcast of the rank's own block) has nothing to hide behind.
            ring_exposed = (steps - (c - 1)) * step + block + (c - 1) * max(block, step) - compute
    return PriorTime(compute, all_to_all, all_gather, ring_exposed)
