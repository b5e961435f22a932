"""A rank that raises, crashes, hangs or computes garbage ends as one clear error, in
bounded time, with no process left behind: also when the caller itself is killed."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import cptune
from conftest import TESTS, assert_pool_gone, pool_processes, processes_left
from cptune import CPConfig, EngineError, Workload
from cptune.engines._pool import _closed
from cptune.engines.mpi import MPIEngine
from cptune.reference import make_inputs

pytestmark = pytest.mark.slow  # every test here runs MPI ranks (and one a caller process)

WORKLOAD = Workload(seq_len=32, heads=4, head_dim=8, dtype="fp32")
CONFIG = CPConfig("ring", 2)


def run_until_failure(engine, timeout=None):
    q, k, v = make_inputs(WORKLOAD)
    started = time.monotonic()
    with pytest.raises(EngineError) as failure:
        cptune.compute(WORKLOAD, CONFIG, q, k, v, backend=engine, timeout=timeout)
    return failure.value, time.monotonic() - started


def start_pool(engine):
    engine._pool_for(CONFIG.ranks)
    return engine._pool.dir, list(engine._pool.pids)


def test_rank_exception_is_reported_with_its_message(faulty_engine):
    engine = faulty_engine("raise")
    pool_dir, pids = start_pool(engine)
    error, _ = run_until_failure(engine)
    assert error.kind == "error"
    assert "rank 1" in str(error) and "injected failure on rank 1" in str(error)
    assert_pool_gone(pool_dir, pids)


def test_rank_crash_is_reported(faulty_engine):
    engine = faulty_engine("crash")
    pool_dir, pids = start_pool(engine)
    error, _ = run_until_failure(engine)
    assert error.kind == "crash"
    assert "crashed" in str(error) and "Ring on 2 ranks" in str(error)
    assert_pool_gone(pool_dir, pids)


def test_rank_hang_times_out(faulty_engine):
    engine = faulty_engine("hang")
    pool_dir, pids = start_pool(engine)
    error, elapsed = run_until_failure(engine, timeout=3)
    assert error.kind == "timeout"
    assert "did not finish Ring on 2 ranks within 3 s" in str(error)
    assert "--timeout of cptune measure" in str(error)  # a run's deadline is the caller's
    assert elapsed < 60  # bounded: the deadline, not forever
    assert_pool_gone(pool_dir, pids)


def test_a_calibration_past_its_fixed_deadline_names_no_setting_to_raise(faulty_engine):
    """Calibration's deadline is cptune's own: the advice names none of a run's settings."""
    engine = faulty_engine("hang")
    with pytest.raises(EngineError) as failure:
        engine.time_collective("all_to_all", 2, 2, [1024], warmup=0, repeats=1, timeout=0.25)
    assert failure.value.kind == "timeout"
    assert "did not finish all_to_all calibration on 2 ranks within 0.25 s" in str(failure.value)
    assert "this deadline is fixed" in str(failure.value) and "--timeout" not in str(failure.value)


def test_engine_recovers_after_a_failure(faulty_engine):
    """After a failure the next call starts a fresh pool (here: still faulty, still clean)."""
    engine = faulty_engine("raise")
    for _ in range(2):
        error, _ = run_until_failure(engine)
        assert error.kind == "error"
    assert engine._pool is None


def test_ranks_lost_between_runs_fail_the_next_run_and_the_one_after_runs_on_a_fresh_pool():
    """Ranks killed while idle (a node's processes lost between a search's runs) are one
    failure of the next run, stored as any other, not a pool started again unseen."""
    engine = MPIEngine()
    try:
        q, k, v = make_inputs(WORKLOAD)
        cptune.compute(WORKLOAD, CONFIG, q, k, v, backend=engine)
        pool = engine._pool
        for pid in pool.pids:  # each rank and its hydra proxy: one killed may take others with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pool.proc.wait(timeout=30)
        error, _ = run_until_failure(engine)
        assert error.kind == "crash"
        assert "a rank crashed before running Ring on 2 ranks: rank" in str(error) and "died" in str(error)
        assert_pool_gone(pool.dir, [])
        outputs = cptune.compute(WORKLOAD, CONFIG, q, k, v, backend=engine)
        assert engine._pool is not None and engine._pool is not pool and outputs.shape == q.shape
    finally:
        engine.close()


def test_wrong_output_is_an_error_not_a_timing(faulty_engine):
    engine = faulty_engine("wrong")
    with pytest.raises(EngineError) as failure:
        cptune.measure(WORKLOAD, CONFIG, backend=engine, warmup=0, repeats=1)
    assert failure.value.kind == "wrong_output"
    assert "timing does not count" in str(failure.value)


def test_killed_caller_leaves_no_ranks_behind(tmp_path):
    """SIGKILL the process that owns a pool while its ranks are busy: the ranks notice and
    exit, and so does mpiexec."""
    script = tmp_path / "caller.py"
    script.write_text(
        "import sys\n"
        "from cptune.engines.mpi import MPIEngine\n"
        "from cptune import CPConfig, Workload, compute\n"
        "from cptune.reference import make_inputs\n"
        f"worker = [sys.executable, {str(TESTS / 'faulty_worker.py')!r}, 'shared', 'hang']\n"
        "engine = MPIEngine(worker=worker)\n"
        "w = Workload(seq_len=32, heads=4, head_dim=8)\n"
        "engine._pool_for(2)\n"
        "print(engine._pool.dir, flush=True)\n"
        "compute(w, CPConfig('ring', 2), *make_inputs(w), backend=engine, timeout=600)\n"
    )
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pool_dir = caller.stdout.readline().strip()
    assert pool_dir and pool_processes(pool_dir), "the pool should be running"
    time.sleep(1.0)  # rank 0 is now waiting inside the ring, rank 1 hangs
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    assert processes_left(pool_dir, within=15) == []


def test_a_rank_that_died_after_sending_is_seen_gone_with_its_data_unread():
    """A node's ranks killed after their replies were sent: the driver must see them gone
    (and name their node) although those replies are still in its socket, unread."""
    for pair in (socket.socketpair(), _tcp_pair()):
        ours, theirs = pair
        try:
            assert not _closed(ours)
            theirs.sendall(b"a reply, unread")
            assert not _closed(ours)
            theirs.close()
            assert _closed(ours)
        finally:
            ours.close()
            theirs.close()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.create_connection(server.getsockname())
        ours, _ = server.accept()
    return ours, theirs
