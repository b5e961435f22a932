"""The contention guard: each evidence judged on given readings, and real runs under load."""

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import cptune
from conftest import StandInCalibrationEngine, assert_refused, make_calibration
from cptune import CPConfig, Workload, guard
from cptune.calibration import CalibrationDisturbedError, CalibrationPieces, calibrate
from cptune.calibration import _calibrate as calibration_module
from cptune.cli import main
from cptune.engines.mpi import MPIEngine
from cptune.execute import measure_round
from cptune.guard import (
    FOREIGN_MARGIN_CORES,
    CpuReading,
    GuardSettingError,
    enabled,
    foreign_load,
    read_cpu,
    reference_slowdown,
    wide_spread,
)
from cptune.hardware import this_host
from cptune.measurement import available_cores
from cptune.reference import make_inputs
from cptune.search import WorkloadSearch
from cptune.store import Store
from suite_cli import IGNORE_LOAD, watch_load

#: The guard's own tests watch the host's load: alone, or another test's ranks are that load.
pytestmark = pytest.mark.serial


@pytest.fixture(autouse=True)
def guard_on(monkeypatch):
    """These tests are about the guard: on and watching the load, whatever the environment
    and conftest say."""
    monkeypatch.setenv("CPTUNE_GUARD", "on")
    monkeypatch.delenv(IGNORE_LOAD)
    watch_load(monkeypatch.setattr)


WORKLOAD = Workload(seq_len=256, heads=4, head_dim=32, kv_heads=2, dtype="fp32")
OURS = (1, 1)  # a thread of ours: (pid, tid)


def reading(wall_s: float, idle_s: float | None, ours_s: float, cpus: int = 2) -> CpuReading:
    return CpuReading(wall_s=wall_s, cpus=cpus, idle_s=idle_s, ours_s={OURS: ours_s})


# --------------------------------------------------------------------------- foreign load


def test_cpu_used_by_our_processes_alone_is_clean():
    before, after = reading(0.0, 100.0, 5.0), reading(1.0, 100.1, 6.9)  # 1.9 busy s, all ours
    assert foreign_load(before, after, idle_cores=0) is None


def test_other_processes_on_the_run_s_cores_disturb_it():
    before, after = reading(0.0, 100.0, 5.0), reading(1.0, 100.0, 5.5)  # 1.5 cores not ours
    assert foreign_load(before, after, idle_cores=0) == "other processes used 1.5 of 2 cores during the run"


def test_load_on_cores_the_run_left_idle_is_clean():
    before, after = reading(0.0, 100.0, 5.0, cpus=4), reading(1.0, 100.5, 7.0, cpus=4)  # 1.5 foreign
    assert foreign_load(before, after, idle_cores=2) is None
    assert foreign_load(before, after, idle_cores=1) is not None


def test_a_quiet_host_s_background_stays_under_the_margin():
    foreign = FOREIGN_MARGIN_CORES * 0.8
    before, after = reading(0.0, 100.0, 5.0), reading(1.0, 100.0, 7.0 - foreign)
    assert foreign_load(before, after, idle_cores=0) is None


def test_a_few_ticks_in_a_short_window_are_not_load_but_the_same_rate_over_a_second_is():
    short = foreign_load(reading(0.0, 100.0, 5.0), reading(0.05, 100.08, 5.0), idle_cores=0)
    long = foreign_load(reading(0.0, 100.0, 5.0), reading(1.0, 101.6, 5.0), idle_cores=0)
    assert short is None  # 0.4 cores, but 2 ticks could be the rounding of /proc/stat
    assert long == "other processes used 0.4 of 2 cores during the run"


def test_a_thread_of_ours_that_started_in_the_window_is_ours():
    before = reading(0.0, 100.0, 5.0)
    after = CpuReading(wall_s=1.0, cpus=2, idle_s=100.5, ours_s={OURS: 5.5, (1, 2): 1.0})
    assert foreign_load(before, after, idle_cores=0) is None


def test_without_proc_stat_the_evidence_is_skipped():
    assert foreign_load(reading(0.0, None, 5.0), reading(1.0, None, 5.0), idle_cores=0) is None


def test_read_cpu_counts_every_thread_of_this_process():
    started = threading.Event()
    stop = threading.Event()
    tids: list[int] = []

    def spin() -> None:
        tids.append(threading.get_native_id())
        started.set()
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        started.wait()
        now = read_cpu([])
    finally:
        stop.set()
        worker.join()
    assert {(os.getpid(), os.getpid()), (os.getpid(), tids[0])} <= set(now.ours_s)
    assert now.cpus == available_cores() and now.idle_s is not None


# --------------------------------------------------------------------------- reference kernel, spread


def test_reference_kernel_within_twice_its_typical_time_is_clean():
    assert reference_slowdown(1.9e-3, 1.05e-3, typical_s=1.0e-3) is None


def test_reference_kernel_slower_after_the_run_disturbs_it():
    assert reference_slowdown(1.0e-3, 2.2e-3, typical_s=1.0e-3) == (
        "a reference kernel ran 2.2x slower after the run than is typical")
    assert reference_slowdown(1.0e-3, 5.0e-3, typical_s=None) is None  # too few times to tell


def test_reference_kernel_slow_on_both_sides_against_its_typical_time_disturbs_it():
    assert "2.5x slower" in reference_slowdown(2.5e-3, 2.5e-3, typical_s=1.0e-3)


def test_the_kernels_typical_time_is_the_median_of_its_latest_times(monkeypatch):
    kernel = guard.ReferenceKernel()
    times = iter([1.0, 5.0, 1.2, 0.5, 1.1, 9.0])
    monkeypatch.setattr(guard.time, "perf_counter", lambda: 0.0)  # each run takes 0 s ...
    for _ in range(guard.REFERENCE_MIN_TIMES - 1):
        kernel.times_s.append(next(times))
        assert kernel.typical_s is None  # too few to tell
    kernel.times_s.append(next(times))
    assert kernel.typical_s == 1.1  # median of 1.0, 5.0, 1.2, 0.5, 1.1: one outlier moves nothing
    assert kernel.time() == 0.0 and kernel.typical_s == pytest.approx(1.05)  # ... and is kept


def test_iterations_spread_far_apart_disturb_a_run():
    assert wide_spread([10.0] * 5 + [30.0] * 5) == "its iterations spread 3.0x from p10 to p90"
    assert wide_spread([10.0, 10.5, 11.0, 10.2, 12.0] * 2) is None


def test_sub_millisecond_jitter_is_not_a_spread():
    assert wide_spread([0.1] * 5 + [0.5] * 5) is None  # 5x, but 0.4 ms apart


def test_one_cold_iteration_among_a_few_is_not_a_spread():
    assert wide_spread([30.0, 10.0, 10.0]) is None  # p90 would be 26: the first iteration alone


# --------------------------------------------------------------------------- the watch


class StandInKernel:
    """A reference kernel that takes the given times, in turn."""

    def __init__(self, *seconds: float) -> None:
        self.seconds = iter(seconds)
        self.typical_s = min(seconds)

    def time(self) -> float:
        return next(self.seconds)


def watched(monkeypatch, readings, kernel_s, samples_ms, ranks: int = 1) -> str | None:
    """The verdict of a ``Watch`` over a run of ``ranks`` ranks (with every core: one rank
    has a thread per core) whose evidence is given, not read."""
    readings = iter(readings)
    monkeypatch.setattr(guard, "read_cpu", lambda pids: next(readings))
    monkeypatch.setattr(guard, "_REFERENCE", StandInKernel(*kernel_s))
    watch = guard.Watch(lambda: [])
    return watch.disturbance(ranks, samples_ms)


def test_a_run_on_a_quiet_host_is_clean(monkeypatch):
    quiet = [reading(0.0, 100.0, 5.0), reading(1.0, 100.05, 6.9)]  # all but 0.05 cores ours
    assert watched(monkeypatch, quiet, (1.0e-3, 1.05e-3), [10.0, 10.2, 10.4, 10.1, 10.3] * 2) is None


def test_a_watch_gives_every_reason_it_found(monkeypatch):
    loaded = [reading(0.0, 100.0, 5.0), reading(1.0, 100.0, 5.5)]
    assert watched(monkeypatch, loaded, (1.0e-3, 2.5e-3), [10.0] * 5 + [25.0] * 5) == (
        "other processes used 1.5 of 2 cores during the run; "
        "a reference kernel ran 2.5x slower after the run than is typical; "
        "its iterations spread 2.5x from p10 to p90")


def test_ranks_sharing_cores_spread_their_iterations_themselves(monkeypatch):
    quiet = [reading(0.0, 100.0, 5.0), reading(1.0, 100.0, 7.0)]
    crowded = available_cores() + 1
    spread = [10.0] * 5 + [25.0] * 5
    assert watched(monkeypatch, quiet, (1e-3, 1e-3), spread, ranks=crowded) is None
    assert watched(monkeypatch, quiet, (1e-3, 1e-3), spread, ranks=1) is not None


# --------------------------------------------------------------------------- switch


def test_cptune_guard_turns_the_guard_off_and_refuses_other_values(monkeypatch):
    assert enabled()
    monkeypatch.setenv("CPTUNE_GUARD", "off")
    assert not enabled()
    monkeypatch.delenv("CPTUNE_GUARD")
    assert enabled()  # on by default
    monkeypatch.setenv("CPTUNE_GUARD", "of")
    with pytest.raises(GuardSettingError, match="CPTUNE_GUARD must be 'on' or 'off', got 'of'"):
        enabled()


def test_cli_refuses_a_bad_cptune_guard_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("CPTUNE_GUARD", "maybe")
    code = main(["measure", "--seq-len", "64", "--heads", "4", "--head-dim", "16", "--max-ranks", "1",
                 "--warmup", "0", "--repeats", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""  # refused before anything ran or was drawn
    assert "CPTUNE_GUARD must be 'on' or 'off'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_search_refuses_a_bad_cptune_guard_even_with_nothing_left_to_measure(monkeypatch, capsys, tmp_path):
    db = str(tmp_path / "none.db")
    monkeypatch.setenv("CPTUNE_GUARD", "maybe")
    code = main(["search", "--db", db, "--seq-lens", "64", "--heads", "4", "--head-dim", "16",
                 "--ranks", "1", "--no-calibrate"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("cptune: error: CPTUNE_GUARD must be 'on' or 'off', got 'maybe'")
    assert not (tmp_path / "none.db").exists()  # nothing was created either


# --------------------------------------------------------------------------- real runs under load


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@contextmanager
def competing_load() -> Iterator[None]:
    """A busy loop per core of this host in other processes, running until the block ends."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(available_cores())]
    try:
        deadline = time.monotonic() + 10.0
        while any(_cpu_ticks(b.pid) == 0 for b in burners) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(b.poll() is None for b in burners), "a competing process ended early"
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


@pytest.mark.slow
def test_engine_names_its_processes():
    engine = MPIEngine()
    try:
        assert engine.process_ids() == []
        cptune.compute(WORKLOAD, CPConfig("ring", 2), *make_inputs(WORKLOAD, 0), backend=engine)
        pids = engine.process_ids()
        programs = Counter(Path(Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0]).name for pid in pids)
        # each process once: mpiexec, hydra's proxy on this host, and the two ranks
        assert len(set(pids)) == len(pids)
        assert programs == Counter({"mpiexec": 1, "hydra_pmi_proxy": 1, Path(sys.executable).name: 2})
    finally:
        engine.close()


@pytest.mark.slow
def test_a_run_beside_a_competing_process_is_marked_disturbed_guard_on_or_off(monkeypatch):
    with competing_load():
        loaded = cptune.measure(WORKLOAD, CPConfig("ring", 2), warmup=1, repeats=3)
        monkeypatch.setenv("CPTUNE_GUARD", "off")
        switched_off = cptune.measure(WORKLOAD, CPConfig("ring", 2), warmup=1, repeats=3)
    assert "other processes used" in loaded.disturbed
    # the guard off waits for nothing, but a timing under load is still no clean one
    assert "other processes used" in switched_off.disturbed


@pytest.mark.slow
def test_a_round_beside_a_competing_process_marks_every_configuration_of_it():
    configs = [CPConfig("ring", 1), CPConfig("ring", 2)]
    with competing_load():
        results = measure_round(WORKLOAD, configs, warmup=1, repeats=4)
    assert all("other processes used" in results[config].disturbed for config in configs)


@pytest.mark.slow
def test_no_measurement_taken_under_load_during_a_search_is_stored_as_clean(tmp_path):
    """The acceptance test: every core busy with another process for the whole search, and
    not one of the search's successful runs is stored as clean."""
    workload = Workload(seq_len=128, heads=4, head_dim=16, dtype="fp32")
    configs = [CPConfig("ring", 1), CPConfig("ring", 2)]  # few: a search re-runs disturbed visits
    with Store(str(tmp_path / "loaded.db")) as store:
        with competing_load():
            # a short patience: the load never ends, and waiting out the default 180 s says nothing more
            WorkloadSearch(workload, configs, store, this_host(), warmup=0, repeats=3,
                           rounds=1, race_rounds=0, patience_s=2).run()
        stored = store.results(status="ok")
        assert {r.config for r in stored} == set(configs)  # the search ran every configuration
        assert store.results(status="ok", disturbed=False) == []
        assert all("other processes used" in r.disturbed for r in stored)


@pytest.mark.slow
def test_cli_measure_says_which_runs_were_disturbed(capsys):
    argv = ["measure", "--seq-len", "64", "--heads", "4", "--head-dim", "16", "--max-ranks", "1",
            "--warmup", "0", "--repeats", "2"]
    with competing_load():
        table_code = main(argv)
        table = capsys.readouterr()
        json_code = main([*argv, "--json"])
        report = json.loads(capsys.readouterr().out)
    assert table_code == json_code == 0  # a disturbed run is a result, not a failure
    assert "* = disturbed by other load" in table.out
    assert "local attention on 1 rank disturbed: other processes used" in " ".join(table.err.split())
    assert [r["disturbed"] is not None for r in report["results"]] == [True]


class CountingEngine(StandInCalibrationEngine):
    """An in-process stand-in for calibrate on one rank: each attention timing is 1 s per
    shape and iteration on its first call, 0.5 s after."""

    def __init__(self) -> None:
        self.attention_calls = 0

    def time_attention(self, ranks, shapes, warmup, repeats, timeout):
        self.attention_calls += 1
        return np.full((len(shapes), repeats), 1.0 if self.attention_calls == 1 else 0.5)

    def describe(self):
        return {"engine": self.name, "kernel": "stand-in"}


class DisturbedFirst:
    """A Watch whose first look finds foreign load and later ones none."""

    looks = 0

    def __init__(self, process_ids, nodes=None) -> None:
        pass

    def host_disturbance(self, ranks: int) -> str | None:
        DisturbedFirst.looks += 1
        return "other processes used 1.0 of 2 cores during the run" if DisturbedFirst.looks == 1 else None


def test_a_disturbed_calibration_step_waits_for_quiet_is_timed_again_and_only_the_clean_timing_kept(
        monkeypatch):
    monkeypatch.setattr(calibration_module, "Watch", DisturbedFirst)
    waits = []
    monkeypatch.setattr(calibration_module, "wait_for_quiet",
                        lambda ranks, pids, patience, what: waits.append((ranks, patience, what)))
    DisturbedFirst.looks = 0
    engine, said = CountingEngine(), []
    calibration = calibrate(1, backend=engine, repeats=3, progress=said.append, rounds=1)
    assert engine.attention_calls == 2
    assert calibration.timed_kernels == "stand-in"  # what the engine said its timings ran
    assert calibration.facts["cores"] == str(available_cores())  # and the host's facts beside
    assert waits == [(1, guard.PATIENCE_S, "calibrating attention on 1 rank(s)")]  # quiet before again
    assert {rate.seconds for rate in calibration.compute} == {0.5}
    assert any("attention on 1 rank(s) disturbed by other load (other processes used" in s
               and s.endswith("timing it again once the host is quiet") for s in said)


def test_with_the_guard_off_a_disturbed_calibration_step_is_kept_and_said_so(monkeypatch):
    monkeypatch.setattr(calibration_module, "Watch", DisturbedFirst)
    monkeypatch.setattr(calibration_module, "wait_for_quiet", lambda *args: pytest.fail("waited"))
    DisturbedFirst.looks = 0
    engine, said = CountingEngine(), []
    unguarded = calibrate(1, backend=engine, repeats=3, guard=False, rounds=1, progress=said.append)
    assert engine.attention_calls == 1 and {rate.seconds for rate in unguarded.compute} == {1.0}
    assert any(s.endswith("kept, as CPTUNE_GUARD=off asks") for s in said)


def test_a_calibration_gives_up_in_one_line_when_the_host_stays_busy_through_the_wait(monkeypatch):
    monkeypatch.setattr(calibration_module, "Watch", DisturbedFirst)
    busy = ("the host stayed busy for 180 s (other processes use 1.0 of 2 cores: pid 4242 stress (98% of a "
            "core))")
    monkeypatch.setattr(calibration_module, "wait_for_quiet", lambda *args: busy)
    DisturbedFirst.looks = 0
    with pytest.raises(CalibrationDisturbedError) as refused:
        calibrate(1, backend=CountingEngine(), repeats=3, rounds=1)
    assert str(refused.value) == (
        f"attention on 1 rank(s) was disturbed by other load 1 time (other processes used 1.0 of 2 cores "
        f"during the run; {busy}): calibrate when the host is quieter, or set CPTUNE_GUARD=off to keep such "
        f"timings")


class BurstEngine(StandInCalibrationEngine):
    """An in-process stand-in for calibrate on two ranks: attention takes 1 s per call on one
    rank and 0.6 s on two, but twice that during a burst of other load the guard cannot see,
    in the ``burst``-th attention timing on two ranks; collectives 1 ms plus 1 ns per byte."""

    def __init__(self, burst: int) -> None:
        self.burst, self.order, self.two_rank_calls = burst, [], 0

    def time_attention(self, ranks, shapes, warmup, repeats, timeout):
        self.order.append(ranks)
        seconds = 1.0 if ranks == 1 else 0.6
        if ranks == 2:
            self.two_rank_calls += 1
            seconds *= 2 if self.two_rank_calls == self.burst else 1
        return np.full((len(shapes), repeats), seconds)


def test_calibration_rounds_take_the_median_so_one_burst_does_not_set_a_rate():
    """A burst the guard does not see doubles one timing of two ranks' attention: timed in one
    pass that timing is the rate; in three rounds (rank counts in turn, each round reversing
    the order) the median of the rounds sets it, and the collectives still fit their times."""
    single = calibrate(2, backend=BurstEngine(burst=1), guard=False, rounds=1)
    assert {r.seconds for r in single.compute if r.ranks == 2} == {1.2}
    engine = BurstEngine(burst=2)
    rounds = calibrate(2, backend=engine, guard=False, rounds=3)
    assert engine.order == [1, 2, 2, 1, 1, 2]
    assert {r.seconds for r in rounds.compute if r.ranks == 2} == {0.6}
    assert {r.seconds for r in rounds.compute if r.ranks == 1} == {1.0}
    assert all(fit.latency_s == pytest.approx(1e-3) and fit.bandwidth == pytest.approx(1e9)
               for fit in rounds.collectives)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        calibrate(2, backend=engine, rounds=0)


class DisturbedFrom:
    """A Watch that finds foreign load from its ``first``-th look on (counting from 1)."""

    looks, first = 0, 1

    def __init__(self, process_ids, nodes=None) -> None:
        pass

    def host_disturbance(self, ranks: int) -> str | None:
        DisturbedFrom.looks += 1
        disturbed = DisturbedFrom.looks >= self.first
        return "other processes used 1.0 of 2 cores during the run" if disturbed else None


def test_a_calibration_a_busy_host_stops_keeps_each_clean_step_and_the_next_times_only_the_rest(monkeypatch):
    """Two ranks in three rounds: 3 x 5 steps (attention on 1 and 2 ranks, the three collectives
    on 2). The host turns busy at the tenth step and stays so: nine steps are kept as they
    finish, the stop says 9 of 15; the next calibration times the other six alone and comes
    out as one never stopped."""
    whole = calibrate(2, backend=BurstEngine(burst=0), guard=False, rounds=3)
    monkeypatch.setattr(calibration_module, "Watch", DisturbedFrom)
    monkeypatch.setattr(calibration_module, "wait_for_quiet", lambda *args: "the host stayed busy for 1 s")
    DisturbedFrom.looks, DisturbedFrom.first = 0, 10
    kept: dict[str, tuple[float, ...]] = {}
    pieces = CalibrationPieces(keep=kept.__setitem__)
    with pytest.raises(CalibrationDisturbedError) as stopped:
        calibrate(2, backend=BurstEngine(burst=0), rounds=3, pieces=pieces)
    assert (stopped.value.kept, stopped.value.total, len(kept)) == (9, 15, 9)
    assert pieces.done == kept and all(len(seconds) > 0 for seconds in kept.values())
    DisturbedFrom.looks, DisturbedFrom.first = 0, 10**9
    engine, said = BurstEngine(burst=0), []
    again = calibrate(2, backend=engine, rounds=3, pieces=CalibrationPieces(dict(kept)), progress=said.append)
    assert DisturbedFrom.looks == 6  # only the steps not kept were timed
    assert said[0] == "going on from 9 of 15 steps a stopped calibration timed clean"
    assert (again.compute, again.collectives) == (whole.compute, whole.collectives)


def test_steps_timed_another_way_are_not_gone_on_from(monkeypatch):
    """A piece's key holds what its step times and how: a calibration with other repeats times
    every step itself."""
    monkeypatch.setattr(calibration_module, "Watch", DisturbedFrom)
    DisturbedFrom.looks, DisturbedFrom.first = 0, 10**9
    kept: dict[str, tuple[float, ...]] = {}
    calibrate(1, backend=CountingEngine(), repeats=3, rounds=1,
              pieces=CalibrationPieces(keep=kept.__setitem__))
    engine = CountingEngine()
    calibrate(1, backend=engine, repeats=4, rounds=1, pieces=CalibrationPieces(dict(kept)))
    assert len(kept) == 1 and engine.attention_calls == 1


def test_a_store_keeps_calibration_pieces_until_the_calibration_is_stored(tmp_path):
    db = str(tmp_path / "pieces.db")
    host = this_host()
    with Store(db) as store:
        store.add_calibration_piece(host, "mpi", "abc/0/attention on 1 rank(s)", (0.5, 0.25))
        store.add_calibration_piece(host, "mpi", "abc/0/attention on 1 rank(s)", (9.0,))  # kept already
        store.add_calibration_piece(host, "torch", "abc/0/attention on 1 rank(s)", (1.0,))
        assert store.calibration_pieces(host.fingerprint, "mpi") == {
            "abc/0/attention on 1 rank(s)": (0.5, 0.25)}
        store.add_calibration(host, make_calibration())  # an mpi calibration: the mpi pieces are done
        assert store.calibration_pieces(host.fingerprint, "mpi") == {}
        assert store.calibration_pieces(host.fingerprint, "torch") == {"abc/0/attention on 1 rank(s)": (1.0,)}


@pytest.mark.skipif(available_cores() < 2, reason="a stranger's core and ours need two")
def test_a_busy_host_is_said_at_the_start_with_what_the_guard_will_do():
    notice = guard.busy_notice(available_cores(), lambda: [], FakeHost(busy=lambda look: True).reader())
    assert notice is not None and notice.startswith(
        f"the host is busy (other processes use 1.0 of {available_cores()} cores: pid 4242 stress (100% of a "
        f"core)): a timing counts when other processes use at most 0.25 of {available_cores()} cores")
    assert f"waits up to {guard.PATIENCE_S:.0f} s" in notice and "a rerun goes on from it" in notice
    quiet = FakeHost(busy=lambda look: False).reader()
    assert guard.busy_notice(available_cores(), lambda: [], quiet) is None


@pytest.mark.slow
def test_a_calibration_beside_a_competing_process_is_refused_not_stored(monkeypatch, tmp_path, capsys):
    """Real ranks, every core busy with another process: calibrate times the attention again
    and then gives up in one line, and the database gains no calibration."""
    monkeypatch.setattr(calibration_module, "ATTENTION_SHAPES", (
        {"heads": 2, "seq_q": 64, "seq_k": 256, "head_dim": 32, "causal": 0},))
    monkeypatch.setattr(calibration_module, "GUARD_RETRIES", 1)
    monkeypatch.setenv("CPTUNE_GUARD_PATIENCE", "2")
    db = str(tmp_path / "cal.db")
    with competing_load():
        refused = (r"attention on 1 rank\(s\) was disturbed by other load 1 time \(other processes used .*; "
                   r"the host stayed busy for 2 s \(other processes use .* of a core\)")
        with pytest.raises(CalibrationDisturbedError, match=refused):
            calibrate(1, repeats=3)
        assert "waiting for the host to quiet down" in capsys.readouterr().err  # the library's countdown
        code = main(["calibrate", "--db", db, "--max-ranks", "1"])
    assert code == 2
    *guard_said, refusal = capsys.readouterr().err.strip().splitlines()
    assert refusal.startswith("cptune: error: attention on 1 rank(s) was disturbed")
    assert "CPTUNE_GUARD=off" in refusal
    assert refusal.endswith(f"0 of the calibration's 6 steps ran clean and are kept in "
                            f"sqlite:///{db}: the same command, once the host is quieter, goes on from them")
    # before it, on stderr too: that the host is busy and what cptune will do, the step timed
    # again, then the wait for quiet
    notice, retimed, *waits = guard_said
    assert notice.startswith("the host is busy (other processes use") and "a rerun goes on from it" in notice
    assert "disturbed by other load" in retimed and retimed.endswith("once the host is quiet")
    assert waits and all("waiting for the host to quiet down" in line for line in waits)
    with Store(db) as store:
        assert store.calibration(this_host().fingerprint) is None


# --------------------------------------------------------------------------- waiting for quiet


class FakeHost:
    """A host of ``available_cores()`` CPUs read through ``guard.HostReader``: a process
    "stress" (pid 4242) takes a whole core while ``busy`` says so, and this process a core
    all the time (ours: never named). Its clock moves only when the guard sleeps."""

    def __init__(self, busy) -> None:
        self.busy, self.now, self.looks = busy, 0.0, 0
        self.cpus = available_cores()
        self.idle_s, self.stress_s, self.ours_s = 100.0, 5.0, 7.0

    def sleep(self, seconds: float) -> None:
        stress = 1.0 if self.busy(self.looks) else 0.0
        self.looks += 1
        self.now += seconds
        self.stress_s += stress * seconds
        self.ours_s += seconds
        self.idle_s += (self.cpus - stress - 1.0) * seconds

    def cpu(self, pids) -> CpuReading:
        return CpuReading(wall_s=self.now, cpus=self.cpus, idle_s=self.idle_s, ours_s={OURS: self.ours_s})

    def processes(self):
        return {4242: ("stress", self.stress_s), os.getpid(): ("python3", self.ours_s), 1: ("init", 0.0)}

    def reader(self) -> guard.HostReader:
        return guard.HostReader(cpu=self.cpu, processes=self.processes, clock=lambda: self.now,
                                sleep=self.sleep)


class Shown(guard.WaitLine):
    def __init__(self) -> None:
        super().__init__()
        self.lines, self.ended = [], 0

    def show(self, text: str) -> None:
        self.lines.append(text)

    def end(self) -> None:
        self.ended += 1


def quiet_wait(host: FakeHost, patience: float) -> tuple[str | None, Shown]:
    shown = Shown()
    ranks = available_cores() - 1 if available_cores() > 1 else 1  # leaves no core for a stranger
    result = guard.wait_for_quiet(ranks, lambda: [], patience, "calibrating attention on 1 rank(s)",
                                  reader=host.reader(), line=shown)
    return result, shown


@pytest.mark.skipif(available_cores() < 2, reason="a stranger's core and ours need two")
def test_the_guard_waits_for_quiet_with_a_countdown_naming_who_takes_the_cores():
    host = FakeHost(busy=lambda look: look < 3)  # three busy looks, then quiet
    result, shown = quiet_wait(host, patience=60)
    assert result is None and host.looks == 4 and shown.ended == 1
    assert shown.lines == [
        f"calibrating attention on 1 rank(s): waiting for the host to quiet down, {left} s left (other "
        f"processes use 1.0 of {available_cores()} cores: pid 4242 stress (100% of a core)); "
        f"CPTUNE_GUARD=off measures anyway, marked disturbed"
        for left in (59, 58, 57)]


@pytest.mark.skipif(available_cores() < 2, reason="a stranger's core and ours need two")
def test_the_guard_gives_up_once_the_host_stays_busy_past_its_patience():
    host = FakeHost(busy=lambda look: True)
    result, shown = quiet_wait(host, patience=5)
    assert result == (f"the host stayed busy for 5 s (other processes use 1.0 of {available_cores()} cores: "
                      f"pid 4242 stress (100% of a core))")
    assert host.looks == 5 and len(shown.lines) == 4 and shown.ended == 1


def test_a_quiet_host_is_not_waited_for():
    host = FakeHost(busy=lambda look: False)
    result, shown = quiet_wait(host, patience=60)
    assert result is None and host.looks == 1 and shown.lines == []


def test_the_busiest_processes_are_named_ours_and_the_idle_left_out():
    before = {1: ("a", 0.0), 2: ("b", 0.0), 3: ("c", 0.0), 4: ("d", 0.0), 5: ("ours", 0.0), 6: ("idle", 0.0)}
    after = {1: ("a", 0.5), 2: ("b", 2.0), 3: ("c", 1.0), 4: ("d", 0.8), 5: ("ours", 2.0), 6: ("idle", 0.05),
             7: ("new", 9.0)}
    busiest = guard.busiest(before, after, wall_s=2.0, ours=[5])
    assert [(b.pid, b.name, b.cores) for b in busiest] == [(2, "b", 1.0), (3, "c", 0.5), (4, "d", 0.4)]


def test_this_host_s_processes_are_read_with_their_names():
    processes = guard.read_processes()
    assert processes[os.getpid()][0] == Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert processes[os.getpid()][1] > 0


def test_cptune_guard_patience_is_seconds_or_refused_in_one_line(cptune_here, monkeypatch, tmp_path):
    assert guard.patience_s() == guard.PATIENCE_S
    monkeypatch.setenv("CPTUNE_GUARD_PATIENCE", "30")
    assert guard.patience_s() == 30.0
    monkeypatch.setenv("CPTUNE_GUARD_PATIENCE", "soon")
    result = cptune_here("search", "--db", tmp_path / "p.db", "--seq-lens", "64", "--heads", "4",
                         "--head-dim", "16", "--ranks", "1", "--no-calibrate")
    assert_refused(result, "CPTUNE_GUARD_PATIENCE must be seconds from 0 to 86400, got 'soon'")
    assert not (tmp_path / "p.db").exists()


# --------------------------------------------------------------------------- the guard off


class AlwaysDisturbed:
    """A Watch that sees other load on every run."""

    def __init__(self, process_ids, nodes=None) -> None:
        pass

    def host_disturbance(self, ranks: int) -> str:
        return "other processes used 1.0 of 2 cores during the run"

    def disturbance(self, ranks: int, samples_ms) -> str:
        return self.host_disturbance(ranks)


@pytest.mark.slow
def test_with_the_guard_off_a_search_stores_what_ran_under_load_marked_disturbed(monkeypatch, tmp_path):
    monkeypatch.setenv("CPTUNE_GUARD", "off")
    monkeypatch.setattr("cptune.execute.Watch", AlwaysDisturbed)
    pauses = []
    monkeypatch.setattr("cptune.search._workload.time.sleep", pauses.append)
    workload = Workload(seq_len=64, heads=4, head_dim=16, dtype="fp32")
    with Store(str(tmp_path / "off.db")) as store:
        search = WorkloadSearch(workload, [CPConfig("ring", 1)], store, this_host(), warmup=0, repeats=2,
                                rounds=1, race_rounds=0, confirm_rounds=0)
        search.run()
        stored = store.results()
        assert stored and all(r.status == "ok" and r.disturbed == AlwaysDisturbed.host_disturbance(None, 1)
                              for r in stored)
        assert store.results(status="ok", disturbed=False) == []  # not one stored as clean
    assert search.verdict is None and search.never_clean == (CPConfig("ring", 1),)
    assert pauses and set(pauses) == {search.settle_s}  # no wait for quiet with the guard off


# --------------------------------------------------------------------------- where its words go


def test_a_calibration_step_timed_again_is_said_on_stderr_unwrapped(monkeypatch, tmp_path, capsys):
    """``cptune calibrate | tee log``: the guard's warnings go to stderr, each on one line."""
    step = ("attention on 1 rank(s) disturbed by other load (other processes used 1.9 of 2 cores during the "
            "run; a reference kernel ran 2.6x slower after the run than is typical): timing it again once "
            "the host is quiet")

    def calibrating(max_ranks, backend, repeats, progress, rounds, pieces):
        progress(step)
        return make_calibration(max_ranks)

    monkeypatch.setattr("cptune.search._space.calibrate", calibrating)
    code = main(["calibrate", "--db", str(tmp_path / "c.db"), "--max-ranks", "1"])
    out, err = capsys.readouterr()
    assert code == 0
    assert step in err.splitlines()  # whole, on a line of its own
    assert "disturbed by other load" not in out
