"""Two emulated cluster nodes on this one machine, for cptune's multi-node tests and CI.

Each node is a network namespace; one veth pair joins them (``cpt0`` in each, 198.18.0.1 on
node0, 198.18.0.2 on node1), shaped by tbf on both ends, so ranks of different nodes talk over a
link of a known rate while ranks of one node keep loopback and shared memory. Nothing is added to
the root namespace: the veth pair is created straight into the two namespaces. As a module::

    with TwoNodes(rate_mbit=200, ranks_per_node=2) as bed:
        bed.run([mpiexec, "-hosts", bed.hosts, python, "prog.py"])

As a script (root): ``python tests/two_nodes.py --rate-mbit 200 [--ranks-per-node 2] -- COMMAND
ARGS...`` runs COMMAND inside node0 with ``TwoNodes.env``, passes its exit status back, and
removes everything on any exit, SIGINT and SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

#: The cross-node interface's name inside each namespace.
IFACE = "cpt0"
#: node0's and node1's addresses (the benchmarking range, RFC 2544): fixed, since each pair of
#: namespaces is a network of its own.
ADDRESSES = ("198.18.0.1", "198.18.0.2")
#: The veth MTU (../shared/notes/multi-node.md): large frames keep the per-packet cost, and so
#: the two cores' load, small at the rates shaped here.
MTU = 65535
#: Namespaces are ``cptn<pid>-<4 hex>-n0`` / ``-n1`` (the launcher's folder ``cptn<pid>-<4 hex>``
#: under the temporary directory): unique per instance, and the owner's pid tells stale ones.
PREFIX = "cptn"
_OWNED = re.compile(rf"{PREFIX}(\d+)-[0-9a-f]{{4}}(-n[01])?")
#: The shaping check's band, as a fraction of the set rate.
RATE_BAND = (0.6, 1.1)
#: How long the shaping check's transfer takes at the set rate, in seconds.
CHECK_SECONDS = 0.4
#: How long the link may take to report itself up once set up (``TwoNodes._wait_until_up``).
UP_TIMEOUT = 5.0

# The shaping check's two ends (``python -c``; address, port and sizes come as arguments). The
# receiver times what arrives after the first SKIP bytes: tbf's full bucket passes those at once.
_RECEIVER = """
import json, socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
skip = int(sys.argv[2])
while skip > 0 and (chunk := connection.recv(1 << 20)):
    skip -= len(chunk)
start, received = time.perf_counter(), 0
while chunk := connection.recv(1 << 20):
    received += len(chunk)
print(json.dumps({"bytes": received, "seconds": time.perf_counter() - start}), flush=True)
"""
_SENDER = """
import socket, sys
left, block = int(sys.argv[3]), memoryview(bytes(1 << 20))
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as connection:
    while left > 0:
        connection.sendall(block[:left])
        left -= len(block)
"""

# An ssh stand-in for MPICH's Hydra. Hydra runs it as ``LAUNCHER -x HOST "PROXY" ARG...`` (the
# proxy's path in literal double quotes, every other word its own argument); ssh joins the words
# after the host with spaces for the remote shell, so this does the same in HOST's namespace.
_LAUNCHER = """#!/bin/sh
# ssh stand-in of a tests/two_nodes.py testbed: HOST is {node0} (node0) or {node1} (node1).
while [ $# -gt 0 ]; do
    case $1 in
        -[BbcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;  # an ssh option and its value
        -*) shift ;;                           # a flag, or an option with its value attached
        *) break ;;
    esac
done
case ${{1#*@}} in
    {node0}) shift; exec {node0_prefix} sh -c "$*" ;;
    {node1}) shift; exec {node1_prefix} sh -c "$*" ;;
    *) echo "two_nodes ssh stand-in: no emulated node at '$1'" >&2; exit 255 ;;
esac
"""


class TestbedError(RuntimeError):
    """The testbed could not be built, or its link is not shaped as asked."""

    __test__ = False  # not a test class, whatever pytest's name rules say


def burst_bytes(rate_mbit: float, mtu: int = MTU) -> int:
    """tbf's bucket: at least 256 KiB, two frames and 200 us at the rate; a smaller one drops
    packets silently (../shared/notes/multi-node.md)."""
    return max(256 * 1024, 2 * mtu, int(rate_mbit * 1e6 / 8 * 200e-6))


def _ip(*args: str) -> str:
    """``ip ARGS`` (argument list, no shell); its stdout. A failure raises ``TestbedError``."""
    done = subprocess.run([_tool("ip"), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise TestbedError(f"`ip {shlex.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def _tool(name: str) -> str:
    """The full path of the command ``name``; ``TestbedError`` where it is missing."""
    path = shutil.which(name)
    if path is None:
        raise TestbedError(f"no `{name}` command (iproute2)")
    return path


def _namespace_pids(namespace: str) -> list[int]:
    """The live (not zombie) processes inside ``namespace``; none once it is gone."""
    done = subprocess.run([_tool("ip"), "netns", "pids", namespace], capture_output=True, text=True)
    return [int(word) for word in done.stdout.split()] if done.returncode == 0 else []


def _kill_all(namespace: str, within: float = 5.0) -> None:
    """SIGKILL every process inside ``namespace``, again until none is left (a dying launcher
    may have started more) or ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    while (pids := _namespace_pids(namespace)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _stale(name: str) -> bool:
    """Whether ``name`` is a testbed's namespace or folder whose owning process is gone."""
    owned = _OWNED.fullmatch(name)
    return owned is not None and not Path(f"/proc/{owned[1]}").exists()


def remove_stale() -> None:
    """Remove the namespaces (and every process in them) and launcher folders of testbeds whose
    owning process is gone: a SIGKILLed test run leaves them."""
    for name in (line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()):
        if _stale(name):
            _kill_all(name)
            subprocess.run([_tool("ip"), "netns", "delete", name], capture_output=True)
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if _stale(folder.name):
            shutil.rmtree(folder, ignore_errors=True)


class TwoNodes:
    """Two network namespaces standing for two cluster nodes, joined by one tbf-shaped veth
    link, removed with every process inside them when the ``with`` block ends however it ends.

    ``rate_mbit``: the cross-node rate, each way. ``ranks_per_node``: what ``hosts`` and
    ``CPTUNE_TESTBED_HOSTS`` give each node. Entering builds the namespaces and checks the shaping
    with a TCP transfer before anything is timed (``measured_mbit``).
    """

    def __init__(self, rate_mbit: float, ranks_per_node: int = 2, mtu: int = MTU,
                 separate_pids: bool = True) -> None:
        if rate_mbit <= 0 or ranks_per_node < 1:
            raise ValueError(f"rate_mbit must be > 0 and ranks_per_node >= 1, not {rate_mbit}, "
                             f"{ranks_per_node}")
        self.rate_mbit, self.ranks_per_node, self.mtu = rate_mbit, ranks_per_node, mtu
        #: Whether node1's processes live in a pid namespace of their own (``_in``).
        self.separate_pids = separate_pids
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        #: node0's and node1's namespaces.
        self.namespaces = (f"{self.name}-n0", f"{self.name}-n1")
        self.folder = Path(tempfile.gettempdir()) / self.name
        #: The ssh stand-in Hydra launches node1's proxy with (``-launcher-exec``).
        self.launcher = self.folder / "ssh"
        #: What the shaping check measured from node1 to node0, in Mbit/s.
        self.measured_mbit: float | None = None
        self._started: tuple[list[subprocess.Popen[Any]], ...] = ([], [])

    @property
    def hosts(self) -> str:
        """The two nodes for ``mpiexec -hosts``: ``198.18.0.1:R,198.18.0.2:R``."""
        return ",".join(f"{address}:{self.ranks_per_node}" for address in ADDRESSES)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment, plus what makes the stacks use the cross-node link, plus
        ``extra``. gloo binds to cpt0. MPICH: the OFI netmod over TCP on cpt0 (the wheel's
        default, UCX, reaches the other namespace through shared memory, bypassing the link;
        ranks of one node still use shared memory); Hydra's control port on cpt0 and node1's
        proxy started by the ssh stand-in, so a plain ``mpiexec -hosts`` works from node0."""
        return {
            **os.environ,
            "GLOO_SOCKET_IFNAME": IFACE,
            "MPIR_CVAR_CH4_NETMOD": "ofi",
            "FI_PROVIDER": "tcp",
            "FI_TCP_IFACE": IFACE,
            "HYDRA_IFACE": IFACE,
            "HYDRA_LAUNCHER": "ssh",
            "HYDRA_LAUNCHER_EXEC": str(self.launcher),
            "CPTUNE_MPI_LAUNCHER": str(self.launcher),
            "CPTUNE_TESTBED_HOSTS": self.hosts,
            **(extra or {}),
        }

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``argv`` inside node0 (the driver node) with ``self.env(env)``, to its end;
        ``kwargs`` go to ``subprocess.run`` (``capture_output``, ``text``, ``timeout``...)."""
        return subprocess.run(self._in(0, argv), env=self.env(env), **kwargs)

    def start(self, node: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """``argv`` inside ``node`` (0 or 1) in the background, with ``self.env(env)``;
        ``kwargs`` go to ``subprocess.Popen``. Killed, if still running, on exit."""
        process = subprocess.Popen(self._in(node, argv), env=self.env(env), **kwargs)
        self._started[node].append(process)
        return process

    def cpu_seconds(self, node: int) -> float:
        """CPU time the processes inside ``node`` have used so far (user and system, from
        ``/proc``): a test tells from its growth when ranks there are running, not waiting."""
        ticks = 0
        for pid in _namespace_pids(self.namespaces[node]):
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def kill_node(self, node: int) -> None:
        """SIGKILL every process inside ``node`` (0 or 1) at this moment: a node lost mid-run.
        Processes started there afterwards (a pool started again) are left to run."""
        for process in self._started[node]:
            process.kill()
        for pid in _namespace_pids(self.namespaces[node]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._reap(node)

    def close(self) -> None:
        """Kill every process in either namespace, delete both (the veth pair goes with them)
        and the launcher's folder. Idempotent; SIGINT and SIGTERM wait until it is done."""
        masked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for node, namespace in enumerate(self.namespaces):
                self._kill(node)
                subprocess.run([_tool("ip"), "netns", "delete", namespace], capture_output=True)
            shutil.rmtree(self.folder, ignore_errors=True)
            for node in (0, 1):
                self._reap(node)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, masked)

    def __enter__(self) -> TwoNodes:
        try:
            remove_stale()
            self._build()
            self._wait_until_up()
            self._check_rate()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _in(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace. With ``separate_pids`` node1 is another
        machine to what runs on node0 in what a process can see of the other's too: its
        processes in a pid namespace of their own (node0 cannot signal them by pid), its own
        host lock file (``$CPTUNE_LOCK``: another machine's temporary directory). Without, the
        nodes share the pids and lock of the one machine they run on, and the contention guard
        on node0 counts node1's ranks as its own from their pids. Either way it sees only
        others' load: node1's readings count node0's CPUs, so the guard judges both nodes as
        one (``cptune.guard``)."""
        inside = [_tool("ip"), "netns", "exec", self.namespaces[node]]
        if node == 1 and self.separate_pids:
            inside += [_tool("unshare"), "--pid", "--fork", "--kill-child", "--mount-proc",
                       "env", f"CPTUNE_LOCK={self.folder / 'node1.lock'}"]
        return [*inside, *argv]

    def _kill(self, node: int) -> None:
        """SIGKILL ``node``'s background processes (one may not have entered the namespace
        yet) and every process inside its namespace."""
        for process in self._started[node]:
            process.kill()  # nothing once it has been waited for
        _kill_all(self.namespaces[node])

    def _reap(self, node: int) -> None:
        """Wait for ``node``'s background processes, all killed by now."""
        for process in self._started[node]:
            process.wait()
        self._started[node].clear()

    def _build(self) -> None:
        """The namespaces, the veth pair between them, addresses, MTU, tbf, the ssh stand-in."""
        ns0, ns1 = self.namespaces
        for namespace in self.namespaces:
            _ip("netns", "add", namespace)
        _ip("link", "add", IFACE, "netns", ns0, "type", "veth", "peer", "name", IFACE, "netns", ns1)
        burst = burst_bytes(self.rate_mbit, self.mtu)
        for namespace, address in zip(self.namespaces, ADDRESSES, strict=True):
            _ip("-n", namespace, "link", "set", "lo", "up")
            # no IPv6 link-local address: gloo would otherwise find two addresses on cpt0
            _ip("-n", namespace, "link", "set", IFACE, "mtu", str(self.mtu), "addrgenmode", "none")
            _ip("-n", namespace, "address", "add", f"{address}/24", "dev", IFACE)
            _ip("-n", namespace, "link", "set", IFACE, "up")
            shaped = subprocess.run(
                [_tool("tc"), "-n", namespace, "qdisc", "replace", "dev", IFACE, "root", "tbf",
                 "rate", f"{round(self.rate_mbit * 1e6)}bit", "burst", str(burst),
                 "latency", "50ms"],  # the queue: rate x 50 ms + burst before tbf drops
                capture_output=True, text=True)
            if shaped.returncode != 0:
                raise TestbedError(f"tbf on {IFACE} in {namespace} failed: {shaped.stderr.strip()}")
        self.folder.mkdir(mode=0o700)
        node0, node1 = (" ".join(map(shlex.quote, self._in(node, []))) for node in (0, 1))
        self.launcher.write_text(_LAUNCHER.format(node0=ADDRESSES[0], node1=ADDRESSES[1], node0_prefix=node0,
                                                  node1_prefix=node1))
        self.launcher.chmod(0o700)

    def _wait_until_up(self) -> None:
        """Wait until both ends of the link report operstate UP. The kernel updates it a moment
        after the link is set up (its link watch runs deferred); until then libfabric's tcp
        provider skips the interface, and a rank starting on node1 then failed MPI_Init
        (``ep_enable failed ... Bad file descriptor``) while node0's ranks waited for it.
        ``TestbedError`` if it is not up within ``UP_TIMEOUT`` seconds."""
        deadline = time.monotonic() + UP_TIMEOUT
        while True:
            states = [json.loads(_ip("-n", namespace, "-json", "link", "show", IFACE))[0]["operstate"]
                      for namespace in self.namespaces]
            if states == ["UP", "UP"]:
                return
            if time.monotonic() > deadline:
                raise TestbedError(f"{IFACE} is not up after {UP_TIMEOUT:g} s (operstate {states})")
            time.sleep(0.02)

    def _check_rate(self) -> None:
        """Time a TCP transfer from node1 to node0 of ``CHECK_SECONDS`` at the set rate, after
        tbf's bucket (which passes at once); ``TestbedError`` unless it ran within ``RATE_BAND``
        of the set rate."""
        burst = burst_bytes(self.rate_mbit, self.mtu)
        size = int(self.rate_mbit * 1e6 / 8 * CHECK_SECONDS) + burst
        timeout = 10 + 5 * CHECK_SECONDS
        receiver = self.start(0, [sys.executable, "-c", _RECEIVER, ADDRESSES[0], str(burst)],
                              stdout=subprocess.PIPE, text=True)
        try:
            assert receiver.stdout is not None
            port = receiver.stdout.readline().strip()
            sent = subprocess.run(self._in(1, [sys.executable, "-c", _SENDER, ADDRESSES[0], port, str(size)]),
                                  capture_output=True, text=True, timeout=timeout)
            if sent.returncode != 0:
                raise TestbedError(f"the shaping check's transfer from node1 failed: {sent.stderr}")
            out, _ = receiver.communicate(timeout=timeout)
        except BaseException:  # a signal or a failure: the receiver would wait for the sender forever
            receiver.kill()
            receiver.communicate()
            raise
        result = json.loads(out)
        self.measured_mbit = result["bytes"] * 8 / result["seconds"] / 1e6
        low, high = RATE_BAND
        if not low * self.rate_mbit <= self.measured_mbit <= high * self.rate_mbit:
            raise TestbedError(
                f"the cross-node link measured {self.measured_mbit:.0f} Mbit/s against "
                f"{self.rate_mbit:g} Mbit/s set (outside {low}x..{high}x): tbf is not shaping it "
                "as asked, or this host is too loaded to carry that rate")


@functools.cache
def unavailable() -> str | None:
    """Why a testbed cannot be built here (not root, no ``ip`` or ``tc``, namespaces, veth or
    tbf refused), for tests to skip with; None where it can. Tried once per process."""
    if os.geteuid() != 0:
        return "the two-node testbed needs root (network namespaces, veth pairs, tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"the two-node testbed needs `{tool}` (iproute2, util-linux)"
    bed = TwoNodes(rate_mbit=100)
    try:
        bed._build()
        for node in (0, 1):
            entered = subprocess.run(bed._in(node, ["true"]), capture_output=True, text=True)
            if entered.returncode != 0:
                raise TestbedError(f"entering node{node} failed: {entered.stderr.strip()}")
    except (TestbedError, OSError) as error:
        return f"the two-node testbed cannot be built here: {error}"
    finally:
        bed.close()
    return None


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    """SIGINT and SIGTERM end the script through ``SystemExit``, so the testbed is removed."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """The script: COMMAND inside node0 of a fresh testbed; COMMAND's exit status (128 + N for
    a signal N, as shells do)."""
    parser = argparse.ArgumentParser(
        prog="two_nodes.py", description="Run COMMAND on node0 of two emulated nodes joined by a "
        "shaped link (root; every namespace and process is removed on exit).")
    parser.add_argument("--rate-mbit", type=float, required=True, help="cross-node rate, each way")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="for CPTUNE_TESTBED_HOSTS")
    parser.add_argument("--shared-pids", action="store_true",
                        help="node1's processes in node0's pid namespace (the guard counts them as ours)")
    parser.add_argument("command", nargs="+", help="after --: the command and its arguments")
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _exit_on_signal)
    try:
        with TwoNodes(args.rate_mbit, args.ranks_per_node, separate_pids=not args.shared_pids) as bed:
            print(f"two_nodes: node0 {bed.namespaces[0]} ({ADDRESSES[0]}), node1 {bed.namespaces[1]} "
                  f"({ADDRESSES[1]}) on {IFACE}; {bed.rate_mbit:g} Mbit/s set, {bed.measured_mbit:.0f} "
                  f"measured; launcher {bed.launcher}", file=sys.stderr, flush=True)
            code = bed.run(args.command).returncode
    except TestbedError as error:  # building it or its shaping check
        print(f"two_nodes: error: {error}", file=sys.stderr)
        return 1
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
