"""What a database must be before a ``Store`` opens it, and how SQLite connections are set up.

Checked before anything is written: whether a SQLite path can hold a database at all
(``path_problem``: a loop of symbolic links, a directory, a missing or read-only parent
directory) and whose tables the database holds (``foreign_tables``: another program's, and
not cptune's or Optuna's, ``OPTUNA_TABLES``). Then every SQLite connection gets WAL mode, a
busy timeout, foreign keys and BEGIN IMMEDIATE (``sqlite_setup``), so several searches can
share one file without "database is locked" errors.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
import time
from pathlib import Path

from sqlalchemy import Connection, Engine, event, inspect

from cptune.store._schema import VERSION_TABLE

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


def sqlite_setup(engine: Engine) -> None:
    """WAL, a busy timeout, foreign keys, and BEGIN IMMEDIATE so writers queue instead of
    failing when two of them upgrade read locks at once."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None  # transactions are begun below
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        _use_wal(cursor)
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE")


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
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return (f"cannot open database {path}: it is a loop of symbolic links (one leads to another and "
                    f"back), so there is no file there; fix or remove the links, or pass another --db")
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            return f"cannot open database {path}: {exc.strerror}; pass another --db"
        if not create or opened_read_only:
            return (f"no database at {path}: check the path (--db or $CPTUNE_DB), or create one with "
                    f"cptune search or cptune calibrate")
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
    if stat.S_ISDIR(mode):
        return f"cannot use database {path}: it is a directory; pass a file path such as {path / 'cptune.db'}"
    return None
