"""A disk that fills under the database (issue 33, item 5): one line that says so, how much
was stored and that the same command resumes; nothing half written, and the rerun completes."""

import errno
import sqlite3
from collections import Counter

import optuna
import pytest
from sqlalchemy import event

from conftest import measurement, stand_in_measuring
from cptune.config import CPConfig
from cptune.hardware import this_host
from cptune.store import DiskFullError, Store, disk_full
from cptune.workload import Workload

SMALL = Workload(seq_len=64, heads=4, head_dim=16)
SEARCH = ["--heads", "4", "--head-dim", "16", "--ranks", "1,2", "--no-calibrate", "--rounds", "1",
          "--race-rounds", "0", "--confirm-rounds", "0"]


def no_room_beyond_this(store):
    """Every later connection of ``store`` may not grow the file past its size now: the next
    write that needs a new page fails as on a full disk (SQLITE_FULL)."""
    with store.engine.connect() as connection:
        pages = connection.exec_driver_sql("PRAGMA page_count").scalar()
    store.engine.dispose()
    event.listen(store.engine, "connect",
                 lambda dbapi_connection, _: dbapi_connection.execute(f"PRAGMA max_page_count = {pages}"))


def test_a_full_disk_is_one_error_that_keeps_every_committed_row(tmp_path):
    path = tmp_path / "full.db"
    with Store(str(path)) as store:
        no_room_beyond_this(store)
        with pytest.raises(DiskFullError) as full:
            for i in range(10_000):
                store.add_measurement(this_host(), measurement(SMALL, CPConfig("ring", 1), 1.0 + i))
        written = store.written
    message = str(full.value)
    assert message.startswith(f"the disk holding database {path} is full: the {written} row(s) this command "
                              f"stored before are kept, nothing is half written; free space on {tmp_path}")
    assert message.endswith("then run the same command again: it resumes where it stopped")
    with Store(str(path)) as store:  # room again: every committed row is there, whole, and writing goes on
        rows = store.results()
        assert len(rows) == written and all(r.clean for r in rows)
        store.add_measurement(this_host(), measurement(SMALL, CPConfig("ring", 2), 1.0))
        assert len(store.results()) == written + 1


def test_a_writer_that_meets_enospc_is_the_same_error(tmp_path, monkeypatch):
    from sqlalchemy.orm import Session

    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with Store(str(tmp_path / "e.db")) as store:
        monkeypatch.setattr(Session, "flush", no_space)
        with pytest.raises(DiskFullError, match="is full: the 0 row"):
            store.add_measurement(this_host(), measurement(SMALL, CPConfig("ring", 1), 1.0))
        monkeypatch.undo()
        assert store.results() == []


def test_a_full_disk_under_the_study_view_says_so_and_does_not_blame_another_process(tmp_path):
    from cptune.search import WorkloadSearch

    class Full(optuna.storages.InMemoryStorage):
        def create_new_trial(self, study_id, template_trial=None):
            try:
                raise sqlite3.OperationalError("database or disk is full")
            except sqlite3.OperationalError as exc:
                raise optuna.exceptions.StorageInternalError("the commit failed") from exc

    with Store(str(tmp_path / "v.db")) as store:
        store.add_measurement(this_host(), measurement(SMALL, CPConfig("ring", 1), 1.0))
        search = WorkloadSearch(SMALL, [CPConfig("ring", 1)], store, this_host(), study_storage=Full())
        with pytest.raises(DiskFullError) as full:
            search.run()
    assert "is full" in str(full.value) and "another process" not in str(full.value)


def test_disk_full_reads_every_form_a_full_disk_takes():
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(sqlite3.OperationalError("database or disk is full"))
    try:
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as exc:
            raise optuna.exceptions.StorageInternalError("commit failed") from exc
    except optuna.exceptions.StorageInternalError as wrapped:
        assert disk_full(wrapped)
    assert not disk_full(sqlite3.OperationalError("database is locked"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))


def test_a_search_that_fills_the_disk_exits_2_in_one_line_and_the_rerun_completes(tmp_path, monkeypatch,
                                                                                  cptune_here):
    """In process, with ``measure`` standing in: the first search fills what room there is
    at 64 tokens; the database then cannot grow, and the search of 64 and 96 tokens stops at
    the first write that needs room. Given room, the same command completes: every
    configuration gets its one clean visit, none twice, and the Optuna view holds every row."""
    import cptune.store._opening as opening

    stand_in_measuring(monkeypatch, lambda workload, config, **_: measurement(workload, config, 10.0))
    db = tmp_path / "s.db"
    assert cptune_here("search", "--db", db, *SEARCH, "--seq-lens", "64").returncode == 0
    use_wal = opening._use_wal

    def no_room(cursor):  # every connection opened from now on: the file may not grow
        use_wal(cursor)
        pages = cursor.execute("PRAGMA page_count").fetchone()[0]
        cursor.execute(f"PRAGMA max_page_count = {pages}")

    monkeypatch.setattr(opening, "_use_wal", no_room)
    full = cptune_here("search", "--db", db, *SEARCH, "--seq-lens", "64,96,128,192")
    assert full.returncode == 2, full.stdout + full.stderr
    (line,) = full.stderr.splitlines()
    assert line.startswith(f"cptune: error: the disk holding database {db} is full: the "), line
    assert line.endswith(f"free space on {tmp_path}, then run the same command again: it resumes where it "
                         f"stopped"), line
    monkeypatch.setattr(opening, "_use_wal", use_wal)
    again = cptune_here("search", "--db", db, *SEARCH, "--seq-lens", "64,96,128,192")
    assert again.returncode == 0, again.stdout + again.stderr
    with Store(str(db)) as store:
        rows = store.results()
        storage = store.optuna_storage()
        trials = sum(summary.n_trials for summary in optuna.get_all_study_summaries(storage))
    visits = Counter((r.workload.seq_len, r.config) for r in rows)
    assert {seq for seq, _ in visits} == {64, 96, 128, 192} and set(visits.values()) == {1}
    assert all(r.clean for r in rows) and trials == len(rows)


def test_no_space_for_the_ranks_folder_is_one_line_too(tmp_path, monkeypatch, cptune_here):
    """ENOSPC outside the database (here: where a pool would make its folder): one line, exit 2."""
    def no_space(workload, config, **_):
        raise OSError(errno.ENOSPC, "No space left on device", "/tmp/cptune-pool-x")

    stand_in_measuring(monkeypatch, no_space)
    result = cptune_here("search", "--db", tmp_path / "n.db", *SEARCH, "--seq-lens", "64")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "cptune: error: no space left on the device (/tmp/cptune-pool-x): every finished measurement is "
        "stored; free space there, then run the same command again: it resumes where it stopped"]


@pytest.mark.parametrize("command", [["results"], ["fit"], ["report", "--text"],
                                     ["recommend", "--heads", "4", "--head-dim", "16", "--seq-len", "64"]])
def test_a_reading_command_on_a_full_disk_says_the_disk_is_full(tmp_path, monkeypatch, cptune_here, command):
    """A WAL database is read through a shared-memory file beside it; on a full disk SQLite
    cannot make it and says "disk I/O error" (SQLITE_IOERR_SHMSIZE): as there, every connection
    fails so, and the disk has no room left. The line says the disk is full, not that the file
    may be damaged; the file keeps every byte."""
    import os
    from types import SimpleNamespace

    db = tmp_path / "r.db"
    with Store(str(db)) as store:
        store.add_measurement(this_host(), measurement(SMALL, CPConfig("ring", 1), 1.0))
    before = db.read_bytes()

    def no_room_for_shared_memory(*args, **kwargs):
        error = sqlite3.OperationalError("disk I/O error")
        error.sqlite_errorcode = 4874  # SQLITE_IOERR_SHMSIZE
        raise error

    statvfs = os.statvfs
    for module in (sqlite3, sqlite3.dbapi2):  # cptune's own probe, and SQLAlchemy's driver
        monkeypatch.setattr(module, "connect", no_room_for_shared_memory)
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=0, f_frsize=4096)
                        if str(path) == str(tmp_path) else statvfs(path))
    result = cptune_here(*command, "--db", db)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line == (f"cptune: error: the disk holding database {db} is full, and SQLite needs a little "
                    f"room beside the file to read it; nothing was changed: free space on {tmp_path}, then "
                    f"run the same command again"), line
    assert db.read_bytes() == before
