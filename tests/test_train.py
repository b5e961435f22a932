"""Training workloads on the mpi engine's ranks: every configuration's output and gradients
of Q, K and V against the float64 reference, a wrong gradient caught before any timing, the
forward's share of the time measured apart, and engines that run the forward alone refusing
``mode="train"`` in one line."""

import pytest

import cptune
from cptune import CPConfig, EngineError, Workload
from cptune.engines import Trained, UntrainedEngineError
from cptune.engines.mpi import MPIEngine
from cptune.feasibility import enumerate_configs
from cptune.reference import (
    TOLERANCE,
    make_inputs,
    make_output_gradient,
    reference_attention,
    reference_gradients,
    relative_error,
)

pytestmark = pytest.mark.slow  # MPI ranks

#: MHA, GQA and MQA, causal or not, fp32 and bf16 (the wire's float16), lengths that need
#: padding on 3 and 4 ranks among them.
WORKLOADS = [
    Workload(64, 4, 8, dtype="fp32", causal=True, mode="train"),
    Workload(60, 4, 8, kv_heads=2, dtype="fp32", causal=False, mode="train"),
    Workload(62, 4, 8, kv_heads=1, dtype="bf16", causal=True, mode="train"),
    Workload(64, 4, 8, kv_heads=2, dtype="bf16", causal=False, mode="train", batch=2),
]


@pytest.fixture(scope="module")
def engine():
    made = MPIEngine()
    yield made
    made.close()


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.shape.describe())
def test_every_configuration_on_1_to_4_ranks_trains_to_the_reference(engine, workload):
    q, k, v = make_inputs(workload)
    dout = make_output_gradient(workload)
    reference = Trained(reference_attention(workload, q, k, v), *reference_gradients(workload, q, k, v, dout))
    configs = enumerate_configs(workload, 4)
    assert {c.strategy for c in configs} == {"ring", "ulysses", "allgather_kv"}
    assert max(c.ranks for c in configs) == 4
    for config in configs:
        trained = cptune.compute_gradients(workload, config, q, k, v, dout, backend=engine)
        for name, got, expected in zip(Trained._fields, trained, reference, strict=True):
            assert got.shape == expected.shape, (config, name)
            assert relative_error(got, expected) <= TOLERANCE[workload.dtype], (config.describe(), name)


class PerturbingK(MPIEngine):
    """The mpi engine with the last rank's gradient of K off by a little after each run."""

    def run_train(self, workload, config, shards, timeout):
        trained, peaks = super().run_train(workload, config, shards, timeout)
        trained[-1] = trained[-1]._replace(dk=trained[-1].dk + 0.05)
        return trained, peaks


def test_a_wrong_gradient_is_caught_before_any_timing():
    engine = PerturbingK()
    try:
        with pytest.raises(EngineError) as failure:
            cptune.measure(WORKLOADS[1], CPConfig("ring", 2), backend=engine, warmup=0, repeats=1)
    finally:
        engine.close()
    assert failure.value.kind == "wrong_output"
    assert "Ring on 2 ranks computed a wrong gradient of K for seq 60 x 4/2kv heads" in str(failure.value)


def test_a_training_measurement_times_the_forward_apart_and_is_stored_in_its_mode(engine, tmp_path):
    from cptune.hardware import this_host
    from cptune.store import Store

    trained = cptune.measure(WORKLOADS[0], CPConfig("ulysses", 2), backend=engine, warmup=0, repeats=3)
    forward = cptune.measure(WORKLOADS[0].in_mode("forward"), CPConfig("ulysses", 2), backend=engine,
                             warmup=0, repeats=3)
    assert trained.forward_ms is not None and 0 < trained.forward_ms < trained.median_ms
    assert forward.forward_ms is None
    assert trained.peak_bytes > forward.peak_bytes  # the saved activations and the gradients
    with Store(str(tmp_path / "c.db")) as store:
        store.add_measurement(this_host(), trained)
        store.add_measurement(this_host(), forward)
        rows = {r.workload.mode: r for r in store.results()}
        assert rows["train"].forward_ms == trained.forward_ms and rows["forward"].forward_ms is None
        assert [r.workload for r in store.results(mode="train")] == [WORKLOADS[0]]


def test_an_engine_that_runs_the_forward_alone_refuses_to_train():
    workload = WORKLOADS[0]
    q, k, v = make_inputs(workload)
    with pytest.raises(UntrainedEngineError) as refusal:
        cptune.compute_gradients(workload, CPConfig("ring", 2), q, k, v, make_output_gradient(workload),
                                 backend="onnx")
    assert str(refusal.value) == ("the onnx engine runs the forward alone (inference), not --mode train: "
                                  "use a backend that trains ('mpi', 'torch')")


def test_the_command_line_trains_end_to_end(tmp_path, cptune_here):
    """search --mode train (guided by the calibration's backward), then results, fit, recommend
    for an unmeasured length, export and report of a training step: the one that starts ranks
    as a user runs it, those that only read in this process."""
    import json

    from conftest import cptune, make_calibration
    from cptune import load_plan
    from cptune.hardware import this_host
    from cptune.store import Store

    db = str(tmp_path / "t.db")
    with Store(db) as store:  # a calibration with a backward (calibrate's own: tests/test_cli_model.py)
        store.add_calibration(this_host(), make_calibration(2))
    shape = ["--heads", "4", "--head-dim", "16", "--mode", "train"]
    searched = cptune("search", "--db", db, *shape, "--seq-lens", "64,96", "--ranks", "1,2", "--rounds", "1",
                      "--race-rounds", "0", "--confirm-rounds", "0")
    assert searched.returncode == 0, searched.stderr
    rows = json.loads(cptune_here("results", "--db", db, "--json").stdout)
    assert len(rows) == 8 and {row["mode"] for row in rows} == {"train"}
    assert all(0 < row["forward_ms"] < row["median_ms"] for row in rows)
    assert cptune_here("fit", "--db", db).returncode == 0
    picked = cptune_here("recommend", "--db", db, *shape, "--seq-len", "128", "--json")
    assert picked.returncode == 0, picked.stderr
    assert json.loads(picked.stdout)["workload"]["mode"] == "train"
    plan = tmp_path / "plan.json"
    exported = cptune_here("export", "--db", db, *shape, "--seq-lens", "64,96", "-o", plan)
    assert exported.returncode == 0, exported.stderr
    assert json.loads(plan.read_text())["shape"]["mode"] == "train"
    assert [b.seq_len for b in load_plan(plan).buckets] == [64, 96]  # what export writes loads
    reported = cptune_here("report", "--db", db, "-o", tmp_path / "report")
    assert reported.returncode == 0, reported.stderr
