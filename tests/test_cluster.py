"""Clusters without a network: the nodes given (--hosts, hostfiles), where ranks and groups
land, a cluster's fingerprint and calibration tiers, the prior reading a calibrated cluster at
a size it never ran, and bad input refused in one line before anything is stored. Runs on two
nodes for real: tests/test_two_node_search.py."""

import dataclasses
import hashlib
import json
import os

import pytest

from conftest import make_calibration
from cptune.calibration import Calibration, CollectiveFit
from cptune.calibration._calibrate import layouts
from cptune.config import CPConfig
from cptune.engines import get_engine
from cptune.hardware import (
    Cluster,
    ClusterError,
    Hardware,
    heads_span_nodes,
    parse_hosts,
    read_hostfile,
    this_host,
    tier_of,
)
from cptune.layout import rank_groups
from cptune.model import CalibratedProfile, recommend, tier_split
from cptune.plans.export import export_plan
from cptune.store import Store
from cptune.workload import Workload

NODE = Hardware(host="n1", cpu_model="cpu", cpu_count=2, gpu_model=None, gpu_count=0,
                interconnect="shared memory (one host)", mpi_library="mpich 4.3.2")
CLUSTER = dataclasses.replace(NODE, host="n1,n2", nodes=2, ranks_per_node=2, network="MPI (ofi)")
WORKLOAD = Workload(seq_len=4096, heads=8, head_dim=64)


# --------------------------------------------------------------------------- the nodes given


def test_hosts_and_hostfiles_give_equal_nodes_in_rank_order(tmp_path):
    assert parse_hosts("a:2,b:2") == Cluster(("a", "b"), 2)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# Hydra's format\nnode1:4  # first\n\nnode2:4\n")
    cluster = read_hostfile(hostfile)
    assert (cluster.hosts, cluster.ranks_per_node, cluster.size) == (("node1", "node2"), 4, 8)
    assert [cluster.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert cluster.where(5) == "rank 5 (node 1, node2)"
    assert cluster.hydra_hosts() == "node1:4,node2:4"
    assert parse_hosts("solo") == Cluster(("solo",), 1)  # Hydra's default: one rank


@pytest.mark.parametrize("text, fragment", [
    ("a:2,b:3", "unequal size (a:2, b:3)"),
    ("a:two,b:2", "'a:two' is not host or host:ranks"),
    ("a:2,a:2", "listed twice"),
    (" , ", "lists no host"),
    ("a:0,b:0", "at least one rank"),
])
def test_bad_hosts_are_named_with_the_fix(text, fragment):
    with pytest.raises(ClusterError) as refused:
        parse_hosts(text)
    assert fragment in str(refused.value)


def test_a_hostfile_is_read_only_when_it_is_a_short_text_file(tmp_path):
    broken = tmp_path / "broken"
    broken.write_text("node1:4\nnode2:four\n")
    with pytest.raises(ClusterError, match=r"broken:2: 'node2:four' is not host or host:ranks"):
        read_hostfile(broken)
    with pytest.raises(ClusterError, match="not a regular file"):
        read_hostfile(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ClusterError, match="not a regular file"):
        read_hostfile(fifo)  # never opened: a FIFO would block the read
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ClusterError, match="not text"):
        read_hostfile(binary)


def test_ranks_beyond_the_nodes_and_names_that_do_not_resolve_are_refused():
    cluster = parse_hosts("localhost:2,nosuchhost.invalid:2")
    with pytest.raises(ClusterError, match="5 ranks asked and the nodes hold 4"):
        cluster.check_ranks(5)
    with pytest.raises(ClusterError, match="host 'nosuchhost.invalid' cannot be reached"):
        cluster.check_reachable()


# --------------------------------------------------------------------------- placement


def test_head_groups_stay_in_a_node_where_their_size_divides_it():
    heads, context = rank_groups(CPConfig("ring", 4, 2))
    assert (tier_of(heads, 2), tier_of(context, 2)) == ("node", "network")
    assert tier_of(context, None) == "node"  # one node: nothing crosses a network
    assert not heads_span_nodes(CPConfig("ring", 4, 2), 2)
    assert heads_span_nodes(CPConfig("ulysses", 4, 4), 2)  # its all-to-all crosses the network
    assert not heads_span_nodes(CPConfig("ulysses", 2, 2), 2)  # two ranks: both on node 0
    assert heads_span_nodes(CPConfig("allgather_kv", 8, 4), 2)
    assert not heads_span_nodes(CPConfig("allgather_kv", 16, 4), 8)


def test_calibration_times_each_tier_where_configurations_use_it():
    assert layouts(4, 2, None) == [("heads", "node")]  # one node: one layout
    assert layouts(4, 2, 2) == [("heads", "node"), ("context", "network")]
    assert layouts(4, 4, 2) == [("heads", "network")]  # every group of 4 spans both nodes
    assert layouts(2, 2, 2) == [("heads", "node")]  # 2 ranks: node 0 only


# --------------------------------------------------------------------------- fingerprints


def test_one_node_keeps_the_fingerprint_it_had_before_clusters():
    facts = {key: value for key, value in dataclasses.asdict(NODE).items()
             if key not in ("nodes", "ranks_per_node", "network")}
    before = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    assert NODE.fingerprint == before
    assert CLUSTER.fingerprint != NODE.fingerprint
    assert dataclasses.replace(CLUSTER, ranks_per_node=4).fingerprint != CLUSTER.fingerprint
    assert "2 nodes x 2 ranks" in CLUSTER.describe() and "MPI (ofi) across nodes" in CLUSTER.describe()


def test_a_cluster_is_stored_and_read_back_whole(tmp_path):
    with Store(str(tmp_path / "c.db")) as store:
        store.add_calibration(CLUSTER, make_calibration(4))
        assert store.hardware()[CLUSTER.fingerprint] == CLUSTER


def test_engines_on_nodes_say_so_and_refuse_what_they_cannot_run():
    cluster = parse_hosts("localhost:2,127.0.0.2:2")
    engine = get_engine("mpi", hosts=cluster)
    assert engine is get_engine("mpi", hosts=parse_hosts("localhost:2,127.0.0.2:2"))
    assert engine is not get_engine("mpi")
    hardware = engine.hardware()
    assert (hardware.nodes, hardware.ranks_per_node, hardware.host) == (2, 2, "localhost,127.0.0.2")
    assert hardware.cpu_model == this_host().cpu_model
    assert engine.capacity() == 4
    with pytest.raises(ClusterError, match="5 ranks asked and the nodes hold 4"):
        engine.preflight(5)


# --------------------------------------------------------------------------- the prior on tiers


def cluster_calibration(network_bandwidth: float) -> Calibration:
    """A 2 x 2 calibration whose collectives across nodes move ``network_bandwidth`` B/s and
    inside a node 1 GB/s."""
    base = make_calibration(4)
    across = tuple(
        dataclasses.replace(f, tier="network", bandwidth=network_bandwidth)
        for f in base.collectives if f.ranks == 4 and f.group == 2
    )
    return dataclasses.replace(base, collectives=base.collectives + across)


def test_the_prior_charges_each_exchange_at_its_tier():
    slow = CalibratedProfile(CLUSTER, calibration=cluster_calibration(1e6))
    fast = CalibratedProfile(CLUSTER, calibration=cluster_calibration(1e9))
    hybrid = CPConfig("ring", 4, 2)  # all-to-all in a node, the Ring across
    split_slow, split_fast = tier_split(WORKLOAD, hybrid, slow), tier_split(WORKLOAD, hybrid, fast)
    assert split_slow["node"] == pytest.approx(split_fast["node"])  # the all-to-all: same rates
    assert split_slow["network"] > split_fast["network"]
    fit = slow.calibration.collective("all_gather", 4, 2, "network")
    assert isinstance(fit, CollectiveFit) and fit.tier == "network"
    assert slow.calibration.collective("all_gather", 4, 2).tier == "node"


def test_a_calibrated_cluster_answers_for_a_size_it_never_ran(tmp_path):
    db = str(tmp_path / "c.db")
    with Store(db) as store:
        store.add_calibration(CLUSTER, cluster_calibration(1e6))
    pick = recommend(WORKLOAD, ranks=16, hardware=CLUSTER.fingerprint, db=db, nodes=2)
    assert pick.config.ranks == 16 and pick.source == "prior"
    assert "read for 2 nodes x 8 ranks" in pick.hardware
    assert pick.tiers is not None and pick.tiers.deciding in ("compute", "node", "network")
    assert "decides" in pick.tiers.describe()
    plan = export_plan([WORKLOAD], ranks=16, hardware=CLUSTER.fingerprint, db=db, nodes=2)
    assert (plan.launch.nodes, plan.launch.ranks_per_node) == (2, 8)
    assert "--rdzv-backend=c10d" in plan.launch.torchrun and "--ntasks-per-node=8" in plan.launch.srun
    assert plan.buckets[0].decided_by == pick.tiers.describe()
    with pytest.raises(Exception, match="give --ranks, a multiple of 2"):
        recommend(WORKLOAD, ranks=15, hardware=CLUSTER.fingerprint, db=db, nodes=2)


def test_one_node_cannot_be_read_as_a_cluster(tmp_path):
    db = str(tmp_path / "c.db")
    with Store(db) as store:
        store.add_calibration(NODE, make_calibration(4))
    with pytest.raises(Exception, match="is one node: only a calibrated cluster"):
        recommend(WORKLOAD, ranks=16, hardware=NODE.fingerprint, db=db, nodes=2)
    assert recommend(WORKLOAD, ranks=4, hardware=NODE.fingerprint, db=db).tiers is None


# --------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("args, fragment", [
    (["--hosts", "a:2,b:3"], "the nodes are of unequal size (a:2, b:3)"),
    (["--hosts", "localhost:2,nosuchhost.invalid:2"], "host 'nosuchhost.invalid' cannot be reached"),
    (["--hosts", "localhost:1,127.0.0.2:1", "--ranks", "4"], "4 ranks asked and the nodes hold 2"),
    (["--hosts", "a:2,b:2", "--backend", "onnx"], "--hosts: the onnx engine runs its ranks on one node"),
])
def test_bad_nodes_are_refused_in_one_line_and_store_nothing(cptune_here, tmp_path, args, fragment):
    db = tmp_path / "c.db"
    done = cptune_here("search", "--db", db, "--heads", "4", "--head-dim", "16", "--seq-lens", "64", *args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and fragment in lines[0], done.stderr
    assert not db.exists()


def test_a_hostfile_that_does_not_parse_is_refused_in_one_line(cptune_here, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1:4\nnode2 4\n")
    done = cptune_here("calibrate", "--db", tmp_path / "c.db", "--hostfile", hostfile)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"cptune: error: {hostfile}:2: 'node2 4' is not host or host:ranks "
                                        f"(e.g. node1:8)"]
    assert not (tmp_path / "c.db").exists()


# --------------------------------------------------------------------------- every node watched


def test_the_guard_names_the_other_node_where_foreign_load_ran():
    from cptune.guard import CpuReading, Watch

    def reading(wall_s: float, idle_s: float, ours_s: float) -> CpuReading:
        return CpuReading(wall_s=wall_s, cpus=2, idle_s=idle_s, ours_s={(7, 7): ours_s})

    readings = iter([{"node 1 (b)": reading(0.0, 0.0, 0.0), "node 2 (c)": reading(0.0, 0.0, 0.0)},
                     {"node 1 (b)": reading(1.0, 0.0, 2.0),  # busy with our ranks only
                      "node 2 (c)": reading(1.0, 0.0, 0.8)}])  # 1.2 cores of someone else's
    watch = Watch(lambda: [], lambda: next(readings))
    reason = watch.host_disturbance(1) or ""
    assert "on node 2 (c), other processes used 1.2 of 2 cores" in reason and "node 1" not in reason


class SteadyKernel:
    """The guard's reference kernel as a stand-in that never finds the machine slower."""

    typical_s = None

    def time(self) -> float:
        return 1e-3


def shared_watch(monkeypatch, host: tuple, nodes: list[dict]) -> str | None:
    """The host evidence of a ``Watch`` of a 4-rank run (no core left idle) whose readings are
    given: ``host`` this host's two, ``nodes`` the other nodes' two."""
    from cptune import guard

    readings = iter(host)
    monkeypatch.setattr(guard, "read_cpu", lambda pids: next(readings))
    monkeypatch.setattr(guard, "_REFERENCE", SteadyKernel())
    looks = iter(nodes)
    return guard.Watch(lambda: [], lambda: next(looks)).host_disturbance(4)


def cpus(wall_s: float, idle_s: float, ours_s: float, cpu_set: str, task: tuple[int, int] = (7, 7)):
    from cptune.guard import CpuReading

    return CpuReading(wall_s=wall_s, cpus=2, idle_s=idle_s, ours_s={task: ours_s}, cpu_set=cpu_set)


def test_nodes_on_this_host_s_cpus_count_each_other_s_ranks_as_ours(monkeypatch):
    """The two-node testbed (namespaces of one machine): both cores busy with the cluster's
    ranks, half of them node 1's, is no foreign load on either node; what the ranks of
    neither used still is. Before, each node counted the other's ranks as foreign: every run
    of a testbed search was disturbed "on node 1"."""
    here = "boot-a:0,1"
    host = (cpus(0.0, 0.0, 0.0, here), cpus(1.0, 0.0, 1.0, here))  # both cores busy, one ours
    node1 = [{"node 1 (b)": cpus(0.0, 0.0, 0.0, here, (3, 3))},
             {"node 1 (b)": cpus(1.0, 0.0, 1.0, here, (3, 3))}]  # the other core node 1's ranks
    assert shared_watch(monkeypatch, host, node1) is None
    node1_idle = [{"node 1 (b)": cpus(0.0, 0.0, 0.0, here, (3, 3))},
                  {"node 1 (b)": cpus(1.0, 0.0, 0.2, here, (3, 3))}]  # 0.8 cores of someone else's
    assert shared_watch(monkeypatch, host, node1_idle) == "other processes used 0.8 of 2 cores during the run"


def test_nodes_sharing_another_machine_are_judged_as_one_and_named_together(monkeypatch):
    here, there = "boot-a:0,1", "boot-b:0,1"
    host = (cpus(0.0, 0.0, 0.0, here), cpus(1.0, 0.0, 2.0, here))  # this host: all ours
    nodes = [{"node 1 (b1)": cpus(wall, 0.0, ours, there, (3, 3)),
              "node 2 (b2)": cpus(wall, 0.0, ours, there, (5, 5))} for wall, ours in ((0.0, 0.0), (1.0, 1.0))]
    assert shared_watch(monkeypatch, host, nodes) is None  # each node's ranks: a core of the two they share
    nodes[1]["node 2 (b2)"] = cpus(1.0, 0.0, 0.4, there, (5, 5))
    assert shared_watch(monkeypatch, host, nodes) == \
        "on node 1 (b1) and node 2 (b2), other processes used 0.6 of 2 cores during the run"
    # a node whose CPUs are unknown (an older rank) is judged alone, as before
    nodes = [{"node 1 (b1)": cpus(0.0, 0.0, 0.0, "", (3, 3))},
             {"node 1 (b1)": cpus(1.0, 0.0, 1.0, "", (3, 3))}]
    assert shared_watch(monkeypatch, host, nodes) == \
        "on node 1 (b1), other processes used 1.0 of 2 cores during the run"


def test_a_node_reading_says_which_cpus_it_counts_as_this_host_s_own_reading_does():
    from cptune.engines._pool import _reading
    from cptune.engines._worker import node_reading
    from cptune.guard import read_cpu

    assert _reading(node_reading()).cpu_set == read_cpu([]).cpu_set != ""


def test_a_node_lost_as_the_guard_reads_it_marks_the_window_and_raises_nothing():
    from cptune.errors import EngineError
    from cptune.guard import Watch

    def lost() -> dict:
        raise EngineError("crash", "a rank crashed while running reading the nodes' load: rank 2 (node 1, b) "
                                   "died.\nLast output of the ranks:")

    reason = Watch(lambda: [], lost).host_disturbance(1) or ""
    assert "the other nodes' load could not be read (a rank crashed while running reading the nodes' load: " \
           "rank 2 (node 1, b) died.)" in reason


def test_a_node_reading_counts_this_rank_and_its_siblings_as_ours():
    from cptune.engines._worker import node_reading

    reading = node_reading()
    assert reading["cpus"] >= 1 and reading["wall_s"] > 0
    assert any(task.startswith(f"{os.getpid()}:") for task in reading["ours_s"])
    assert all(seconds >= 0 for seconds in reading["ours_s"].values())


def test_a_node_whose_lock_another_cptune_holds_is_busy_unless_our_driver_holds_it(tmp_path, monkeypatch):
    import subprocess
    import sys
    import time

    from cptune.hostlock import hold_for_life
    from cptune.measurement import machine_id

    lock = tmp_path / "node.lock"
    monkeypatch.setenv("CPTUNE_LOCK", str(lock))
    holder = subprocess.Popen([sys.executable, "-c", "import time; from cptune.hostlock import measuring\n"
                               "with measuring():\n    print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "CPTUNE_LOCK": str(lock)})
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        busy = hold_for_life(driver_machine="another machine's driver")
        assert busy is not None and f"pid {holder.pid}" in busy
        # the holder runs on this machine: as a driver here, its own lock on a shared file system
        assert hold_for_life(driver_machine=machine_id()) is None
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 5
    while (free := hold_for_life(driver_machine="another machine's driver")) is not None:
        assert time.monotonic() < deadline, free  # taken once the holder is gone
        time.sleep(0.1)


def test_the_command_line_answers_for_a_cluster_size_it_never_ran(cptune_here, tmp_path):
    db = tmp_path / "c.db"
    with Store(str(db)) as store:
        store.add_calibration(CLUSTER, cluster_calibration(1e6))
    shape = ("--heads", "8", "--head-dim", "64")
    picked = cptune_here("recommend", "--db", db, "--hardware", CLUSTER.fingerprint, "--nodes", "2",
                         "--ranks", "16", *shape, "--seq-len", "4096")
    assert picked.returncode == 0, picked.stderr
    assert "read for 2 nodes x 8 ranks" in picked.stdout and "across nodes: " in picked.stdout
    plan = tmp_path / "plan.json"
    exported = cptune_here("export", "--db", db, "--hardware", CLUSTER.fingerprint, "--nodes", "2", "--ranks",
                           "16", *shape, "--seq-lens", "4096", "-o", plan)
    assert exported.returncode == 0, exported.stderr
    assert "mpiexec -n 16 -ppn 8" in exported.stdout
    assert json.loads(plan.read_text())["buckets"][0]["decided_by"]
    odd = cptune_here("recommend", "--db", db, "--hardware", CLUSTER.fingerprint, "--nodes", "2",
                      "--ranks", "15", *shape, "--seq-len", "4096")
    assert odd.returncode == 2 and odd.stderr.count("\n") == 1 and "a multiple of 2" in odd.stderr


def test_the_command_a_search_prints_for_a_failed_configuration_names_its_nodes():
    from cptune.search._visits import measure_command

    command = measure_command(WORKLOAD, CPConfig("ring", 4), "mpi", hosts="a:2,b:2")
    assert command.endswith("--ranks 4 --head-group 1 --hosts a:2,b:2")
    assert "--hosts" not in measure_command(WORKLOAD, CPConfig("ring", 4))
