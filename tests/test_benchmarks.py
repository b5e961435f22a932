"""benchmarks/reproducibility.py on two small constructed databases: today's newest-wins
figures beside the verdict-based ones; benchmarks/gpu_tensorrt_stack.py where there is no GPU."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_benchmark, make_calibration, measurement
from cptune.config import CPConfig
from cptune.estimate import combine
from cptune.hardware import this_host
from cptune.store import Store
from cptune.workload import Workload

reproducibility = load_benchmark("reproducibility")

CLEAR = Workload(seq_len=1024, heads=8, head_dim=64)  # ring wins by ~30%
CLOSE = Workload(seq_len=2048, heads=8, head_dim=64)  # ring and ulysses within a few %
RING, ULYSSES = CPConfig("ring", 2), CPConfig("ulysses", 2, 2)

# (workload, config) -> the median of each round, oldest first
FIRST = {
    # the newest ring visit is slow: newest-wins picks ulysses; all five rounds say ring
    (CLEAR, RING): [10.0, 10.1, 9.9, 10.05, 13.5],
    (CLEAR, ULYSSES): [13.0, 13.1, 12.9, 13.05, 13.0],
    (CLOSE, RING): [10.0, 10.5, 9.8],
    (CLOSE, ULYSSES): [10.2, 10.1, 10.3],
}
SECOND = {
    (CLEAR, RING): [10.0, 10.1, 10.0],
    (CLEAR, ULYSSES): [13.0, 13.2, 13.1],
    (CLOSE, RING): [10.6, 10.5, 10.7],
    (CLOSE, ULYSSES): [10.0, 10.1, 10.0],
}


def _database(path: Path, rounds: dict, disturbed: tuple[Workload, CPConfig, float] | None = None) -> str:
    host = this_host()
    with Store(str(path)) as store:
        for (workload, config), medians in rounds.items():
            for i, ms in enumerate(medians):
                store.add_measurement(host, measurement(workload, config, ms), round_id=f"r{i}")
        if disturbed is not None:  # newest of all, and fastest: counts for nothing
            workload, config, ms = disturbed
            m = dataclasses.replace(measurement(workload, config, ms), disturbed="load: processes 1.5 cores")
            store.add_measurement(host, m, round_id="r9")
    return str(path)


@pytest.fixture
def runs(tmp_path: Path) -> tuple[str, str]:
    return (_database(tmp_path / "first.db", FIRST, disturbed=(CLEAR, ULYSSES, 5.0)),
            _database(tmp_path / "second.db", SECOND))


def _combined(db: str) -> dict[tuple[Workload, CPConfig], float]:
    """Each configuration's latency as cptune.estimate combines the database's visits
    (each at its round's level, then the median)."""
    with Store(db) as store:
        estimates = combine(store.results())
    return {(workload, config): e.median_ms for (_, workload, config), e in estimates.items()}


def _figures(runs: tuple[str, str]) -> dict:
    fingerprint = this_host().fingerprint
    return reproducibility.figures(*(reproducibility.clean_rows([db], fingerprint) for db in runs))


def test_newest_wins_is_todays_single_visit_judgement(runs):
    out = _figures(runs)
    by_second = {j["workload"]: j for j in out["newest_wins"]["first_judged_by_second"]["per_workload"]}
    clear = by_second[CLEAR.describe()]
    # first run's newest visits: ring 13.5, ulysses 13.0 (the disturbed 5.0 does not count)
    assert clear["pick"] == ULYSSES.describe() and clear["other_best"] == RING.describe()
    assert clear["regret"] == pytest.approx(13.1 / 10.0)
    close = by_second[CLOSE.describe()]
    # newest visits: ring 9.8 beats ulysses 10.3; the second run's newest: ring 10.7, ulysses 10.0
    assert close["pick"] == RING.describe() and close["regret"] == pytest.approx(10.7 / 10.0)
    summary = out["newest_wins"]["first_judged_by_second"]["summary"]
    assert summary["winners"] == 2 and summary["ties"] == 0
    assert summary["median_regret"] == pytest.approx((1.31 + 1.07) / 2)
    assert summary["worst_regret"] == pytest.approx(1.31)


def test_the_verdict_counts_ties_as_ties_and_judges_winners_by_combined_estimates(runs):
    out = _figures(runs)
    first = {j["workload"]: j for j in out["verdict"]["first_judged_by_second"]["per_workload"]}
    # all five rounds combined: ring separates from ulysses, and the second run agrees
    assert first[CLEAR.describe()]["pick"] == RING.describe()
    assert first[CLEAR.describe()]["regret"] == pytest.approx(1.0)
    # a few % apart with a 7% swing between rounds: a tie, the second's leader among the tied
    close = first[CLOSE.describe()]
    assert close["regret"] is None and set(close["tied"]) == {RING.describe(), ULYSSES.describe()}
    assert close["other_leader_among_tied"] is True
    summary = out["verdict"]["first_judged_by_second"]["summary"]
    assert (summary["winners"], summary["ties"], summary["ties_with_other_leader_among_tied"]) == (1, 1, 1)
    assert summary["goal_met"] is True

    # the other way: the second run separates ulysses at CLOSE; the first run's estimates judge it
    second = {j["workload"]: j for j in out["verdict"]["second_judged_by_first"]["per_workload"]}
    assert second[CLOSE.describe()]["pick"] == ULYSSES.describe()
    first_run = _combined(runs[0])
    expected = first_run[(CLOSE, ULYSSES)] / first_run[(CLOSE, RING)]
    assert second[CLOSE.describe()]["regret"] == pytest.approx(expected)
    summary = out["verdict"]["second_judged_by_first"]["summary"]
    assert summary["winners"] == 2 and summary["worst_regret"] == pytest.approx(expected)


def test_the_ratio_spread_compares_combined_latencies(runs):
    ratio = _figures(runs)["ratio_second_over_first"]
    first_run, second_run = (_combined(db) for db in runs)
    expected = [second_run[key] / first_run[key] for key in FIRST]
    assert ratio["configurations"] == 4
    assert ratio["min"] == pytest.approx(min(expected)) and ratio["max"] == pytest.approx(max(expected))


def test_the_fit_floor_judges_every_leader_as_fit_judges_a_pick(runs):
    floor = _figures(runs)["fit_floor"]
    # first run: ring leads at both workloads (tied with ulysses at CLOSE, but still the pick);
    # the second run separates ulysses at CLOSE, so the first's pick there costs 10.6 / 10.0
    second_run = _combined(runs[1])
    close = second_run[(CLOSE, RING)] / second_run[(CLOSE, ULYSSES)]
    first = floor["first_judged_by_second"]
    assert first["worst_regret"] == pytest.approx(close) and first["above_1_05"] == 1
    assert first["median_regret"] == pytest.approx((1.0 + close) / 2)
    # second run's ulysses at CLOSE is tied with the first run's leader: 1.0, ties as ties
    second = floor["second_judged_by_first"]
    assert (second["median_regret"], second["worst_regret"], second["above_1_05"]) == (1.0, 1.0, 0)


def test_json_and_text_output(runs, capsys):
    first, second = runs
    assert reproducibility.main(["--first", first, "--second", second, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workloads"] == 2 and out["goal"] == {"median_regret": 1.02, "worst_regret": 1.1}
    assert reproducibility.main(["--first", first, "--second", second]) == 0
    text = capsys.readouterr().out
    assert "newest-wins (today)" in text and "verdict (new)" in text
    assert "1 winners, 1 ties" in text and "goal median <= 1.02, worst <= 1.1: met" in text
    assert "floor under cptune fit's regret" in text and "1 of 2 above 1.05" in text


def test_a_run_stored_in_several_databases_is_judged_as_one(runs, tmp_path, capsys):
    """The first run's two workloads split over two databases: the same figures as one."""
    split = [_database(tmp_path / f"first-{n}.db", {key: medians for key, medians in FIRST.items()
                                                     if key[0] == workload})
             for n, workload in enumerate((CLEAR, CLOSE))]
    whole = _database(tmp_path / "first-whole.db", FIRST)
    outputs = []
    for first in (split, [whole]):
        assert reproducibility.main(["--first", *first, "--second", runs[1], "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["workloads"] == 2 and outputs[0] == outputs[1]


def test_a_missing_database_is_one_line_and_exit_2(runs, tmp_path, capsys):
    assert reproducibility.main(["--first", runs[0], "--second", str(tmp_path / "absent.db")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "absent.db" in err
    assert reproducibility.main(["--first", runs[0], "--second", runs[1], "--hardware", "nothing"]) == 2
    assert "no workload" in capsys.readouterr().err


@pytest.mark.slow
def test_the_gpu_stack_check_says_why_each_check_cannot_run_without_a_gpu(tmp_path):
    """The prepared GPU-node check runs anywhere: here, no GPU, every check ends with its
    reason and the doctor's one line, none hangs."""
    out = tmp_path / "stack.txt"
    done = subprocess.run([sys.executable, "benchmarks/gpu_tensorrt_stack.py", "--timeout", "120",
                           "--out", str(out)], cwd=Path(__file__).parent.parent, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    report = out.read_text()
    sections = report.split("\n## ")[1:]
    names = ["nccl_bare_name", "nccl_load_order", "nccl4py_communicators", "cuda_runtime_path", "preflight"]
    assert [s.splitlines()[0] for s in sections] == names
    assert all(len(s.strip().splitlines()) > 1 for s in sections)  # each said something
    assert "did not finish" not in report
    if shutil.which("nvidia-smi") is None:
        assert "cptune doctor: exit 2" in report and "needs NVIDIA GPUs" in report


def test_length_mix_megatron_rule_runs_each_sequence_once_on_power_of_two_ring_groups():
    from cptune.mixes import LengthMix, mix_costs

    length_mix = load_benchmark("length_mix")
    batch = [4096, 3000, 900, 600, 300, 200, 150, 130]
    costs = mix_costs(length_mix.SHAPE, LengthMix.of(batch), 4, hardware="h100-sxm-8")
    plan = length_mix.megatron_plan(costs, batch, 4, 1024)
    assert sorted(s for g in plan.groups for s in g.sequences) == list(range(len(batch)))
    assert sum(g.config.ranks for g in plan.groups) <= 4
    assert all(g.config.strategy == "ring" and g.config.ranks & (g.config.ranks - 1) == 0
               for g in plan.groups)
    longest = next(g for g in plan.groups if 0 in g.sequences)
    assert longest.config.ranks == max(g.config.ranks for g in plan.groups) > 1
    assert plan.makespan_ms == max(g.ms for g in plan.groups) > 0
    assert all(length_mix.flexsp(g.config) for g in length_mix.plans_for(costs, batch, 4, 1024)[
        length_mix.RULES[1]].groups)


def test_length_mix_pairs_plans_round_by_round():
    length_mix = load_benchmark("length_mix")
    assert length_mix.round_ratios([[2.0, 4.0, 9.0], [3.0]], [[1.0, 2.0, 2.0], [6.0]]) == [2.0, 0.5]
    with pytest.raises(ValueError):
        length_mix.round_ratios([[1.0]], [[1.0], [1.0]])


@pytest.mark.slow
def test_length_mix_runs_every_rule_on_two_ranks_and_reports_its_error(tmp_path):
    db, out = str(tmp_path / "host.db"), tmp_path / "length_mix.txt"
    with Store(db) as store:
        store.add_calibration(this_host(), make_calibration())
    length_mix = load_benchmark("length_mix")
    assert length_mix.main(["--db", db, "--ranks", "2", "--batches", "1", "--sequences", "2", "--rounds", "1",
                            "--repeats", "1", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    measured = [line for line in lines if line.startswith("    1  ")]
    assert [line[7:24].strip() for line in measured] == list(length_mix.RULES)
    assert all(float(line[24:].split()[1]) > 0 for line in measured)  # a measured makespan each
    distinct = sum("(the plan of" not in line for line in measured)
    assert any(line.startswith("predicted-vs-measured makespan error")
               and f"over the {distinct} distinct" in line for line in lines)
    assert any("round by round: median" in line and "over 1)" in line for line in lines)


def test_masked_prior_regret_floor_judges_one_half_of_the_rounds_by_the_other():
    regret = load_benchmark("masked_prior_regret")
    # two classes of one decision: a is faster on even rounds, b on odd ones
    times = {0: [1.0, 2.0, 1.0, 2.0], 1: [2.0, 1.0, 2.0, 1.0], 2: [1.5, 1.5, 1.5, 1.5]}
    work = [("a",), ("b",), ("c",)]
    assert regret.split_half_regrets(times, work, [[0, 1]]) == [2.0, 2.0]
    assert regret.split_half_regrets(times, work, [[0, 2]]) == pytest.approx([2.0 / 1.5, 1.5])
    times[1] = [float("nan"), 1.0, float("nan"), 1.0]  # b disturbed in every even round
    assert regret.split_half_regrets(times, work, [[0, 1, 2]]) == pytest.approx([2.0 / 1.5, 1.5])
