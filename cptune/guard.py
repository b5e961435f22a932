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
  evidence is skipped. On a cluster each other node's first rank reads its node's accounts,
  and nodes whose readings count the same CPUs (one kernel, the same CPU numbers: containers
  or namespaces of one machine, as the two-node testbed's) are judged as one, each one's
  ranks ours on all of them: a node's own cluster is no foreign load there.
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

The evidence is always gathered and a disturbed run always stored marked: a timing taken
under load is never stored as clean. What the guard does about it (``enabled``): where a
calibration step was disturbed, or a search is to visit again a configuration whose last
visit was, it waits for the host to quiet down (``wait_for_quiet``: a countdown on stderr
naming the processes taking the cores, up to ``patience_s``) and times it again.
``CPTUNE_GUARD=off`` (a host known to be shared) skips the waiting and the timing again:
the calibration keeps its timings, the search its marked visits.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cptune._waiting import WaitLine
from cptune.errors import CPTuneError, EngineError
from cptune.measurement import available_cores, boot_id, oversubscribed, process_stat, threads_per_rank

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

#: Seconds the guard waits for a busy host to quiet down before it gives up
#: (``$CPTUNE_GUARD_PATIENCE`` overrides): other work of a few minutes passes, a host that
#: stays busy longer is better measured later.
PATIENCE_S = 180.0
#: Seconds of each look at the host while waiting for it to quiet down.
QUIET_LOOK_S = 1.0
#: The processes named as taking the cores: the busiest few, from this share of a core on.
TOP_PROCESSES = 3
TOP_MIN_CORES = 0.1

_REFERENCE_LOOP = 30_000
_REFERENCE_RUNS = 5
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

#: A thread of one of our processes: (pid, tid).
Task = tuple[int, int]


class GuardSettingError(CPTuneError, ValueError):
    """``$CPTUNE_GUARD`` holds neither "on" nor "off", or ``$CPTUNE_GUARD_PATIENCE`` no
    number of seconds."""


def enabled() -> bool:
    """Whether the guard waits for quiet and times disturbed work again: yes, unless
    ``$CPTUNE_GUARD`` is "off" (the evidence is gathered and stored either way)."""
    setting = os.environ.get("CPTUNE_GUARD", "on")
    if setting not in ("on", "off"):
        raise GuardSettingError(f"CPTUNE_GUARD must be 'on' or 'off', got {setting!r}: "
                                f"fix it or unset it (the guard is on by default)")
    return setting == "on"


def patience_s() -> float:
    """How long the guard waits for a busy host to quiet down: ``$CPTUNE_GUARD_PATIENCE``
    seconds, else ``PATIENCE_S``."""
    setting = os.environ.get("CPTUNE_GUARD_PATIENCE")
    if setting is None:
        return PATIENCE_S
    try:
        value = float(setting)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 86_400:
        raise GuardSettingError(f"CPTUNE_GUARD_PATIENCE must be seconds from 0 to 86400, got {setting!r}: "
                                f"fix it or unset it (default {PATIENCE_S:.0f})")
    return value


@dataclass(frozen=True)
class CpuReading:
    """The CPU accounts at one moment: idle seconds so far (idle and waiting for I/O) of
    ``cpus`` CPUs, ours (None: no /proc/stat), and CPU seconds so far of each thread of our
    processes. ``cpu_set`` says which CPUs they are of (the kernel's boot id and the CPU
    numbers; "" where unknown): readings of one set, taken by processes in other namespaces
    of one machine, count the same CPUs."""

    wall_s: float
    cpus: int
    idle_s: float | None
    ours_s: dict[Task, float]
    cpu_set: str = ""

    def ours_since(self, before: CpuReading) -> float:
        """CPU seconds our processes used since ``before`` (a thread that started since counts
        from zero; one that ended is lost)."""
        return sum(seconds - before.ours_s.get(task, 0.0) for task, seconds in self.ours_s.items())


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
    affinity = os.sched_getaffinity(0)
    cpus, idle = _idle_seconds(affinity)
    return CpuReading(wall_s=time.monotonic(), cpus=cpus, idle_s=idle, ours_s=ours,
                      cpu_set=_cpu_set(frozenset(affinity)))


@functools.cache
def _cpu_set(cpus: frozenset[int]) -> str:
    """``CpuReading.cpu_set`` of ``cpus`` on this kernel ("" where its boot id is unknown)."""
    boot = boot_id()
    return f"{boot}:{','.join(map(str, sorted(cpus)))}" if boot else ""


def foreign_cores(before: CpuReading, after: CpuReading, idle_cores: float,
                  also_ours_s: float = 0.0) -> float | None:
    """The cores other processes used between two readings when that is more than
    ``idle_cores`` (the cores a run leaves idle, which others may use freely) allow, else
    None (or when the readings cannot tell). ``also_ours_s``: CPU seconds our processes the
    readings cannot see used on these CPUs meanwhile (another node's ranks on this machine)."""
    if before.idle_s is None or after.idle_s is None or before.cpus != after.cpus:
        return None
    wall, cpus = after.wall_s - before.wall_s, after.cpus
    if wall <= 0:
        return None
    busy = cpus * wall - (after.idle_s - before.idle_s)
    # a thread that ended in the window is lost (counted as foreign: the guard errs towards
    # calling a run disturbed)
    foreign = (busy - after.ours_since(before) - also_ours_s) / wall
    allowance = TICK_ALLOWANCE * _TICK_S * math.sqrt(cpus) / wall
    return None if foreign <= max(0.0, idle_cores) + FOREIGN_MARGIN_CORES + allowance else foreign


def foreign_load(before: CpuReading, after: CpuReading, idle_cores: float,
                 also_ours_s: float = 0.0) -> str | None:
    """Why the window between two readings was disturbed by other processes' CPU use, or
    None. ``idle_cores``: the cores the run left idle, which others may use freely;
    ``also_ours_s`` as ``foreign_cores`` takes it."""
    foreign = foreign_cores(before, after, idle_cores, also_ours_s)
    if foreign is None:
        return None
    return f"other processes used {foreign:.1f} of {after.cpus} cores during the run"


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


#: Each other node's CPU accounts, read by its first rank, by the node's name.
NodeReadings = Callable[[], dict[str, CpuReading]]


class Watch:
    """The evidence around one timed run: create it just before the run, ask ``disturbance``
    just after."""

    def __init__(self, process_ids: Callable[[], Sequence[int]], nodes: NodeReadings | None = None) -> None:
        """``process_ids``: the engine's processes (their CPU time is ours, not foreign);
        ``nodes``: the CPU accounts of the cluster's other nodes (``Engine.node_readings``),
        each judged as this host is."""
        self._process_ids = process_ids
        self._nodes = nodes or dict
        self._unread: str | None = None
        self._reference_before = _REFERENCE.time()
        self._before = read_cpu(process_ids())
        self._nodes_before = self._read_nodes()

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
        nodes_after = self._read_nodes()
        machines = _by_machine(self._nodes_before, nodes_after)
        # nodes on this host's CPUs (namespaces or containers of this machine): their ranks are ours here
        here = machines.pop(after.cpu_set, []) if after.cpu_set else []
        elsewhere = [f"on {' and '.join(node for node, _, _ in nodes)}, {reason}"
                     for nodes in machines.values()
                     if (reason := foreign_load(nodes[0][1], nodes[0][2], 0.0, _ours_s(nodes[1:])))]
        return join_reasons(
            foreign_load(self._before, after, idle_cores(ranks), _ours_s(here)),
            reference_slowdown(self._reference_before, reference_after, _REFERENCE.typical_s),
            *elsewhere,
            self._unread,
        )

    def _read_nodes(self) -> dict[str, CpuReading]:
        """The other nodes' readings; none when their ranks are lost as they are asked (the
        window then counts as disturbed, and the runs meet the loss as a failure)."""
        try:
            return self._nodes()
        except EngineError as error:
            self._unread = f"the other nodes' load could not be read ({str(error).splitlines()[0]})"
            return {}


#: A node's name and its readings before and after a window.
NodeWindow = tuple[str, CpuReading, CpuReading]


def _by_machine(before: dict[str, CpuReading], after: dict[str, CpuReading]) -> dict[str, list[NodeWindow]]:
    """Each node read both times, grouped by the CPUs its readings count (``cpu_set``; a node
    whose CPUs are unknown, alone under its name): nodes of one group share a machine's CPUs,
    so each one's ranks are the others' too, not foreign load."""
    machines: dict[str, list[NodeWindow]] = {}
    for node, reading in after.items():
        if node in before:
            machines.setdefault(reading.cpu_set or node, []).append((node, before[node], reading))
    return machines


def _ours_s(windows: Iterable[NodeWindow]) -> float:
    """CPU seconds the processes of ``windows``' nodes used in them, as their readings count."""
    return sum(after.ours_since(before) for _, before, after in windows)


def idle_cores(ranks: int) -> float:
    """The cores of this host a run of ``ranks`` ranks leaves idle (others may use them)."""
    return available_cores() - min(available_cores(), ranks * threads_per_rank(ranks))


def own_spread(ranks: int, samples_ms: Sequence[float]) -> str | None:
    """Why the iterations of a run of ``ranks`` ranks spread too far (``wide_spread``), or
    None; ranks that share cores spread their iterations themselves, so not for them."""
    return None if oversubscribed(ranks) else wide_spread(samples_ms)


def join_reasons(*reasons: str | None) -> str | None:
    """The given reasons "; "-joined, or None when there are none."""
    return "; ".join(reason for reason in reasons if reason) or None


# --------------------------------------------------------------------------- waiting for quiet


@dataclass(frozen=True)
class Busy:
    """A process other than ours taking CPU: its pid, command name and cores used."""

    pid: int
    name: str
    cores: float

    def describe(self) -> str:
        return f"pid {self.pid} {self.name} ({self.cores:.0%} of a core)"


def read_processes() -> dict[int, tuple[str, float]]:
    """Every process of this host now: pid -> (command name, CPU seconds so far), from
    ``/proc/<pid>/stat`` (empty without ``/proc``)."""
    processes: dict[int, tuple[str, float]] = {}
    try:
        entries = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:
        return processes
    for pid in entries:
        try:
            name, fields = process_stat(int(pid)) or ("", [])
            processes[int(pid)] = (name, (int(fields[11]) + int(fields[12])) * _TICK_S)  # utime + stime
        except (ValueError, IndexError):
            continue  # ended meanwhile
    return processes


def busiest(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall_s: float,
            ours: Iterable[int]) -> list[Busy]:
    """The ``TOP_PROCESSES`` processes not in ``ours`` that used the most CPU between two
    ``read_processes`` readings ``wall_s`` apart, busiest first, from ``TOP_MIN_CORES`` on."""
    if wall_s <= 0:
        return []
    skip = set(ours)
    busy = [Busy(pid, name, (seconds - before[pid][1]) / wall_s) for pid, (name, seconds) in after.items()
            if pid in before and pid not in skip]
    busy = [b for b in busy if b.cores >= TOP_MIN_CORES]
    return sorted(busy, key=lambda b: -b.cores)[:TOP_PROCESSES]


@dataclass
class HostReader:
    """Where ``wait_for_quiet`` reads the host from and how it passes time (tests give their own)."""

    cpu: Callable[[Iterable[int]], CpuReading] = read_cpu
    processes: Callable[[], dict[int, tuple[str, float]]] = read_processes
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


def host_load(ranks: int, process_ids: Callable[[], Sequence[int]], reader: HostReader | None = None
              ) -> str | None:
    """One look of ``QUIET_LOOK_S`` at the host: None when other processes leave its cores
    free for a run of ``ranks`` ranks (judged as ``foreign_load`` judges a run), else their
    load in words, the busiest of them named ("other processes use 1.0 of 2 cores: pid ...")."""
    reader = reader or HostReader()
    ours = {os.getpid(), *process_ids()}
    cpu_before, processes_before = reader.cpu(ours), reader.processes()
    reader.sleep(QUIET_LOOK_S)
    cpu_after, processes_after = reader.cpu(ours), reader.processes()
    foreign = foreign_cores(cpu_before, cpu_after, idle_cores(ranks))
    if foreign is None:
        return None
    who = busiest(processes_before, processes_after, cpu_after.wall_s - cpu_before.wall_s, ours)
    return f"other processes use {foreign:.1f} of {cpu_after.cpus} cores" + (
        f": {', '.join(b.describe() for b in who)}" if who else "")


def busy_notice(ranks: int, process_ids: Callable[[], Sequence[int]], reader: HostReader | None = None
                ) -> str | None:
    """Where the host is busy now for a run of ``ranks`` ranks (``host_load``), one line saying
    so and what the guard will do; None on a quiet host."""
    load = host_load(ranks, process_ids, reader)
    if load is None:
        return None
    allowed = max(0.0, idle_cores(ranks)) + FOREIGN_MARGIN_CORES
    return (f"the host is busy ({load}): a timing counts when other processes use at most {allowed:.2f} "
            f"of {available_cores()} cores beside it, so each disturbed one waits up to {patience_s():.0f} s "
            f"for that (CPTUNE_GUARD_PATIENCE) and runs again; what runs clean is kept, and a rerun goes on "
            f"from it (CPTUNE_GUARD=off measures anyway, marked disturbed)")


def wait_for_quiet(ranks: int, process_ids: Callable[[], Sequence[int]], patience: float,
                   what: str, reader: HostReader | None = None, line: WaitLine | None = None) -> str | None:
    """Wait until other processes leave this host's cores free for a run of ``ranks`` ranks
    (the foreign load over a look of ``QUIET_LOOK_S``, judged as ``foreign_load`` judges a
    run), at most ``patience`` seconds, with a countdown naming the busiest other processes
    on ``line`` (default: stderr). ``what`` names what waits. None once the host is quiet;
    why not (the load and who) once patience ran out."""
    reader = reader or HostReader()
    line = line or WaitLine(clock=reader.clock)
    deadline = reader.clock() + patience
    try:
        while True:
            load = host_load(ranks, process_ids, reader)
            if load is None:
                return None
            left = deadline - reader.clock()
            if left <= 0:
                return f"the host stayed busy for {patience:.0f} s ({load})"
            line.show(f"{what}: waiting for the host to quiet down, {left:.0f} s left ({load}); "
                      f"CPTUNE_GUARD=off measures anyway, marked disturbed")
    finally:
        line.end()
