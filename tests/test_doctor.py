"""Node probes: ``cptune doctor`` and ``check_host``, the verdict kept per host and engine, and a
search that goes by it (refused configurations left out, a node probed once). A stand-in
engine with canned verdicts plays the GPU node; nothing starts a rank."""

from __future__ import annotations

import dataclasses
import re
import shutil

import pytest

import cptune
from conftest import assert_refused, measurement, stand_in_measuring
from cptune import CPConfig, Workload
from cptune.cli import main
from cptune.engines import ENGINES, BackendUnavailableError, NodeVerdict, ProbeResult
from cptune.errors import EngineError
from cptune.hardware import Hardware
from cptune.measurement import oversubscribed
from cptune.reference import TOLERANCE
from cptune.search import SearchProgress, SearchSetupError, check_host, search_space
from cptune.store import Store

GPU_NODE = Hardware(host="gpu-node", cpu_model="test cpu", cpu_count=32, gpu_model="NVIDIA H100 (SM90)",
                    gpu_count=4, interconnect="NVLink (NV18)", mpi_library="MPICH 5", nccl_version="2.27",
                    tensorrt_version="11.0")
HEALTHY = (
    ProbeResult("collectives", True, "all_to_all, all_gather and broadcast right on every rank"),
    ProbeResult("subgroups", True, "right in both groups"),
    ProbeResult("attention_bf16", True, "built, off by 4e-3"),
)
#: Subgroups go wrong (hybrids refused) and collectives fuse away unless a Cast bounds them
#: (worked around, nothing refused).
UNHEALTHY = (
    ProbeResult.judged("collectives", True, "all_to_all, all_gather and broadcast right on every rank"),
    ProbeResult.judged("subgroups", False, "ranks 2-3 received group 0's values"),
    ProbeResult.judged("standalone", False, "fused into one Myelin region; standalone behind a Cast",
                       answer="boundary"),
)
BF16_BROKEN = (ProbeResult.judged("attention_bf16", False, "the build failed: no bf16 tactic"),)


class StandInNode:
    """The TensorRT engine as a GPU node would show it, with ``results`` as its probes' answers."""

    spec = ENGINES["tensorrt"]
    name = "tensorrt"
    device = "gpu"
    tolerance = TOLERANCE

    def __init__(self, results: tuple[ProbeResult, ...], gpus: int = 4) -> None:
        self.results, self.gpus = results, gpus
        self.probed: list[int | None] = []  # each check_node call's ranks

    def preflight(self, ranks: int) -> None:
        if ranks > self.gpus:
            raise BackendUnavailableError(f"{ranks} ranks need {ranks} GPUs, but this node has {self.gpus}")

    def capacity(self) -> int:
        return self.gpus

    def hardware(self) -> Hardware:
        return GPU_NODE

    def check_node(self, ranks: int | None = None) -> NodeVerdict:
        self.probed.append(ranks)
        return NodeVerdict(ranks or self.gpus, self.results)

    def close(self) -> None:
        pass


@pytest.fixture
def node(monkeypatch):
    """Make ``--backend tensorrt`` (and ``backend="tensorrt"``) the stand-in answering ``results``."""

    def make(results: tuple[ProbeResult, ...]) -> StandInNode:
        engine = StandInNode(results)
        monkeypatch.setitem(cptune.engines._engines, ("tensorrt", None), engine)
        return engine

    return make


@pytest.fixture
def wide(monkeypatch):
    """A console wide enough that each table row is one line (Rich reads COLUMNS)."""
    monkeypatch.setenv("COLUMNS", "300")


# --------------------------------------------------------------------------- cptune doctor


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver")
def test_doctor_off_a_gpu_prints_the_preflights_line_and_exits_2(cptune_here, tmp_path, monkeypatch):
    """No stand-in: this machine, as it is, has no GPU."""
    monkeypatch.chdir(tmp_path)
    refused = cptune_here("doctor")
    # the advice is what runs here (a search with mpi), never a doctor --backend mpi that doctor refuses
    assert_refused(refused, "--backend tensorrt needs NVIDIA GPUs", "search, measure and calibrate with "
                   "--backend mpi", "cptune doctor has no node to probe here")
    assert_refused(cptune_here("doctor", "--max-ranks", "2", "--db", tmp_path / "x.db"), "needs NVIDIA GPUs")
    assert list(tmp_path.iterdir()) == []  # no database, not even the default one


@pytest.mark.parametrize("backend, said", [("mpi", "mpi has no node probes"),
                                           ("nosuch", "nosuch is not an engine")])
def test_doctor_takes_only_engines_with_probes(cptune_here, tmp_path, backend, said):
    result = cptune_here("doctor", "--backend", backend, "--db", tmp_path / "x.db")
    assert_refused(result, said, "engines with probes: tensorrt", prefix="cptune doctor: error: ")
    assert not (tmp_path / "x.db").exists()


def test_doctor_on_a_healthy_node_prints_the_table_and_exits_0(cptune_here, node, wide):
    engine = node(HEALTHY)
    result = cptune_here("doctor", "--max-ranks", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert engine.probed == [2] and result.stderr == ""
    header = next(line for line in result.stdout.splitlines() if line.lstrip().startswith("probe"))
    assert re.split(r"\s{2,}", header.strip()) == ["probe", "result", "what was seen", "what cptune does"]
    for probe in HEALTHY:
        row = next(line for line in result.stdout.splitlines() if line.lstrip().startswith(probe.probe))
        assert re.split(r"\s{2,}", row.strip()) == [probe.probe, "ok", probe.seen, "-"]
    assert "FAILED" not in result.stdout
    assert result.stdout.splitlines()[-1] == ("healthy: all 3 probes passed on 2 GPU(s); tensorrt runs every "
                                              "configuration; not kept (--db keeps it for searches)")


def test_doctor_exits_1_and_says_what_cptune_does_about_each_failing_probe(cptune_here, node, wide, tmp_path):
    engine = node(UNHEALTHY)
    db = tmp_path / "d.db"
    result = cptune_here("doctor", "--db", db)
    assert result.returncode == 1, result.stdout + result.stderr
    assert engine.probed == [None] and result.stderr == ""  # every GPU: the engine's default
    rows = {line.split()[0]: line for line in result.stdout.splitlines()
            if line.strip() and line.split()[0] in {r.probe for r in UNHEALTHY}}
    for probe in UNHEALTHY:
        assert re.split(r"\s{2,}", rows[probe.probe].strip()) == [
            probe.probe, "ok" if probe.ok else "FAILED", probe.seen, probe.action or "-"]
        assert probe.ok or len(probe.action) > 20  # what cptune does, in words
    summary = result.stdout.splitlines()[-1]
    assert summary.startswith("2 of 3 probes failed on 4 GPU(s) (subgroups, standalone): cptune works around")
    assert summary.endswith(f"kept in {db}, where searches on this host go by it")
    with Store(str(db), create=False) as store:
        assert store.node_verdict(GPU_NODE.fingerprint, "tensorrt") == NodeVerdict(4, UNHEALTHY)


def test_doctor_is_listed_in_the_help(cptune_here):
    result = cptune_here("--help")
    assert result.returncode == 0 and "doctor" in result.stdout


# --------------------------------------------------------------------------- check_host


def test_check_host_keeps_the_verdict_only_in_a_database_given(tmp_path, node):
    engine = node(UNHEALTHY)
    db = str(tmp_path / "c.db")
    hardware, verdict = cptune.check_host(max_ranks=2)
    assert (hardware, verdict) == (GPU_NODE, NodeVerdict(2, UNHEALTHY)) and engine.probed == [2]
    assert list(tmp_path.iterdir()) == []
    check_host(db, max_ranks=2)
    engine.results = HEALTHY
    _, again = check_host(db)  # a later check replaces the one before
    assert again == NodeVerdict(4, HEALTHY) and again.healthy
    with Store(db, create=False) as store:
        assert store.node_verdict(GPU_NODE.fingerprint, "tensorrt") == again


def test_check_host_refuses_before_probing(tmp_path, node):
    engine = node(HEALTHY)
    db = tmp_path / "c.db"
    refused = r"mpi has no node probes \(.*\); engines with probes: tensorrt$"
    with pytest.raises(SearchSetupError, match=refused):
        check_host(str(db), backend="mpi")
    with pytest.raises(BackendUnavailableError, match="8 ranks need 8 GPUs"):
        check_host(str(db), max_ranks=8)
    assert engine.probed == [] and not db.exists()


def test_a_probe_that_fails_leaves_no_new_database(tmp_path, node, monkeypatch):
    engine = node(HEALTHY)

    def fails(ranks):
        raise EngineError("crash", "rank 1 died while probing")

    monkeypatch.setattr(engine, "check_node", fails)
    with pytest.raises(EngineError, match="rank 1 died"):
        check_host(str(tmp_path / "new.db"))
    assert list(tmp_path.iterdir()) == []  # made only once there is a verdict to keep


# --------------------------------------------------------------------------- the search goes by it

#: On 2 and 4 ranks, 4 heads: 4 pure configurations on 4 ranks, 2 hybrids, 3 on 2 ranks.
SEARCH = ["--heads", "4", "--head-dim", "16", "--seq-lens", "64,96", "--ranks", "2,4", "--no-calibrate",
          "--rounds", "1", "--race-rounds", "0", "--confirm-rounds", "0"]
HYBRIDS = {CPConfig("ring", 4, 2), CPConfig("allgather_kv", 4, 2)}


@pytest.fixture
def runs(monkeypatch):
    """The search's measurements made up (as the TensorRT engine would store them): the
    configurations run, in order."""
    ran = []

    def fake(workload, config, **_):
        ran.append((workload.seq_len, config))
        made = measurement(workload, config, 10.0 + config.ranks + config.head_group)
        return dataclasses.replace(made, engine="tensorrt", oversubscribed=oversubscribed(config.ranks))

    stand_in_measuring(monkeypatch, fake)
    return ran


def test_search_leaves_out_what_the_node_refuses_and_says_why(tmp_path, node, runs, capsys):
    engine = node(UNHEALTHY)
    db = str(tmp_path / "s.db")
    assert main(["search", "--backend", "tensorrt", "--db", db, *SEARCH]) == 0
    out = capsys.readouterr().out
    assert engine.probed == [4]  # once, on the space's largest rank count, before the first run
    ran = {config for _, config in runs}
    assert ran and not ran & HYBRIDS and CPConfig("ring", 4) in ran and CPConfig("ulysses", 4) in ran
    lines = out.splitlines()
    verdict = NodeVerdict(4, UNHEALTHY)
    for seq_len in (64, 96):
        for hybrid in HYBRIDS:
            reason = verdict.refuses(Workload(seq_len=seq_len, heads=4, head_dim=16), hybrid)
            assert reason is not None and reason.startswith(hybrid.describe())
            assert f"seq {seq_len}: left out: {reason}" in lines, out
    assert "this node failed probes: subgroups, standalone (probed now)" in out
    assert ("4 configuration(s) left out, refused by this node (the reasons are above; cptune doctor "
            "--backend tensorrt shows its probes)") in lines
    with Store(db, create=False) as store:
        assert not {r.config for r in store.results()} & HYBRIDS
        assert store.node_verdict(GPU_NODE.fingerprint, "tensorrt") == NodeVerdict(4, UNHEALTHY)


def test_a_second_search_goes_by_the_stored_verdict_without_probing(tmp_path, node, runs, capsys):
    engine = node(UNHEALTHY)
    db = str(tmp_path / "s.db")
    first = search_space(_space(), db, backend="tensorrt", calibrate_first=False, rounds=1, race_rounds=0,
                         confirm_rounds=0)
    assert engine.probed == [4] and first.node == NodeVerdict(4, UNHEALTHY)
    assert first.refused == {n: {c: first.node.refuses(_space().shape.at(n), c) for c in HYBRIDS}
                             for n in (64, 96)}
    assert first.refused_count == 4 and first.skipped == ()
    heard = []

    class Listener(SearchProgress):
        def node_checked(self, verdict, stored):
            heard.append(("checked", stored))

        def refused(self, workload, config, reason):
            heard.append(("refused", workload.seq_len, config))

    again = search_space(_space(), db, backend="tensorrt", calibrate_first=False, remeasure=True, rounds=1,
                         race_rounds=0, confirm_rounds=0, progress=Listener())
    assert engine.probed == [4]  # not probed again, --remeasure or not
    assert heard[0] == ("checked", True) and len(heard) == 5
    assert {h[2] for h in heard[1:]} == HYBRIDS and again.refused == first.refused
    assert not {config for _, config in runs} & HYBRIDS


def test_a_verdict_probed_on_fewer_ranks_is_probed_again_on_the_search_s(tmp_path, node, runs):
    engine = node(HEALTHY)
    db = str(tmp_path / "s.db")
    check_host(db, max_ranks=2)
    run = search_space(_space(), db, backend="tensorrt", calibrate_first=False, rounds=1, race_rounds=0,
                       confirm_rounds=0)
    assert engine.probed == [2, 4] and run.node == NodeVerdict(4, HEALTHY) and run.refused == {}
    assert {config for _, config in runs} >= HYBRIDS  # a healthy node runs the hybrids too


def test_a_workload_the_node_refuses_entirely_is_skipped_and_the_rest_searched(tmp_path, node, runs, capsys):
    engine = node(BF16_BROKEN)
    db = str(tmp_path / "s.db")
    space = _space(dtype="bf16")
    run = search_space(space, db, backend="tensorrt", calibrate_first=False, rounds=1, race_rounds=0,
                       confirm_rounds=0)
    assert engine.probed == [4] and runs == [] and run.searches == {} and run.skipped == (64, 96)
    assert run.describe().splitlines() == [f"seq {n}: not searched, this node refuses every configuration"
                                           for n in (64, 96)]
    assert main(["search", "--backend", "tensorrt", "--db", db, *SEARCH, "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert engine.probed == [4] and runs == []
    reason = NodeVerdict(4, BF16_BROKEN).refuses(space.shape.at(96), CPConfig("ring", 4))
    assert reason is not None and "cptune doctor: attention_bf16" in reason
    for seq_len in (64, 96):  # one line each: the reason is the same for every configuration
        said = f"seq {seq_len}: not searched, this node refuses every configuration: {reason}"
        assert said in out.splitlines() and f"seq {seq_len}: left out" not in out
    assert "16 configuration(s) left out, refused by this node (the reasons are above; " in out
    assert out.splitlines()[-2].endswith("; seq 64, 96 not searched at all"), out
    # fp32 builds on this node: the same search in fp32 runs as usual
    assert main(["search", "--backend", "tensorrt", "--db", db, *SEARCH, "--dtype", "fp32"]) == 0
    assert {config for _, config in runs} >= HYBRIDS and engine.probed == [4]


def _space(dtype: str = "fp32"):
    from cptune.space import MeasureSettings, SearchSpace

    shape = Workload(seq_len=64, heads=4, head_dim=16, dtype=dtype).shape
    return SearchSpace(name="tiny", description="two lengths", source=None, shape=shape, seq_lens=(64, 96),
                       ranks=(2, 4), strategies=cptune.STRATEGIES, trials=None,
                       measure=MeasureSettings(warmup=0, repeats=2))
