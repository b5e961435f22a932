"""The store at the edges a first user hits (issue 33): another program's database, a database
in memory or opened read-only, a --db path that cannot hold a database. Each is answered at
once, in one line on stderr with exit code 2 where refused, and no stored byte changes."""

import hashlib
import os
import sqlite3
from pathlib import Path

import pytest

from conftest import assert_refused
from cptune import CPConfig, Workload
from cptune.hardware import Hardware
from cptune.store import VERSION_TABLE, Store, StoreError
from cptune.store._opening import OPTUNA_TABLES
from cptune.store._urls import in_memory, read_only, sqlite_file

HARDWARE = Hardware(host="h1", cpu_model="test cpu", cpu_count=2, gpu_model=None, gpu_count=0,
                    interconnect="shared memory (one host)", mpi_library="MPICH 5")
WORKLOAD = Workload(seq_len=64, heads=4, head_dim=16, kv_heads=2, dtype="bf16", causal=True)
SEARCH = ["search", "--heads", "4", "--head-dim", "16", "--seq-lens", "64", "--ranks", "1,2",
          "--no-calibrate"]
#: A reading command and the writing ones, each as a user types it (before --db).
COMMANDS = {
    "results": ["results"],
    "search": SEARCH,
    "calibrate": ["calibrate", "--max-ranks", "2"],
    "recommend": ["recommend", "--heads", "4", "--head-dim", "16", "--seq-len", "64"],
}
IN_MEMORY = ["sqlite://", "sqlite:///:memory:", "sqlite:///", "sqlite:///file::memory:?uri=true",
             "sqlite:///file:scratch?mode=memory&uri=true"]


def checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def other_app(tmp_path):
    """Another program's SQLite file (four tables and a view, a row of data; a rollback
    journal, as SQLite makes by default), alone in its directory."""
    path = tmp_path / "apps" / "other-app.db"
    path.parent.mkdir()
    with sqlite3.connect(path) as connection:
        for table in ("users", "orders", "sessions", "audit_log"):
            connection.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, name TEXT)")
        connection.execute("CREATE VIEW named AS SELECT name FROM users")
        connection.execute("INSERT INTO users (name) VALUES ('ada')")
    connection.close()
    return path


@pytest.fixture
def rollback_journal_store(tmp_path):
    """A cptune database with one row, in a rollback journal rather than WAL (as a copy of
    one on read-only media may be): switching it to WAL needs a write."""
    path = tmp_path / "kept.db"
    with Store(str(path)) as store:
        store.add_failure(HARDWARE, WORKLOAD, CPConfig("ring", 2), "crash", "x", "mpi")
    connection = sqlite3.connect(path)
    assert connection.execute("PRAGMA journal_mode = DELETE").fetchone() == ("delete",)
    connection.close()
    return path


# ------------------------------------------------------------------- another program's database


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_another_programs_database_is_refused_untouched(cptune_here, other_app, monkeypatch, command):
    monkeypatch.chdir(other_app.parent.parent)
    before = checksum(other_app)
    result = cptune_here(*command, "--db", other_app)
    assert_refused(result, f"database {other_app} holds another program's tables (audit_log, named, orders "
                           f"and 2 more) and no cptune data", "pass another --db path")
    assert checksum(other_app) == before
    assert os.listdir(other_app.parent) == [other_app.name]  # no journal, WAL or shared-memory file either
    with sqlite3.connect(other_app) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone() == ("delete",)


def test_another_programs_database_is_refused_as_a_url_too(other_app):
    before = checksum(other_app)
    with pytest.raises(StoreError, match=f"database {other_app} holds another program's tables"):
        Store(f"sqlite:///{other_app}", create=False)
    assert checksum(other_app) == before


def test_sharing_a_database_with_another_program_is_explicit(other_app):
    """``share=True`` (for the CLI to pass when a user asks): cptune's tables beside theirs,
    theirs untouched; from then on the file holds cptune's schema and opens as any store."""
    with Store(str(other_app), share=True) as store:
        store.add_failure(HARDWARE, WORKLOAD, CPConfig("ring", 2), "crash", "x", "mpi")
    with Store(str(other_app), create=False) as store:
        assert len(store.results()) == 1
    with sqlite3.connect(other_app) as connection:
        assert connection.execute("SELECT name FROM users").fetchall() == [("ada",)]
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"users", "orders", "sessions", "audit_log", VERSION_TABLE, "measurements"} <= tables


def test_a_cptune_database_with_other_tables_beside_it_still_opens(tmp_path):
    path = tmp_path / "mine.db"
    with Store(str(path)) as store:
        store.add_failure(HARDWARE, WORKLOAD, CPConfig("ring", 2), "crash", "x", "mpi")
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE my_notes (note TEXT)")
    connection.close()
    with Store(str(path), create=False) as store:
        assert len(store.results()) == 1


@pytest.mark.parametrize("contents", [b"", None], ids=["empty-file", "no-file"])
def test_an_empty_file_or_a_new_path_becomes_a_store(tmp_path, contents):
    path = tmp_path / "new.db"
    if contents is not None:
        path.write_bytes(contents)
    with Store(str(path)) as store:
        assert store.results() == []


def test_optunas_tables_are_the_ones_optuna_makes():
    """A database holding only Optuna's tables may be opened (cptune keeps its studies there
    too): the list cptune keeps is Optuna's own, and its Alembic version table."""
    from optuna.storages._rdb import models

    assert set(models.BaseModel.metadata.tables) | {"alembic_version"} == OPTUNA_TABLES


# ------------------------------------------------------------------- in memory, read-only, immutable


@pytest.mark.timeout(30)
@pytest.mark.parametrize("url", IN_MEMORY)
@pytest.mark.parametrize("command", [COMMANDS["results"], SEARCH], ids=["results", "search"])
def test_a_database_in_memory_is_refused_at_once(cptune_here, tmp_path, monkeypatch, command, url):
    """It used to spin forever: the switch to WAL was retried while memory never becomes WAL
    (the timeout mark fails a spin; no bound on the machine's speed)."""
    monkeypatch.chdir(tmp_path)
    result = cptune_here(*command, "--db", url)
    assert_refused(result, f"cannot keep results in {url}: a database in memory is gone when the command "
                           f"ends", "pass a file path")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("opened", ["immutable=1", "mode=ro"])
def test_a_read_only_or_immutable_database_is_read_at_once_and_never_written(
        cptune_here, rollback_journal_store, capsys, opened):
    """Its journal cannot become WAL: reading works without it; writing is refused before
    anything is measured, naming what in the URL makes it read-only."""
    url = f"sqlite:///file:{rollback_journal_store}?{opened}&uri=true"
    before = checksum(rollback_journal_store)
    listed = cptune_here("results", "--db", url, "--json")  # a spin would meet the timeout mark
    assert listed.returncode == 0, listed.stderr
    assert '"status": "crash"' in listed.stdout
    assert_refused(cptune_here(*SEARCH, "--db", url), f"cannot write to database {url}",
                   f"open it without {opened} in the URL or pass another --db")
    assert checksum(rollback_journal_store) == before


def test_an_immutable_url_of_a_missing_file_is_not_created(cptune_here, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = "sqlite:///file:x.db?immutable=1&uri=true"
    for command in (COMMANDS["results"], SEARCH):
        assert_refused(cptune_here(*command, "--db", url), "no database at x.db: check the path")
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_file_cptune_must_write_first_says_so(tmp_path):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")  # its schema must be created first, which is a write
    with pytest.raises(StoreError, match=r"It can only be read here \(mode=ro\) and nothing was changed: "
                                         r"open it without mode=ro in the URL or pass another --db$"):
        Store(f"sqlite:///file:{path}?mode=ro&uri=true")
    assert path.read_bytes() == b""


@pytest.mark.parametrize(("url", "file", "memory", "opened"), [
    ("sqlite://", None, True, None),
    ("sqlite:///:memory:", None, True, None),
    ("sqlite:///file::memory:?cache=shared&uri=true", None, True, None),
    ("sqlite:///file:x.db?immutable=1&uri=true", Path("x.db"), False, "immutable=1"),
    ("sqlite:///file:///srv/x.db?mode=ro&uri=true", Path("/srv/x.db"), False, "mode=ro"),
    ("sqlite:///file:x.db?mode=rw&uri=true", Path("x.db"), False, None),
    ("sqlite:////srv/file:x.db", Path("/srv/file:x.db"), False, None),
    ("postgresql+psycopg://u@h/cptune", None, False, None),
])
def test_what_a_sqlite_url_opens(url, file, memory, opened):
    assert (sqlite_file(url), in_memory(url), read_only(url)) == (file, memory, opened)


# ------------------------------------------------------------------- paths that cannot hold a database


@pytest.mark.parametrize("command", [COMMANDS["results"], SEARCH], ids=["results", "search"])
def test_a_symlink_loop_is_named_in_one_line(cptune_here, tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert_refused(cptune_here(*command, "--db", "a"),
                   f"cannot open database {tmp_path / 'a'}: it is a loop of symbolic links",
                   "fix or remove the links, or pass another --db")
    assert_refused(cptune_here(*command, "--db", "a/results.db"), "loop of symbolic links")
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_a_db_in_a_missing_directory_names_it(cptune_here, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_refused(cptune_here(*SEARCH, "--db", "runs/today/results.db"),
                   f"cannot create database {tmp_path}/runs/today/results.db: its directory "
                   f"{tmp_path}/runs/today does not exist; create it (mkdir -p {tmp_path}/runs/today)")
    assert_refused(cptune_here("results", "--db", "runs/results.db"),
                   f"no database at {tmp_path}/runs/results.db: check the path")
    assert list(tmp_path.iterdir()) == []


def test_a_db_under_a_file_or_at_a_directory_names_it(cptune_here, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    assert_refused(cptune_here(*SEARCH, "--db", "notes.txt/results.db"),
                   f"{tmp_path}/notes.txt is a file, not a directory")
    (tmp_path / "runs").mkdir()
    for command in (COMMANDS["results"], SEARCH):
        assert_refused(cptune_here(*command, "--db", "runs"),
                       f"cannot use database {tmp_path}/runs: it is a directory; pass a file path such as "
                       f"{tmp_path}/runs/cptune.db")
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "runs"] and os.listdir(tmp_path / "runs") == []


def test_a_db_in_a_directory_that_is_not_writable_names_it(cptune_here, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: the directory is as a user would find it
        access = os.access
        monkeypatch.setattr("cptune.store._opening.os.access",
                            lambda path, mode: Path(path) != locked and access(path, mode))
    try:
        assert_refused(cptune_here(*SEARCH, "--db", locked / "results.db"),
                       f"cannot create database {locked}/results.db: its directory {locked} is not writable")
    finally:
        locked.chmod(0o755)
    assert os.listdir(locked) == []
