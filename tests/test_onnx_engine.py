"""The onnx engine on real MPI ranks: each rank runs its exported graph with ONNX's reference
runtime and the output matches the float64 reference, for every configuration on 1-4 ranks;
it shares the MPI engine's supervised pool (one error, no process left behind) and refuses
to time."""

import hashlib
import json
import sys

import numpy as np
import onnx
import pytest

import cptune
from conftest import TESTS, assert_pool_gone
from cptune import CPConfig, CPTuneError, EngineError, Workload
from cptune.cli import main
from cptune.engines import get_engine
from cptune.engines.onnx import OnnxEngine, rank_graph, tensorrt_rank_graph
from cptune.feasibility import enumerate_configs
from cptune.reference import TOLERANCE, make_inputs, reference_attention, relative_error

#: Largest relative error accepted of a graph's output, per dtype. fp32 and fp16 as for the
#: MPI engine (fp16 graphs: worst seen 1.2e-3). bf16 graphs are real bfloat16 (8 significant
#: bits; the MPI engine's bf16 travels as float16): each rounding to bf16 costs up to 2^-9 ~
#: 2e-3, and the reference runtime computes the fused Attention op wholly in bf16, softmax
#: sums included (a GPU kernel accumulates in float32). Worst seen: 1.5e-2 fused, 9e-3 for
#: the Ring's float32-softmax blocks; 3e-2 leaves room for other inputs. The fp32 cases are
#: the exact check (2e-5).
GRAPH_TOLERANCE = {**TOLERANCE, "bf16": 3e-2}

SHAPES = {"mha": 12, "gqa": 4, "mqa": 1}


@pytest.fixture(scope="module")
def engine():
    """One engine for the module: its pool starts at 4 ranks and serves every run."""
    engine = get_engine("onnx")
    engine._pool_for(4)
    return engine


def cases():
    out = []
    for name, kv_heads in SHAPES.items():
        for causal in (False, True):
            workload = Workload(13 if causal else 11, 12, 8, kv_heads=kv_heads, causal=causal, dtype="fp32")
            mask = "causal" if causal else "full"
            out += [pytest.param(workload, c, id=f"{name}-{mask}-{c.label}-{c.ranks}")
                    for c in enumerate_configs(workload, 4)]
    return out


def check(engine, workload, config, seed=0):
    q, k, v = make_inputs(workload, seed)
    out = cptune.compute(workload, config, q, k, v, backend=engine)
    error = relative_error(out, reference_attention(workload, q, k, v))
    assert error <= GRAPH_TOLERANCE[workload.dtype], f"{config.describe()}: {error:.2e}"
    return error


@pytest.mark.parametrize(("workload", "config"), cases())
@pytest.mark.slow
def test_graphs_on_real_ranks_match_the_float64_reference(engine, workload, config):
    check(engine, workload, config)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize(
    "config",
    [CPConfig("ring", 4), CPConfig("ring", 4, 2), CPConfig("allgather_kv", 3), CPConfig("ulysses", 4),
     CPConfig("allgather_kv", 4, 2), CPConfig("ring", 1)],
    ids=lambda c: f"{c.label}-{c.ranks}",
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.slow
def test_16_bit_graphs_stay_within_their_tolerance(engine, dtype, config, causal):
    workload = Workload(37, 12, 16, kv_heads=4, causal=causal, dtype=dtype)
    check(engine, workload, config)


@pytest.mark.parametrize(
    "config", [CPConfig("ring", 4, 2), CPConfig("ulysses", 4), CPConfig("allgather_kv", 2)],
    ids=lambda c: f"{c.label}-{c.ranks}",
)
@pytest.mark.slow
def test_graphs_behind_the_cast_boundary_compute_the_same(engine, monkeypatch, config):
    """What the TensorRT rank builds where a collective was fused away: a float32 Cast on each
    side of every 16-bit collective, the collective in float32; the outputs still match."""
    from cptune.engines.onnx import _engine as onnx_engine

    def boundary(wl, c, r):
        model, feeds = tensorrt_rank_graph(wl, c, r, cast_boundary=True)
        collectives = [n for n in model.graph.node if n.op_type == "DistCollective"]
        casts = {n.output[0] for n in model.graph.node if n.op_type == "Cast"}
        assert all(n.input[0] in casts for n in collectives)  # each behind its own Cast
        return model, feeds

    monkeypatch.setattr(onnx_engine, "tensorrt_rank_graph", boundary)
    check(engine, Workload(37, 12, 16, kv_heads=4, causal=True, dtype="bf16"), config)


@pytest.mark.slow
def test_a_wrong_graph_is_caught_by_the_reference(engine, monkeypatch):
    """The check has teeth: graphs whose causal mask is dropped on the ranks' side compute
    a different attention, far outside the tolerance."""
    from cptune.engines.onnx import _engine as onnx_engine

    workload = Workload(16, 4, 8, causal=True, dtype="fp32")  # no padding either way: same shapes
    blind = Workload(16, 4, 8, causal=False, dtype="fp32")
    monkeypatch.setattr(onnx_engine, "tensorrt_rank_graph", lambda wl, c, r: tensorrt_rank_graph(blind, c, r))
    with pytest.raises(AssertionError, match="Ring on 2 ranks"):
        check(engine, workload, CPConfig("ring", 2))


@pytest.mark.slow
def test_the_ranks_run_the_bytes_they_were_sent(engine, monkeypatch):
    """A graph that fails on the ranks fails the run: they do not rebuild it themselves."""
    from cptune.engines.onnx import _engine as onnx_engine

    def broken(wl, c, r):
        model, feeds = tensorrt_rank_graph(wl, c, r)
        if r == 1:
            model.graph.node[0].op_type = "NoSuchOp"
        return model, feeds

    monkeypatch.setattr(onnx_engine, "tensorrt_rank_graph", broken)
    with pytest.raises(EngineError, match="rank 1 failed") as failure:
        check(engine, Workload(8, 4, 8, dtype="fp32"), CPConfig("ring", 2))
    assert failure.value.kind == "error"


def test_measure_and_calibrate_refuse_the_correctness_engine():
    with pytest.raises(CPTuneError, match="checks that each configuration's graphs compute"):
        cptune.measure(Workload(8, 4, 8), CPConfig("ring", 2), backend="onnx")
    from cptune.calibration import calibrate

    with pytest.raises(CPTuneError, match="does not time"):
        calibrate(2, backend="onnx")


def test_cli_search_with_the_onnx_backend_is_one_line(capsys, tmp_path):
    code = main(["search", "--backend", "onnx", "--heads", "4", "--head-dim", "8", "--seq-lens", "16",
                 "--db", str(tmp_path / "db.sqlite")])
    err = capsys.readouterr()
    assert code == 2
    text = (err.out + err.err).strip()
    assert len(text.splitlines()) == 1 and "does not time" in text
    assert not (tmp_path / "db.sqlite").exists()


@pytest.mark.slow
def test_rank_failures_end_as_one_error_with_no_process_left(faulty_engine):
    """The onnx engine's ranks are the shared supervised pool: a crashing rank is one error."""
    engine = OnnxEngine(worker=[sys.executable, str(TESTS / "faulty_worker.py"), "shared", "crash"])
    try:
        engine._pool_for(2)
        pool_dir, pids = engine._pool.dir, list(engine._pool.pids)
        with pytest.raises(EngineError) as failure:
            check(engine, Workload(8, 4, 8, dtype="fp32"), CPConfig("ring", 2))
        assert failure.value.kind == "crash"
        assert_pool_gone(pool_dir, pids)
    finally:
        engine.close()


def test_export_graph_writes_the_graphs_the_engine_runs(tmp_path, capsys):
    workload = Workload(13, 12, 8, kv_heads=4, causal=True, dtype="bf16")
    config = CPConfig("ring", 4, 2)
    code = main(["export-graph", "--seq-len", "13", "--heads", "12", "--kv-heads", "4", "--head-dim", "8",
                 "--causal", "--dtype", "bf16", "--strategy", "ring", "--ranks", "4", "--head-group", "2",
                 "-o", str(tmp_path)])
    assert code == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["workload"] == workload.to_dict() and manifest["config"] == config.to_dict()
    layout = cptune.layout.SequenceLayout(workload, config)
    for rank, entry in enumerate(manifest["ranks"]):
        data = (tmp_path / entry["file"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        model, feeds = tensorrt_rank_graph(workload, config, rank)
        assert data == model.SerializeToString(deterministic=True)  # deterministic, the graph TensorRT builds
        standard = rank_graph(workload, config, rank)  # checked before TensorRT's attribute went in
        onnx.checker.check_model(standard, full_check=True)
        assert [n.op_type for n in model.graph.node] == [n.op_type for n in standard.graph.node]
        for name, value in feeds.items():
            assert entry["inputs"][name]["values"] == value.ravel().tolist()
        assert entry["nodes"] == len(model.graph.node)
        tokens = np.concatenate([np.arange(a, b) for a, b in entry["tokens"]])
        assert np.array_equal(tokens, layout.rank_positions(rank))
        assert entry["inputs"]["q"]["shape"] == [1, len(tokens), 12, 8]
        assert entry["inputs"]["k"]["dtype"] == "bfloat16"
    assert "wrote 4 graph(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--strategy", "ulysses", "--ranks", "4", "--heads", "6"],  # heads not divisible by 4
        ["--strategy", "ring", "--ranks", "4", "--head-group", "3", "--heads", "12"],
        ["--strategy", "ring", "--ranks", "2", "--heads", "12", "--kv-heads", "5"],
    ],
)
def test_export_graph_bad_input_is_one_line(argv, tmp_path, capsys):
    code = main(["export-graph", "--seq-len", "16", "--head-dim", "8", *argv, "-o", str(tmp_path / "g")])
    captured = capsys.readouterr()
    text = (captured.out + captured.err).strip()
    assert code == 2 and len(text.splitlines()) == 1 and text.startswith("cptune: error:")
    assert not (tmp_path / "g").exists()
