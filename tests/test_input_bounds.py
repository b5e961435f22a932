"""Counts and figures read from what a user gives (issue 54): a plan, ``--hosts`` and hostfiles,
rank flags, search spaces, hardware descriptions, database URLs. Each is bounded where it is read,
before anything is enumerated or started: one line on stderr, exit 2, every named file byte for
byte as it was - never a traceback, a hang or memory that grows."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import pytest

from conftest import add_measurements, assert_refused, measurement
from cptune.config import CPConfig
from cptune.hardware import builtin_descriptions
from cptune.measurement import available_cores
from cptune.plans._plan import digest
from cptune.space import builtin_spaces
from cptune.workload import Workload

SMALL = Workload(seq_len=64, heads=4, head_dim=16)
DESCRIBED = ["--hardware", "h100-sxm-8", "--heads", "24", "--head-dim", "128", "--seq-lens", "16896"]


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_plan_of_more_ranks_than_any_machine_is_one_line_for_export_for(cptune_here, tmp_path):
    plan = tmp_path / "p.json"
    assert cptune_here("export", *DESCRIBED, "-o", plan).returncode == 0
    data = json.loads(plan.read_text())
    data["buckets"][0]["config"]["ranks"] = 10**30
    data["digest"] = digest(data)
    plan.write_text(json.dumps(data, indent=2))
    before = sha256(plan)
    result = cptune_here("export", "--for", "diffusers", "--plan", plan)
    assert_refused(result, str(plan), "buckets[0].config.ranks", "greater than the maximum of 1000000")
    assert sha256(plan) == before


# --------------------------------------------------------------------------- a SQLite URL's query


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "db.db"
    add_measurements(str(path), measurement(SMALL, CPConfig("ring", 1), 3.0),
                     measurement(SMALL, CPConfig("ring", 2), 2.0))
    return path


@pytest.mark.parametrize("query", ["mode=ro", "immutable=1", "mode=ro&uri=true"])
def test_a_read_only_url_is_never_written(cptune_here, db, monkeypatch, query):
    monkeypatch.chdir(db.parent)
    before = sha256(db)
    url = f"sqlite:///db.db?{query}"
    assert_refused(cptune_here("results", "--db", url, "--exclude", "1"), "cannot write to database",
                   f"open it without {query.partition('&')[0]} in the URL")
    assert sha256(db) == before
    shown = cptune_here("results", "--db", url, "--json")
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr  # read as it is, no warning
    assert [row["id"] for row in json.loads(shown.stdout)] == [1, 2]
    assert sha256(db) == before


def test_a_query_argument_sqlite_does_not_take_is_refused(cptune_here, db, monkeypatch):
    monkeypatch.chdir(db.parent)
    before = sha256(db)
    assert_refused(cptune_here("results", "--db", "sqlite:///db.db?mode=ro&foo=1", "--exclude", "1"),
                   "SQLite takes no query argument foo", "remove it from the URL")
    assert sha256(db) == before


@pytest.mark.parametrize("command", [["results"], ["results", "--exclude", "1"]])
def test_every_query_argument_reaches_sqlite_readers_and_writers_alike(cptune_here, db, monkeypatch, command):
    """A VFS that does not exist: SQLite itself refuses it, so it was not dropped on the way."""
    monkeypatch.chdir(db.parent)
    before = sha256(db)
    assert_refused(cptune_here(*command, "--db", "sqlite:///db.db?vfs=no-such-vfs"), "no such vfs")
    assert sha256(db) == before


# --------------------------------------------------------------------------- rank counts


HUGE = "1000000000000"  # 10^12: once enumerated 1..10^12, memory grew by the GB


@pytest.mark.parametrize("hosts, reason", [
    ("127.0.0.1:99999999999999999999,localhost:99999999999999999999", "more than any node runs"),
    ("127.0.0.1:100000000000000000000,localhost:100000000000000000000", "more than any node runs"),
    ("a:5000,b:5000", "5,000 ranks on each node, more than any node runs: give at most 4,096"),
    ("a:\N{SUPERSCRIPT TWO}", "is not host or host:ranks"),
])
@pytest.mark.parametrize("command", ["measure", "search"])
def test_hosts_counts_are_bounded_where_they_are_read(cptune_here, tmp_path, hosts, reason, command):
    db = tmp_path / "o.db"
    result = cptune_here(command, "--hosts", hosts, *(["--db", db] if command == "search" else []))
    assert_refused(result, reason)
    assert not db.exists()


def test_a_hostfile_is_bounded_and_read_only_if_it_is_a_regular_file(cptune_here, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a:99999999999999999999\nb:99999999999999999999\n")
    result = cptune_here("measure", "--hostfile", hostfile)
    assert_refused(result, f"{hostfile}:1: 99999999999999999999 ranks")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # an open for reading would wait for a writer forever
    assert_refused(cptune_here("measure", "--hostfile", fifo), "is a FIFO (named pipe), not a regular file")


@pytest.mark.parametrize("args, reason", [
    (["measure", "--max-ranks", HUGE], f"--max-ranks {HUGE}: more ranks than this host's"),
    (["measure", "--max-ranks", HUGE, "--oversubscribe"],
     "1,000,000,000,000 ranks on one host, more than any node runs, --oversubscribe or not: use at most "
     "4,096"),
    (["measure", "--ranks", f"2,{HUGE}", "--oversubscribe"], "more than any node runs"),
    (["search", "--heads", "4", "--head-dim", "16", "--seq-lens", "64", "--ranks", HUGE, "--oversubscribe"],
     "more than any node runs"),
    (["search", "--max-ranks", HUGE], f"--max-ranks {HUGE}: more ranks than this host's"),
    (["search", "--max-ranks", HUGE, "--oversubscribe"], "more than any node runs"),
    (["calibrate", "--max-ranks", HUGE, "--oversubscribe"], "more than any node runs"),
])
def test_rank_counts_are_bounded_before_anything_is_enumerated(cptune_here, tmp_path, args, reason):
    db = tmp_path / "o.db"
    result = cptune_here(*args, *(["--db", db] if args[0] != "measure" else []))
    assert_refused(result, reason)
    assert not db.exists()


def test_search_refuses_a_rank_count_before_importing_the_search(tmp_path):
    """The search package pulls in Optuna and the model (seconds): a count no host runs is
    refused before it is imported."""
    argv = ["search", "--heads", "4", "--head-dim", "16", "--seq-lens", "64", "--ranks", HUGE,
            "--oversubscribe", "--db", str(tmp_path / "o.db")]
    probe = ("import sys\nfrom cptune.cli import main\n"
             f"code = main({argv!r})\n"
             "print(code, 'cptune.search' in sys.modules, 'optuna' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False", "False"], done.stdout + done.stderr
    assert "more than any node runs" in done.stderr
    assert not (tmp_path / "o.db").exists()


def test_a_space_of_more_ranks_than_any_machine_is_refused_where_it_is_read(cptune_here, tmp_path):
    space = tmp_path / "big.toml"
    space.write_text(f'name = "big"\n[model]\nheads = 4\nhead_dim = 16\n[sweep]\nseq_lens = [64]\n'
                     f"ranks = [1, {HUGE}]\n")
    result = cptune_here("search", space, "--oversubscribe", "--db", tmp_path / "o.db")
    assert_refused(result, f"{space}: sweep.ranks[1]: out of range", "at most 1,000,000")


# --------------------------------------------------------------------------- measure and oversubscription


def test_measure_refuses_more_ranks_than_cores_as_search_does(cptune_here, monkeypatch):
    ran = []
    monkeypatch.setattr("cptune.execute.measure", lambda workload, config, **_: ran.append(config))
    for args in (["--max-ranks", str(available_cores() + 1)], ["--ranks", str(available_cores() + 1)]):
        result = cptune_here("measure", "--seq-len", "64", "--heads", "4", "--head-dim", "16", *args)
        assert_refused(result, f"more ranks than this host's {available_cores()} core", "--oversubscribe")
    assert ran == []


def test_measure_oversubscribed_marks_what_it_ran(cptune_here, monkeypatch):
    too_many = available_cores() + 1
    monkeypatch.setattr("cptune.execute.measure", lambda workload, config, **_: dataclasses.replace(
        measurement(workload, config, 2.0), oversubscribed=config.ranks > available_cores()))
    flags = ["measure", "--seq-len", "64", "--heads", "4", "--head-dim", "16", "--strategies", "ring",
             "--ranks", f"1,{too_many}", "--head-group", "1", "--oversubscribe"]
    shown = cptune_here(*flags)
    assert shown.returncode == 0, shown.stderr
    assert f"{too_many} oversub." in shown.stdout and "1 oversub." not in shown.stdout
    rows = json.loads(cptune_here(*flags, "--json").stdout)["results"]
    assert {r["config"]["ranks"]: r["oversubscribed"] for r in rows} == {1: False, too_many: True}


# --------------------------------------------------------------------------- hardware figures, TOML files


RECOMMEND = ["recommend", "--heads", "24", "--head-dim", "128", "--seq-len", "16896"]


def shipped_h100(tmp_path, old=None, new=None):
    text = builtin_descriptions()["h100-sxm-8"].read_text()
    if old is not None:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / "h100.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("old, new, key", [
    ("bandwidth_gbps = { value = 360, low = 290, high = 370 }", "bandwidth_gbps = 1e-300",
     "links.node.bandwidth_gbps"),
    ("memory_gib = 80", "memory_gib = 1e-300", "device.memory_gib"),
    ("latency_us = { value = 12.5", "latency_us = { value = 1e300", "links.node.latency_us.value"),
])
def test_a_figure_beyond_any_hardware_is_refused_where_it_is_read(cptune_here, tmp_path, old, new, key):
    described = shipped_h100(tmp_path, old, new)
    before = sha256(described)
    assert_refused(cptune_here(*RECOMMEND, "--hardware", described), f"{described}: {key}: out of range")
    assert sha256(described) == before


def test_a_figure_given_beyond_any_hardware_is_refused(cptune_here):
    result = cptune_here(*RECOMMEND, "--hardware", "h100-sxm-8", "--figure",
                         "links.node.bandwidth_gbps.default=1e-300")
    assert_refused(result, "links.node.bandwidth_gbps.default: out of range: expected 0.001 to 1e+06 GB/s")


def test_toml_files_may_begin_with_a_byte_order_mark(cptune_here, tmp_path):
    described = shipped_h100(tmp_path)
    described.write_bytes(b"\xef\xbb\xbf" + described.read_bytes())
    space = tmp_path / "space.toml"
    space.write_bytes(b"\xef\xbb\xbf" + builtin_spaces()["demo"].read_bytes())
    done = cptune_here("export", space, "--hardware", described, "-o", tmp_path / "plan.json")
    assert done.returncode == 0, done.stderr
