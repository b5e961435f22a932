"""The host lock: one measuring process per host, a second one waiting and saying who holds it."""

import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import CLI, assert_refused, cptune
from cptune import hostlock
from cptune._waiting import WaitLine
from cptune.hostlock import LOCK_ENV, lock_path, measuring, read_holder
from suite_cli import IGNORE_LOAD

#: Searches taking turns on one host, one of them judging the load as a user's does: alone.
pytestmark = pytest.mark.serial

#: A process holding the lock through the library until a line arrives on its stdin.
HOLDER = ("import sys\nfrom cptune.hostlock import measuring\nwith measuring():\n"
          "    print('held', flush=True)\n    sys.stdin.readline()\n")
TINY_MEASURE = ["measure", "--seq-len", "64", "--heads", "4", "--head-dim", "16", "--max-ranks", "1",
                "--warmup", "0", "--repeats", "1"]
#: Two ranks at most, one visit each: the smallest search that stores rows of several configurations.
TINY_SEARCH = ["--heads", "4", "--head-dim", "16", "--ranks", "1,2", "--no-calibrate", "--rounds", "1",
               "--race-rounds", "0", "--confirm-rounds", "0"]


@pytest.fixture
def lock_file(tmp_path, monkeypatch):
    """A lock file of this test's own (inherited by the processes it starts)."""
    path = tmp_path / "host.lock"
    monkeypatch.setenv(LOCK_ENV, str(path))
    return path


class Said(WaitLine):
    """A wait line that keeps what it was told."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.ended = 0

    def show(self, text: str) -> None:
        self.lines.append(text)

    def end(self) -> None:
        self.ended += 1


def start_holder() -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-P", "-c", HOLDER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def release(holder: subprocess.Popen) -> None:
    holder.stdin.write("\n")
    holder.stdin.flush()
    holder.wait(timeout=30)


def test_the_lock_file_is_the_environment_s_or_one_per_user_in_one_place_whatever_tmpdir_says(
        monkeypatch, tmp_path):
    """Two processes started with different TMPDIRs (a job's own, a user's) still take turns: the
    default file does not move with the temporary directory."""
    monkeypatch.delenv(LOCK_ENV, raising=False)
    default = Path("/tmp") / f"cptune-{os.getuid()}.lock"
    for tmpdir in (None, str(tmp_path)):
        if tmpdir is None:
            monkeypatch.delenv("TMPDIR", raising=False)
        else:
            monkeypatch.setenv("TMPDIR", tmpdir)
        monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir reads TMPDIR again
        assert lock_path() == default
    monkeypatch.setenv(LOCK_ENV, str(tmp_path / "x.lock"))
    assert lock_path() == tmp_path / "x.lock"


def test_the_holder_writes_who_it_is_and_nested_holds_take_the_lock_once(lock_file):
    with measuring():
        holder = read_holder(lock_file)
        assert holder is not None and holder.pid == os.getpid()
        with measuring():  # re-entered (a search that calibrates first): no deadlock
            assert hostlock._LOCK.depth == 2
        assert read_holder(lock_file) == holder  # still held by the outer one
    assert hostlock._LOCK.depth == 0 and hostlock._LOCK.fd is None  # released
    assert read_holder(lock_file) == holder  # the record stays: the file is never emptied
    with measuring():  # and it is taken again
        assert read_holder(lock_file).pid == os.getpid()


def test_a_lazy_hold_takes_the_lock_only_when_a_hold_inside_it_measures(lock_file):
    with measuring(lazy=True):  # a search with every result stored: no lock, so no wait
        assert hostlock._LOCK.fd is None and lock_file.read_bytes() == b""  # checked usable, not taken
        with measuring():  # the first run takes it ...
            assert read_holder(lock_file).pid == os.getpid()
        assert hostlock._LOCK.fd is not None  # ... and the search keeps it to its end
    assert hostlock._LOCK.fd is None and hostlock._LOCK.depth == 0


@pytest.mark.parametrize("lazy", [False, True])
def test_a_lock_that_names_another_file_refuses_and_leaves_it_as_it_is(lock_file, monkeypatch, lazy):
    database = lock_file.parent / "my.db"
    sqlite3.connect(database).executescript("create table rows (x); insert into rows values (1);")
    before = database.read_bytes()
    monkeypatch.setenv(LOCK_ENV, str(database))
    # lazy too: refused before a search writes anything, not at its first run
    with pytest.raises(hostlock.HostLockError, match="not cptune's host lock file"), measuring(lazy=lazy):
        pass
    assert database.read_bytes() == before and hostlock._LOCK.fd is None


@pytest.mark.parametrize("kind", ["device", "fifo", "folder"])
def test_a_lock_that_names_a_device_a_fifo_or_a_folder_is_refused_at_once(lock_file, monkeypatch, kind):
    path = {"device": lambda: "/dev/null", "fifo": lambda: _fifo(lock_file.parent / "fifo"),
            "folder": lambda: str(lock_file.parent)}[kind]()
    mode = os.stat(path).st_mode
    monkeypatch.setenv(LOCK_ENV, path)
    with pytest.raises(hostlock.HostLockError, match="host lock"), measuring():
        pass
    assert os.stat(path).st_mode == mode  # still what it was: nothing replaced or written


def test_the_cli_refuses_a_lock_naming_its_own_database_in_one_line(cptune_here, monkeypatch, tmp_path):
    database = tmp_path / "my.db"
    sqlite3.connect(database).executescript("create table rows (x); insert into rows values (1);")
    before = database.read_bytes()
    monkeypatch.setenv(LOCK_ENV, str(database))
    assert_refused(cptune_here(*TINY_MEASURE), "not cptune's host lock file", LOCK_ENV)
    assert database.read_bytes() == before


def test_a_search_whose_lock_names_its_own_database_writes_nothing_to_it(cptune_here, monkeypatch, tmp_path):
    from cptune.store import Store

    database = tmp_path / "my.db"
    with Store(str(database)):  # a cptune database, as a search leaves it
        pass
    before = database.read_bytes()
    monkeypatch.setenv(LOCK_ENV, str(database))
    assert_refused(cptune_here("search", "--db", database, "--seq-lens", "64", *TINY_SEARCH),
                   "not cptune's host lock file")
    assert database.read_bytes() == before  # not even the search's study was written


def _fifo(path) -> str:
    os.mkfifo(path)
    return str(path)


def test_a_lock_file_that_cannot_be_opened_is_one_line_exit_2(cptune_here, monkeypatch, tmp_path):
    monkeypatch.setenv(LOCK_ENV, str(tmp_path / "no such folder" / "host.lock"))
    assert_refused(cptune_here(*TINY_MEASURE), "cannot open the host lock", LOCK_ENV)


@pytest.mark.slow
def test_a_second_process_waits_saying_who_holds_the_lock_then_proceeds(lock_file):
    holder = start_holder()
    said, slept = Said(), []

    def sleep(seconds: float) -> None:  # the first wait lets the holder go
        slept.append(seconds)
        if len(slept) == 1:
            release(holder)

    try:
        with measuring(sleep=sleep, line=said):
            assert read_holder(lock_file).pid == os.getpid()
    finally:
        holder.kill()
    assert slept == [hostlock.POLL_S]
    assert len(said.lines) == 1 and said.ended == 1
    assert f"pid {holder.pid}, python -c ..., since " in said.lines[0]
    assert said.lines[0].startswith("waiting for the other cptune measuring on this host to finish")


@pytest.mark.slow
def test_a_killed_holder_blocks_nobody(lock_file):
    holder = start_holder()
    holder.kill()
    holder.wait(timeout=30)
    said = Said()
    with measuring(line=said):
        pass
    assert said.lines == []


@pytest.mark.slow
def test_cli_measure_waits_for_the_holder_on_stderr_then_measures(lock_file):
    holder = start_holder()
    try:
        waiting = subprocess.Popen([*CLI, *TINY_MEASURE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        first = waiting.stderr.readline()  # not a terminal: the wait's line at once, whole
        release(holder)
        out, err = waiting.communicate(timeout=300)
    finally:
        holder.kill()
    assert first.startswith("waiting for the other cptune measuring on this host to finish (pid "
                            f"{holder.pid}, python -c ..., since ")
    assert waiting.returncode == 0, err
    assert "local attention" in out or "ring" in out


@pytest.mark.slow
def test_a_stored_search_never_waits_and_ctrl_c_while_waiting_loses_nothing(lock_file, tmp_path):
    db = tmp_path / "kept.db"
    first = cptune("search", "--db", db, "--seq-lens", "64", *TINY_SEARCH)
    assert first.returncode == 0, first.stderr
    kept = sqlite3.connect(db).execute("SELECT count(*) FROM measurements").fetchone()[0]
    holder = start_holder()
    try:
        stored = cptune("search", "--db", db, "--seq-lens", "64", *TINY_SEARCH, timeout=120)
        assert stored.returncode == 0 and "waiting" not in stored.stderr  # all stored: nothing to wait for
        waiting = subprocess.Popen([*CLI, "search", "--db", str(db), "--seq-lens", "96", *TINY_SEARCH],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert waiting.stderr.readline().startswith("waiting for the other cptune measuring")
        waiting.send_signal(signal.SIGINT)
        _, err = waiting.communicate(timeout=60)
    finally:
        holder.kill()
    assert waiting.returncode == 130
    assert err.splitlines() == ["interrupted: every finished measurement is stored; rerun to resume"]
    assert sqlite3.connect(db).execute("SELECT count(*) FROM measurements").fetchone()[0] == kept


@pytest.mark.slow
def test_two_searches_on_one_host_take_turns_and_keep_every_row(lock_file, tmp_path, monkeypatch):
    """The acceptance test: a second search started while one runs waits for it, then
    completes; every row of both is kept, and none was measured beside the other."""
    monkeypatch.setenv("CPTUNE_GUARD", "on")
    monkeypatch.delenv(IGNORE_LOAD)  # the load judged as a user's search judges it
    monkeypatch.setenv("CPTUNE_GUARD_PATIENCE", "10")  # other tests' load: wait a little, not minutes
    db = str(tmp_path / "both.db")
    # four rounds: the first must still hold the lock when the second, started once it does, gets there
    first = subprocess.Popen([*CLI, "search", "--db", db, "--seq-lens", "64", *TINY_SEARCH, "--rounds", "4"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while read_holder(lock_file) is None or read_holder(lock_file).pid != first.pid:
        assert first.poll() is None, first.communicate()
        time.sleep(0.05)
    second = subprocess.Popen([*CLI, "search", "--db", db, "--seq-lens", "96", *TINY_SEARCH],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outputs = [first.communicate(timeout=600), second.communicate(timeout=600)]
    assert [first.returncode, second.returncode] == [0, 0], outputs
    assert f"(pid {first.pid}, cptune search --db {db} --seq-lens 64" in outputs[1][1]
    with sqlite3.connect(db) as connection:
        rows = connection.execute("SELECT seq_len, status, measured_at FROM measurements JOIN workloads "
                                  "ON workloads.id = measurements.workload_id").fetchall()
    assert {seq_len for seq_len, _, _ in rows} == {64, 96} and all(status == "ok" for _, status, _ in rows)
    # the second measured nothing before the first was done
    assert max(t for s, _, t in rows if s == 64) <= min(t for s, _, t in rows if s == 96)


def test_waiting_lines_elsewhere_than_a_terminal_come_whole_and_every_30_s(capsys):
    now = [0.0]
    line = WaitLine(clock=lambda: now[0])
    for second in range(0, 65, 5):
        now[0] = second
        line.show(f"waiting {second} " + "x" * 150)
    line.end()
    err = capsys.readouterr().err.splitlines()
    assert [text.split()[1] for text in err] == ["0", "30", "60"]
    assert all(len(text) > 150 for text in err)  # never wrapped or cut


def test_the_command_line_names_itself_cptune_in_the_lock(monkeypatch, lock_file):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/cptune", "search", "--db", "a b.db", "--seq-lens", "64"])
    with measuring():
        assert read_holder(lock_file).command == "cptune search --db 'a b.db' --seq-lens 64"


def test_a_password_in_the_command_line_is_never_written_to_the_lock(monkeypatch, lock_file):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/cptune", "search", "--db", "postgresql://me:s3cret@db/x"])
    with measuring():
        assert "s3cret" not in lock_file.read_text()
        assert read_holder(lock_file).command == "cptune search --db 'postgresql://me:***@db/x'"
