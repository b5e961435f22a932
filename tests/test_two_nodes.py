"""The two-node testbed (tests/two_nodes.py): it builds two namespaces joined by one shaped link,
its shaping check catches a link that is not shaped as asked, MPI ranks land on both emulated
nodes through its ssh stand-in, and nothing of it is left after any exit. Needs root, ``ip`` and
``tc``; skipped with the reason elsewhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from two_nodes import (
    ADDRESSES,
    IFACE,
    MTU,
    PREFIX,
    RATE_BAND,
    TestbedError,
    TwoNodes,
    remove_stale,
    unavailable,
)

pytestmark = pytest.mark.slow  # each test starts processes (ip, tc, the shaping check's ends)

SCRIPT = Path(__file__).with_name("two_nodes.py")


@pytest.fixture(autouse=True)
def _testbed_possible() -> None:
    if (reason := unavailable()) is not None:
        pytest.skip(reason)


def namespaces(prefix: str = PREFIX) -> list[str]:
    """The network namespaces whose names start with ``prefix``."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]


def ip_json(*args: str) -> list[dict]:
    """``ip -json ARGS``, parsed."""
    return json.loads(subprocess.run(["ip", "-json", *args], capture_output=True, text=True,
                                     check=True).stdout)


def command_name(pid: str) -> str:
    """Process ``pid``'s command name; "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def assert_gone(bed: TwoNodes) -> None:
    """Neither of ``bed``'s namespaces nor its launcher's folder is left."""
    assert not set(bed.namespaces) & set(namespaces())
    assert not bed.folder.exists()


@pytest.mark.parametrize("rate", [100, 400])
def test_two_namespaces_joined_by_one_shaped_link(rate: int) -> None:
    with TwoNodes(rate_mbit=rate, ranks_per_node=3) as bed:
        assert bed.measured_mbit is not None
        assert RATE_BAND[0] * rate <= bed.measured_mbit <= RATE_BAND[1] * rate
        for namespace, address in zip(bed.namespaces, ADDRESSES, strict=True):
            links = {link["ifname"]: link for link in ip_json("-n", namespace, "address", "show")}
            assert set(links) == {"lo", IFACE}
            assert "UP" in links["lo"]["flags"] and links[IFACE]["mtu"] == MTU
            assert links[IFACE]["operstate"] == "UP"  # as a rank starting at once finds it
            assert [(a["family"], a["local"], a["prefixlen"]) for a in links[IFACE]["addr_info"]] == \
                [("inet", address, 24)]
            qdisc = subprocess.run(["tc", "-n", namespace, "qdisc", "show", "dev", IFACE],
                                   capture_output=True, text=True, check=True).stdout
            assert qdisc.startswith("qdisc tbf") and f"rate {rate}Mbit" in qdisc
        root = ip_json("address", "show")
        assert not [link for link in root if link["ifname"] == IFACE]
        assert not [a for link in root for a in link.get("addr_info", []) if a["local"] in ADDRESSES]
        environment = bed.env({"EXTRA": "1"})
        assert environment["CPTUNE_TESTBED_HOSTS"] == "198.18.0.1:3,198.18.0.2:3" == bed.hosts
        assert environment["CPTUNE_MPI_LAUNCHER"] == str(bed.launcher) and environment["EXTRA"] == "1"
    assert_gone(bed)


def test_the_shaping_check_refuses_a_link_faster_than_set(monkeypatch: pytest.MonkeyPatch) -> None:
    build = TwoNodes._build

    def build_then_reshape(bed: TwoNodes) -> None:  # node1 sends 4x faster than the rate set
        build(bed)
        subprocess.run(["tc", "-n", bed.namespaces[1], "qdisc", "replace", "dev", IFACE, "root", "tbf",
                        "rate", "400mbit", "burst", "256kb", "latency", "50ms"], check=True)
        beds.append(bed)

    beds: list[TwoNodes] = []
    monkeypatch.setattr(TwoNodes, "_build", build_then_reshape)
    with pytest.raises(TestbedError, match=r"measured \d+ Mbit/s against 100 Mbit/s set"), TwoNodes(100):
        pass
    assert_gone(beds[0])


def test_everything_goes_on_an_exception_and_kill_node_kills_one_node() -> None:
    with pytest.raises(RuntimeError, match="inside"), TwoNodes(rate_mbit=200) as bed:
        sleepers = [bed.start(node, ["sleep", "30"]) for node in (0, 1)]
        bed.kill_node(1)
        assert sleepers[1].wait(timeout=5) == -signal.SIGKILL
        assert sleepers[0].poll() is None
        raise RuntimeError("inside the with block")
    assert sleepers[0].returncode == -signal.SIGKILL
    assert_gone(bed)


def test_stale_testbeds_are_removed() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = f"{PREFIX}{dead}-abcd"
    subprocess.run(["ip", "netns", "add", f"{stale}-n1"], check=True)
    folder = Path(tempfile.gettempdir()) / stale
    folder.mkdir()
    remove_stale()  # (a testbed built beside this one may have removed them first)
    assert namespaces(stale) == [] and not folder.exists()


def test_the_script_runs_the_command_in_node0_and_passes_its_status_back() -> None:
    shown = "readlink /proc/self/ns/net; ip -4 -o address show dev cpt0; echo $CPTUNE_TESTBED_HOSTS; exit 3"
    done = subprocess.run([sys.executable, str(SCRIPT), "--rate-mbit", "200", "--ranks-per-node", "1", "--",
                           "sh", "-c", shown], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    namespace, address, hosts = done.stdout.splitlines()
    assert namespace != os.readlink("/proc/self/ns/net")
    assert "198.18.0.1/24" in address and hosts == "198.18.0.1:1,198.18.0.2:1"
    assert "200 Mbit/s set" in done.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_script_removes_everything_on_a_signal(signum: int) -> None:
    script = subprocess.Popen([sys.executable, str(SCRIPT), "--rate-mbit", "200", "--", "sleep", "30"],
                              stderr=subprocess.PIPE, text=True)
    prefix = f"{PREFIX}{script.pid}-"
    try:
        deadline, sleeper = time.monotonic() + 30, None
        while sleeper is None and time.monotonic() < deadline and script.poll() is None:
            for namespace in namespaces(prefix):
                inside = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
                sleeper = next((int(p) for p in inside.stdout.split() if command_name(p) == "sleep"), sleeper)
            time.sleep(0.05)
        assert sleeper is not None, "the command never started in node0"
        sent = time.monotonic()
        script.send_signal(signum)
        assert script.wait(timeout=10) == 128 + signum
        assert time.monotonic() - sent < 5
    finally:
        script.kill()
        script.communicate()
    assert namespaces(prefix) == []
    assert not list(Path(tempfile.gettempdir()).glob(prefix + "*"))
    assert not Path(f"/proc/{sleeper}").exists()


# Each rank's network namespace, and the rates from rank 2 (node1) to rank 0 and from rank 1 to rank 0.
RANKS = """
import json, os, time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
message = np.ones(2 << 20, np.uint8)
rates = []
for sender in (2, 1):
    comm.Barrier()
    start = time.perf_counter()
    if comm.rank == sender:
        comm.Send(message, 0)
    elif comm.rank == 0:
        comm.Recv(message, sender)
    rates.append(message.nbytes * 8 / (time.perf_counter() - start) / 1e6)
namespaces = comm.gather(os.readlink("/proc/self/ns/net"))
if comm.rank == 0:
    print(json.dumps({"namespaces": namespaces, "cross_mbit": rates[0], "in_node_mbit": rates[1]}))
"""


def test_mpi_ranks_run_on_both_nodes_and_cross_the_shaped_link(tmp_path: Path) -> None:
    program = tmp_path / "ranks.py"
    program.write_text(RANKS)
    mpiexec = Path(sys.executable).with_name("mpiexec")
    with TwoNodes(rate_mbit=200) as bed:
        node0 = bed.run(["readlink", "/proc/self/ns/net"], capture_output=True, text=True).stdout.strip()
        done = bed.run([str(mpiexec), "-hosts", bed.hosts, "-launcher", "ssh", "-launcher-exec",
                        bed.env()["CPTUNE_MPI_LAUNCHER"], "-iface", IFACE, sys.executable, str(program)],
                       capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ranks = json.loads(done.stdout.splitlines()[-1])
    assert ranks["namespaces"][:2] == [node0] * 2
    assert ranks["namespaces"][2] == ranks["namespaces"][3] != node0
    assert 0.6 * 200 <= ranks["cross_mbit"] <= 1.3 * 200
    assert ranks["in_node_mbit"] > 5 * ranks["cross_mbit"]
