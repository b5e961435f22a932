"""measure() on real ranks: a checked output, then timings of the slowest rank."""

import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest

import cptune
from cptune import CPConfig, Workload
from cptune.cli import main
from cptune.engines.mpi import MPIEngine
from cptune.engines.mpi._rank import _collective, in_send_order, out_of_receive_order
from cptune.errors import EngineError
from cptune.execute import ITERATIONS_PER_PASS, measure_round
from cptune.reference import TOLERANCE
from cptune.strategies.primitives import HEADS, SEQ

WORKLOAD = Workload(seq_len=256, heads=4, head_dim=32, kv_heads=2, dtype="bf16", causal=True)


@pytest.mark.parametrize("config", [CPConfig("ring", 2), CPConfig("ulysses", 2), CPConfig("allgather_kv", 1)],
                         ids=lambda c: f"{c.label}-{c.ranks}r")
@pytest.mark.slow
def test_measurement_fields(config):
    m = cptune.measure(WORKLOAD, config, warmup=1, repeats=5)
    assert m.workload == WORKLOAD and m.config == config
    assert len(m.samples_ms) == 5 and all(s > 0 for s in m.samples_ms)
    assert m.p10_ms <= m.median_ms <= m.p90_ms
    assert min(m.samples_ms) <= m.median_ms <= max(m.samples_ms)
    assert 0 < m.compute_ms <= m.p90_ms and m.comm_ms >= 0
    # the slowest rank's iteration covers its compute and its communication waits
    assert m.compute_ms + m.comm_ms <= max(m.samples_ms) * 1.05
    input_bytes = cptune.analytic_cost(WORKLOAD, config).padded_seq_len // config.ranks * 2 * (4 + 2 * 2) * 32
    assert m.peak_bytes > input_bytes
    assert 0 <= m.max_error <= TOLERANCE["bf16"]
    assert m.engine == "mpi" and m.host["mpi_library"].startswith("MPICH")
    assert m.host["allocator"] == "steady"  # every CI host here runs glibc
    assert m.host["kernel"] == "numpy"  # what a stored row shows it ran (cptune results)
    assert json.loads(json.dumps(m.to_dict()))["config"] == config.to_dict()


@pytest.mark.slow
def test_communication_is_timed_where_there_is_some():
    ulysses = cptune.measure(WORKLOAD, CPConfig("ulysses", 2), warmup=1, repeats=3)
    local = cptune.measure(WORKLOAD, CPConfig("ring", 1), warmup=1, repeats=3)
    assert ulysses.comm_ms > 0  # three all-to-alls cannot take zero time
    assert local.comm_ms == 0  # one rank never communicates


def test_infeasible_measure_is_refused():
    with pytest.raises(cptune.InfeasibleConfigError, match="Ulysses limit"):
        cptune.measure(WORKLOAD, CPConfig("ulysses", 3))


def test_bad_repeat_counts_are_refused():
    with pytest.raises(ValueError, match="repeats"):
        cptune.measure(WORKLOAD, CPConfig("ring", 1), repeats=0)


class RecordingEngine(MPIEngine):
    """The MPI engine, noting which configuration each run was of."""

    def __init__(self) -> None:
        super().__init__()
        self.runs: list[CPConfig] = []

    def run(self, workload, config, shards, timeout):
        self.runs.append(config)
        return super().run(workload, config, shards, timeout)


ROUND = [CPConfig("ring", 1), CPConfig("ulysses", 2), CPConfig("allgather_kv", 2)]


@pytest.mark.slow
def test_a_round_interleaves_its_configurations_in_passes_each_checked():
    engine = RecordingEngine()
    try:
        results = measure_round(WORKLOAD, ROUND, backend=engine, warmup=1, repeats=5, rng=random.Random(0))
    finally:
        engine.close()
    passes = -(-5 // ITERATIONS_PER_PASS)
    assert len(engine.runs) == passes * len(ROUND)  # every pass runs (and checks) every configuration
    orders = [tuple(engine.runs[i:i + len(ROUND)]) for i in range(0, len(engine.runs), len(ROUND))]
    assert all(set(order) == set(ROUND) for order in orders)
    assert len(set(orders)) > 1  # a fresh random order per pass
    for config, m in results.items():
        assert isinstance(m, cptune.Measurement) and m.config == config
        assert m.repeats == len(m.samples_ms) == 5 and all(s > 0 for s in m.samples_ms)
        assert m.warmup == 1 and 0 <= m.max_error <= TOLERANCE["bf16"]


@pytest.mark.slow
def test_a_configuration_that_fails_in_a_round_leaves_it_and_the_others_go_on(faulty_engine):
    engine = faulty_engine("wrong")  # rank 1 computes a wrong output: every 2-rank configuration
    results = measure_round(WORKLOAD, [CPConfig("ring", 1), CPConfig("ring", 2)], backend=engine,
                            warmup=0, repeats=4)
    assert isinstance(results[CPConfig("ring", 2)], EngineError)
    assert results[CPConfig("ring", 2)].kind == "wrong_output"
    assert len(results[CPConfig("ring", 1)].samples_ms) == 4


@pytest.mark.slow
def test_past_its_deadline_a_round_starts_no_further_pass():
    results = measure_round(WORKLOAD, ROUND[:2], warmup=0, repeats=6, deadline=time.monotonic())
    assert [len(m.samples_ms) for m in results.values()] == [ITERATIONS_PER_PASS] * 2


@pytest.mark.slow
def test_cli_measure_json(capsys):
    code = main(["measure", "--seq-len", "64", "--heads", "4", "--head-dim", "16", "--max-ranks", "2",
                 "--warmup", "0", "--repeats", "2", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    labels = {tuple(r["config"].values()) for r in report["results"]}
    assert labels == {("ring", 1, 1), ("ring", 2, 1), ("allgather_kv", 2, 1), ("ulysses", 2, 2)}
    assert report["failures"] == []


@pytest.mark.slow
def test_cli_table(capsys):
    code = main(["measure", "--seq-len", "64", "--heads", "4", "--head-dim", "16", "--max-ranks", "2",
                 "--strategies", "ulysses", "--warmup", "0", "--repeats", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "fastest first" in out and "ulysses" in out


@pytest.mark.parametrize("argv, message", [
    (["measure", "--heads", "8", "--kv-heads", "3"], "kv_heads"),
    (["measure", "--heads", "0"], "--heads"),
    (["measure", "--strategies", "ring,zigzag"], "zigzag"),
    (["measure", "--dtype", "fp8"], "--dtype"),
    (["measure", "--ranks", "2", "--max-ranks", "4"], "give --ranks (these rank counts) or --max-ranks"),
    (["measure", "--strategies", "ulysses", "--ranks", "2", "--head-group", "1"],
     "no configuration of ulysses on 2 rank(s) with head group 1 can run"),
    (["measure", "--ranks", "2,2"], "listed twice"),
])
def test_cli_bad_input_exits_2(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2
    assert message in captured.out + captured.err
    assert "Traceback" not in captured.out + captured.err


def test_summarize_takes_each_iteration_from_its_slowest_rank():
    import numpy as np

    from cptune.measurement import summarize

    timings = np.zeros((2, 3, 3))
    timings[0, :, 0] = [0.005, 0.001, 0.001]  # rank 0: one slow iteration
    timings[1, :, 0] = [0.002, 0.003, 0.004]  # rank 1: slowest overall
    timings[0, :, 1:] = [0.004, 0.0]
    timings[1, :, 1:] = [0.001, 0.0015]
    s = summarize(timings)
    assert s["samples_ms"] == pytest.approx([5, 3, 4])
    assert s["median_ms"] == pytest.approx(4)
    assert (s["compute_ms"], s["comm_ms"]) == pytest.approx((1, 1.5))  # rank 1's phases


_ITERATIONS_FAULTS = """
import resource, sys
import numpy as np
from cptune.engines._worker import steady_allocator
if sys.argv[1] == "steady":
    assert steady_allocator()
def iteration():  # eight 1 MiB arrays and a 40 MiB one written, then freed, as an iteration's temporaries
    arrays = [np.ones(2**18, dtype=np.float32) for _ in range(8)] + [np.ones(10 * 2**20, dtype=np.float32)]
    return sum(float(a[-1]) for a in arrays)
iteration(); iteration()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    iteration()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
def test_steady_allocator_keeps_timed_iterations_from_faulting_fresh_pages():
    """glibc left to itself returns the freed arrays' pages and faults them in again every
    iteration; with the ranks' settings the iterations reuse them, a block over 32 MiB (glibc's
    largest mmap threshold) too."""
    faults = {mode: int(subprocess.run([sys.executable, "-c", _ITERATIONS_FAULTS, mode], check=True,
                                       capture_output=True, text=True).stdout)
              for mode in ("default", "steady")}
    assert faults["default"] >= 8 * 256  # at least one 1 MiB array's 256 pages per iteration
    assert faults["steady"] < 64


def test_the_exchanges_reorders_join_member_chunks_along_the_axis():
    """An all-to-all's send order cut along one axis and joined back along it is the tensor;
    an all-gather's arrivals are joined in member order."""
    x = np.arange(2 * 6 * 4 * 3, dtype=np.float32).reshape(2, 6, 4, 3)
    send = in_send_order(x, HEADS, 3, np.dtype(np.float16))
    assert send.shape == (3, 2, 2, 4, 3) and send.dtype == np.float16 and send.flags.c_contiguous
    np.testing.assert_array_equal(send[1], x[:, 2:4].astype(np.float16))
    np.testing.assert_array_equal(out_of_receive_order(send, HEADS), x.astype(np.float16))
    ties = (x + np.float32(2049.0)) * np.float32(1.0 + 2.0**-11)  # values float16 must round
    np.testing.assert_array_equal(out_of_receive_order(in_send_order(ties, SEQ, 2, np.dtype(np.float16)), SEQ)
                                  .view(np.uint16), ties.astype(np.float16).view(np.uint16))
    blocks = np.stack([x, x + 1000])
    joined = out_of_receive_order(blocks, SEQ)
    np.testing.assert_array_equal(joined, np.concatenate([x, x + 1000], axis=SEQ))


class _LoopbackComm:
    """Two members whose peer sends what this one does: enough to run an exchange."""

    def Get_size(self) -> int:
        return 2

    def Get_rank(self) -> int:
        return 0

    def Alltoall(self, send, received) -> None:
        received[0][...] = send[0]

    def Allgather(self, send, received) -> None:
        received[0][...] = np.stack([send[0], send[0]])


@pytest.mark.parametrize("kind", ["all_to_all", "all_gather"])
def test_calibration_times_the_exchange_with_its_copies(kind):
    """Calibration's all-to-all and all-gather run the strategies' exchange, not the bare
    collective: a case returns the joined tensor, so its copies are in the timing."""
    joined = _collective(kind, _LoopbackComm(), 64)()  # K and V of 4 heads, 8 rows each
    assert joined.shape == (2, 4, 16, 1) and joined.flags.c_contiguous


def test_references_are_kept_for_interleaved_workloads_within_their_budget(monkeypatch):
    """Workloads measured in turn, configuration by configuration, compute each reference
    once while they fit the cache's budget, and again once they do not."""
    from cptune import execute

    computed = []
    real = execute.reference_attention
    monkeypatch.setattr(execute, "reference_attention", lambda w, *a: computed.append(w) or real(w, *a))
    monkeypatch.setattr(execute, "_references", type(execute._references)())
    plain, packed = Workload(64, 2, 8, causal=True), Workload(64, 2, 8, causal=True, documents=[32, 32])
    for w in (plain, packed, plain, packed):
        execute._reference_case(w, 0)
    assert computed == [plain, packed]
    monkeypatch.setattr(execute, "REFERENCE_CACHE_BYTES", 1)  # only the newest is kept
    for w in (plain, packed):
        execute._reference_case(w, 1)
    assert computed == [plain, packed, plain, packed]
    assert list(execute._references) == [(packed, 1)]
