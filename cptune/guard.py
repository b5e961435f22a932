"""The contention guard: was a measurement disturbed by other load on this host?

``measure`` opens a ``Watch`` just before it times a configuration and asks it just after
whether other load disturbed the run (``Watch.disturbance``). Three kinds of evidence, each
judged on its own (any one suffices):

- Foreign CPU load: the busy time of this process's CPUs (their wall time less their idle
  time in ``/proc/stat``, which a tickless kernel keeps to the microsecond, where its busy
  counts are sampled a tick at a time) minus the CPU time of our own processes (this one
  and the engine's, to the nanosecond from each thread's ``/proc/<pid>/task/<tid>/schedstat``),
  per second of the window. More than the cores the
  run leaves idle means other processes took cores our ranks wanted. Time a hypervisor
  stole from this machine counts as foreign too. Without ``/proc`` (not Linux) this
  evidence is skipped.
- A reference kernel: a fixed pure-Python loop of about a millisecond, best of five (the
  first runs wake the core up from power saving), run in this process before and after the
  window. Twice as slow as is typical this session (the median of its times so far) means
  the machine itself got slower (clock throttling, a busy neighbour, load that came or went
  during the run). Not against its fastest: on this project's VMs the loop's best moves by
  up to 1.9x with nothing else running, and a quiet sweep judged that way marked 48 of 106
  runs whose timings matched the unmarked ones. The
  scheduler favours a process that just woke, so this rarely sees plain CPU contention;
  the foreign-load evidence does.
- The spread of the iterations: p90/p10 far above what a quiet host gives (judged from ten
  iterations on: with fewer, one slow first iteration sets p90).

Only host-side evidence: on GPUs, another tenant of the same GPU is not noticed yet.
``CPTUNE_GUARD=off`` turns the guard off (a host known to be shared, where every run would
be marked); ``measure(..., guard=...)`` decides per call.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cptune.errors import CPTuneError
from cptune.measurement import available_cores, oversubscribed, threads_per_rank

#: Foreign load (cores) tolerated beyond the cores a run leaves idle: daemons, kernel
#: threads and interrupts of a quiet Linux host stay well under a quarter of a core.
FOREIGN_MARGIN_CORES = 0.25
#: ``/proc/stat`` shows each CPU's idle time in whole ticks, so its idle time over a window is
#: off by less than a tick; allow this many ticks per sqrt(CPU) (the errors of independent
#: CPUs add up like a random walk; up to 4 CPUs this covers the worst case).
TICK_ALLOWANCE = 2.0
#: The shortest window the foreign load is judged over: shorter runs are followed by a
#: pause that watches the host with our ranks idle, so a few ticks of error stay small
#: (0.3 cores on 2 CPUs) and a run of a few milliseconds is judged too.
MIN_WINDOW_S = 0.1
#: The reference kernel's best time may exceed its typical time this session (the median)
#: by this factor: frequency boost, cache effects and the hypervisor move a best-of-five
#: millisecond loop by up to 1.9x around its fastest on a quiet VM, so the median and
#: twice it.
REFERENCE_SLOWDOWN = 2.0
#: The kernel's times a session needs before the slowdown is judged (its typical time).
REFERENCE_MIN_TIMES = 5
#: How many of its latest times the typical time is the median of (drift over hours).
_REFERENCE_HISTORY = 101
#: p90/p10 of the iterations above this is disturbed: generous, as the demo's runs stored on
#: this project's 2-core machines mostly stay under 1.6, and load that comes and goes
#: doubles some iterations.
SPREAD_LIMIT = 2.0
#: ... and only when p90 - p10 exceeds this: sub-millisecond iterations jitter by scheduler
#: ticks and wake-up latency on a quiet host, so their ratio says nothing.
SPREAD_FLOOR_MS = 1.0
#: ... and only from this many iterations: with fewer, p90 is mostly the slowest one (a cold
#: first iteration after no warm-up), which says nothing about other load.
SPREAD_MIN_SAMPLES = 10

_REFERENCE_LOOP = 30_000
_REFERENCE_RUNS = 5
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

#: A thread of one of our processes: (pid, tid).
Task = tuple[int, int]


class GuardSettingError(CPTuneError, ValueError):
    """``$CPTUNE_GUARD`` holds neither "on" nor "off"."""


def enabled() -> bool:
    """Whether measurements are guarded: yes, unless ``$CPTUNE_GUARD`` is "off"."""
    setting = os.environ.get("CPTUNE_GUARD", "on")
    if setting not in ("on", "off"):
        raise GuardSettingError(f"CPTUNE_GUARD must be 'on' or 'off', got {setting!r}: "
                                f"fix it or unset it (the guard is on by default)")
    return setting == "on"


@dataclass(frozen=True)
class CpuReading:
    """The CPU accounts at one moment: idle seconds so far (idle and waiting for I/O) of
    ``cpus`` CPUs, ours (None: no /proc/stat), and CPU seconds so far of each thread of our
    processes."""

    wall_s: float
    cpus: int
    idle_s: float | None
    ours_s: dict[Task, float]


def _idle_seconds(cpus: set[int]) -> tuple[int, float | None]:
    """How many of ``cpus`` /proc/stat lists, and their idle seconds so far (time stolen by a
    hypervisor is not idle: it counts as someone else's)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return 0, None
    listed, ticks = 0, 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            listed += 1
            ticks += int(fields[3]) + int(fields[4])  # idle, iowait
    return listed, ticks * _TICK_S if listed else None


def _thread_seconds(pids: Iterable[int]) -> dict[Task, float]:
    """CPU seconds so far of every thread of ``pids`` (gone processes are left out)."""
    seconds: dict[Task, float] = {}
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                runtime_ns = int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            seconds[(pid, int(task.name))] = runtime_ns / 1e9
    return seconds


def read_cpu(pids: Iterable[int]) -> CpuReading:
    """The CPU accounts now of this process's CPUs and of ``pids`` (and this process)."""
    ours = _thread_seconds({os.getpid(), *pids})
    cpus, idle = _idle_seconds(os.sched_getaffinity(0))
    return CpuReading(wall_s=time.monotonic(), cpus=cpus, idle_s=idle, ours_s=ours)


def foreign_load(before: CpuReading, after: CpuReading, idle_cores: float) -> str | None:
    """Why the window between two readings was disturbed by other processes' CPU use, or
    None. ``idle_cores``: the cores the run left idle, which others may use freely."""
    if before.idle_s is None or after.idle_s is None or before.cpus != after.cpus:
        return None
    wall, cpus = after.wall_s - before.wall_s, after.cpus
    if wall <= 0:
        return None
    busy = cpus * wall - (after.idle_s - before.idle_s)
    # a thread that started in the window counts from zero; one that ended is lost (counted
    # as foreign: the guard errs towards calling a run disturbed)
    ours = sum(seconds - before.ours_s.get(task, 0.0) for task, seconds in after.ours_s.items())
    foreign_cores = (busy - ours) / wall
    allowance = TICK_ALLOWANCE * _TICK_S * math.sqrt(cpus) / wall
    if foreign_cores <= max(0.0, idle_cores) + FOREIGN_MARGIN_CORES + allowance:
        return None
    return f"other processes used {foreign_cores:.1f} of {cpus} cores during the run"


def reference_slowdown(before_s: float, after_s: float, typical_s: float | None) -> str | None:
    """Why the reference kernel's times before and after a run show a slower machine, or
    None. ``typical_s``: the kernel's typical time this session (None: too few to tell)."""
    slowest = max(before_s, after_s)
    if typical_s is None or slowest <= REFERENCE_SLOWDOWN * typical_s:
        return None
    when = "after" if after_s >= before_s else "before"
    return f"a reference kernel ran {slowest / typical_s:.1f}x slower {when} the run than is typical"


def wide_spread(samples_ms: Sequence[float]) -> str | None:
    """Why the iterations' spread shows a disturbed run, or None."""
    if len(samples_ms) < SPREAD_MIN_SAMPLES:
        return None
    p10, p90 = np.percentile(samples_ms, [10, 90])
    if p90 - p10 <= SPREAD_FLOOR_MS or p90 <= SPREAD_LIMIT * p10:
        return None
    return f"its iterations spread {p90 / p10:.1f}x from p10 to p90"


class ReferenceKernel:
    """A fixed millisecond of pure-Python work, and how long it typically took this session."""

    def __init__(self) -> None:
        self.times_s: deque[float] = deque(maxlen=_REFERENCE_HISTORY)

    @property
    def typical_s(self) -> float | None:
        """The median of its latest times (None before ``REFERENCE_MIN_TIMES``)."""
        return float(np.median(self.times_s)) if len(self.times_s) >= REFERENCE_MIN_TIMES else None

    def time(self) -> float:
        """Best of a few runs of the kernel, in seconds."""
        best = math.inf
        for _ in range(_REFERENCE_RUNS):
            start = time.perf_counter()
            total = 0
            for i in range(_REFERENCE_LOOP):
                total += i * i
            best = min(best, time.perf_counter() - start)
        self.times_s.append(best)
        return best


_REFERENCE = ReferenceKernel()


class Watch:
    """The evidence around one timed run: create it just before the run, ask ``disturbance``
    just after."""

    def __init__(self, process_ids: Callable[[], Sequence[int]]) -> None:
        """``process_ids``: the engine's processes (their CPU time is ours, not foreign)."""
        self._process_ids = process_ids
        self._reference_before = _REFERENCE.time()
        self._before = read_cpu(process_ids())

    def disturbance(self, ranks: int, samples_ms: Sequence[float]) -> str | None:
        """Why the run of ``ranks`` ranks was disturbed ("; "-joined reasons), or None when it
        ran clean: the host's evidence and the iterations' own spread (``own_spread``)."""
        return join_reasons(self.host_disturbance(ranks), own_spread(ranks, samples_ms))

    def host_disturbance(self, ranks: int) -> str | None:
        """The host's evidence alone (foreign load, the reference kernel) over the window,
        judged for runs of up to ``ranks`` ranks: what a round's interleaved runs share."""
        reference_after = _REFERENCE.time()  # at once: the pause below lets the core idle
        time.sleep(max(0.0, self._before.wall_s + MIN_WINDOW_S - time.monotonic()))
        after = read_cpu(self._process_ids())
        busy_cores = min(available_cores(), ranks * threads_per_rank(ranks))
        return join_reasons(
            foreign_load(self._before, after, available_cores() - busy_cores),
            reference_slowdown(self._reference_before, reference_after, _REFERENCE.typical_s),
        )


def own_spread(ranks: int, samples_ms: Sequence[float]) -> str | None:
    """Why the iterations of a run of ``ranks`` ranks spread too far (``wide_spread``), or
    None; ranks that share cores spread their iterations themselves, so not for them."""
    return None if oversubscribed(ranks) else wide_spread(samples_ms)


def join_reasons(*reasons: str | None) -> str | None:
    """The given reasons "; "-joined, or None when there are none."""
    return "; ".join(reason for reason in reasons if reason) or None
