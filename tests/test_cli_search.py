"""cptune search / results end to end, as a user runs them: interrupted, killed, in parallel."""

import dataclasses
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter

import optuna
import pytest

from conftest import CLI, assert_refused, cptune, measurement, stand_in_measuring
from cptune.hardware import this_host
from cptune.store import Store

# 3 lengths x (ring x1, ring x2, allgather_kv x2, ulysses x2) = 12 configurations, 24 visits in
# ROUNDS: long enough (about 10 s) for a signal to land between the second row and the last
TWELVE = ["--heads", "4", "--head-dim", "32", "--seq-lens", "256,384,512", "--ranks", "1,2",
          "--no-calibrate"]
QUICK = ["--heads", "4", "--head-dim", "16", "--seq-lens", "64,96", "--ranks", "1,2"]
ROUNDS = ["--rounds", "2", "--race-rounds", "0", "--confirm-rounds", "0"]  # 2 clean visits each, fixed
ONE_VISIT = ["--rounds", "1", "--race-rounds", "0", "--confirm-rounds", "0"]  # one clean visit each


def stored(db):
    """(strategy, ranks, head_group, seq_len, status, median_ms, disturbed) rows, read as SQLite sees them."""
    with sqlite3.connect(db) as connection:
        return connection.execute(
            "SELECT strategy, ranks, head_group, seq_len, status, median_ms, disturbed FROM measurements "
            "JOIN workloads ON workloads.id = measurements.workload_id"
        ).fetchall()


def clean_visits(db):
    """(strategy, ranks, head_group, seq_len) -> its clean visits stored."""
    return Counter(row[:4] for row in stored(db) if row[4] == "ok" and row[6] is None)


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
    # Ctrl-C as a terminal delivers it: a suite started in the background by a shell without
    # job control inherits SIGINT ignored, and the search rightly keeps an ignored SIGINT
    search = subprocess.Popen([*CLI, "search", "--db", db, *TWELVE, *ROUNDS], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for_rows(db, 2, search)
    search.send_signal(how)
    _, err = search.communicate(timeout=60)
    assert search.returncode == (130 if how == signal.SIGINT else -signal.SIGKILL), err
    if how == signal.SIGINT:  # one line, no traceback (Optuna's per-trial one included)
        assert err.splitlines()[-1].startswith("interrupted: every finished measurement is stored")
        assert "Traceback" not in err and "Trial" not in err
    with Store(db) as store:  # opens cleanly, migrations already at head
        kept = store.results()
    assert 2 <= len(kept) < 24
    assert all(r.status == "ok" and r.median_ms is not None and r.median_ms > 0 for r in kept)

    rerun = cptune("search", "--db", db, *TWELVE, *ROUNDS)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    rows = stored(db)
    assert f"in {len(rows) - len(kept)} visit(s)" in rerun.stdout  # only what was missing ran
    visits = clean_visits(db)
    assert len(visits) == 12 and set(visits.values()) == {2}  # each configuration its two rounds


@pytest.mark.slow
def test_two_searches_share_one_sqlite_file(tmp_path):
    """Two searches writing one file at once, as two hosts sharing a database do: each its own
    host lock (one host's searches take turns: tests/test_hostlock.py)."""
    db = str(tmp_path / "shared.db")
    runs = [subprocess.Popen([*CLI, "search", "--db", db, "--heads", "4", "--head-dim", "16",
                              "--seq-lens", seq_lens, "--ranks", "1,2", "--no-calibrate",
                              "--race-rounds", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "CPTUNE_LOCK": str(tmp_path / f"host-{seq_lens}.lock")})
            for seq_lens in ("64,96", "80,112")]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert not any("locked" in out for out in outputs)
    rows = stored(db)
    assert all(row[4] == "ok" for row in rows)
    assert {row[3] for row in rows} == {64, 96, 80, 112}
    visits = clean_visits(db)  # each configuration of each length: its rounds, at most the race's cap
    assert len(visits) == 16 and all(2 <= n <= 4 + 3 for n in visits.values()), visits  # + a second sitting
    # each workload's study, written by both processes into the same file, lost nothing either
    studies = optuna.get_all_study_summaries(f"sqlite:///{db}")
    assert len(studies) == 4
    for summary in studies:
        seq_len = int(summary.study_name.split(":seq ")[1].split()[0])
        trials = optuna.load_study(study_name=summary.study_name, storage=f"sqlite:///{db}").trials
        assert sorted((t.params["strategy"], t.params["ranks"], t.params["head_group"], t.value)
                      for t in trials) == sorted((r[0], r[1], r[2], r[5]) for r in rows if r[3] == seq_len)


@pytest.mark.slow
def test_search_calibrates_then_results_export_and_report(tmp_path, cptune_here):
    """Searches as a user runs them (a process each); the commands that only read, in this process."""
    db = str(tmp_path / "r.db")
    first = cptune("search", "--db", db, *QUICK, *ONE_VISIT)
    assert first.returncode == 0, first.stderr
    assert "no calibration yet: calibrating 1..2 ranks first" in first.stdout
    lines = first.stdout.splitlines()  # not a terminal: every message on a line of its own, unbroken
    assert any(line.startswith("8 configuration(s) measured now") for line in lines), first.stdout
    assert any(line.endswith(f"results in sqlite:///{db}, exhaustive order") for line in lines), first.stdout
    with Store(db) as store:
        calibration = store.calibration(this_host().fingerprint)
    assert calibration is not None and calibration.max_ranks == 2
    again = cptune("search", "--db", db, *QUICK, *ONE_VISIT)
    assert "0 configuration(s) measured now in 0 visit(s)" in again.stdout
    assert "calibrating" not in again.stdout
    listed = cptune_here("results", "--db", db, "--json")
    rows = [row for row in json.loads(listed.stdout) if row["disturbed"] is None]
    assert len(rows) == 8
    for row in rows:
        assert {"seq_len", "heads", "kv_heads", "head_dim", "strategy", "ranks", "head_group", "status",
                "median_ms", "error"} <= set(row)
        assert row["status"] == "ok" and row["median_ms"] > 0 and row["error"] is None
    csv_lines = cptune_here("results", "--db", db, "--csv", "--seq-len", "64").stdout.strip().splitlines()
    assert csv_lines[0].startswith("id,") and len(csv_lines) >= 1 + 4

    # export a plan, load it in another process, select between the two buckets (1-78, 79-96)
    plan = tmp_path / "plan.json"
    exported = cptune_here("export", "--db", db, *QUICK[:6], "-o", str(plan))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    script = (f"import cptune; c = cptune.load_plan({str(plan)!r}).select(80); "
              f"print(c.strategy, c.ranks, c.head_group)")
    loaded = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=60)
    fastest = min((r for r in rows if r["seq_len"] == 96), key=lambda r: r["median_ms"])
    assert loaded.stdout.split() == [fastest["strategy"], str(fastest["ranks"]), str(fastest["head_group"])]

    report = cptune_here("report", "--db", db, "-o", str(tmp_path / "report"))
    assert report.returncode == 0, report.stdout + report.stderr
    pngs = sorted(f.name for f in (tmp_path / "report").glob("*.png"))
    assert pngs == ["4x16-bf16-compute-vs-communication.png", "4x16-bf16-latency-vs-ranks.png",
                    "4x16-bf16-speedup.png", "4x16-bf16-strategy-map.png", "predicted-vs-measured.png"]
    assert "data:image/png;base64," in (tmp_path / "report" / "report.html").read_text()

    # guided by the model fitted on these measurements: it says where it stopped and why
    before = len(stored(db))
    guided = cptune("search", "--db", db, *QUICK, *ONE_VISIT, "--order", "guided", "--remeasure")
    assert guided.returncode == 0, guided.stdout + guided.stderr
    assert "guided order" in guided.stdout and "not guided" not in guided.stdout
    stops = re.findall(r"^seq (\d+): stopped after (\d+) of 4 configurations", guided.stdout, re.MULTILINE)
    measured_now = 8 - sum(4 - int(tried) for _, tried in stops)
    visits = re.search(rf"^{measured_now} configuration\(s\) measured now in (\d+) visit", guided.stdout,
                       re.MULTILINE)
    assert visits is not None, guided.stdout
    assert len(stored(db)) == before + int(visits[1])


@pytest.mark.slow
def test_search_gives_each_length_its_verdict_in_words_and_a_rerun_runs_nothing(tmp_path):
    db = str(tmp_path / "v.db")
    first = cptune("search", "--db", db, *QUICK, "--no-calibrate", "--rounds", "3", "--race-rounds", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "in 3 round(s), up to 2 more in the final race" in first.stdout
    for seq_len in (64, 96):  # a winner with its margin and interval, or a tie naming the tied
        said = re.findall(rf"^seq {seq_len}( after a second sitting)?: (.*)$", first.stdout, re.MULTILINE)
        assert said, first.stdout
        verdict = r"(.+, faster than .+ by [\d.]+% \(95% interval -?[\d.]+% to [\d.]+%\)" \
                  r"|.+ and .+ tied within the noise of this hardware \(.+\))"
        if said[0][1].endswith("; a second sitting after the other lengths confirms it"):
            assert len(said) == 2 and said[1][0], first.stdout  # the second sitting's verdict follows
            assert re.fullmatch(verdict, said[1][1]), said[1][1]
        else:
            assert len(said) == 1 and not said[0][0], first.stdout
        assert re.fullmatch(verdict + "(; a second sitting after the other lengths confirms it)?",
                            said[0][1]), said[0][1]
    visits = clean_visits(db)
    assert len(visits) == 8 and all(3 <= n <= 8 for n in visits.values()), visits  # 3 + 2 race + 3 confirm
    disturbed = sum(row[6] is not None for row in stored(db))
    summary = (rf"^8 configuration\(s\) measured now in {len(stored(db))} visit\(s\) \(0 failed, stored with "
               rf"their reason; {disturbed} disturbed")
    assert re.search(summary, first.stdout, re.MULTILINE), first.stdout
    again = cptune("search", "--db", db, *QUICK, "--no-calibrate", "--rounds", "3", "--race-rounds", "2")
    assert "0 configuration(s) measured now in 0 visit(s)" in again.stdout, again.stdout


@pytest.mark.parametrize("args, message", [
    (["search", "nosuchspace"], "no such file and no built-in space"),
    (["search", "demo", "--heads", "8"], "not both"),
    (["search", "--heads", "8", "--head-dim", "64"], "--seq-lens"),
    (["search", "--heads", "1", "--head-dim", "8", "--seq-lens", "64", "--ranks", "2",
      "--strategies", "ulysses"], "no feasible configuration"),
    (["search", "--heads", "8", "--kv-heads", "3", "--head-dim", "8", "--seq-lens", "64"], "kv_heads"),
    (["search", "--seq-lens", "64,x"], "--seq-lens"),
    (["search", "--rounds", "0"], "--rounds"),
    (["search", "--race-rounds", "-1"], "--race-rounds"),
])
def test_bad_search_input_exits_2_without_traceback(cptune_here, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    result = cptune_here(*args, "--db", tmp_path / "x.db")
    assert result.returncode == 2
    assert message in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "x.db").exists()  # refused before anything was opened


def test_bad_space_file_exits_2(cptune_here, tmp_path):
    space = tmp_path / "space.toml"
    space.write_text('name = "x"\n[model]\nhaeds = 8\nhead_dim = 64\n[sweep]\nseq_lens = [64]\n')
    result = cptune_here("search", space, "--db", tmp_path / "x.db")
    assert_refused(result, "space.toml", "haeds")


def test_corrupt_database_exits_2_and_is_kept(cptune_here, tmp_path):
    db = tmp_path / "broken.db"
    db.write_bytes(b"\x00garbage" * 512)
    before = db.read_bytes()
    assert_refused(cptune_here("results", "--db", db), "not a database")
    assert db.read_bytes() == before


def test_search_says_how_many_visits_were_disturbed_and_which_never_ran_clean(tmp_path, monkeypatch, capsys):
    """In process, with ``measure`` standing in: ring on 2 ranks is always disturbed."""
    import dataclasses

    from cptune import CPConfig
    from cptune.cli import main

    def measure(workload, config, **_):
        reason = "load 3.1 on 2 cores" if config == CPConfig("ring", 2) else None
        return dataclasses.replace(measurement(workload, config, 10.0 * config.ranks), disturbed=reason)

    stand_in_measuring(monkeypatch, measure)
    monkeypatch.setattr("cptune.search._workload.time.sleep", lambda seconds: None)
    code = main(["search", "--db", str(tmp_path / "d.db"), *QUICK[:4], "--seq-lens", "64", "--ranks", "1,2",
                 "--no-calibrate", "--rounds", "1", "--race-rounds", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert "seq 64: 4 visit(s) disturbed by other load: stored marked, not counted, visited again" in lines
    assert any(line.startswith("seq 64: Ring on 2 ranks left out of the verdict: it never ran clean in 4 "
                               "visit(s) (other load each time); searches do not run it again") and
               line.endswith("measure it alone with: cptune measure --seq-len 64 --heads 4 --head-dim 16 "
                             "--dtype bf16 --strategies ring --ranks 2 --head-group 1")
               for line in lines), out
    assert any(line.startswith("seq 64: local attention on 1 rank, faster than") for line in lines), out
    assert any(line.startswith("4 configuration(s) measured now in 7 visit(s) (0 failed, stored with their "
                               "reason; 4 disturbed") for line in lines), out


def test_narrow_winners_get_a_second_sitting_after_every_length_ran_once(tmp_path, monkeypatch, capsys):
    """In process, with ``measure`` standing in: local attention runs in 10 ms, every 2-rank
    configuration in 12 (a narrow winner at each length)."""
    from cptune.cli import main

    stand_in_measuring(monkeypatch, lambda workload, config, **_: measurement(
        workload, config, 10.0 if config.ranks == 1 else 12.0))
    code = main(["search", "--db", str(tmp_path / "c.db"), *QUICK, "--no-calibrate", "--rounds", "3",
                 "--race-rounds", "0", "--confirm-rounds", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    said = [line for line in out.splitlines() if re.match(r"seq \d+( after a second sitting)?: ", line)]
    assert [line.split(":")[0] for line in said] == [
        "seq 64", "seq 96", "seq 64 after a second sitting", "seq 96 after a second sitting"], out
    assert all(line.endswith("; a second sitting after the other lengths confirms it") for line in said[:2])
    assert all(", faster than" in line and "confirms it" not in line for line in said[2:])
    assert "in 3 round(s), up to 0 more in the final race, 2 in a second sitting for each winner" in out
    local = Counter(row[3] for row in stored(str(tmp_path / "c.db")) if row[1] == 1)
    assert local == {64: 3 + 2, 96: 3 + 2}  # per length: 3 visits, then 2 in the second sitting


@pytest.mark.parametrize("marked", [True, False])
def test_the_verdict_line_says_when_the_leader_ran_oversubscribed(tmp_path, marked):
    """As its row was stored: on a cluster a node's ranks decide, not this host's cores."""
    from cptune import CPConfig, Workload
    from cptune.cli._search import verdict_line
    from cptune.estimate import combine, judge

    workload = Workload(seq_len=64, heads=4, head_dim=16)
    with Store(str(tmp_path / "o.db")) as store:
        for config, ms in ((CPConfig("ring", 4), 5.0), (CPConfig("ring", 1), 20.0)):
            shared = marked and config.ranks > 2
            store.add_measurement(this_host(), dataclasses.replace(measurement(workload, config, ms),
                                                                   oversubscribed=shared))
        rows = store.results()
    verdict = judge(combine(rows).values())
    line = verdict_line(64, verdict, second=False, unconfirmed=False)
    assert line.startswith("seq 64: Ring on 4 ranks, faster than local attention on 1 rank by 300.0%")
    said = "; it ran more ranks than cores (--oversubscribe), so the model and the picks leave it out"
    assert line.endswith(said) == marked


def test_a_crashed_configuration_is_named_with_the_command_that_measures_it_and_retried_once(
        tmp_path, monkeypatch, capsys, cptune_here):
    """In process, with ``measure`` standing in: Ring on 2 ranks crashes in the first search
    only. The first search's output names it, says the next search retries it and gives the
    ``cptune measure`` command, which measures exactly that configuration; the second search
    runs it and leaves nothing out."""
    from cptune import CPConfig
    from cptune.errors import EngineError

    ring = CPConfig("ring", 2)
    ran, crashed = [], []

    def measure(workload, config, **_):
        ran.append(config)
        if config == ring and not crashed:
            crashed.append(config)
            raise EngineError("crash", "a rank crashed while running Ring on 2 ranks: rank 1 died.\ntail")
        return measurement(workload, config, 10.0 * config.ranks)

    stand_in_measuring(monkeypatch, measure)
    search = ["search", "--db", tmp_path / "r.db", *QUICK[:4], "--seq-lens", "64", "--ranks", "1,2",
              "--no-calibrate", "--rounds", "1", "--race-rounds", "0", "--confirm-rounds", "0"]
    first = cptune_here(*search)
    assert first.returncode == 0, first.stdout + first.stderr
    (line,) = [line for line in first.stdout.splitlines() if "left out of the verdict" in line]
    assert line.startswith("seq 64: Ring on 2 ranks left out of the verdict: its latest run failed (crash: a "
                           "rank crashed while running Ring on 2 ranks: rank 1 died); the next search of "
                           "this space runs it once more; measure it alone with: cptune measure "), line
    command = line.partition("measure it alone with: cptune ")[2].split()
    measured = []
    monkeypatch.setattr("cptune.execute.measure", lambda workload, config, **_: measured.append(
        (workload.seq_len, config)) or measurement(workload, config, 20.0))
    alone = cptune_here(*command)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert measured == [(64, ring)]  # that configuration alone
    ran.clear()
    second = cptune_here(*search)
    assert second.returncode == 0, second.stdout + second.stderr
    assert ring in ran and "left out" not in second.stdout


def test_a_search_that_stopped_waiting_for_quiet_says_what_measures_again(tmp_path, monkeypatch, capsys):
    """In process, with ``measure`` standing in and the guard on: the host stays busy through
    the wait, Ring on 2 ranks is disturbed in every visit. What the line says measures it again
    does; a plain rerun, which it does not promise anything of, measures nothing."""
    from cptune import CPConfig
    from cptune.cli import main

    ring = CPConfig("ring", 2)
    runs = []

    def measure(workload, config, **_):
        runs.append(config)
        busy = "other processes used 1.9 of 2 cores" if config == ring else None
        return dataclasses.replace(measurement(workload, config, 10.0 * config.ranks), disturbed=busy)

    stand_in_measuring(monkeypatch, measure)
    monkeypatch.setenv("CPTUNE_GUARD", "on")
    monkeypatch.setattr("cptune.search._workload.wait_for_quiet", lambda *args, **kwargs: "1.9 of 2 cores")
    monkeypatch.setattr("cptune.search._workload.time.sleep", lambda seconds: None)
    search = ["search", "--db", str(tmp_path / "d.db"), *QUICK[:4], "--seq-lens", "64", "--ranks", "1,2",
              "--strategies", "ring", "--no-calibrate", "--rounds", "1", "--race-rounds", "1"]
    assert main(search) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "stopped waiting for quiet" in line]
    assert "a rerun with --remeasure" in line, line
    assert ring in runs
    for rerun, measures_ring in ((search, False), ([*search, "--remeasure"], True)):
        runs.clear()
        assert main(rerun) == 0
        assert (ring in runs) == measures_ring, (rerun, runs)
