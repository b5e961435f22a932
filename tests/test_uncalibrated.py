"""``recommend`` and ``export`` after ``cptune search --no-calibrate`` (issue 33, item 9): the
measured lengths are answered from their measurements; a length with none is refused in one
line that says what to run."""

import json

import pytest

from conftest import assert_refused, measurement, stand_in_measuring

SHAPE = ["--heads", "4", "--head-dim", "16"]


@pytest.fixture
def searched(tmp_path, monkeypatch, cptune_here):
    """A database of this host searched at 64 tokens without a calibration: local attention
    in 10 ms, every 2-rank configuration in 20 ms (ring in 15)."""
    from cptune import CPConfig

    stand_in_measuring(monkeypatch, lambda workload, config, **_: measurement(
        workload, config, 10.0 if config.ranks == 1 else 15.0 if config == CPConfig("ring", 2) else 20.0))
    db = tmp_path / "u.db"
    done = cptune_here("search", "--db", db, *SHAPE, "--seq-lens", "64", "--ranks", "1,2", "--no-calibrate",
                       "--rounds", "2", "--race-rounds", "0", "--confirm-rounds", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    return db


def test_recommend_answers_a_measured_length_from_its_measurements(searched, cptune_here):
    result = cptune_here("recommend", *SHAPE, "--seq-len", "64", "--db", searched, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    pick = json.loads(result.stdout)
    assert pick["config"] == {"strategy": "ring", "ranks": 1, "head_group": 1}
    assert pick["source"] == "measured" and {c["source"] for c in pick["candidates"]} == {"measured"}
    assert pick["hardware"].endswith("(measured, not calibrated)")
    shown = cptune_here("recommend", *SHAPE, "--seq-len", "64", "--db", searched, "--ranks", "2")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "pick: Ring on 2 ranks" in shown.stdout


def test_recommend_refuses_a_length_nothing_measured_in_one_line_that_names_calibrate(searched, cptune_here):
    result = cptune_here("recommend", *SHAPE, "--seq-len", "128", "--db", searched)
    assert_refused(result, "has measurements but no calibration", "(measured there: seq_len 64)",
                   "run cptune calibrate with this database")


def test_export_writes_a_plan_for_the_measured_lengths_and_refuses_others(searched, cptune_here, tmp_path):
    plan = tmp_path / "plan.json"
    written = cptune_here("export", *SHAPE, "--seq-lens", "64", "--db", searched, "-o", plan)
    assert written.returncode == 0, written.stdout + written.stderr
    data = json.loads(plan.read_text())
    assert data["buckets"][0]["source"] == "measured" and data["buckets"][0]["label"] == "local"
    assert data["hardware"]["kind"] == "host" and data["hardware"]["engine"] == "mpi"
    assert_refused(cptune_here("export", *SHAPE, "--seq-lens", "64,128", "--db", searched, "-o", plan),
                   "run cptune calibrate")
