"""cptune search / results end to end, as a user runs them: interrupted, killed, in parallel."""

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import optuna
import pytest

from cptune.hardware import this_host
from cptune.store import Store

CLI = [sys.executable, "-P", "-c", "import sys; from cptune.cli import main; sys.exit(main())"]
# 3 lengths x (ring x1, ring x2, allgather_kv x2, ulysses x2) = 12 configurations
SLOW = ["--heads", "8", "--head-dim", "64", "--seq-lens", "1024,1536,2048", "--ranks", "1,2",
        "--no-calibrate"]
QUICK = ["--heads", "4", "--head-dim", "16", "--seq-lens", "64,96", "--ranks", "1,2"]


def cptune(*args, **kwargs):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, **kwargs)


def stored(db):
    """(strategy, ranks, head_group, seq_len, status, median_ms) rows, read as SQLite sees them."""
    with sqlite3.connect(db) as connection:
        return connection.execute(
            "SELECT strategy, ranks, head_group, seq_len, status, median_ms FROM measurements "
            "JOIN workloads ON workloads.id = measurements.workload_id"
        ).fetchall()


def wait_for_rows(db, count, process, limit=120):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and process.poll() is None:
        if os.path.exists(db):
            try:
                if len(stored(db)) >= count:
                    return
            except sqlite3.OperationalError:
                pass  # tables not created yet
        time.sleep(0.1)
    pytest.fail(f"search stored fewer than {count} rows in time")


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_interrupted_search_resumes_with_only_what_is_missing(tmp_path, how):
    db = str(tmp_path / "search.db")
    search = subprocess.Popen([*CLI, "search", "--db", db, *SLOW], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    wait_for_rows(db, 2, search)
    search.send_signal(how)
    _, err = search.communicate(timeout=60)
    assert search.returncode == (130 if how == signal.SIGINT else -signal.SIGKILL)
    if how == signal.SIGINT:  # one line, no traceback (Optuna's per-trial one included)
        assert err.splitlines()[-1].startswith("interrupted: every finished measurement is stored")
        assert "Traceback" not in err and "Trial" not in err
    with Store(db) as store:  # opens cleanly, migrations already at head
        kept = store.results()
    assert 2 <= len(kept) < 12
    assert all(r.status == "ok" and r.median_ms is not None and r.median_ms > 0 for r in kept)

    rerun = cptune("search", "--db", db, *SLOW)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"{12 - len(kept)} configuration(s) measured now" in rerun.stdout
    rows = stored(db)
    keys = [row[:4] for row in rows]
    assert len(rows) == 12 and len(set(keys)) == 12  # each configuration once


@pytest.mark.slow
def test_two_searches_share_one_sqlite_file(tmp_path):
    db = str(tmp_path / "shared.db")
    runs = [subprocess.Popen([*CLI, "search", "--db", db, "--heads", "4", "--head-dim", "16",
                              "--seq-lens", seq_lens, "--ranks", "1,2", "--no-calibrate"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for seq_lens in ("64,96,128", "80,112,144")]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert not any("locked" in out for out in outputs)
    rows = stored(db)
    assert len(rows) == 24 and all(row[4] == "ok" for row in rows)
    assert {row[3] for row in rows} == {64, 96, 128, 80, 112, 144}
    # each workload's study, written by both processes into the same file, lost nothing either
    studies = optuna.get_all_study_summaries(f"sqlite:///{db}")
    assert len(studies) == 6
    for summary in studies:
        seq_len = int(summary.study_name.split(":seq ")[1].split()[0])
        trials = optuna.load_study(study_name=summary.study_name, storage=f"sqlite:///{db}").trials
        assert sorted((t.params["strategy"], t.params["ranks"], t.params["head_group"], t.value)
                      for t in trials) == sorted((r[0], r[1], r[2], r[5]) for r in rows if r[3] == seq_len)


def test_search_calibrates_then_results_export_and_report(tmp_path):
    db = str(tmp_path / "r.db")
    first = cptune("search", "--db", db, *QUICK)
    assert first.returncode == 0, first.stderr
    assert "no calibration yet: calibrating 1..2 ranks first" in first.stdout
    lines = first.stdout.splitlines()  # not a terminal: every message on a line of its own, unbroken
    assert any(line.startswith("8 configuration(s) measured now") for line in lines), first.stdout
    assert any(line.endswith(f"results in sqlite:///{db}, exhaustive order") for line in lines), first.stdout
    with Store(db) as store:
        calibration = store.calibration(this_host().fingerprint)
    assert calibration is not None and calibration.max_ranks == 2
    again = cptune("search", "--db", db, *QUICK)
    assert "0 configuration(s) measured now" in again.stdout
    assert "calibrating" not in again.stdout
    listed = cptune("results", "--db", db, "--json")
    rows = json.loads(listed.stdout)
    assert len(rows) == 8
    for row in rows:
        assert {"seq_len", "heads", "kv_heads", "head_dim", "strategy", "ranks", "head_group", "status",
                "median_ms", "error"} <= set(row)
        assert row["status"] == "ok" and row["median_ms"] > 0 and row["error"] is None
    csv_lines = cptune("results", "--db", db, "--csv", "--seq-len", "64").stdout.strip().splitlines()
    assert csv_lines[0].startswith("id,") and len(csv_lines) == 1 + 4

    # export a plan, load it in another process, select between the two buckets (1-78, 79-96)
    plan = tmp_path / "plan.json"
    exported = cptune("export", "--db", db, *QUICK[:6], "-o", str(plan))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    script = (f"import cptune; c = cptune.load_plan({str(plan)!r}).select(80); "
              f"print(c.strategy, c.ranks, c.head_group)")
    loaded = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=60)
    fastest = min((r for r in rows if r["seq_len"] == 96), key=lambda r: r["median_ms"])
    assert loaded.stdout.split() == [fastest["strategy"], str(fastest["ranks"]), str(fastest["head_group"])]

    report = cptune("report", "--db", db, "-o", str(tmp_path / "report"))
    assert report.returncode == 0, report.stdout + report.stderr
    pngs = sorted(f.name for f in (tmp_path / "report").glob("*.png"))
    assert pngs == ["4x16-bf16-compute-vs-communication.png", "4x16-bf16-latency-vs-ranks.png",
                    "4x16-bf16-speedup.png", "4x16-bf16-strategy-map.png", "predicted-vs-measured.png"]
    assert "data:image/png;base64," in (tmp_path / "report" / "report.html").read_text()

    # guided by the model fitted on these measurements: it says where it stopped and why
    guided = cptune("search", "--db", db, *QUICK, "--order", "guided", "--remeasure")
    assert guided.returncode == 0, guided.stdout + guided.stderr
    assert "guided order" in guided.stdout and "not guided" not in guided.stdout
    stops = re.findall(r"^seq (\d+): stopped after (\d+) of 4 configurations", guided.stdout, re.MULTILINE)
    measured_now = 8 - sum(4 - int(tried) for _, tried in stops)
    assert f"{measured_now} configuration(s) measured now" in guided.stdout
    assert len(stored(db)) == 8 + measured_now


@pytest.mark.parametrize("args, message", [
    (["search", "nosuchspace"], "no such file and no built-in space"),
    (["search", "demo", "--heads", "8"], "not both"),
    (["search", "--heads", "8", "--head-dim", "64"], "--seq-lens"),
    (["search", "--heads", "3", "--head-dim", "8", "--seq-lens", "64", "--ranks", "2",
      "--strategies", "ulysses"], "no feasible configuration"),
    (["search", "--heads", "8", "--kv-heads", "3", "--head-dim", "8", "--seq-lens", "64"], "kv_heads"),
    (["search", "--seq-lens", "64,x"], "--seq-lens"),
])
def test_bad_search_input_exits_2_without_traceback(tmp_path, args, message):
    result = cptune(*args, "--db", str(tmp_path / "x.db"), cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "x.db").exists()  # refused before anything was opened


def test_bad_space_file_exits_2(tmp_path):
    space = tmp_path / "space.toml"
    space.write_text('name = "x"\n[model]\nhaeds = 8\nhead_dim = 64\n[sweep]\nseq_lens = [64]\n')
    result = cptune("search", str(space), "--db", str(tmp_path / "x.db"))
    assert result.returncode == 2 and result.stdout == ""
    assert "space.toml" in result.stderr and "haeds" in result.stderr


def test_corrupt_database_exits_2_and_is_kept(tmp_path):
    db = tmp_path / "broken.db"
    db.write_bytes(b"\x00garbage" * 512)
    before = db.read_bytes()
    result = cptune("results", "--db", str(db))
    assert result.returncode == 2 and "not a database" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert db.read_bytes() == before
