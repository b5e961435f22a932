"""Commands that only read never change a database (issue 41): an older schema is read as it
is, an empty file or one that is not cptune's is refused untouched, a database on a read-only
filesystem is read. And what writes never writes into a damaged file, nor leaves behind a new
empty database when it fails before storing anything. "Untouched" is checked byte for byte,
over every file in the database's directory (SQLite's journals included)."""

import contextlib
import hashlib
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest

from conftest import assert_refused, make_calibration, measurement, migrated, stand_in_measuring
from cptune import CPConfig, Workload
from cptune.feasibility import enumerate_configs
from cptune.hardware import this_host
from cptune.store import VERSION_TABLE, Store

SHAPE = {"heads": 4, "head_dim": 16, "kv_heads": 4, "dtype": "fp32"}
LENGTHS = (256, 512)
ROUNDS = 3
#: Each command that only reads, as a user types it before --db; {out}: a directory it may write to.
READING = {
    "results": ["results", "--json"],
    "recommend": ["recommend", "--heads", "4", "--head-dim", "16", "--dtype", "fp32", "--seq-len", "512"],
    "export": ["export", "--heads", "4", "--head-dim", "16", "--dtype", "fp32", "--seq-lens", "256,512",
               "-o", "{out}/plan.json"],
    "report": ["report", "--text"],
    "fit": ["fit"],
}
SEARCH = ["search", "--heads", "4", "--head-dim", "16", "--seq-lens", "64", "--ranks", "1", "--no-calibrate"]
CALIBRATE = ["calibrate", "--max-ranks", "1"]


def command(name: str, out: Path) -> list[str]:
    return [arg.format(out=out) for arg in READING[name]]


def files_in(directory: Path) -> dict[str, str]:
    """Every file in ``directory`` and a hash of its bytes."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def revision_of(path: Path) -> str:
    """The schema revision of the database at ``path`` (read as cptune's readers do: a
    read-only connection would leave SQLite's journals behind)."""
    with sqlite3.connect(f"file:{path}?mode=rw", uri=True) as connection:
        (revision,) = connection.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchone()
    connection.close()
    return revision


def downgrade(path: Path, revision: str) -> None:
    """Take the database at ``path`` back to the schema ``revision``, as an older cptune left it."""
    migrated(path, revision, down=True).dispose()


@pytest.fixture(scope="module")
def kept(tmp_path_factory) -> Path:
    """A database of this host, calibrated, with every configuration on 1 and 2 ranks at two
    lengths in three interleaved rounds: what every reading command has something to say about."""
    path = tmp_path_factory.mktemp("kept") / "cptune.db"
    host = this_host()
    with Store(str(path)) as store:
        store.add_calibration(host, make_calibration(2))
        for seq_len in LENGTHS:
            workload = Workload(seq_len, **SHAPE)
            for i in range(ROUNDS):
                for k, config in enumerate(enumerate_configs(workload, 2)):
                    ms = seq_len / 256 * (1 + 0.5 * k) * (1 + 0.01 * ((i + k) % 3))
                    store.add_measurement(host, measurement(workload, config, ms), round_id=f"{seq_len}-{i}")
    return path


@pytest.fixture
def database(kept, tmp_path) -> Path:
    """A copy of ``kept`` alone in a directory of its own."""
    path = tmp_path / "db" / "cptune.db"
    path.parent.mkdir()
    shutil.copy(kept, path)
    return path


# --------------------------------------------------------------------------- an older schema


@pytest.mark.parametrize("revision", ["0002"])  # the oldest a reader upgrades in memory: every later step too
def test_an_older_database_is_read_as_this_cptune_reads_it_and_left_as_it_is(
        cptune_here, database, tmp_path, revision):
    """Every reading command answers on a database of an older schema exactly as on the same
    database once a writing command upgraded it; the older file keeps every byte (and so
    stays readable by the cptune that wrote it), and no journal is left beside it."""
    downgrade(database, revision)
    upgraded = tmp_path / "upgraded" / "cptune.db"
    upgraded.parent.mkdir()
    shutil.copy(database, upgraded)
    Store(str(upgraded)).close()  # what the next search or calibrate does to it
    assert revision_of(upgraded) != revision
    before = files_in(database.parent)
    for name in READING:
        old = cptune_here(*command(name, tmp_path), "--db", database)
        new = cptune_here(*command(name, tmp_path), "--db", upgraded)
        assert old.returncode == new.returncode == 0, (name, old.stderr, new.stderr)
        assert old.stdout.replace(str(database), str(upgraded)) == new.stdout, name
        assert files_in(database.parent) == before, name
    assert revision_of(database) == revision


def test_a_writing_command_upgrades_an_older_database(cptune_here, database):
    downgrade(database, "0002")
    (first, *_) = json.loads(cptune_here("results", "--json", "--db", database).stdout)
    done = cptune_here("results", "--exclude", str(first["id"]), "--db", database)
    assert done.returncode == 0, done.stderr
    assert revision_of(database) == revision_of_head()


def revision_of_head() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(files("cptune.db")))
    return ScriptDirectory.from_config(config).get_current_head()


# --------------------------------------------------------------------------- no database to read


@pytest.mark.parametrize("name", [*READING, "exclude"])
def test_an_empty_file_stays_empty_and_is_refused(cptune_here, tmp_path, name):
    """It was silently made an empty cptune database; a command that writes makes a new
    database of it (it holds nothing to lose), one that reads finds none there."""
    path = tmp_path / "db" / "results.db"
    path.parent.mkdir()
    path.touch()
    argv = ["results", "--exclude", "1"] if name == "exclude" else command(name, tmp_path)
    assert_refused(cptune_here(*argv, "--db", path),
                   f"no database at {path}: the file is empty (0 bytes) and is left so; check the path")
    assert os.listdir(path.parent) == ["results.db"] and path.read_bytes() == b""


@pytest.mark.parametrize("name", READING)
def test_a_missing_database_is_not_created(cptune_here, tmp_path, name):
    path = tmp_path / "db" / "nothere.db"
    path.parent.mkdir()
    assert_refused(cptune_here(*command(name, tmp_path), "--db", path), f"no database at {path}")
    assert os.listdir(path.parent) == []


def _optuna_only(path: Path) -> None:
    import optuna

    optuna.storages.RDBStorage(f"sqlite:///{path}").engine.dispose()


def _no_tables(path: Path) -> None:
    with sqlite3.connect(path) as connection:
        connection.execute("PRAGMA user_version = 7")  # a database, not empty, with no table
    connection.close()


def _notes(path: Path) -> None:
    path.write_text("my notes, not a database\n" * 100)


@pytest.mark.parametrize(("make", "refusal"), [
    (_optuna_only, "holds no cptune data and is left as it is; check the path"),
    (_no_tables, "holds no cptune data and is left as it is; check the path"),
    (_notes, "file is not a database"),
], ids=["optuna-only", "no-tables", "not-sqlite"])
@pytest.mark.parametrize("name", ["results", "recommend", "report"])
def test_a_file_that_holds_no_cptune_data_is_refused_untouched(cptune_here, tmp_path, make, refusal, name):
    """An Optuna study's database got cptune's tables from a command that only reads."""
    path = tmp_path / "db" / "other.db"
    path.parent.mkdir()
    make(path)
    before = files_in(path.parent)
    assert_refused(cptune_here(*command(name, tmp_path), "--db", path), refusal)
    assert files_in(path.parent) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [READING["results"], SEARCH], ids=["results", "search"])
def test_a_fifo_is_no_database(cptune_here, tmp_path, argv):
    """Opening it would wait for a writer forever; nothing is read from it or made beside it."""
    fifo = tmp_path / "pipe.db"
    os.mkfifo(fifo)
    assert_refused(cptune_here(*argv, "--db", fifo),
                   f"cannot use database {fifo}: it is a FIFO (named pipe), not a file; pass a file path")
    assert os.listdir(tmp_path) == ["pipe.db"]


# --------------------------------------------------------------------------- a read-only filesystem

#: Run in a mount namespace of its own where argv[1] is a read-only view: each reading command
#: (JSON in argv[2]) on the database there, answered as [exit code, stdout, stderr].
RUN_ON_READ_ONLY = """
import contextlib, io, json, sys
from cptune.cli import main

answers = []
for argv in json.loads(sys.argv[2]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([*argv, "--db", sys.argv[1] + "/cptune.db"])
        except SystemExit as exit_:
            code = exit_.code
    answers.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(answers))
"""


def read_only_view(source: Path, view: Path, *then: str) -> list[str]:
    """A command line that mounts ``source`` read-only at ``view`` in a mount namespace of
    its own (no root needed where user namespaces are allowed), then runs ``then``."""
    script = 'mount --bind "$0" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    return ["unshare", "--map-root-user", "--mount", "sh", "-c", script, str(source), str(view), *then]


def test_a_database_on_a_read_only_filesystem_is_read(database, tmp_path):
    """Its WAL needs a shared-memory file SQLite cannot make there: every reading command read
    it as "unable to open database file"; a writing one says it can only be read there."""
    view = tmp_path / "view"
    view.mkdir()
    if shutil.which("unshare") is None or subprocess.run(read_only_view(database.parent, view, "true"),
                                                         capture_output=True).returncode != 0:
        pytest.skip("needs a read-only mount: unshare --map-root-user --mount (user namespaces) fails here")
    with sqlite3.connect(database) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    connection.close()
    before = files_in(database.parent)
    out = tmp_path / "out"
    out.mkdir()
    argvs = [command(name, out) for name in READING] + [SEARCH]
    done = subprocess.run(read_only_view(database.parent, view, sys.executable, "-c", RUN_ON_READ_ONLY,
                                         str(view), json.dumps(argvs)),
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    *read, (written_code, _, written_err) = json.loads(done.stdout)
    for name, (code, stdout, stderr) in zip(READING, read, strict=True):
        assert code == 0, (name, stderr)
        assert stdout, name
    assert '"round_id": "256-0"' in read[0][1]
    assert written_code == 2
    assert written_err.startswith(f"cptune: error: cannot write to database sqlite:///{view}/cptune.db: ")
    assert "only be read here (the file or its directory is read-only: a read-only filesystem" in written_err
    assert written_err.count("\n") == 1
    assert files_in(database.parent) == before
    assert (out / "plan.json").exists()


# --------------------------------------------------------------------------- what writes


@pytest.fixture
def damaged(tmp_path) -> Path:
    """A cptune database whose schema and version opens but some of whose measurement pages
    are garbage (as a disk or a copy may leave it)."""
    path = tmp_path / "db" / "damaged.db"
    path.parent.mkdir()
    host = this_host()
    with Store(str(path)) as store:
        for n in range(200):
            workload = Workload(64 * (n + 1), **SHAPE)
            store.add_failure(host, workload, CPConfig("ring", 1), "crash", "x" * 200, "mpi")
    with sqlite3.connect(path) as connection:
        (page_size,) = connection.execute("PRAGMA page_size").fetchone()
        leaves = [page for (page,) in connection.execute(  # the rows' own pages, never the schema's
            "SELECT pageno FROM dbstat WHERE name = 'measurements' AND pagetype = 'leaf' ORDER BY pageno")]
    connection.close()
    garbled = bytearray(path.read_bytes())
    noise = random.Random(41)
    for page in leaves[len(leaves) // 2:len(leaves) // 2 + 3]:
        garbled[(page - 1) * page_size:page * page_size] = noise.randbytes(page_size)
    path.write_bytes(bytes(garbled))
    assert revision_of(path)  # it opens, and its version reads
    with sqlite3.connect(f"file:{path}?mode=rw", uri=True) as connection, \
            contextlib.suppress(sqlite3.DatabaseError):  # too damaged even to list what is wrong
        assert connection.execute("PRAGMA quick_check").fetchall() != [("ok",)]
    connection.close()
    return path


@pytest.mark.parametrize("argv", [READING["results"], ["results", "--exclude", "1"], SEARCH],
                         ids=["results", "exclude", "search"])
def test_a_damaged_database_is_refused_and_never_written(cptune_here, monkeypatch, damaged, argv):
    """A search measured, then wrote pages into it before failing on the damage."""
    stand_in_measuring(monkeypatch, lambda workload, config, **_: measurement(workload, config, 1.0))
    before = files_in(damaged.parent)
    assert_refused(cptune_here(*argv, "--db", damaged), f"database {damaged} is damaged (",
                   f"cptune leaves it as it is: recover what it holds with sqlite3 {damaged} .recover")
    assert files_in(damaged.parent) == before


@pytest.mark.parametrize("existing", [None, b""], ids=["no-file", "empty-file"])
@pytest.mark.parametrize("argv", [SEARCH, CALIBRATE], ids=["search", "calibrate"])
def test_a_command_that_cannot_take_the_host_lock_leaves_no_database(
        cptune_here, monkeypatch, tmp_path, existing, argv):
    """The new database used to be made before the lock was taken, and stayed, empty."""
    monkeypatch.setenv("CPTUNE_LOCK", str(tmp_path / "no-such-dir" / "host.lock"))
    path = tmp_path / "db" / "new.db"
    path.parent.mkdir()
    if existing is not None:
        path.write_bytes(existing)
    assert_refused(cptune_here(*argv, "--db", path), "lock")
    assert files_in(path.parent) == ({} if existing is None else {"new.db": hashlib.sha256(b"").hexdigest()})
