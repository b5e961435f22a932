"""What one measured configuration produced, and the host it ran on."""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TypedDict

import numpy as np

from cptune.config import CPConfig
from cptune.errors import EngineError
from cptune.workload import Workload

#: How a run of a configuration ends: "ok", or the kind of the ``EngineError`` that ended it.
STATUSES: tuple[str, ...] = ("ok", *EngineError.KINDS)
#: The facts of a run (``Measurement.host``, a calibration's ``facts``) that say what it ran,
#: with the words each is shown after: the attention kernel(s) (the torch engine's, on a GPU
#: those its probe chose), the process group, and on a GPU the cuDNN and NCCL versions; first,
#: a framework's own implementation where one ran in place of the strategy (its name, version
#: and function: ``cptune.engines.torch``'s ``IMPLEMENTATIONS``).
RUN_FACTS: tuple[tuple[str, str], ...] = (
    ("implementation", ""), ("kernel", ""), ("process_group", "process group "), ("cudnn", "cuDNN "),
    ("nccl", "NCCL "),
)


def ran_with(facts: Mapping[str, str]) -> str:
    """What a run ran, in one line ("flash_for_cpu; process group gloo"): its ``RUN_FACTS``
    that ``facts`` holds; "" where none (a row stored before they were kept)."""
    return "; ".join(f"{words}{facts[key]}" for key, words in RUN_FACTS if facts.get(key))


@dataclass(frozen=True)
class Measurement:
    """Timings of one configuration on one host; output checked before any timing.

    Latencies are per iteration of the slowest rank (all ranks start each iteration
    together). ``compute_ms`` and ``comm_ms`` are the medians of the slowest rank (largest
    median iteration time): time in attention math, and time spent waiting on
    communication that compute did not hide; None where the engine could not tell them
    apart (a TensorRT collective fused into a region with compute). ``oversubscribed``: the run had more ranks
    than this host's cores, so its timings include ranks waiting for a core. ``disturbed``:
    the contention guard saw other load during the run, so its timings do not count."""

    workload: Workload
    config: CPConfig
    median_ms: float
    p10_ms: float
    p90_ms: float
    compute_ms: float | None
    comm_ms: float | None
    peak_bytes: int
    max_error: float
    engine: str
    host: dict[str, str]
    warmup: int
    repeats: int
    samples_ms: list[float] = field(repr=False)
    measured_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    oversubscribed: bool = False
    #: Why the contention guard judged this run disturbed by other load (None: ran clean).
    disturbed: str | None = None
    #: A training run's forward alone: median ms of the slowest rank (whose whole iteration,
    #: forward and backward, is ``median_ms``); None for a forward run.
    forward_ms: float | None = None

    @property
    def spread_ms(self) -> float:
        """p90 - p10 of the iteration latency."""
        return self.p90_ms - self.p10_ms

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["workload"] = self.workload.to_dict()
        data["config"] = self.config.to_dict()
        return data


class TimingSummary(TypedDict):
    median_ms: float
    p10_ms: float
    p90_ms: float
    compute_ms: float | None
    comm_ms: float | None
    samples_ms: list[float]
    forward_ms: float | None


def format_ms(value: float) -> str:
    """A latency in ms as people read it: three significant digits, no exponent (0.731, 12.5, 1870)."""
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def summarize(timings: np.ndarray) -> TimingSummary:
    """Turn seconds [rank, iteration, (wall, compute, comm[, forward wall])] into the figures
    of a ``Measurement``: per-iteration latency is the slowest rank's wall time; the phase
    split (and a training run's forward time) is that of the rank with the largest median
    wall time (None where an engine reported it as NaN: unavailable)."""
    latency_ms = timings[:, :, 0].max(axis=0) * 1e3
    slowest = int(np.argmax(np.median(timings[:, :, 0], axis=1)))
    split = np.median(timings[slowest, :, 1:3], axis=0) * 1e3
    compute_ms, comm_ms = (None, None) if np.isnan(split).any() else (float(split[0]), float(split[1]))
    training = timings.shape[2] > 3  # a training run's forward wall time last
    return TimingSummary(
        median_ms=float(np.median(latency_ms)),
        p10_ms=float(np.percentile(latency_ms, 10)),
        p90_ms=float(np.percentile(latency_ms, 90)),
        compute_ms=compute_ms,
        comm_ms=comm_ms,
        samples_ms=[float(x) for x in latency_ms],
        forward_ms=float(np.median(timings[slowest, :, 3]) * 1e3) if training else None,
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def available_cores() -> int:
    """CPU cores this process may run on (what the ranks share)."""
    return len(os.sched_getaffinity(0))


def threads_per_rank(ranks: int) -> int:
    """Threads each of ``ranks`` ranks computes with: its share of this host's cores."""
    return max(1, available_cores() // ranks)


def oversubscribed(ranks: int, ranks_per_node: int | None = None) -> bool:
    """Whether ``ranks`` ranks share cores: more of them on one node (this host, or each of
    a cluster's nodes of ``ranks_per_node`` ranks, taken to be like this one) than
    ``available_cores``."""
    return min(ranks, ranks_per_node or ranks) > available_cores()


def boot_id() -> str:
    """Which running kernel this process is on (its boot id, the same in every namespace and
    container of one machine, so processes of one id share its CPUs); "" where unknown."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def machine_id() -> str:
    """Which kernel and process namespace this process runs in (its boot id and pid
    namespace): processes of one id can signal each other by pid, and share a host lock
    file; "" where unknown."""
    boot = boot_id()
    try:
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}" if boot else ""
    except OSError:
        return ""


def host_memory_bytes() -> int:
    """This machine's physical memory, shared by every rank it runs."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def process_stat(pid: int) -> tuple[str, list[str]] | None:
    """Process ``pid``'s command name and the fields of ``/proc/<pid>/stat`` after it (its
    state first: field 3 of proc(5) is index 0), or None where they cannot be read (no
    ``/proc``, the process ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 1:].split()
    except (OSError, ValueError):
        return None


def host_memory_limit(ranks: int) -> int:
    """Bytes of activations each of ``ranks`` ranks computing on this machine's CPU may
    hold: they share its memory. What ``recommend`` checks this host's CPU ranks against
    (``feasibility``'s ``memory_limit``), and ``measure`` and ``search`` before they run."""
    return host_memory_bytes() // ranks


def describe_host() -> dict[str, str]:
    """Facts of this machine that decide how fast a configuration runs."""
    memory = host_memory_bytes()
    return {
        "hostname": socket.gethostname(),
        "cpu": _cpu_model(),
        "cores": str(available_cores()),
        "memory_gib": f"{memory / 2**30:.1f}",
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
