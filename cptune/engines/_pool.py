"""The supervised worker pool every engine's ranks run in, and the engine base that keeps one.

The calling process never initialises MPI. It starts ``mpiexec`` with a pool of worker
ranks (``cptune.engines._worker``, or an engine's own) once, keeps it for every later run (a search does
not pay process start-up per trial) and talks to each rank over a private Unix socket. On a
cluster (``Cluster``, ``--hosts``) mpiexec starts the ranks on every node, and they reach the
driver over TCP, each showing the pool's random token. Every wait has a deadline; a rank that
raises, dies or overruns ends the pool with one ``EngineError`` naming it (and its node) and no
process left behind, and a fresh pool starts on the next call. The ranks watch the driver too:
if it is killed, they exit. Which engine's task a rank runs is named in each "run" request, so
every engine shares this one supervisor.

A pool's folder in the temporary directory names its owner (pid and start time): a driver
killed outright (SIGKILL) cannot remove it, so each new pool removes this user's folders
whose owner is gone (``remove_stale_folders``). The command line turns SIGTERM and SIGHUP
into a normal exit, which stops the pools and removes their folders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import itertools
import os
import secrets
import select
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cptune.config import CPConfig
from cptune.engines import EngineSpec, NodeVerdict, Trained, check_runs
from cptune.engines import _protocol as protocol
from cptune.errors import CPTuneError, EngineError
from cptune.guard import CpuReading
from cptune.hardware import Cluster, Hardware, this_host
from cptune.measurement import available_cores, machine_id, process_stat, threads_per_rank
from cptune.reference import TOLERANCE
from cptune.workload import Workload


def worker_command(module: str) -> list[str]:
    """The command of one rank running ``module``. -P: the ranks must not import a cptune
    from their working directory; PYTHONPATH (set when the pool starts) points them at the
    very package this process imported."""
    return [sys.executable, "-P", "-m", module]

_OUTPUT_TAIL_LINES = 15
#: What to do about a run that overran the deadline its caller set, wherever they set it.
RAISE_RUN_DEADLINE = ("if the run is just slow, allow it more time: --timeout of cptune measure, timeout in "
                      "a search space's [measure] table, or timeout= in Python")
#: ... and one that overran a deadline of cptune's own (calibration, an engine build, a probe).
FIXED_DEADLINE = "this deadline is fixed: if the machine was busy, run again when it is quiet"
#: How long a rank's failure waits to see whether a peer died with it (a killed peer's
#: connection closes as its process ends, as its collectives fail on the others).
_PEER_GRACE_S = 0.1
#: ... and, once mpiexec has exited, for the connection of the rank whose death ended it: a
#: killed process's exit (its memory released) can outlast its node's hydra proxy, on a
#: loaded host by most of a second.
_EXITED_GRACE_S = 2.0
#: The file in a pool's folder naming the process that owns it: "<pid> <start time>".
OWNER_FILE = "owner"


class NodeBusyError(CPTuneError):
    """Another cptune measures on a node of the cluster: nothing is run (a search keeps what
    it stored before)."""


def seconds_text(seconds: float) -> str:
    """``seconds`` for a message: two significant digits under 10 s (0.5 s, never "0 s"), whole
    seconds above."""
    return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"


def _started(pid: int) -> str:
    """When process ``pid`` started (clock ticks after boot, /proc's field 22), to tell it
    from a later process given the same pid; "" where unknown (no /proc, no such process)."""
    _, fields = process_stat(pid) or ("", [])
    return fields[19] if len(fields) > 19 else ""


def _owner_alive(owner: str) -> bool:
    """Whether the process an owner file names ("<pid> <start time>") still runs."""
    pid_text, _, started = owner.partition(" ")
    pid = int(pid_text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process has the pid now: compare start times
    return not started.strip() or _started(pid) in ("", started.strip())


def remove_stale_folders(prefix: str) -> list[Path]:
    """Remove the pool folders (``prefix``*) of this user in the temporary directory whose
    owning process is gone (killed before it could remove them); the folders removed. A folder
    without an owner file, of another user, or whose owner runs, is left alone."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            if folder.is_symlink() or not folder.is_dir() or folder.stat().st_uid != os.getuid():
                continue
            if _owner_alive((folder / OWNER_FILE).read_text()):
                continue
        except (OSError, ValueError):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def find_mpiexec() -> str:
    """The mpiexec that belongs to the MPI mpi4py loads: the MPICH wheel puts it next to
    this Python's scripts. Its directory also holds hydra's proxy, which mpiexec needs."""
    scripts = sysconfig.get_path("scripts")
    found = shutil.which("mpiexec", path=os.pathsep.join([scripts, os.environ.get("PATH", "")]))
    if found is None:
        raise EngineError(
            "launch",
            "no mpiexec found: install the MPI library wheel into this environment "
            "(pip install mpich) or put an MPICH mpiexec on PATH",
        )
    return found


def rank_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a rank this process starts: its own, ``extra`` added, and
    PYTHONPATH leading to the very cptune this process imported."""
    env = {**os.environ, **(extra or {})}
    package_root = str(Path(__file__).resolve().parents[2])  # the directory holding this cptune
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


#: Where the driver listens for ranks on other nodes: an address (or host name) of this host
#: they reach. Default: the address this host reaches the last node from.
DRIVER_ADDRESS_VARIABLE = "CPTUNE_DRIVER_ADDRESS"
#: Extra mpiexec arguments for a pool across nodes (shell words): how Hydra reaches the nodes
#: (``-launcher slurm``, ``-launcher ssh -launcher-exec PATH``) and which interface its
#: proxies use (``-iface ib0``).
MPIEXEC_ARGUMENTS_VARIABLE = "CPTUNE_MPIEXEC_ARGS"


def driver_host(peer: str) -> str:
    """The address of this host that ranks on other nodes connect to: ``$CPTUNE_DRIVER_ADDRESS``,
    else the one this host's routes reach ``peer`` (another node) from."""
    if chosen := os.environ.get(DRIVER_ADDRESS_VARIABLE):
        return chosen
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # sends nothing: routes only
        try:
            probe.connect((peer, 9))
        except OSError as exc:
            raise EngineError(
                "launch", f"no route from this host to {peer} ({exc.strerror}): set "
                          f"{DRIVER_ADDRESS_VARIABLE} to an address the nodes reach") from None
        address = str(probe.getsockname()[0])
    if address.startswith("127."):
        raise EngineError("launch", f"this host reaches {peer} over loopback, which other nodes cannot: set "
                                    f"{DRIVER_ADDRESS_VARIABLE} to an address of this host the nodes reach")
    return address


def mpiexec_arguments() -> list[str]:
    """``$CPTUNE_MPIEXEC_ARGS`` as mpiexec's arguments."""
    return shlex.split(os.environ.get(MPIEXEC_ARGUMENTS_VARIABLE, ""))


class WorkerPool:
    """``size`` worker ranks under one mpiexec, each connected to this process."""

    def __init__(self, size: int, worker: Sequence[str], start_timeout: float,
                 env: Mapping[str, str] | None = None, cluster: Cluster | None = None) -> None:
        mpiexec = find_mpiexec()
        self._prepare(size, "cptune-pool-", cluster)
        env = rank_environment(env)
        env["PATH"] = os.pathsep.join([str(Path(mpiexec).parent), env.get("PATH", "")])
        if cluster is None:
            listener, address = self._unix_listener(size)
            placement: list[str] = []
        else:
            listener, address = self._tcp_listener(size, cluster)
            env[protocol.TOKEN_VARIABLE] = self.token
            env[protocol.DRIVER_MACHINE_VARIABLE] = machine_id()
            placement = ["-hosts", cluster.hydra_hosts(), *mpiexec_arguments()]
        command = [mpiexec, *placement, "-n", str(size), *worker,
                   "--socket", address, "--driver-pid", str(os.getpid())]
        self._start(command, env, listener, start_timeout)

    def _unix_listener(self, size: int) -> tuple[socket.socket, str]:
        """The pool's Unix socket, in its private folder: for ranks on this host."""
        address = self.dir / "driver.sock"
        try:
            return protocol.unix_listener(address, size), str(address)
        except OSError as exc:
            self._discard()
            raise EngineError("launch", f"cannot open the pool's socket {address} ({exc.strerror}): point "
                                        f"TMPDIR at a writable local directory") from None

    def _tcp_listener(self, size: int, cluster: Cluster) -> tuple[socket.socket, str]:
        """A TCP socket the ranks of every node reach (``driver_host``); only ranks that send
        the pool's token are taken."""
        host = driver_host(cluster.hosts[-1])
        try:
            listener = socket.create_server((host, 0), backlog=size)
        except OSError as exc:
            self._discard()
            raise EngineError("launch", f"cannot listen for the ranks at {host} ({exc.strerror}): set "
                                        f"{DRIVER_ADDRESS_VARIABLE} to an address of this host the nodes "
                                        f"reach") from None
        return listener, protocol.tcp_address(host, listener.getsockname()[1])

    def _prepare(self, size: int, prefix: str, cluster: Cluster | None = None) -> None:
        """The pool's state before any rank connects: its directory and the ranks' log."""
        self.size = size
        self.cluster = cluster
        self.token = secrets.token_hex(16)
        remove_stale_folders(prefix)
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        (self.dir / OWNER_FILE).write_text(f"{os.getpid()} {_started(os.getpid())}")
        self.log = open(self.dir / "ranks.log", "w+b")  # noqa: SIM115 - lives as long as the pool
        self.socks: dict[int, socket.socket] = {}
        self.pids: list[int] = []
        #: The first rank of each node on another machine: it reads its node's load.
        self.node_firsts: list[int] = []
        self.mpi_library = ""
        self.allocator = ""

    def _start(self, command: Sequence[str], env: Mapping[str, str], listener: socket.socket,
               start_timeout: float) -> None:
        """Run ``command`` in a session of its own, its output into the pool's log, and wait
        until every rank has connected to ``listener`` (closed after); a failure ends the ranks."""
        try:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )
        except BaseException:
            listener.close()
            self._discard()
            raise
        try:
            self._accept(listener, start_timeout)
        except BaseException:
            self.kill()
            raise
        finally:
            listener.close()

    def _accept(self, listener: socket.socket, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        listener.settimeout(0.2)
        while len(self.socks) < self.size:
            if self.proc.poll() is not None:
                raise EngineError(
                    "launch",
                    f"the MPI worker pool exited during start-up (code {self.proc.returncode}):\n"
                    f"{self.output_tail()}",
                )
            if time.monotonic() > deadline:
                raise EngineError(
                    "launch",
                    f"only {len(self.socks)} of {self.size} ranks started within {seconds_text(timeout)}; "
                    f"the machine may be overloaded. Output so far:\n{self.output_tail()}",
                )
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(max(1.0, deadline - time.monotonic()))
            try:
                hello, _ = protocol.receive(conn)
            except OSError as exc:  # the rank died (or its job was ended) between connecting and hello
                conn.close()
                raise EngineError(
                    "launch", f"a rank was lost during start-up ({exc}). Output so far:\n{self.output_tail()}"
                ) from None
            conn.settimeout(None)
            if self.cluster is not None and not hmac.compare_digest(str(hello.get("token", "")), self.token):
                conn.close()  # not one of this pool's ranks
                continue
            self.socks[hello["rank"]] = conn
            if (busy := hello.get("busy")) and self.cluster is not None:
                node = self.cluster.node_name(self.cluster.node_of(hello["rank"]))
                raise NodeBusyError(f"{node} has another cptune measuring there ({busy}): one measures at a "
                                    f"time on each node; run again when it is done")
            if hello.get("machine") == machine_id():  # a pid means something here only
                self.pids += [hello["pid"], hello["parent_pid"]]
            elif self.cluster is not None and hello["rank"] % self.cluster.ranks_per_node == 0:
                self.node_firsts.append(hello["rank"])
            self.mpi_library = hello["mpi_library"]
            self.allocator = hello["allocator"]

    def where(self, rank: int) -> str:
        """Rank ``rank`` for a message, with its node on a cluster."""
        return f"rank {rank}" if self.cluster is None else self.cluster.where(rank)

    def output_tail(self) -> str:
        self.log.flush()
        text = (self.dir / "ranks.log").read_text(errors="replace").strip()
        lines = text.splitlines()[-_OUTPUT_TAIL_LINES:]
        return "\n".join("    " + line for line in lines) if lines else "    (no output)"

    def request(
        self, messages: dict[int, protocol.Message], timeout: float, what: str, *, caller_set: bool
    ) -> dict[int, protocol.Message]:
        """Send each rank its message and collect every reply; on any failure stop the pool
        and raise one ``EngineError`` naming the rank(s) and what happened. ``caller_set``:
        whether ``timeout`` is the deadline of a run the caller may raise (else cptune's own),
        for the advice when it passes."""
        try:
            if self.proc.poll() is not None:  # the ranks ended since the last request
                self._crashed_peer(what, _EXITED_GRACE_S, when="before")
                self._crashed(what, f"mpiexec exited with code {self.proc.returncode}", when="before")
            for rank, (header, arrays) in messages.items():
                try:
                    protocol.send(self.socks[rank], header, arrays)
                except OSError as exc:
                    self._crashed(what, f"{self._lost(self._dead_ranks(0.0) or [rank])} ({exc})")
            return self._collect(set(messages), timeout, what, caller_set)
        except BaseException:  # the ranks' state is unknown (also after Ctrl-C): stop them
            self.kill()
            raise

    def _collect(self, waiting: set[int], timeout: float, what: str,
                 caller_set: bool) -> dict[int, protocol.Message]:
        deadline = time.monotonic() + timeout
        replies: dict[int, protocol.Message] = {}
        with selectors.DefaultSelector() as selector:
            for rank in waiting:
                selector.register(self.socks[rank], selectors.EVENT_READ, rank)
            while waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    ranks = ", ".join(self.where(rank) for rank in sorted(waiting))
                    advice = RAISE_RUN_DEADLINE if caller_set else FIXED_DEADLINE
                    raise EngineError(
                        "timeout",
                        f"rank(s) {ranks} did not finish {what} within {seconds_text(timeout)}, so the "
                        f"ranks were stopped. A hang points at a deadlock; {advice}.",
                    )
                if self.proc.poll() is not None:
                    self._crashed_peer(what, _EXITED_GRACE_S)  # whose death ended mpiexec
                    self._crashed(what, f"mpiexec exited with code {self.proc.returncode}")
                for key, _ in selector.select(timeout=min(remaining, 0.25)):
                    rank = key.data
                    sock = self.socks[rank]
                    sock.settimeout(max(1.0, deadline - time.monotonic()))
                    try:
                        header, arrays = protocol.receive(sock)
                    except OSError:  # closed, reset or stalled mid-message
                        self._crashed(what, self._lost(self._dead_ranks(0.0) or [rank]))
                    sock.settimeout(None)
                    if not header.get("ok"):
                        self._crashed_peer(what)  # the cause, where a peer died
                        raise EngineError(
                            header.get("kind", "error"),
                            f"{self.where(rank)} failed running {what}:\n{header.get('error', '').rstrip()}",
                        )
                    replies[rank] = (header, arrays)
                    waiting.discard(rank)
                    selector.unregister(sock)
        return replies

    def _crashed_peer(self, what: str, grace: float = _PEER_GRACE_S, when: str = "while") -> None:
        """The crash of the ranks that have died (their connections closed) within ``grace``
        seconds, if any: a rank whose collective failed because its peer was killed reports
        an error, and mpiexec ends as a node's proxy is killed; the deaths are what happened."""
        if dead := self._dead_ranks(grace):
            self._crashed(what, self._lost(dead), when)

    def _dead_ranks(self, grace: float) -> list[int]:
        """The ranks whose connection to this process has closed, waiting up to ``grace``
        seconds for the first."""
        deadline = time.monotonic() + grace
        while True:
            dead = [rank for rank, sock in sorted(self.socks.items()) if _closed(sock)]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def _lost(self, ranks: Sequence[int]) -> str:
        """``ranks`` died, for a message, each node's together: "rank 3 (node 1, b) died",
        "ranks 0, 1 (node 0, a) and 2, 3 (node 1, b) died" (every rank of a cluster dies with
        mpiexec, soon after the node that was lost: all that are gone by then are named)."""
        noun = "rank" if len(ranks) == 1 else "ranks"
        if self.cluster is None:
            return f"{noun} {', '.join(map(str, ranks))} died"
        cluster = self.cluster
        parts = [f"{', '.join(map(str, group))} (node {node}, {cluster.hosts[node]})"
                 for node, group in itertools.groupby(ranks, cluster.node_of)]
        return f"{noun} {' and '.join(parts)} died"

    def _crashed(self, what: str, how: str, when: str = "while") -> None:
        """Stop the pool and raise the ``EngineError`` "crash": ``how`` a rank was lost
        ``when`` ("while" or "before") running ``what``, with the ranks' last output."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2.0)
        code = self.proc.returncode
        killed = code is not None and code in (-signal.SIGKILL, 128 + signal.SIGKILL, 137)
        hint = " (killed: possibly out of memory)" if killed else ""
        tail = self.output_tail()
        self.kill()
        raise EngineError(
            "crash",
            f"a rank crashed {when} running {what}: {how}{hint}. Last output of the ranks:\n{tail}",
        )

    def close(self) -> None:
        """Ask the ranks to exit; force them after a grace period."""
        for sock in self.socks.values():
            with contextlib.suppress(OSError):
                protocol.send(sock, {"op": "exit"})
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        self.kill()

    def kill(self) -> None:
        """Stop every process of the pool now and remove its files (idempotent)."""
        if self.log.closed:
            return
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()
        self.pids.clear()
        self._discard()

    def _discard(self) -> None:
        """Close the ranks' log and remove the pool's folder (its processes are gone)."""
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _closed(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` has closed it (or reset it), also where what it sent
    before it died is still unread (a rank killed after its reply): Linux's POLLRDHUP says
    so, where a peek would return the data and hide the end."""
    if hasattr(select, "POLLRDHUP"):
        poller = select.poll()
        poller.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))
    try:  # elsewhere the end shows once the data before it is read
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def on_cluster(node: Hardware, cluster: Cluster | None, network: str) -> Hardware:
    """``node`` as one of ``cluster``'s equal nodes joined by ``network`` (``node`` itself
    without a cluster): the hosts, nodes x ranks per node and both tiers in its fingerprint."""
    if cluster is None:
        return node
    return dataclasses.replace(node, host=",".join(cluster.hosts), nodes=cluster.nodes,
                               ranks_per_node=cluster.ranks_per_node, network=network)


#: How long a node's first rank may take to read its node's load.
_NODE_LOAD_TIMEOUT_S = 10.0


def _reading(header: Mapping[str, Any]) -> CpuReading:
    """A node's CPU accounts as its rank sent them (``_worker.node_reading``)."""
    ours: dict[tuple[int, int], float] = {}
    for task, seconds in header["ours_s"].items():
        pid, _, tid = task.partition(":")
        ours[(int(pid), int(tid))] = float(seconds)
    return CpuReading(wall_s=float(header["wall_s"]), cpus=int(header["cpus"]),
                      idle_s=None if header["idle_s"] is None else float(header["idle_s"]), ours_s=ours,
                      cpu_set=str(header.get("cpu_set", "")))


class PooledEngine:
    """Base of the engines whose ranks run in a ``WorkerPool``: keeps one pool, grows it when
    a run needs more ranks, and forgets it after any failure (the pool stopped itself).
    A subclass sets ``spec``; ``worker`` (default: the spec's worker module) is the command
    each rank runs. ``run``, ``time_collective`` and ``time_attention`` send the requests the
    shared rank loop and the torch ranks answer; an engine whose ranks want others overrides them."""

    spec: EngineSpec
    #: The largest relative error of an output, per workload dtype, ``measure`` accepts.
    tolerance: Mapping[str, float] = TOLERANCE

    def __init__(self, worker: Sequence[str] | None = None, start_timeout: float = 60.0,
                 hosts: Cluster | None = None) -> None:
        self.worker = list(worker) if worker is not None else worker_command(self.spec.worker)
        self.start_timeout = start_timeout
        self._hosts = hosts
        self._pool: WorkerPool | None = None
        self._timed_ranks = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def cluster(self) -> Cluster | None:
        """The nodes the ranks run on (``--hosts``); None: this host."""
        return self._hosts

    @property
    def hosts(self) -> Cluster | None:
        """The nodes this engine was given (``--hosts``); None: this host, or a launcher's."""
        return self._hosts

    @property
    def device(self) -> str:
        """Where this engine's ranks run on this machine: "cpu" or "gpu"."""
        return self.spec.device

    def preflight(self, ranks: int) -> None:
        """On one host nothing to check: CPU ranks run anywhere (more ranks than cores share
        them). On a cluster, ``ClusterError`` when the nodes hold fewer ranks or a host's name
        does not resolve."""
        if self._hosts is not None:  # the nodes given: a launcher's were placed already
            self._hosts.check_ranks(ranks)
            self._hosts.check_reachable()

    def capacity(self) -> int:
        """This host's cores, one rank each; a cluster's ranks."""
        return available_cores() if self.cluster is None else self.cluster.size

    def check_node(self, ranks: int | None = None) -> NodeVerdict:
        """Nothing only a run can tell: an empty verdict (the engine's runs are checked
        against the reference as they go)."""
        return NodeVerdict(ranks or 1)

    def hardware(self) -> Hardware:
        """This host: its CPU cores, linked by shared memory; on a cluster, its nodes (each
        taken to be like this one) and the network between them."""
        return on_cluster(this_host(), self.cluster, self._network())

    def _network(self) -> str:
        """How this engine's ranks on different nodes reach each other (a cluster's fingerprint)."""
        netmod = os.environ.get("MPIR_CVAR_CH4_NETMOD", "MPICH's default netmod")
        provider = os.environ.get("FI_PROVIDER")
        return f"MPI ({netmod}{f', libfabric {provider}' if provider else ''})"

    def _pool_for(self, ranks: int) -> WorkerPool:
        self.preflight(ranks)
        if self._pool is not None and self._pool.size < ranks:  # one that ended: its next request says so
            self.close()
        if self._pool is None:  # a cluster's pool has all its ranks: a start there is slow
            size = ranks if self.cluster is None else self.cluster.size
            self._pool = WorkerPool(size, self.worker, self.start_timeout, self._pool_env(), self.cluster)
        return self._pool

    def _pool_env(self) -> dict[str, str]:
        """Environment variables a new pool's ranks get beyond this process's own."""
        return {}

    def _request(
        self, messages: dict[int, protocol.Message], timeout: float, what: str, *, caller_set: bool
    ) -> dict[int, protocol.Message]:
        pool = self._pool
        assert pool is not None
        try:
            return pool.request(messages, timeout, what, caller_set=caller_set)
        except BaseException:
            self._pool = None  # request() already stopped it
            raise

    def _run(
        self, workload: Workload, config: CPConfig, arrays: Sequence[Sequence[np.ndarray]], timeout: float,
        what: str, **extra: object,
    ) -> tuple[list[list[np.ndarray]], list[int]]:
        """A "run" of ``config`` by this engine's rank side, rank r sent ``arrays[r]`` (its
        shard, and whatever else the engine's ranks need) and ``extra`` in the header: the
        arrays each rank returned (its output shard; a training run's gradients after it)
        and its peak bytes. The ranks keep the run for ``time``."""
        self._pool_for(config.ranks)
        header = {"op": "run", "engine": self.name, "workload": workload.to_dict(),
                  "config": config.to_dict(), **extra}
        messages = {rank: (header, list(sent)) for rank, sent in enumerate(arrays)}
        replies = self._request(messages, timeout, what, caller_set=True)
        return self._arrays(replies, config.ranks)

    def _arrays(self, replies: dict[int, protocol.Message],
                ranks: int) -> tuple[list[list[np.ndarray]], list[int]]:
        """Each rank's arrays and peak bytes from a run's ``replies``; the ranks keep the run
        for ``time``."""
        self._timed_ranks = ranks
        ordered = [replies[r] for r in range(ranks)]
        self._reported(ordered[0][0])
        return [list(arrays) for _, arrays in ordered], [int(h.get("peak_bytes", 0)) for h, _ in ordered]

    def _reported(self, header: dict) -> None:
        """What the first rank's reply to a run or a calibration op says it ran with (its
        header); an engine that records it for ``describe`` keeps it here, others ignore it."""

    def _ran(self, replies: dict[int, protocol.Message], ranks: int) -> tuple[list[np.ndarray], list[int]]:
        """Each rank's output shard and peak bytes from a run's ``replies`` (``_arrays``)."""
        arrays, peaks = self._arrays(replies, ranks)
        return [shard[0] for shard in arrays], peaks

    def time(self, warmup: int, repeats: int, timeout: float, what: str) -> np.ndarray:
        """Time the last ``run``: seconds [rank, iteration, (wall, compute, comm)]; after
        ``run_train`` with the forward's wall time last."""
        if self._pool is None or not self._timed_ranks:
            raise RuntimeError("time() needs a successful run() first")
        header = {"op": "time", "warmup": warmup, "repeats": repeats}
        replies = self._request({r: (header, []) for r in range(self._timed_ranks)}, timeout, what,
                                caller_set=True)
        return np.stack([replies[r][1][0] for r in range(self._timed_ranks)])

    def _threads(self, ranks: int) -> int:
        """Compute threads of each of ``ranks`` ranks: its share of its node's cores on CPUs."""
        if self.device != "cpu":
            return 1
        return threads_per_rank(ranks if self.cluster is None else min(ranks, self.cluster.ranks_per_node))

    def run(
        self, workload: Workload, config: CPConfig, shards: Sequence[tuple[np.ndarray, ...]],
        timeout: float,
    ) -> tuple[list[np.ndarray], list[int]]:
        """Run ``config`` once with rank r holding ``shards[r]`` (q, k, v in the API layout):
        each rank's output shard and peak bytes. The ranks keep the inputs for ``time``."""
        arrays, peaks = self._run(workload, config, shards, timeout, config.describe(),
                                  threads=self._threads(config.ranks))
        return [shard[0] for shard in arrays], peaks

    def run_train(
        self, workload: Workload, config: CPConfig,
        shards: Sequence[tuple[np.ndarray, ...]], timeout: float,
    ) -> tuple[list[Trained], list[int]]:
        """Run ``config``'s forward and backward once, rank r holding ``shards[r]`` (q, k, v
        and the output's gradient): each rank's output and gradients, and peak bytes."""
        check_runs(self.spec, workload)
        what = f"{config.describe()}, forward and backward"
        arrays, peaks = self._run(workload, config, shards, timeout, what,
                                  threads=self._threads(config.ranks))
        return [Trained(*shard) for shard in arrays], peaks

    def time_collective(
        self, kind: str, ranks: int, group: int, chunks: Sequence[int], warmup: int, repeats: int,
        timeout: float, along: str = "heads",
    ) -> np.ndarray:
        """Seconds [chunk, iteration], slowest rank, of collective ``kind`` in groups of
        ``group`` ranks among the first ``ranks`` (all groups at once; consecutive ranks, or
        strided as context groups: ``along``), moving ``chunks[i]`` bytes per peer."""
        header = {"op": "time_collective", "kind": kind, "ranks": ranks, "group": group, "along": along,
                  "chunks": [int(c) for c in chunks], "warmup": warmup, "repeats": repeats}
        return self._time_slowest(ranks, header, timeout, f"{kind} calibration on {ranks} ranks")

    def time_attention(
        self, ranks: int, shapes: Sequence[dict[str, int]], warmup: int, repeats: int, timeout: float
    ) -> np.ndarray:
        """Seconds [shape, iteration], slowest rank, of the attention kernel on each shape
        (heads, seq_q, seq_k, head_dim), ``ranks`` ranks computing at once (on their share of
        the cores on a CPU host)."""
        header = {"op": "time_attention", "ranks": ranks, "shapes": list(shapes),
                  "threads": self._threads(ranks), "warmup": warmup, "repeats": repeats}
        return self._time_slowest(ranks, header, timeout, f"attention calibration on {ranks} ranks")

    def _time_slowest(self, ranks: int, header: dict[str, object], timeout: float, what: str) -> np.ndarray:
        """A calibration op's timings (``header``, sent to the first ``ranks`` ranks) of the
        slowest rank, element by element."""
        self._pool_for(ranks)
        request = {**header, "engine": self.name}
        replies = self._request({r: (request, []) for r in range(ranks)}, timeout, what, caller_set=False)
        self._reported(replies[0][0])
        return np.max([replies[r][1][0] for r in range(ranks)], axis=0)

    def time_steps(
        self, ranks: int, steps: Sequence[dict[str, object]], warmup: int, repeats: int, timeout: float
    ) -> np.ndarray:
        """Refused: this engine's calibration times no kernel steps (``spec.times_steps``)."""
        raise ValueError(f"the {self.name} engine's kernel has no memory-bound steps to time "
                         f"(its spec says times_steps=False)")

    def time_waits(
        self, ranks: int, groups: Sequence[int], shape: dict[str, int], calls: int, chunk: int, warmup: int,
        repeats: int, timeout: float,
    ) -> np.ndarray:
        """Refused: this engine's calibration times no exchange waits (``spec.times_waits``)."""
        raise ValueError(f"the {self.name} engine's calibration times no exchange waits "
                         f"(its spec says times_waits=False)")

    def _pool_software(self) -> dict[str, str]:
        """What the ranks run on, for the record of a measurement: the MPI library, and
        whether the ranks' allocator is ``steady`` (``_worker.steady_allocator``); empty
        before the pool has started."""
        if self._pool is None:
            return {}
        return {"mpi_library": self._pool.mpi_library, "allocator": self._pool.allocator}

    def node_readings(self) -> dict[str, CpuReading]:
        """The CPU accounts of each node on another machine, read by its first rank (none
        without a pool, or on one machine): what the contention guard judges there."""
        pool = self._pool
        if pool is None or not pool.node_firsts or pool.cluster is None:
            return {}
        asked: dict[int, protocol.Message] = {rank: ({"op": "node_load"}, []) for rank in pool.node_firsts}
        replies = self._request(asked, _NODE_LOAD_TIMEOUT_S, "reading the nodes' load", caller_set=False)
        return {pool.cluster.node_name(pool.cluster.node_of(rank)): _reading(header)
                for rank, (header, _) in replies.items()}

    def process_ids(self) -> list[int]:
        """The pool's processes now: mpiexec, its hydra proxies and the ranks (none without a pool)."""
        return [] if self._pool is None else list(dict.fromkeys([self._pool.proc.pid, *self._pool.pids]))

    def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()
