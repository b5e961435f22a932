"""What a database must be before a ``Store`` opens it, and how SQLite connections are set up.

Checked before anything is written: whether a SQLite path can hold a database at all
(``path_problem``: a loop of symbolic links, a directory, a device, FIFO or socket, a missing
or read-only parent directory; for a command that does not create one, a missing or empty
file) and whose tables the database holds (``foreign_tables``: another program's, and not
cptune's or Optuna's, ``OPTUNA_TABLES``). A writer then checks the file is whole
(``damage``). Every SQLite connection of a writer gets WAL mode, a busy timeout, foreign
keys and BEGIN IMMEDIATE (``sqlite_setup``), so several searches can share one file without
"database is locked" errors; a reader's gets none of the writes: no switch to WAL, no write
lock, ``query_only``, and a URI that opens the file without changing it, read-only where it
cannot be written (``reading_url``).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, urlencode

from sqlalchemy import URL, Connection, Engine, event, inspect
from sqlalchemy.exc import DBAPIError

from cptune._files import kind_of
from cptune.store._schema import VERSION_TABLE
from cptune.store._urls import URI_ARGUMENTS

#: How long a SQLite connection waits for another's write lock.
BUSY_TIMEOUT_MS = 60_000
#: The tables Optuna keeps (its models' and its Alembic version table): a database that
#: holds only these is one cptune may open, as it keeps its own studies there too.
OPTUNA_TABLES = frozenset({
    "alembic_version", "studies", "study_directions", "study_system_attributes", "study_user_attributes",
    "trial_heartbeats", "trial_intermediate_values", "trial_params", "trial_system_attributes",
    "trial_user_attributes", "trial_values", "trials", "version_info",
})
#: How many of another program's tables a refusal names.
NAMED_TABLES = 3
#: What to do where there is no database to read.
CHECK_OR_CREATE = "check the path (--db or $CPTUNE_DB), or create one with cptune search or cptune calibrate"


def sqlite_setup(engine: Engine, reading: bool = False) -> None:
    """A writer's connections: WAL, a busy timeout, foreign keys, and BEGIN IMMEDIATE so
    writers queue instead of failing when two of them upgrade read locks at once. A
    reader's (``reading``): the busy timeout, ``query_only`` (a write is refused, not made)
    and a plain BEGIN, which takes no write lock; the journal stays as the file has it."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None  # transactions are begun below
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if reading:
            cursor.execute("PRAGMA query_only = ON")
        else:
            _use_wal(cursor)
            cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        connection.exec_driver_sql("BEGIN" if reading else "BEGIN IMMEDIATE")


def _use_wal(cursor: sqlite3.Cursor) -> None:
    """Put the database in WAL mode (it stays so). The switch needs the file to itself and
    SQLite does not wait for that (no busy handler): a new file opened by two processes at
    once has one of them creating tables while the other switches, so a switch refused as
    "locked" is tried again until the busy timeout. A database that cannot be in WAL mode
    answers the switch with the mode it keeps (in memory: "memory"; immutable: its own) or
    as read-only: it is left as it is, to be read (a write is refused when it comes)."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal":
        return
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "readonly" in str(exc):
                return
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def foreign_tables(connection: Connection) -> list[str]:
    """The tables and views of another program in the database ``connection`` opens, when it
    holds no cptune schema; none when it is cptune's, empty, or holds only Optuna's."""
    found = inspect(connection)
    names = set(found.get_table_names()) | set(found.get_view_names())
    return [] if VERSION_TABLE in names else sorted(names - OPTUNA_TABLES)


def named_few(names: list[str]) -> str:
    """A few of ``names`` on one line, and how many more."""
    shown = ", ".join(" ".join(name.split()) or repr(name) for name in names[:NAMED_TABLES])
    more = len(names) - NAMED_TABLES
    return shown + (f" and {more} more" if more > 0 else "")


def path_problem(path: Path, create: bool, opened_read_only: str | None) -> str | None:
    """Why the SQLite file ``path`` cannot be opened (``create``: or made), as one line
    with what to do; None when it can."""
    try:
        found = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return (f"cannot open database {path}: it is a loop of symbolic links (one leads to another and "
                    f"back), so there is no file there; fix or remove the links, or pass another --db")
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            return f"cannot open database {path}: {exc.strerror}; pass another --db"
        if not create or opened_read_only:
            return f"no database at {path}: {CHECK_OR_CREATE}"
        parent = path.absolute().parent
        if not parent.is_dir():
            blocker = next((p for p in (parent, *parent.parents) if p.exists() or p.is_symlink()), None)
            if blocker is not None and not blocker.is_dir():
                return (f"cannot create database {path}: {blocker} is a file, not a directory; "
                        f"pass another --db")
            return (f"cannot create database {path}: its directory {parent} does not exist; create it "
                    f"(mkdir -p {parent}) or pass another --db")
        if not os.access(parent, os.W_OK | os.X_OK):
            return (f"cannot create database {path}: its directory {parent} is not writable; pass a --db "
                    f"in a directory you can write to")
        return None
    mode = found.st_mode
    if stat.S_ISDIR(mode):
        return f"cannot use database {path}: it is a directory; pass a file path such as {path / 'cptune.db'}"
    if not stat.S_ISREG(mode):
        return (f"cannot use database {path}: it is {kind_of(mode)}, not a file; pass a file path such as "
                f"./cptune.db")
    if not create and found.st_size == 0:
        return f"no database at {path}: the file is empty (0 bytes) and is left so; {CHECK_OR_CREATE}"
    return None


def reading_url(path: Path, opened_read_only: str | None, kept: Mapping[str, str]) -> URL:
    """The URL a command that only reads opens the SQLite file ``path`` by, so that nothing
    in it changes: read and write, never creating (``mode=rw``; ``query_only`` refuses any
    write, and SQLite's journal files come and go as for any reader) where the file and its
    directory can be written and the user's URL did not ask for less (``opened_read_only``);
    else read-only (``mode=ro``); else, where even that cannot open it (a WAL database whose
    shared-memory file cannot be made: a read-only filesystem), as a file that nobody
    changes (``immutable=1``). The first that opens; the last when none does, to fail with
    SQLite's own reason. ``kept``: the user's other query arguments (``uri_arguments``), kept."""
    modes = [("mode", "rw")] if opened_read_only is None and writable(path) else []
    if not (opened_read_only or "").startswith("immutable"):
        modes.append(("mode", "ro"))
    uri = {key: value for key, value in kept.items() if key in URI_ARGUMENTS}
    for key, value in [*modes, ("immutable", "1")]:
        url = URL.create("sqlite", database=f"file:{quote(str(path))}",
                         query={**kept, key: value, "uri": "true"})
        if _opens(f"{url.database}?{urlencode({**uri, key: value})}"):
            break
    return url


def writable(path: Path) -> bool:
    """Whether this user may write the existing file ``path`` and make files beside it
    (SQLite's journals): False on a read-only filesystem."""
    return os.access(path, os.W_OK) and os.access(path.absolute().parent, os.W_OK | os.X_OK)


def _opens(uri: str) -> bool:
    """Whether SQLite can open the file ``uri`` names and read its schema, reading only; a
    file it opens but finds damaged or not a database counts (the store names why later)."""
    try:
        connection = sqlite3.connect(uri, uri=True)
    except sqlite3.OperationalError:
        return False
    try:
        connection.execute("PRAGMA query_only = ON")
        connection.execute("SELECT count(*) FROM sqlite_master")
    except sqlite3.DatabaseError as exc:
        return getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_CANTOPEN
    finally:
        connection.close()
    return True


def damage(connection: Connection) -> str | None:
    """The first thing SQLite's quick check finds wrong in the database ``connection``
    opens, None when it is whole: checked before a writer's first write, so a damaged file
    is left as it is rather than written into."""
    try:
        found = [str(row[0]) for row in connection.exec_driver_sql("PRAGMA quick_check(1)")]
    except DBAPIError as exc:
        if not corrupt(exc.orig):
            raise  # not a database at all, locked, ...: the store says so
        return " ".join(str(exc.orig).split())
    return None if found == ["ok"] else " ".join(" ".join(found).split())


#: Free bytes below which a disk counts as full when SQLite reports an I/O error there: a
#: WAL database's shared-memory file alone takes 32 KiB.
NO_ROOM_BYTES = 1 << 20


def io_error(error: BaseException | None) -> bool:
    """Whether ``error`` (or the driver's error it wraps) is SQLite's I/O error, of any kind
    (its primary result code SQLITE_IOERR)."""
    error = getattr(error, "orig", None) or error
    return (getattr(error, "sqlite_errorcode", 0) or 0) & 0xFF == sqlite3.SQLITE_IOERR


def no_room(path: Path) -> bool:
    """Whether the disk holding ``path`` has (next to) no space left for this user."""
    try:
        found = os.statvfs(path.absolute().parent)
    except OSError:
        return False
    return found.f_bavail * found.f_frsize < NO_ROOM_BYTES


def corrupt(error: BaseException | None) -> bool:
    """Whether SQLite's ``error`` says the database file is damaged ("malformed")."""
    return getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_CORRUPT


def damaged(where: str, problem: str) -> str:
    """The refusal of the damaged SQLite database at ``where`` (a path), SQLite's ``problem``
    and how to save what it holds."""
    return (f"database {where} is damaged ({problem}); cptune leaves it as it is: recover what it holds "
            f"with sqlite3 {where} .recover | sqlite3 recovered.db and pass --db recovered.db, or pass "
            f"another --db")
