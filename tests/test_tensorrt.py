"""The TensorRT engine where there is no GPU: it imports without TensorRT, refuses in one
line what a node lacks, keys and writes its engine cache safely, reads the GPU node's
fingerprint from the driver's text, and its calibration graphs are valid ONNX that compute
attention correctly. The GPU tests at the end skip, with their reason, where the node
cannot run them."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

import cptune
from conftest import processes_left
from cptune import CPConfig, EngineError, Workload
from cptune.calibration import calibrate
from cptune.cli import main
from cptune.engines import PROBES, UNTRIED, BackendUnavailableError, NodeVerdict, ProbeResult
from cptune.engines.onnx import _calibration as graphs
from cptune.engines.onnx import collective_attributes, rank_graph
from cptune.engines.tensorrt import NodeProbe, TensorRTEngine, preflight, probe_node
from cptune.engines.tensorrt._cache import EngineCache, cache_dir, engine_key
from cptune.engines.tensorrt._worker import fused_collectives, io_specs, split_layer_times, to_device_dtype
from cptune.hardware import Hardware
from cptune.hardware._host import (
    GpuInfo,
    gpu_hardware,
    parse_cuda_version,
    parse_gpu_query,
    parse_topology,
    visible_gpus,
)
from cptune.reference import make_inputs

# --------------------------------------------------------------------------- recorded driver text

QUERY_H100 = """\
0, GPU-1b2c3d4e-0000-1111-2222-333344445555, NVIDIA H100 80GB HBM3, 9.0, 570.124.06
1, GPU-2b2c3d4e-0000-1111-2222-333344445555, NVIDIA H100 80GB HBM3, 9.0, 570.124.06
2, GPU-3b2c3d4e-0000-1111-2222-333344445555, NVIDIA H100 80GB HBM3, 9.0, 570.124.06
3, GPU-4b2c3d4e-0000-1111-2222-333344445555, NVIDIA H100 80GB HBM3, 9.0, 570.124.06
"""
QUERY_V100 = """\
0, GPU-aaaa0000-0000-1111-2222-333344445555, Tesla V100-SXM2-32GB, 7.0, 535.183.01
1, GPU-bbbb0000-0000-1111-2222-333344445555, Tesla V100-SXM2-32GB, 7.0, 535.183.01
"""
TOPO_NVLINK = """\
\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tNV18\tNV18\tSYS\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tSYS\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\t56-111,168-223\t1\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\t56-111,168-223\t1\t\tN/A
NIC0\tSYS\tSYS\tSYS\tSYS\t X \t\t\t\t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""
TOPO_MIXED = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\tPIX\tSYS\t0-31\t0
GPU1\tNV4\t X \tSYS\tPIX\t0-31\t0
GPU2\tPIX\tSYS\t X \tNV4\t32-63\t1
GPU3\tSYS\tPIX\tNV4\t X \t32-63\t1
"""
SMI_HEADER = "| NVIDIA-SMI 570.124.06     Driver Version: 570.124.06     CUDA Version: 12.8     |"


def node(query: str = QUERY_H100, missing: dict[str, str] | None = None) -> NodeProbe:
    return NodeProbe(tuple(parse_gpu_query(query)), None, missing or {})


# --------------------------------------------------------------------------- imports


@pytest.mark.slow
def test_runtime_modules_import_without_the_gpu_packages():
    """Even where TensorRT, nccl4py and cuda-bindings are installed, importing the engine
    must not import them (they load only on the ranks, when a task needs them)."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('tensorrt', 'nccl', 'cuda'):\n"
        "            raise ImportError(f'{name} blocked by the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import cptune.engines.tensorrt, cptune.engines.tensorrt._worker\n"
        "import cptune.engines.onnx._calibration\n"
        "from cptune.engines import get_engine\n"
        "assert get_engine('tensorrt').name == 'tensorrt'\n"
        "assert not {'tensorrt', 'nccl', 'cuda'} & {m.split('.')[0] for m in sys.modules}\n"
        "print('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"


# --------------------------------------------------------------------------- preflight


def inject(
    monkeypatch, query: str | None, missing: dict[str, str] | None = None, nccl: str | None = None
) -> None:
    """Make the node's probe see ``query`` as nvidia-smi's answer (None: no nvidia-smi),
    ``missing`` packages fail to import and NCCL's library fail to load for reason ``nccl``
    (None: it loads); the checks themselves run as they are."""

    def nvidia_smi(*arguments):
        if query is None:
            raise FileNotFoundError("nvidia-smi is not on PATH: no NVIDIA driver here")
        return query

    monkeypatch.setattr("cptune.hardware._host._nvidia_smi", nvidia_smi)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr("cptune.engines.tensorrt._preflight._import_problem",
                        lambda module: (missing or {}).get(module))
    monkeypatch.setattr("cptune.engines.tensorrt._preflight._nccl_problem", lambda: nccl)


BRANCHES = {
    "no GPU": (None, None, [], "has no CUDA GPU (nvidia-smi is not on PATH"),
    "NCCL library missing": (QUERY_H100, None, ["--nccl-fails"],
                             "needs NCCL's library, which cannot be loaded here"),
    "TensorRT missing": (QUERY_H100, {"tensorrt": "ModuleNotFoundError: No module named 'tensorrt'"}, [],
                         "needs tensorrt, which cannot be imported here"),
    "fewer GPUs than ranks": (QUERY_H100, None, ["--max-ranks", "8"],
                              "8 ranks need 8 GPUs, but this node has 4"),
    "older than SM80": (QUERY_V100, None, [], "GPU 0 (Tesla V100-SXM2-32GB) is 7.0"),
}
COMMANDS = {
    "search": ["search", "--heads", "8", "--head-dim", "64", "--seq-lens", "256"],
    "calibrate": ["calibrate"],
    "measure": ["measure"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("branch", BRANCHES)
def test_preflight_exits_2_with_one_line(monkeypatch, capsys, tmp_path, command, branch):
    query, missing, extra, message = BRANCHES[branch]
    nccl = "DynamicLibNotFoundError: libnccl.so.2 not found" if "--nccl-fails" in extra else None
    extra = [e for e in extra if e != "--nccl-fails"]
    inject(monkeypatch, query, missing, nccl)
    db = tmp_path / "x.db"
    args = [*COMMANDS[command], "--backend", "tensorrt", *extra]
    code = main([*args, "--db", str(db)] if command != "measure" else args)
    out = capsys.readouterr()
    text = (out.out + out.err).strip()
    assert code == 2
    assert message in text
    assert len(text.splitlines()) == 1, text
    assert "Traceback" not in text
    assert not db.exists()  # refused before the database was opened


def test_preflight_messages_say_how_to_get_what_is_missing():
    with pytest.raises(BackendUnavailableError, match=r"pip install 'cptune\[tensorrt\]'"):
        preflight(2, node(missing={"nccl.core": "ModuleNotFoundError: No module named 'nccl'"}))
    with pytest.raises(BackendUnavailableError, match="--max-ranks 4"):
        preflight(5, node())
    with pytest.raises(BackendUnavailableError, match="--backend mpi"):
        preflight(1, NodeProbe((), "nvidia-smi failed: No devices were found", {}))
    preflight(4, node())  # four SM90 GPUs and every package: nothing to say


def test_preflight_checks_only_the_gpus_the_ranks_use():
    mixed = "0, GPU-a, NVIDIA A100-SXM4-80GB, 8.0, 550.54\n1, GPU-b, Tesla T4, 7.5, 550.54\n"
    preflight(1, node(mixed))
    with pytest.raises(BackendUnavailableError, match=r"GPU 1 \(Tesla T4\) is 7.5"):
        preflight(2, node(mixed))


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver")
@pytest.mark.slow
def test_search_with_tensorrt_here_exits_2_with_one_line(tmp_path):
    """No injection: this machine, as it is, has no GPU."""
    done = subprocess.run([sys.executable, "-m", "cptune.cli", "search", "--backend", "tensorrt",
                           "--db", str(tmp_path / "x.db")], capture_output=True, text=True, timeout=120)
    text = (done.stdout + done.stderr).strip()
    assert done.returncode == 2
    assert "--backend tensorrt needs NVIDIA GPUs" in text and len(text.splitlines()) == 1
    assert "Traceback" not in text


def test_library_callers_get_the_preflight_before_any_process_starts(tmp_path):
    engine = TensorRTEngine(probe=lambda: NodeProbe((), "nvidia-smi is not on PATH", {}))
    w = Workload(seq_len=16, heads=2, head_dim=8, dtype="fp32")
    with pytest.raises(BackendUnavailableError, match="no CUDA GPU"):
        cptune.compute(w, CPConfig("ulysses", 2), *make_inputs(w), backend=engine)
    assert engine._pool is None


@pytest.mark.slow
@pytest.mark.serial  # its ranks are found by the module's name: alone
def test_rank_failures_on_the_tensorrt_pool_end_as_one_error_and_no_process(monkeypatch):
    """The node is said to be fine, but the ranks cannot import TensorRT here: the
    supervised pool reports the rank's failure as one EngineError and leaves nothing."""
    engine = TensorRTEngine(probe=lambda: node())
    w = Workload(seq_len=16, heads=2, head_dim=8, dtype="fp32")
    try:
        with pytest.raises(EngineError) as failure:
            cptune.compute(w, CPConfig("ulysses", 2), *make_inputs(w), backend=engine, timeout=120)
    finally:
        engine.close()
    assert failure.value.kind == "error"
    assert re.match(r"rank \d failed running building the engines of Ulysses on 2 ranks", str(failure.value))
    if importlib.util.find_spec("cuda") is None:  # the graph was made; NCCL's loader, first, is missing
        assert "No module named 'cuda'" in str(failure.value)
    assert processes_left("cptune.engines.tensorrt._worker") == []


# --------------------------------------------------------------------------- engine cache


def test_engine_key_changes_with_graph_version_and_gpu():
    base = engine_key(b"graph", "11.4.0.106", "NVIDIA H100 80GB HBM3", "9.0")
    assert base == engine_key(b"graph", "11.4.0.106", "NVIDIA H100 80GB HBM3", "9.0")
    others = {
        engine_key(b"graph2", "11.4.0.106", "NVIDIA H100 80GB HBM3", "9.0"),
        engine_key(b"graph", "11.5.0.1", "NVIDIA H100 80GB HBM3", "9.0"),
        engine_key(b"graph", "11.4.0.106", "NVIDIA A100-SXM4-80GB", "9.0"),
        engine_key(b"graph", "11.4.0.106", "NVIDIA H100 80GB HBM3", "10.0"),
    }
    assert base not in others and len(others) == 4


def test_engine_cache_round_trip_is_atomic_and_refuses_damaged_entries(tmp_path):
    cache = EngineCache(tmp_path / "engines")
    key = engine_key(b"g", "11.4", "gpu", "9.0")
    assert cache.load(key) is None
    cache.store(key, b"\x01serialized engine", 12.5)
    assert cache.load(key) == b"\x01serialized engine"
    assert sorted(p.name for p in (tmp_path / "engines").iterdir()) == [f"{key}.engine", f"{key}.json"]
    (tmp_path / "engines" / f"{key}.engine").write_bytes(b"\x01serialized eng")  # truncated
    assert cache.load(key) is None
    (tmp_path / "engines" / f"{key}.json").write_text("{not json")
    assert cache.load(key) is None


def test_engine_cache_failed_write_leaves_no_file(tmp_path, monkeypatch):
    cache = EngineCache(tmp_path)

    def broken_replace(source, target):
        raise OSError("disk full")

    monkeypatch.setattr("cptune.engines.tensorrt._cache.os.replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        cache.store("k", b"engine", 1.0)
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CPTUNE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" / "engines"
    monkeypatch.delenv("CPTUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "cptune" / "engines"


# --------------------------------------------------------------------------- fingerprint


def test_gpu_query_and_visible_devices():
    gpus = parse_gpu_query(QUERY_H100 + "garbage line\n")
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert gpus[0] == GpuInfo(0, "GPU-1b2c3d4e-0000-1111-2222-333344445555", "NVIDIA H100 80GB HBM3", "9.0",
                              "570.124.06")
    assert gpus[0].sm == 90 and parse_gpu_query(QUERY_V100)[0].sm == 70
    assert [g.index for g in visible_gpus(gpus, None)] == [0, 1, 2, 3]
    assert [g.index for g in visible_gpus(gpus, "2,0")] == [2, 0]
    assert [g.index for g in visible_gpus(gpus, "GPU-3b2c,1")] == [2, 1]
    assert [g.index for g in visible_gpus(gpus, "1,7,2")] == [1]  # CUDA stops at the unknown entry
    assert visible_gpus(gpus, "") == []


def test_topology_in_the_drivers_terms():
    assert parse_topology(TOPO_NVLINK, [0, 1, 2, 3]) == "NVLink (NV18)"
    assert parse_topology(TOPO_MIXED, [0, 1, 2, 3]) == "NVLink (NV4) and PCIe (PIX, SYS)"
    assert parse_topology(TOPO_MIXED, [0, 1]) == "NVLink (NV4)"
    assert parse_topology(TOPO_MIXED, [0, 2]) == "PCIe (PIX)"
    assert parse_topology(TOPO_MIXED, [3]) == "single GPU"
    with pytest.raises(ValueError, match="GPU0 and GPU5"):
        parse_topology(TOPO_MIXED, [0, 5])


def test_cuda_version_from_either_form():
    assert parse_cuda_version(SMI_HEADER) == "12.8"
    assert parse_cuda_version("    CUDA Version                          : 13.0\n") == "13.0"
    assert parse_cuda_version("no driver") is None


def test_gpu_fingerprint_holds_the_node_facts(monkeypatch):
    monkeypatch.setattr("cptune.hardware._host.nccl_version", lambda: "2.27.7")
    monkeypatch.setattr("cptune.hardware._host.tensorrt_version", lambda: "11.4.0.106")
    gpus = parse_gpu_query(QUERY_H100)
    hardware = gpu_hardware(gpus, TOPO_NVLINK, "12.8")
    assert hardware.gpu_model == "NVIDIA H100 80GB HBM3 (sm_90, driver 570.124.06, CUDA 12.8)"
    assert hardware.gpu_count == 4 and hardware.interconnect == "NVLink (NV18)"
    assert (hardware.nccl_version, hardware.tensorrt_version) == ("2.27.7", "11.4.0.106")
    assert gpu_hardware(gpus[:2], TOPO_NVLINK, "12.8").fingerprint != hardware.fingerprint
    assert gpu_hardware(gpus, TOPO_NVLINK, "13.0").fingerprint != hardware.fingerprint


def test_cpu_host_fingerprint_is_unchanged():
    """The value main computed for these facts before GPU fingerprints existed."""
    cpu = Hardware(host="node-1", cpu_model="Some CPU", cpu_count=2, gpu_model=None, gpu_count=0,
                   interconnect="shared memory (one host)", mpi_library="mpich 4.3.1")
    assert cpu.fingerprint == "e98b8de11af8f74c"


# --------------------------------------------------------------------------- rank-side pure parts


def test_layer_times_split_into_compute_and_communication():
    collectives = {"exchange_kv": {"exchange_kv", "kv_out"}, "exchange_out": {"exchange_out"}}
    alone = {"q_transpose + q_cast": 0.5, "exchange_kv": 2.0, "exchange_out": 1.0, "attention": 3.0,
             "{ForeignNode[scores...merge]}": 4.0}
    assert split_layer_times(alone, collectives) == (0.5 + 3.0 + 4.0, 2.0 + 1.0)
    assert fused_collectives(alone, collectives) == []


def test_no_split_where_a_collective_is_fused_with_compute():
    """A collective inside a Myelin region or a fused "a + b" layer has no time of its own:
    the split is unavailable (NaN), never a guess."""
    collectives = {"exchange_kv": {"exchange_kv"}, "exchange_out": {"exchange_out"}}
    for fused in ({"exchange_kv": 2.0, "{ForeignNode[exchange_out...out_cast]}": 1.0, "attention": 3.0},
                  {"exchange_kv": 2.0, "exchange_out + out_cast": 1.0}):
        assert fused_collectives(fused, collectives) == ["exchange_out"]
        assert all(np.isnan(split_layer_times(fused, collectives)))


def test_io_specs_and_bfloat16_inputs():
    model = graphs.attention_graph({"heads": 2, "seq_q": 4, "seq_k": 8, "head_dim": 8, "causal": 1})
    specs = io_specs(model)
    assert specs["q"][0] == (1, 2, 4, 8) and specs["k"][0] == (1, 2, 8, 8) and specs["out"][0] == (1, 2, 4, 8)
    assert specs["q"][1].name == "bfloat16"
    x = np.array([1.0, 1.0 + 2**-9, 3.140625, -2.0], dtype=np.float32)
    converted = to_device_dtype(x, specs["q"][1])
    assert converted.dtype.itemsize == 2 and converted.flags.c_contiguous
    assert converted.astype(np.float32).tolist() == [1.0, 1.0, 3.140625, -2.0]  # 1 + 2^-9 rounds to even


# --------------------------------------------------------------------------- calibration graphs


@pytest.mark.parametrize("kind", ["all_to_all", "all_gather", "broadcast"])
def test_collective_graphs_are_valid_and_grouped_like_the_mpi_engine(kind):
    """Calibration writes each collective for its group's own communicator (no ranks named,
    root 0 of the group), so every rank's graph is the same; the doctor's subgroup probe
    names the members among all ranks, as a hybrid's graphs do."""
    for rank in range(4):
        members = [0, 1] if rank < 2 else [2, 3]
        for local in (True, False):
            model = graphs.collective_graph(kind, ranks=4, group=2, rank=rank, chunk_bytes=4096, local=local)
            onnx.checker.check_model(model, full_check=True)
            (node,) = model.graph.node
            attributes = collective_attributes(node)
            assert attributes["collective_operation"] == kind
            assert attributes["groups"] == ([] if local else members) and attributes["nb_rank"] == 2
            assert attributes["root"] == ((0 if local else members[0]) if kind == "broadcast" else -1)
            shapes = {name: spec[0] for name, spec in io_specs(model).items()}
            per_peer = 4096 // 2  # float16 elements
            assert shapes["x"] == {"all_to_all": (2 * per_peer,)}.get(kind, (per_peer,))
            assert shapes["y"] == {"all_gather": (2 * per_peer,)}.get(kind, shapes["x"])
    with pytest.raises(ValueError, match="groups of 3 among 4"):
        graphs.collective_graph(kind, ranks=4, group=3, rank=0, chunk_bytes=64)


@pytest.mark.parametrize("kind", ["all_to_all", "all_gather", "broadcast"])
def test_calibration_values_tell_which_member_sent_which_chunk(kind):
    """Every member's expected output is what the collective makes of every member's
    marked input; a collective run in the wrong group, or not at all, gives other values."""
    group, elements = 4, 8
    shape_in = (group * elements,) if kind == "all_to_all" else (elements,)
    sent = [graphs.collective_inputs(kind, group, m, shape_in) for m in range(group)]
    for member in range(group):
        if kind == "all_to_all":
            made = np.concatenate([np.split(sent[j], group)[member] for j in range(group)])
        elif kind == "all_gather":
            made = np.concatenate(sent)
        else:
            made = sent[0]
        expected = graphs.collective_expected(kind, group, member, made.shape)
        assert np.array_equal(made, expected)
        if member and kind == "broadcast":  # a broadcast that did nothing leaves the input: not the expected
            assert not np.array_equal(sent[member], expected)
    if kind == "all_to_all":  # each member gets its own chunks, from every member
        outputs = {graphs.collective_expected(kind, group, m, shape_in).tobytes() for m in range(group)}
        assert len(outputs) == group


@pytest.mark.parametrize("causal", [0, 1])
def test_attention_graph_computes_attention(causal):
    shape = {"heads": 2, "seq_q": 5, "seq_k": 12, "head_dim": 8, "causal": causal}
    model = graphs.attention_graph(shape, dtype=onnx.TensorProto.FLOAT)
    onnx.checker.check_model(model, full_check=True)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 5, 8), dtype=np.float32)
    k, v = (rng.standard_normal((1, 2, 12, 8), dtype=np.float32) for _ in range(2))
    (out,) = ReferenceEvaluator(model).run(None, {"q": q, "k": k, "v": v})
    scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) / np.sqrt(8)
    if causal:  # queries are the last 5 of 12 positions
        scores = np.where(graphs.causal_mask(5, 12), scores, -np.inf)
        assert graphs.causal_mask(5, 12)[0].sum() == 8 and graphs.causal_mask(5, 12)[-1].all()
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = np.einsum("bhqk,bhkd->bhqd", weights / weights.sum(axis=-1, keepdims=True), v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_calibration_requests_make_one_graph_per_point():
    request = {"collective": "all_gather", "group": 2, "chunks": [1024, 4096, 16384]}
    collective = graphs.case_graphs(request, 2, 1)
    assert [io_specs(m)["x"][0] for m in collective] == [(512,), (2048,), (8192,)]
    attention = graphs.case_graphs({"shapes": [{"heads": 4, "seq_q": 8, "seq_k": 32, "head_dim": 64,
                                                "causal": 0}]}, 2, 0)
    assert len(attention) == 1 and attention[0].graph.node[0].op_type == "Attention"


# --------------------------------------------------------------------------- on GPUs


def gpu_node_or_skip(ranks: int) -> None:
    """Skip, with the preflight's own reason, where this node cannot run ``ranks`` ranks."""
    try:
        preflight(ranks, probe_node())
    except BackendUnavailableError as missing:
        pytest.skip(str(missing))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [CPConfig("ulysses", 1), CPConfig("allgather_kv", 2), CPConfig("ring", 2),
                                    CPConfig("ulysses", 2)], ids=lambda c: c.label + str(c.ranks))
@pytest.mark.slow
def test_tensorrt_output_matches_the_reference_and_times(config, tmp_path, monkeypatch):
    gpu_node_or_skip(config.ranks)
    monkeypatch.setenv("CPTUNE_CACHE", str(tmp_path))  # the ranks start with it: a fresh engine
    engine = TensorRTEngine()
    workload = Workload(seq_len=256, heads=4, kv_heads=2, head_dim=64, dtype="fp16", causal=True)
    try:
        measured = cptune.measure(workload, config, backend=engine, warmup=1, repeats=3)
        again = cptune.measure(workload, config, backend=engine, warmup=1, repeats=3)
    finally:
        engine.close()
    assert measured.engine == "tensorrt" and measured.median_ms > 0
    assert measured.compute_ms + measured.comm_ms > 0
    assert measured.host["build_s"] != "cached"  # a fresh cache: built, and the time reported
    assert again.host["build_s"] == "cached"


@pytest.mark.gpu
@pytest.mark.slow
def test_tensorrt_calibration_times_every_collective(tmp_path, monkeypatch):
    gpu_node_or_skip(2)
    monkeypatch.setenv("CPTUNE_CACHE", str(tmp_path))
    engine = TensorRTEngine()
    try:
        calibration = calibrate(2, backend=engine, warmup=1, repeats=3)
    finally:
        engine.close()
    assert {f.kind for f in calibration.collectives} == {"all_to_all", "all_gather", "broadcast"}
    assert all(rate.seconds > 0 for rate in calibration.compute)


def test_gpu_tests_skip_with_the_preflight_reason_here():
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None and shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA driver")
    with pytest.raises(pytest.skip.Exception, match="needs NVIDIA GPUs"):
        gpu_node_or_skip(1)


@pytest.mark.slow
def test_measure_holds_each_engine_to_its_own_tolerance():
    """The same correct run passes under the MPI engine's tolerance and is refused as
    wrong_output under a stricter one: the check reads the engine's, not a global table."""
    from cptune.engines.mpi import MPIEngine

    class Exacting(MPIEngine):
        tolerance = {"fp32": 0.0}

    w = Workload(seq_len=16, heads=2, head_dim=8, dtype="fp32")
    engine = Exacting()
    try:
        with pytest.raises(EngineError) as failure:
            cptune.measure(w, CPConfig("ring", 2), backend=engine, warmup=0, repeats=1)
    finally:
        engine.close()
    assert failure.value.kind == "wrong_output"
    assert TensorRTEngine.tolerance["bf16"] == 3e-2 and TensorRTEngine.tolerance["fp32"] == 2e-5


def test_a_cuda_visible_devices_that_hides_every_gpu_is_named(monkeypatch):
    monkeypatch.setattr("cptune.hardware._host._nvidia_smi", lambda *arguments: QUERY_H100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    probe = probe_node()
    assert probe.gpus == ()
    with pytest.raises(BackendUnavailableError, match=r"CUDA_VISIBLE_DEVICES='7' selects none of the 4 GPUs"):
        preflight(1, probe)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert [g.index for g in probe_node().gpus] == [3, 1]


def test_the_gpu_fingerprint_reads_the_drivers_answers(monkeypatch):
    answers = {("topo", "-m"): TOPO_NVLINK, ("-q",): SMI_HEADER}
    monkeypatch.setattr("cptune.hardware._host._nvidia_smi", lambda *arguments: answers[arguments])
    from cptune.hardware import this_gpu_node

    hardware = this_gpu_node(parse_gpu_query(QUERY_H100)[:2])
    assert hardware.gpu_count == 2 and hardware.interconnect == "NVLink (NV18)"
    assert hardware.gpu_model.endswith("(sm_90, driver 570.124.06, CUDA 12.8)")


# --------------------------------------------------------------------------- the rank side, on a stand-in


FAKE_GPU_STACK = Path(__file__).parent / "fake_gpu_stack"


@pytest.fixture
def stand_in_engine(monkeypatch, tmp_path):
    """A TensorRT engine whose ranks import ``tests/fake_gpu_stack`` (see its README) in
    place of TensorRT, nccl4py and cuda-bindings, with its engine cache in ``tmp_path``."""
    monkeypatch.setenv("PYTHONPATH", str(FAKE_GPU_STACK))
    monkeypatch.setenv("CPTUNE_CACHE", str(tmp_path))
    engine = TensorRTEngine(probe=lambda: node())
    yield engine
    engine.close()


@pytest.mark.parametrize(("config", "dtype"), [
    (CPConfig("ring", 2), "fp32"), (CPConfig("ulysses", 2), "bf16"), (CPConfig("allgather_kv", 1), "fp16"),
    (CPConfig("allgather_kv", 2), "fp32"), (CPConfig("ring", 4, 2), "bf16"),
], ids=["ring2-fp32", "ulysses2-bf16", "one-rank-fp16", "allgather2-fp32", "hybrid4-bf16"])
@pytest.mark.slow
def test_rank_side_runs_checks_times_and_caches_on_a_stand_in(stand_in_engine, tmp_path, config, dtype):
    """The worker's whole path on real MPI ranks, TensorRT replaced by the stand-in: the
    rank graph goes through build (fp32 attention only builds decomposable), cache,
    deserialize and device buffers, the output passes measure's reference check, timing has
    the [rank, iteration, 3] shape with the DistCollective layers counted as communication,
    and a second run loads the cache. One engine for the configuration, built once, not
    one per rank (a hybrid's ranks name their own groups: one each, by design)."""
    workload = Workload(seq_len=24, heads=4, kv_heads=2, head_dim=8, dtype=dtype, causal=True)
    first = cptune.measure(workload, config, backend=stand_in_engine, warmup=1, repeats=2)
    assert first.engine == "tensorrt" and first.median_ms > 0
    # The stand-in's profiler reports 0.01 ms per node: the split counts DistCollective nodes.
    nodes = rank_graph(workload, config, 0).graph.node
    collectives = sum(n.op_type == "DistCollective" for n in nodes)
    assert (collectives > 0) == (config.ranks > 1)
    assert first.comm_ms == pytest.approx(0.01 * collectives)
    assert first.compute_ms == pytest.approx(0.01 * (len(nodes) - collectives))
    assert first.max_error <= stand_in_engine.tolerance[dtype]
    assert first.host["build_s"] != "cached" and first.host["tensorrt"] == "0.0-fake"
    engines = sorted((tmp_path / "engines").glob("*.engine"))
    hybrid = config.head_group > 1 and config.context_degree > 1
    assert len(engines) == (config.ranks if hybrid else 1)
    second = cptune.measure(workload, config, backend=stand_in_engine, warmup=0, repeats=1)
    assert second.host["build_s"] == "cached"
    assert sorted((tmp_path / "engines").glob("*.engine")) == engines


@pytest.mark.slow
def test_calibration_runs_its_graphs_on_a_stand_in(stand_in_engine, tmp_path):
    """Every rank of a group runs the same collective graph: rank 0 builds it once and
    broadcasts it; the timing comes back as [chunk, iteration]."""
    seconds = stand_in_engine.time_collective("broadcast", 2, 2, [1024, 4096], 1, 3, timeout=120)
    assert seconds.shape == (2, 3) and np.all(seconds > 0)
    assert len(list((tmp_path / "engines").glob("*.engine"))) == 2  # one per chunk size, not per rank
    shapes = [{"heads": 2, "seq_q": 4, "seq_k": 16, "head_dim": 8, "causal": c} for c in (0, 1)]
    seconds = stand_in_engine.time_attention(2, shapes, warmup=0, repeats=2, timeout=120)
    assert seconds.shape == (2, 2) and np.all(seconds > 0)


def test_every_rank_gets_the_same_calibration_graph():
    """Written for their group's own communicator, the collective graphs are the same bytes
    on every rank of every group: one engine for all."""
    same = {graphs.collective_graph("all_gather", 4, 2, rank, 64).SerializeToString() for rank in range(4)}
    named = {graphs.collective_graph("all_gather", 4, 2, rank, 64, local=False).SerializeToString()
             for rank in range(4)}
    assert len(same) == 1 and len(named) == 2


@pytest.mark.slow
@pytest.mark.serial  # its ranks are found by the module's name: alone
def test_a_rank_stuck_in_execute_becomes_a_timeout_and_leaves_no_process(stand_in_engine, monkeypatch):
    monkeypatch.setenv("FAKE_TENSORRT_HANG_RANK", "1")
    w = Workload(seq_len=16, heads=2, head_dim=8, dtype="fp32")
    with pytest.raises(EngineError) as failure:
        cptune.compute(w, CPConfig("ring", 2), *make_inputs(w), backend=stand_in_engine, timeout=5)
    assert failure.value.kind == "timeout"  # rank 0 waits on rank 1 in a collective: both overrun
    assert "did not finish Ring on 2 ranks within 5 s" in str(failure.value)
    assert stand_in_engine._pool is None
    assert processes_left("cptune.engines.tensorrt._worker") == []


@pytest.mark.slow
def test_calibrate_times_the_engines_own_collective_kinds_on_a_stand_in(stand_in_engine, monkeypatch):
    """calibrate() asks the TensorRT engine for the Ring's broadcast (no p2p) and gets a fit
    for every kind and group; sizes shrunk so the reference runtime stays quick."""
    monkeypatch.setattr("cptune.calibration._calibrate.MESSAGE_SIZES", (1024, 4096, 16384))
    monkeypatch.setattr("cptune.calibration._calibrate.ATTENTION_SHAPES", tuple(
        {"heads": 2, "seq_q": q, "seq_k": 4 * q, "head_dim": 8, "causal": c} for c in (0, 1) for q in (4, 8)))
    calibration = calibrate(2, backend=stand_in_engine, warmup=0, repeats=2)
    assert calibration.engine == "tensorrt"
    assert sorted((f.kind, f.ranks, f.group) for f in calibration.collectives) == [
        ("all_gather", 2, 2), ("all_to_all", 2, 2), ("broadcast", 2, 2)]
    assert len(calibration.compute) == 2 * 4 and all(r.seconds > 0 for r in calibration.compute)


# --------------------------------------------------------------- first contact: what TensorRT may do


@pytest.fixture
def faulty(monkeypatch, stand_in_engine):
    """The stand-in engine, with ``FAKE_TENSORRT_FAULT`` set by calling the fixture's value."""

    def fault(*names: str) -> TensorRTEngine:
        stand_in_engine.close()  # new ranks read the new environment
        monkeypatch.setenv("FAKE_TENSORRT_FAULT", ",".join(names))
        return stand_in_engine

    return fault


@pytest.mark.slow
def test_the_rank_loads_nccl4pys_nccl_before_tensorrt(monkeypatch):
    """TensorRT finds NCCL by bare name when its runtime starts; the stand-in's runtime
    remembers whether nccl4py's copy was loaded by then (a communicator from one NCCL cannot
    be used by another). Creating the runtime first, as the rank once did, gets another."""
    monkeypatch.setenv("PYTHONPATH", str(FAKE_GPU_STACK))
    script = (
        "import tensorrt as trt\n"
        "first = trt.Runtime(trt.Logger(trt.Logger.WARNING)).nccl_copy\n"
        "from cptune.engines.tensorrt._worker import GpuRank\n"
        "print(first, '|', GpuRank(0).runtime.nccl_copy)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "another on the library path | nccl4py's"


@pytest.mark.slow
def test_collectives_fused_away_are_rebuilt_behind_a_cast_boundary(faulty, tmp_path):
    """The inspector finds a collective inside a Myelin region: every rank rebuilds with a
    float32 Cast on each side, and the run is checked and timed as usual; if even that is
    fused, the configuration fails with the reason instead of running collectives that do
    not communicate."""
    workload = Workload(seq_len=24, heads=4, head_dim=8, dtype="bf16", causal=True)
    engine = faulty("fused")
    measured = cptune.measure(workload, CPConfig("ulysses", 2), backend=engine, warmup=0, repeats=1)
    assert measured.host["cast_boundary"] == "True" and measured.max_error <= engine.tolerance["bf16"]
    assert measured.comm_ms is not None and measured.comm_ms > 0  # the collectives stand alone again
    engine = faulty("fused_always")
    with pytest.raises(EngineError, match="fused DistCollective layer.* even with a float32 Cast"):
        cptune.measure(workload, CPConfig("ulysses", 2), backend=engine, warmup=0, repeats=1)


def test_a_calibration_collective_with_wrong_values_stops_calibration():
    """What the rank checks before timing a calibration graph: the right chunk from the
    right member, or an error naming the collective."""
    from cptune.engines.tensorrt._checks import check_case

    class Ran:  # a loaded graph whose collective ran: "y" holds what it produced
        def __init__(self, kind: str, produced: np.ndarray) -> None:
            self.specs = {"x": ((8,), np.dtype(np.float16)), "y": (produced.shape, np.dtype(np.float16))}
            self.produced = produced

        def fill(self, arrays):
            pass

        def execute(self):
            return 0.0

        def read(self, name):
            return self.produced

    case = {"collective": "all_gather", "group": 2}
    right = graphs.collective_expected("all_gather", 2, 1, (16,))
    check_case(Ran("all_gather", right), case, 16, rank=3)
    in_the_wrong_group = graphs.collective_expected("all_gather", 2, 1, (16,)) * 0 + right[::-1]
    with pytest.raises(RuntimeError, match="all_gather over groups of 2 gave rank 3 wrong values"):
        check_case(Ran("all_gather", in_the_wrong_group), case, 16, rank=3)


@pytest.mark.slow
@pytest.mark.serial  # its ranks are found by the module's name: alone
def test_a_rank_blocked_holding_the_gil_dies_with_its_driver(monkeypatch, tmp_path):
    """TensorRT's set_communicator blocks in native code holding the GIL until every rank
    calls it; ranks all stuck there (a peer never came) must still go when their driver is
    killed, though no watchdog thread of theirs can run."""
    mark = tmp_path / "blocked"
    env = {**os.environ, "PYTHONPATH": str(FAKE_GPU_STACK), "CPTUNE_CACHE": str(tmp_path),
           "FAKE_TENSORRT_HANG_COMMUNICATOR": "0,1", "FAKE_TENSORRT_HANG_MARK": str(mark)}
    script = (
        "import cptune\n"
        "from cptune import CPConfig, Workload\n"
        "from cptune.engines.tensorrt import NodeProbe, TensorRTEngine\n"
        "from cptune.hardware._host import parse_gpu_query\n"
        f"gpus = tuple(parse_gpu_query({QUERY_H100!r}))\n"
        "engine = TensorRTEngine(probe=lambda: NodeProbe(gpus, None, {}))\n"
        "w = Workload(seq_len=16, heads=2, head_dim=8, dtype='fp32')\n"
        "inputs = cptune.reference.make_inputs(w)\n"
        "cptune.compute(w, CPConfig('ring', 2), *inputs, backend=engine, timeout=600)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        marks = [Path(f"{mark}.{rank}") for rank in (0, 1)]
        while not all(m.exists() for m in marks) and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.1)
        assert all(m.exists() for m in marks), "the ranks never reached set_communicator"
        time.sleep(0.5)  # well inside the native call
        assert processes_left("cptune.engines.tensorrt._worker", within=0)  # the ranks are there
        driver.kill()
        driver.wait()
    finally:
        driver.kill()
    assert processes_left("cptune.engines.tensorrt._worker", within=20) == []


def doctor(engine: TensorRTEngine, ranks: int) -> dict[str, tuple[bool, str, str, str]]:
    verdict = engine.check_node(ranks)
    assert [r.probe for r in verdict.results] == list(PROBES)
    return {r.probe: (r.ok, r.answer, r.action, r.seen) for r in verdict.results}


def verdict_seen(found: dict, probe: str) -> str:
    return found[probe][3]


@pytest.mark.slow
def test_the_doctors_probes_on_a_healthy_stand_in(stand_in_engine):
    found = doctor(stand_in_engine, 4)
    assert all(ok for ok, *_ in found.values()), found
    assert found["broadcast_root"][1] == "global" and found["standalone"][1] == "alone"


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "probe", "answer", "action", "also"), [
    # groups ignored: the reversed-order broadcast runs on ranks in world order, its root read so too
    ("subgroups_ignored", "subgroups", "", "hybrids .* are refused", {"broadcast_root"}),
    # a root read as an index: the subgroup probe's global root 2 is no index into [2, 3]
    ("root_local", "broadcast_root", "local", "hybrids are refused", {"subgroups"}),
    ("fused", "standalone", "boundary", "float32 Cast on each side", set()),
    ("fused_always", "standalone", "fused", "every multi-GPU configuration is refused", set()),
])
def test_the_doctor_names_each_failure_and_what_cptune_does(faulty, fault, probe, answer, action, also):
    found = doctor(faulty(fault), 4)
    ok, seen_answer, said, _ = found[probe]
    assert not ok and seen_answer == answer and re.search(action, said), found[probe]
    if fault == "subgroups_ignored":
        assert "Did not properly set the child communicator" in verdict_seen(found, probe)
    assert {name for name, (ok, *_) in found.items() if not ok} == {probe, *also}, found


def test_a_verdict_refuses_what_the_node_cannot_run():
    healthy = NodeVerdict(4, tuple(ProbeResult.judged(p, True, "fine") for p in PROBES))
    w = Workload(seq_len=64, heads=4, head_dim=8, dtype="bf16")
    hybrid, pure = CPConfig("ring", 4, 2), CPConfig("ulysses", 4)
    assert healthy.refuses(w, hybrid) is None and healthy.healthy
    child = "Did not properly set the child communicator"
    broken = NodeVerdict(4, (ProbeResult.judged("subgroups", False, child, "error"),))
    assert "is a hybrid" in broken.refuses(w, hybrid) and broken.refuses(w, pure) is None
    boundary = NodeVerdict(4, (ProbeResult.judged("standalone", False, "fused", "boundary"),))
    assert boundary.refuses(w, pure) is None  # rebuilt behind casts: runs
    fused = NodeVerdict(4, (ProbeResult.judged("standalone", False, "fused", "fused"),))
    assert "needs collectives" in fused.refuses(w, pure) and fused.refuses(w, CPConfig("ulysses", 1)) is None
    no_fp32 = NodeVerdict(4, (ProbeResult.judged("attention_fp32", False, "build failed"),))
    assert "attention in fp32" in no_fp32.refuses(Workload(64, 4, 8, dtype="fp32"), pure)
    assert NodeVerdict.from_dict(broken.to_dict()) == broken


@pytest.mark.slow
def test_calibration_needs_no_subgroups_of_tensorrt(faulty, monkeypatch):
    """Where TensorRT ignores the groups a node names (pytorch/TensorRT#4380), calibration in
    groups smaller than the ranks still times the right collective: each group's graph runs
    on a communicator of that group alone, and its values are checked before it is timed."""
    engine = faulty("subgroups_ignored")
    for kind in ("all_to_all", "all_gather", "broadcast"):
        seconds = engine.time_collective(kind, 4, 2, [1024, 4096], 0, 2, timeout=120)
        assert seconds.shape == (2, 2) and np.all(seconds > 0)


@pytest.mark.slow
def test_the_doctor_command_prints_the_table_and_exits_by_the_verdict(faulty, monkeypatch, capsys):
    """``cptune doctor`` as a user runs it, on four stand-in GPUs: healthy (exit 0), then on
    a node that ignores subgroups (exit 1, the failed probes and what cptune does)."""
    from cptune.engines import _engines

    answers = {("topo", "-m"): TOPO_NVLINK, ("-q",): SMI_HEADER}  # the fingerprint's driver facts
    monkeypatch.setattr("cptune.hardware._host._nvidia_smi", lambda *arguments: answers[arguments])
    monkeypatch.setitem(_engines, ("tensorrt", None), faulty())
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["doctor", "--max-ranks", "4"]) == 0
    healthy = capsys.readouterr().out
    assert all(probe in healthy for probe in PROBES) and "healthy" in healthy and "FAILED" not in healthy
    monkeypatch.setitem(_engines, ("tensorrt", None), faulty("subgroups_ignored"))
    assert main(["doctor", "--max-ranks", "4"]) == 1
    unhealthy = capsys.readouterr().out
    assert "FAILED" in unhealthy and "hybrids" in unhealthy and "child communicator" in unhealthy


@pytest.mark.slow
def test_probes_two_gpus_cannot_ask_say_so(stand_in_engine):
    """On 2 GPUs there are no two subgroups of 2: that probe passes as "not tried", and the
    others run (a root read either way is still told apart by the reversed group)."""
    verdict = stand_in_engine.check_node(2)
    untried = {r.probe for r in verdict.results if r.answer == UNTRIED}
    assert untried == {"subgroups"} and verdict.healthy
    assert verdict.result("broadcast_root").answer == "global"
