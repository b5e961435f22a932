"""Bad input and awkward surroundings, as a user meets them on the command line: one line on
stderr, exit 2, no traceback, stored data intact; normal output on stdout, as text."""

import dataclasses
import json
import os
import signal
import sqlite3
import subprocess

import pytest

from conftest import CLI, assert_refused, cptune, make_calibration, measurement
from cptune.config import CPConfig
from cptune.cost import analytic_cost
from cptune.hardware import builtin_descriptions, this_host
from cptune.measurement import available_cores, host_memory_bytes
from cptune.store import VERSION_TABLE, Store
from cptune.workload import Workload

SMALL = Workload(seq_len=64, heads=4, head_dim=16)


def rows(db):
    """Every measurement row as SQLite sees it (id, ranks, median_ms, oversubscribed, excluded)."""
    with sqlite3.connect(db) as connection:
        return connection.execute(
            "SELECT id, ranks, median_ms, oversubscribed, excluded FROM measurements ORDER BY id").fetchall()


def dump(db):
    """The whole database as SQL (what it holds, whatever the WAL has checkpointed)."""
    with sqlite3.connect(db) as connection:
        return list(connection.iterdump())


@pytest.fixture
def db(tmp_path):
    """This host calibrated on 2 ranks, and three made-up measurements of SMALL (ids 1-3)."""
    path = tmp_path / "c.db"
    with Store(str(path)) as store:
        store.add_calibration(this_host(), make_calibration(2))
        for strategy, ranks, ms in (("ring", 1, 3.0), ("ring", 2, 2.0), ("ulysses", 2, 4.0)):
            store.add_measurement(this_host(), measurement(SMALL, CPConfig(strategy, ranks), ms))
    return path


# --------------------------------------------------------------------------- flags (item 12)


@pytest.mark.parametrize("args, prefix, fragment", [
    (["search", "--seq-lens", "64,x"], "cptune search: error: ", "argument --seq-lens"),
    (["recommend", "--heads", "8"], "cptune recommend: error: ", "--head-dim"),
    (["results", "--frobnicate"], "cptune results: error: ", "unrecognized arguments: --frobnicate"),
    # counts say their range: from 0 where 0 is allowed, from 1 where it is not
    (["search", "--race-rounds", "-1"], "cptune search: error: ",
     "--race-rounds: must be a whole number from 0 to 1,000, got -1"),
    (["search", "--confirm-rounds", "-2"], "cptune search: error: ",
     "--confirm-rounds: must be a whole number from 0 to 1,000, got -2"),
    (["measure", "--warmup", "-2"], "cptune measure: error: ",
     "--warmup: must be a whole number from 0 to 1,000, got -2"),
    (["search", "--rounds", "0"], "cptune search: error: ",
     "--rounds: must be a whole number from 1 to 1,000, got 0"),
    ([], "cptune: error: ", "command"),
])
def test_a_flag_error_is_one_line_with_where_to_get_help(cptune_here, args, prefix, fragment):
    result = cptune_here(*args)
    assert_refused(result, fragment, prefix=prefix)
    assert result.stderr.rstrip().endswith("--help)")
    assert "usage:" not in result.stderr


# --------------------------------------------------------------- streams and text (items 9, 10, 11)


@pytest.mark.parametrize("command", ["results", "fit", "report", "export", "recommend"])
def test_reading_a_database_that_does_not_exist_refuses_and_creates_nothing(cptune_here, tmp_path,
                                                                            monkeypatch, command):
    shape = {"recommend": ["--heads", "4", "--head-dim", "16", "--seq-len", "64"],
             "export": ["--heads", "4", "--head-dim", "16", "--seq-lens", "64"]}.get(command, [])
    monkeypatch.chdir(tmp_path)
    result = cptune_here(command, *shape, "--db", tmp_path / "typo.db")
    assert_refused(result, f"no database at {tmp_path / 'typo.db'}")
    assert list(tmp_path.iterdir()) == []


def test_recommend_for_a_description_needs_no_database_and_creates_none(cptune_here, tmp_path, monkeypatch):
    monkeypatch.delenv("CPTUNE_DB", raising=False)  # the default database: ./cptune.db
    monkeypatch.chdir(tmp_path)
    result = cptune_here("recommend", "--hardware", "h100-sxm-8", "--heads", "24", "--head-dim", "128",
                         "--seq-len", "16896", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["source"] == "prior"
    assert list(tmp_path.iterdir()) == []


def test_messages_are_text_not_markup(cptune_here, tmp_path):
    space = tmp_path / "space.toml"
    space.write_text('name = "x"\n[model]\nhaeds = 8\nhead_dim = 64\n[sweep]\nseq_lens = [64]\n')
    assert_refused(cptune_here("search", space, "--db", tmp_path / "x.db"), "allowed in [model]: heads")
    assert not (tmp_path / "x.db").exists()


def test_a_description_name_in_brackets_is_shown_as_written(cptune_here, tmp_path, db):
    description = tmp_path / "box.toml"
    shipped = builtin_descriptions()["h100-sxm-8"].read_text()
    description.write_text(shipped.replace('name = "', 'name = "[bold]lab[/bold] ', 1))
    result = cptune_here("recommend", "--hardware", description, "--heads", "8", "--head-dim", "64",
                         "--seq-len", "4096", "--db", db)
    assert result.returncode == 0, result.stderr
    assert "[bold]lab[/bold]" in result.stdout


# --------------------------------------------------------------------------- oversubscription (item 2)


@pytest.mark.parametrize("how", ["flags", "space", "max-ranks", "calibrate"])
def test_more_ranks_than_cores_are_refused_without_the_flag(cptune_here, tmp_path, how):
    too_many = available_cores() + 1
    space = tmp_path / "space.toml"
    space.write_text(f'name = "big"\n[model]\nheads = 1\nhead_dim = 16\n[sweep]\nseq_lens = [64]\n'
                     f'ranks = [1, {too_many}]\n')
    flags = ["--heads", "1", "--head-dim", "16", "--seq-lens", "64", "--ranks", f"1,{too_many}"]
    args = {"flags": ["search", *flags],
            "space": ["search", space],
            "max-ranks": ["search", "--max-ranks", too_many],
            "calibrate": ["calibrate", "--max-ranks", too_many]}[how]
    result = cptune_here(*args, "--db", tmp_path / "o.db")
    assert_refused(result, f"more ranks than this host's {available_cores()} core", "--oversubscribe")
    assert not (tmp_path / "o.db").exists()


@pytest.mark.slow
def test_an_oversubscribed_search_is_stored_marked_and_left_out_of_the_picks(db):
    too_many = available_cores() + 1
    result = cptune("search", "--heads", "1", "--head-dim", "16", "--seq-lens", "64", "--ranks", too_many,
                    "--strategies", "ring", "--oversubscribe", "--db", db)
    assert result.returncode == 0, result.stdout + result.stderr
    new = rows(db)[3:]
    assert len(new) >= 2  # the search's two rounds (and any visit the guard found disturbed)
    assert all(row[1] == too_many and row[2] > 0 and row[3] == 1 for row in new)  # marked oversubscribed
    listed = cptune("results", "--db", db)
    assert "ok, oversub." in listed.stdout
    assert json.loads(cptune("results", "--db", db, "--json").stdout)[3]["oversubscribed"] is True


def test_oversubscribed_and_excluded_rows_answer_for_nothing(cptune_here, tmp_path):
    path = tmp_path / "m.db"
    with Store(str(path)) as store:
        store.add_calibration(this_host(), make_calibration(2))
        kept = store.add_measurement(this_host(), measurement(SMALL, CPConfig("ring", 1), 3.0))
        fastest = measurement(SMALL, CPConfig("ring", 2), 0.5)
        store.add_measurement(this_host(), dataclasses.replace(fastest, oversubscribed=True))
        excluded = store.add_measurement(this_host(), measurement(SMALL, CPConfig("ulysses", 2), 0.1))
        store.set_excluded([excluded])
    picked = json.loads(cptune_here("recommend", "--heads", "4", "--head-dim", "16", "--seq-len", "64",
                                    "--json", "--db", path).stdout)
    measured = {(c["strategy"], c["ranks"]): c["measurement_id"] for c in picked["candidates"]
                if c["source"] == "measured"}
    assert measured == {("ring", 1): kept}


# --------------------------------------------------------------------------- exclude / delete (item 3)


def test_results_exclude_include_and_delete(cptune_here, db):
    before = rows(db)
    excluded = cptune_here("results", "--exclude", "2,3", "--db", db)
    assert excluded.returncode == 0, excluded.stderr
    assert excluded.stdout.startswith("excluded 2 measurement(s): 2, 3\n")
    assert "--include 2,3" in excluded.stdout
    assert [r[4] for r in rows(db)] == [0, 1, 1]
    listed = cptune_here("results", "--db", db).stdout
    assert listed.count("ok, excluded") == 2

    included = cptune_here("results", "--include", "3", "--db", db)
    assert included.stdout.startswith("included again 1 measurement(s): 3\n")
    assert [r[4] for r in rows(db)] == [0, 1, 0]

    deleted = cptune_here("results", "--delete", "1", "--db", db)
    assert deleted.returncode == 0, deleted.stderr
    assert "deleted 1 measurement(s)" in deleted.stdout and "1: local attention on 1 rank" in deleted.stdout
    assert [r[0] for r in rows(db)] == [2, 3]
    assert [r[:3] for r in rows(db)] == [r[:3] for r in before[1:]]


@pytest.mark.parametrize("change", ["--exclude", "--include", "--delete"])
def test_unknown_ids_are_refused_and_nothing_changes(cptune_here, db, change):
    before = rows(db)
    assert_refused(cptune_here("results", change, "2,7,9", "--db", db), "no measurement with id 7, 9")
    assert rows(db) == before


# --------------------------------------------------------------------------- tracebacks (item 8)


def test_an_absurd_length_is_one_line(cptune_here, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cptune_here("recommend", "--hardware", "h100-sxm-8", "--heads", "24", "--head-dim", "128",
                         "--seq-len", "10000000000")
    assert_refused(result, "no configuration can run seq 10000000000", "per rank, over the limit of 80.0 GiB")


def test_a_database_of_a_newer_cptune_is_refused_untouched(cptune_here, db):
    with sqlite3.connect(db) as connection:
        connection.execute(f"UPDATE {VERSION_TABLE} SET version_num = '0099'")
    before = dump(db)
    search = ["search", "--heads", "4", "--head-dim", "16", "--seq-lens", "64", "--ranks", "1"]
    for args in (["results"], search):
        assert_refused(cptune_here(*args, "--db", db), "by a newer cptune", "'0099'", "Nothing was changed")
    assert dump(db) == before


@pytest.mark.parametrize("args", [
    ["search", "--heads", "4", "--head-dim", "16", "--seq-lens", "128", "--ranks", "1"],
    ["calibrate", "--max-ranks", "1"],
    ["results", "--exclude", "1"],
])
def test_a_read_only_database_is_refused_before_measuring(cptune_here, db, args):
    before = rows(db)
    read_only = f"sqlite:///file:{db}?mode=ro&uri=true"
    assert_refused(cptune_here(*args, "--db", read_only), "cannot write to database", "readonly")
    assert rows(db) == before


@pytest.mark.slow  # a subprocess: its reader must really close the pipe
def test_a_reader_that_leaves_early_ends_the_listing_quietly(tmp_path):
    path = tmp_path / "big.db"
    with Store(str(path)) as store:
        store.add_failure(this_host(), SMALL, CPConfig("ring", 1), "crash", "x" * 40, "mpi")
    with sqlite3.connect(path) as connection:  # 2,048 copies of it: about twice what a pipe buffers
        columns = ", ".join(c[1] for c in connection.execute("PRAGMA table_info(measurements)")
                            if c[1] != "id")
        for _ in range(11):
            connection.execute(f"INSERT INTO measurements ({columns}) SELECT {columns} FROM measurements")
    connection.close()
    for fmt in ("--csv", "--json", None):
        listing = subprocess.Popen([*CLI, "results", *([fmt] if fmt else []), "--db", str(path)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert listing.stdout.readline()  # like head -1
        listing.stdout.close()
        error = listing.stderr.read().decode()
        assert listing.wait(timeout=120) == 0, error
        assert error == ""


@pytest.mark.slow  # a subprocess: its reader must really close the pipe
def test_a_table_into_a_pipe_already_closed_ends_quietly_with_exit_0():
    for command in (["hardware"], ["hardware", "--json"]):
        listing = subprocess.Popen([*CLI, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        listing.stdout.close()  # the reader left before the first line (rich's own way out is exit 1)
        error = listing.stderr.read().decode()
        assert listing.wait(timeout=120) == 0, error
        assert error == ""


# --------------------------------------------------------------------------- host memory (item 4)


def test_this_hosts_memory_is_shared_by_its_ranks(cptune_here, db):
    # long enough that one rank's activations alone exceed half of this host's memory
    workload = Workload(seq_len=1024, heads=4, head_dim=16)
    while analytic_cost(workload, CPConfig("ring", 2)).peak_bytes * 2 <= host_memory_bytes():
        workload = dataclasses.replace(workload, seq_len=workload.seq_len * 2)
    result = cptune_here("recommend", "--heads", "4", "--head-dim", "16", "--seq-len", workload.seq_len,
                         "--json", "--db", db)
    if result.returncode == 0:
        picked = json.loads(result.stdout)
        for c in picked["candidates"]:
            config = CPConfig(c["strategy"], c["ranks"], c["head_group"])
            assert analytic_cost(workload, config).peak_bytes * config.ranks <= host_memory_bytes()
        reasons = [r for item in picked["infeasible"] for r in item["reasons"]]
    else:
        assert_refused(result, "no configuration can run")
        reasons = [result.stderr]
    assert any("over the limit of" in reason for reason in reasons)


def test_ctrl_c_that_python_drops_in_a_finalizer_still_interrupts(tmp_path, monkeypatch, capsys):
    """Python drops a KeyboardInterrupt raised while a ``__del__`` runs and goes on: the press
    must still end the command as interrupted, with one line and no traceback."""
    from cptune import cli

    class ConnectionBeingClosed:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C lands while the finalizer runs

    def command_that_finishes(args, console):
        ConnectionBeingClosed()
        return 0

    monkeypatch.setitem(cli.COMMANDS, "results", command_that_finishes)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts us
    try:
        code = cli.main(["results", "--db", str(tmp_path / "x.db")])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert code == 130
    assert err.splitlines() == ["interrupted: nothing was changed"]  # results only reads


@pytest.mark.parametrize(("command", "said"), [
    ("search", "every finished measurement is stored; rerun to resume"),
    ("calibrate", "no calibration is stored (one is kept only whole); run it again"),
    ("export", "no plan is written (a plan is written whole or not at all); run it again"),
    ("results", "nothing was changed"),
])
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stopped_command_says_in_one_line_what_it_kept(monkeypatch, capsys, command, said, how):
    from cptune import cli

    def stopped(args, console):
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # as a batch system's kill: the handler main installed
        raise AssertionError("SIGTERM should have ended the command")

    monkeypatch.setitem(cli.COMMANDS, command, stopped)
    code = cli.main([command])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back
    lines = capsys.readouterr().err.splitlines()
    if how == "ctrl-c":
        assert (code, lines) == (130, [f"interrupted: {said}"])
    else:
        assert (code, lines) == (128 + signal.SIGTERM, [f"stopped by SIGTERM: {said}"])


@pytest.mark.parametrize(("args", "said"), [
    (["measure", "--repeats", "100000000"], "--repeats: must be a whole number from 1 to 10,000"),
    (["calibrate", "--rounds", "5000"], "--rounds: must be a whole number from 1 to 1,000"),
    (["search", "--race-rounds", "99999"], "--race-rounds: must be a whole number from 0 to 1,000"),
    (["search", "--heads", "4", "--head-dim", "16",
      "--seq-lens", ",".join(str(64 * i) for i in range(1, 10_001))],
     "10,000 lengths, more than the 256 one command sweeps"),
])
def test_counts_past_what_a_search_can_use_are_refused_before_anything_runs(cptune_here, args, said):
    assert_refused(cptune_here(*args), said, prefix=f"cptune {args[0]}: error: argument")
