"""Every measurement, kept: SQLAlchemy 2 over SQLite by default, any SQLAlchemy URL allowed.

A store is opened to write with ``Store(url)``: the schema is brought up to date by the Alembic
migrations in ``cptune.db`` (version table ``cptune_alembic_version``, so Optuna's own
tables and ``alembic_version`` can live in the same database). SQLite runs in WAL mode with
a busy timeout and takes its write lock at the start of each transaction (BEGIN
IMMEDIATE), so several searches can share one file without "database is locked" errors.
On PostgreSQL (``postgresql://``, psycopg 3) migrations run under an advisory lock and rows
that writers share (hardware, workloads) are added under a savepoint, so searches can share
a database there too. Each measurement is committed on its own: an interrupted search loses
at most the one in flight. A URL is shown only with its password hidden (``display_url``).

A store opened ``reading`` (what commands that only read use) changes nothing: no WAL switch,
no migration, no write (SQLite's ``query_only``, a URI that never creates the file, read-only
or immutable where the file cannot be written: ``reading_url``). An older schema is read
through a copy migrated in memory (SQLite) or refused naming what upgrades it (PostgreSQL); an
empty file or a database without cptune's schema is refused. A writer refuses a damaged
SQLite file (``quick_check``) before its first write.

A store never touches a database that is not cptune's: one that holds other tables and no
cptune schema (no ``cptune_alembic_version``) is refused before anything is written, even
the switch to WAL. Optuna's tables do not count (cptune keeps its studies beside its own
tables); ``Store(db, share=True)`` opens such a database anyway and adds cptune's tables
beside the others (on PostgreSQL, a schema of cptune's own in the URL's search_path keeps
them apart without it). SQLite in memory is refused (it would keep nothing for the next
command); a file opened read-only (``mode=ro``) or ``immutable=1`` stays out of WAL mode and
can be read, not written. A path that cannot hold a database (a loop of symbolic links, a
directory, a device, FIFO or socket, a missing or read-only parent directory) is refused with
what to do. These checks and SQLite's connection setup live in ``_opening``.

A disk that fills (SQLite's "database or disk is full", ``ENOSPC``, PostgreSQL's disk_full,
also wrapped in Optuna's ``StorageInternalError``) is a ``DiskFullError``: one line saying
which disk, how much this store had written and that the same command resumes once there is
room. Every write is one transaction, rolled back whole, so nothing is left half written.
"""

from __future__ import annotations

import errno
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    StaticPool,
    column,
    create_engine,
    delete,
    func,
    inspect,
    select,
    table,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from cptune._shipped import shipped
from cptune.calibration import Calibration
from cptune.config import CPConfig
from cptune.engines import NodeVerdict
from cptune.hardware import Hardware
from cptune.layout import normal
from cptune.masks import Documents, check_window
from cptune.measurement import Measurement
from cptune.store._facts import bounded_facts
from cptune.store._opening import (
    BUSY_TIMEOUT_MS,
    CHECK_OR_CREATE,
    corrupt,
    damage,
    damaged,
    foreign_tables,
    io_error,
    named_few,
    no_room,
    path_problem,
    reading_url,
    sqlite_setup,
    writable,
)
from cptune.store._result import STATUSES, Result
from cptune.store._schema import (
    VERSION_TABLE,
    CalibrationPieceRow,
    CalibrationRow,
    HardwareRow,
    MeasurementRow,
    NodeCheckRow,
    WorkloadRow,
    config_columns,
    stored_config,
)
from cptune.store._urls import (
    StoreError,
    database_url,
    display_url,
    in_memory,
    missing_driver_hint,
    passwords_in,
    read_only,
    redact,
    sqlite_file,
    uri_arguments,
)
from cptune.version import __version__
from cptune.workload import Workload

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory
    from optuna.storages import RDBStorage

#: Tries at opening Optuna's storage (a first open creates its tables).
_OPTUNA_ATTEMPTS = 3
#: PostgreSQL advisory lock key held while migrating ("cptune" in ASCII).
_MIGRATION_LOCK = 0x637074756E65
#: The commands whose ``--share-db`` passes ``Store(share=True)``: those that create cptune's tables.
SHARING_COMMANDS = "cptune search, calibrate or doctor"


class DiskFullError(StoreError):
    """The disk holding the database is full; what was committed before is kept."""


#: SQLite's result code for "database or disk is full" (also a ``max_page_count`` reached).
_SQLITE_FULL = 13
#: PostgreSQL's SQLSTATE for a full disk.
_PG_DISK_FULL = "53100"


def disk_full(error: BaseException | None) -> bool:
    """Whether ``error``, or any error it wraps (``__cause__``, ``__context__``, a DBAPI
    error's ``orig``), says the disk is full."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if isinstance(error, sqlite3.Error) and (
                getattr(error, "sqlite_errorcode", None) == _SQLITE_FULL or "disk is full" in str(error)):
            return True
        if getattr(error, "sqlstate", None) == _PG_DISK_FULL:
            return True
        wrapped = error.orig if isinstance(error, DBAPIError) else None
        error = wrapped or error.__cause__ or error.__context__
    return False


def _utc(moment: datetime) -> datetime:
    """``moment`` in UTC; a naive one (SQLite keeps no offset) is UTC, as cptune writes it."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _alembic() -> tuple[Config, ScriptDirectory]:
    """Alembic's configuration of cptune's migrations (``cptune.db``) and their scripts."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(shipped("cptune.db")))
    return config, ScriptDirectory.from_config(config)


#: The newest schema revision cptune's migrations (db/versions) make; tests/test_store.py holds
#: it to Alembic's head. A database already at it is opened without loading Alembic (0.4 s of
#: every command).
HEAD_REVISION = "0011"


def _revision(connection: Connection) -> str | None:
    """The schema revision of the database ``connection`` opens (None: no cptune schema), read only."""
    if not inspect(connection).has_table(VERSION_TABLE):
        return None
    revision: str | None = connection.execute(select(column("version_num")).select_from(
        table(VERSION_TABLE))).scalar_one_or_none()
    return revision


def _refuse_newer(current: str | None, scripts: ScriptDirectory, url: str) -> None:
    """Refuse a database of a newer cptune (``current`` is a revision this one does not know)."""
    if current is not None and current not in {script.revision for script in scripts.walk_revisions()}:
        raise StoreError(
            f"database {display_url(url)} was written by a newer cptune (schema revision {current!r}; "
            f"this cptune {__version__} knows up to {scripts.get_current_head()!r}): upgrade cptune "
            f"to use it, or pass another --db. Nothing was changed"
        )


def _migrate(engine: Engine, url: str) -> None:
    """Bring the schema to this cptune's head; a database of a newer cptune (a revision
    this one does not know) is refused before anything is written."""
    from alembic import command

    with engine.connect() as connection, _foreign_keys_checked_at_the_end(connection), connection.begin():
        if connection.dialect.name == "postgresql":
            # two processes opening a new database at once: the second waits, then finds it migrated
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
        current = _revision(connection)
        if current == HEAD_REVISION:
            return
        config, scripts = _alembic()
        _refuse_newer(current, scripts, url)
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
        sqlite = connection.dialect.name == "sqlite"
        if sqlite and connection.exec_driver_sql("PRAGMA foreign_key_check").first():
            raise StoreError(f"migrating {display_url(url)} would leave rows pointing at none; "
                             f"nothing was changed")


@contextmanager
def _foreign_keys_checked_at_the_end(connection: Connection) -> Iterator[None]:
    """SQLite's foreign keys off while ``connection`` migrates (a table altered by copying it
    is dropped while rows point at it; its copy has the same ids), as SQLite's own procedure
    for altering a table has it; the migration checks them before it commits. The switch
    works only outside a transaction: it is made on the driver's connection, unseen by the
    transaction events."""
    raw = connection.connection.dbapi_connection if connection.dialect.name == "sqlite" else None
    if raw is None:
        yield
        return
    raw.execute("PRAGMA foreign_keys = OFF")
    try:
        yield
    finally:
        raw.execute("PRAGMA foreign_keys = ON")


def new_database(db: str | None = None) -> bool:
    """Whether opening ``db`` to write makes a new database (a SQLite file that does not
    exist yet, or is empty), checked as ``Store`` would (a ``StoreError`` saying why it
    cannot be made there) but not made: a command can then take what it waits for (the host
    lock) first, and one that fails or is stopped before leaves no empty database behind."""
    url = database_url(db)
    path = None if in_memory(url) or read_only(url) else sqlite_file(url)
    if path is None:
        return False
    if problem := path_problem(path, create=True, opened_read_only=None):
        raise StoreError(problem)
    return not path.exists() or path.stat().st_size == 0


#: The columns of a workload's unique shape (``uq_workload_shape``): what tells workloads apart.
_UNIQUE_SHAPE = ("seq_len", "heads", "kv_heads", "head_dim", "batch", "dtype", "causal", "mode", "mask_key")

Row = TypeVar("Row", HardwareRow, WorkloadRow)
T = TypeVar("T")


def _get_or_add(session: Session, model: type[Row], key: dict[str, object], **rest: object) -> Row:
    """The row of ``model`` with ``key`` (unique), added if missing. Another writer may add it
    at the same moment (PostgreSQL lets both look first): the later insert then fails on the
    unique constraint inside a savepoint, and the row the other committed is used."""
    query = select(model).filter_by(**key)
    row = session.scalar(query)
    if row is None:
        try:
            with session.begin_nested():
                row = model(**key, **rest)
                session.add(row)
        except IntegrityError:
            row = session.scalar(query)
    assert row is not None
    return row


class Store:
    """Opens (and migrates) the database at ``db``; see ``database_url``. With
    ``create=False`` a SQLite file that does not exist, or is empty, is refused rather than
    made a database. ``reading`` (what commands that only read use; implies ``create=False``)
    changes nothing in the database, its schema included: an older schema is read through a
    copy migrated in memory (SQLite; ``copied``) or refused, saying which command upgrades
    it; a file that cannot be written is read read-only (``reading_url``). A database that
    holds other programs' tables and no cptune schema is refused untouched unless ``share``
    (cptune's tables are then added beside theirs); one in memory is refused; so is a
    damaged SQLite file a writer would write into."""

    def __init__(self, db: str | None = None, create: bool = True, share: bool = False,
                 reading: bool = False) -> None:
        url = database_url(db)
        #: The URL as it may be shown or written: its password lives only inside the engine.
        self.url = display_url(url)
        self._passwords = passwords_in(url)
        usage = "pass a file path or a SQLAlchemy URL such as postgresql://user:password@host/database"
        try:
            backend = make_url(url).get_backend_name()
            if in_memory(url):
                raise StoreError(f"cannot keep results in {self.url}: a database in memory is gone when the "
                                 f"command ends, holding nothing for the next one; pass a file path such as "
                                 f"--db cptune.db")
            path = sqlite_file(url)
            opened_read_only = read_only(url)
            if path is not None and (problem := path_problem(path, create and not reading, opened_read_only)):
                raise StoreError(problem)
            opened = (reading_url(path, opened_read_only, uri_arguments(url)) if reading and path is not None
                      else url)
            self.engine = create_engine(opened)
        except ImportError as exc:
            raise StoreError(f"cannot use database {self.url}: its driver {exc.name or exc} is not "
                             f"installed; {missing_driver_hint(backend)}") from None
        except ArgumentError as exc:
            raise StoreError(f"cannot use database {self.url}: {self._explain(exc)}; {usage}") from None
        except ValueError:  # the text may hold pieces of a password the URL split wrongly
            raise StoreError(f"cannot use database {self.url}: the URL does not parse (a port that is not "
                             f"a number, or a password with @ : / not %-encoded?); {usage}") from None
        self._opened_read_only = opened_read_only
        self._path = path
        self._reading = reading
        #: Rows this store committed (measurements, failures, calibrations, node verdicts).
        self.written = 0
        #: Whether this (reading) store reads a copy in memory of an older database, migrated
        #: there: what is written to the file after it opened is not seen.
        self.copied = False
        self._where = str(path) if path is not None else self.url
        try:
            if reading:
                self._open_to_read(url)
            else:
                self._open_to_write(url, share)
        except StoreError:
            self.engine.dispose()
            raise
        except DBAPIError as exc:
            self.engine.dispose()
            self._raise_if_full(exc)
            raise self._unopened(exc.orig, reading) from None

    def _unopened(self, error: BaseException | None, reading: bool) -> StoreError:
        """Why the driver's ``error`` kept the database from opening, in one line with what to do."""
        reason = self._explain(error)
        if self._path is not None and corrupt(error):
            return StoreError(damaged(self._where, reason))
        reason += "" if reason.endswith((".", "?", "!")) else "."
        read_only = self._opened_read_only
        if self._path is None:
            fix = ("check that the server is up, the URL's host, port, user, password and database name, and "
                   "that the user may create tables there")
        elif not reading and (read_only or "readonly" in str(error) or not writable(self._path)):
            why = read_only or "the file or its directory is read-only: a read-only filesystem or permissions"
            to_write = f"open it without {read_only} in the URL" if read_only else "make it writable"
            readers = (" (results, recommend, export, report and fit read it as it is)"
                       if self._path.stat().st_size else "")
            return StoreError(f"cannot write to database {self.url}: {reason} It can only be read here "
                              f"({why}) and nothing was changed: {to_write} or pass another --db{readers}")
        else:
            fix = "if the file is not a cptune database (or is damaged), move it away or pass another --db"
        return StoreError(f"cannot open database {self.url}: {reason} Nothing was changed; {fix}")

    def _open_to_write(self, url: str, share: bool) -> None:
        """Check the database before the first write (the switch to WAL is one): whole, and
        cptune's (``share``: or anyone's); then migrate it to this cptune's schema."""
        sqlite = self.engine.dialect.name == "sqlite"
        if sqlite or not share:
            with self.engine.connect() as connection:
                if sqlite:  # another process may be creating the file's tables
                    connection.exec_driver_sql(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                    if problem := damage(connection):
                        raise StoreError(damaged(self._where, problem))
                foreign = [] if share else foreign_tables(connection)
            self.engine.dispose()  # later connections get the setup below
            if foreign:
                raise StoreError(self._not_cptunes(foreign))
        if sqlite:
            sqlite_setup(self.engine)
        _migrate(self.engine, url)

    def _open_to_read(self, url: str) -> None:
        """Check that the database holds cptune's schema, of this cptune or an older one,
        reading only; an older one is migrated in a copy in memory (SQLite) or refused."""
        sqlite = self.engine.dialect.name == "sqlite"
        if sqlite:
            sqlite_setup(self.engine, reading=True)
        with self.engine.connect() as connection:
            current = _revision(connection)
            foreign = foreign_tables(connection) if current is None else []
        if current is None:
            empty = f"database {self._where} holds no cptune data and is left as it is; {CHECK_OR_CREATE}"
            raise StoreError(self._not_cptunes(foreign) if foreign else empty)
        if current == HEAD_REVISION:
            return
        _, scripts = _alembic()
        head = scripts.get_current_head()
        _refuse_newer(current, scripts, url)
        if not sqlite:
            raise StoreError(
                f"database {self.url} holds cptune's schema revision {current!r}, older than this cptune "
                f"{__version__}'s {head!r}, and a command that only reads leaves it as it is: upgrade it "
                f"once with a command that writes to it (cptune search or cptune calibrate with this --db), "
                f"then read it. Nothing was changed"
            )
        self.engine = self._migrated_copy(url)
        self.copied = True

    def _migrated_copy(self, url: str) -> Engine:
        """An engine on a copy in memory of this store's SQLite database, migrated to this
        cptune's schema and then kept from writes (``query_only``): an older database read as
        this cptune reads its own, the file left as it is."""
        copy = sqlite3.connect(":memory:", check_same_thread=False)
        source = self.engine.raw_connection()
        try:
            source.driver_connection.backup(copy)  # type: ignore[union-attr]
        finally:
            source.close()
            self.engine.dispose()
        engine = create_engine("sqlite://", creator=lambda: copy, poolclass=StaticPool)
        _migrate(engine, url)
        copy.execute("PRAGMA query_only = ON")
        return engine

    def _not_cptunes(self, foreign: list[str]) -> str:
        """The refusal of a database that holds the tables ``foreign`` and no cptune schema."""
        elsewhere = ("another --db path (a new file is created there)" if self._path is not None else
                     "another --db: a database of cptune's own, or a schema of its own (CREATE "
                     "SCHEMA cptune, then add ?options=-csearch_path%3Dcptune to the URL)")
        return (f"database {self._where} holds another program's tables ({named_few(foreign)}) and no "
                f"cptune data; cptune leaves it untouched: pass {elsewhere}, or add --share-db to "
                f"{SHARING_COMMANDS} to keep cptune's tables beside theirs")

    def _explain(self, error: BaseException | None) -> str:
        """The text of a driver's or SQLAlchemy's ``error`` on one line, with no password."""
        return redact(" ".join(str(error).split()), self._passwords)

    def full_disk(self) -> DiskFullError:
        """The error for a write the full disk refused: which disk, what this store had
        committed before (kept), and what to do; for a reader, that SQLite found no room to
        read the file (a WAL database's shared-memory file goes beside it)."""
        if self._path is not None and self._reading:
            return DiskFullError(
                f"the disk holding database {self._path} is full, and SQLite needs a little room beside "
                f"the file to read it; nothing was changed: free space on {self._path.absolute().parent}, "
                f"then run the same command again")
        if self._path is not None:
            where = f"the disk holding database {self._path} is full"
            free = f"free space on {self._path.absolute().parent}"
        else:
            where, free = f"the database server of {self.url} has no space left", "free space on its disk"
        return DiskFullError(
            f"{where}: the {self.written} row(s) this command stored before are kept, nothing is half "
            f"written; {free}, then run the same command again: it resumes where it stopped"
        )

    def _raise_if_full(self, error: BaseException) -> None:
        """Raise ``full_disk`` (the driver's error hidden) when ``error`` says the disk is
        full (``disk_full``), or is SQLite's I/O error on a disk with no room left (a reader's
        shared-memory file that cannot grow: SQLITE_IOERR_SHMSIZE): opening,
        ``require_writable`` and ``session`` check this first."""
        if disk_full(error) or (self._path is not None and io_error(error) and no_room(self._path)):
            raise self.full_disk() from None

    def failed(self, error: BaseException, doing: str, after: str = "") -> StoreError:
        """A ``StoreError`` for ``error`` met while ``doing`` (in words): ``full_disk`` when
        it says so, else its real cause in one line, then ``after``."""
        if disk_full(error):
            return self.full_disk()
        cause: BaseException | None = error.__cause__ if isinstance(error.__cause__, BaseException) else error
        if isinstance(cause, DBAPIError):
            cause = cause.orig
        return StoreError(f"cannot {doing} in {self.url}: {self._explain(cause)}{after}")

    def close(self) -> None:
        self.engine.dispose()

    def require_writable(self) -> None:
        """Raise ``StoreError`` unless results can be written here: checked before a
        search or calibration spends time measuring (a no-op write, rolled back)."""
        try:
            with self.engine.connect() as connection, connection.begin() as transaction:
                connection.exec_driver_sql(f"UPDATE {VERSION_TABLE} SET version_num = version_num")
                transaction.rollback()
        except DBAPIError as exc:
            self._raise_if_full(exc)
            fix = (f"open it without {self._opened_read_only} in the URL" if self._opened_read_only else
                   "make it writable")
            raise StoreError(
                f"cannot write to database {self.url}: {self._explain(exc.orig)}. Nothing was changed; "
                f"{fix} or pass another --db"
            ) from None

    def optuna_storage(self) -> RDBStorage:
        """Optuna's storage on this database (its own tables beside cptune's), where a search
        keeps its studies as a view for dashboards. On SQLite its engine gets cptune's busy
        timeout, WAL and BEGIN IMMEDIATE, so searches sharing a file queue instead of failing;
        creating Optuna's tables is retried, in case another process creates them at once."""
        import optuna
        from sqlalchemy.exc import SQLAlchemyError

        url = self.engine.url.render_as_string(hide_password=False)
        sqlite = self.engine.dialect.name == "sqlite"
        engine_kwargs = {"connect_args": {"timeout": BUSY_TIMEOUT_MS / 1000}} if sqlite else {}
        for attempt in range(_OPTUNA_ATTEMPTS):
            try:
                storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
                break
            except (SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
                if attempt + 1 == _OPTUNA_ATTEMPTS or disk_full(exc):
                    unaffected = "; the measurements are unaffected"
                    raise self.failed(exc, "keep Optuna studies", unaffected) from None
                time.sleep(0.5)
        if sqlite:
            sqlite_setup(storage.engine)
            storage.engine.dispose()  # every later connection gets the setup above
        return storage

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction: committed when the block ends, rolled back if it raises."""
        try:
            with Session(self.engine) as session, session.begin():
                yield session
        except (DBAPIError, OSError) as exc:  # the server refused or failed: one line, no password
            self._raise_if_full(exc)
            if isinstance(exc, OSError):
                raise
            reason = self._explain(exc.orig)
            if corrupt(exc.orig):
                raise StoreError(damaged(self._where, reason)) from None
            raise StoreError(f"database {self.url} failed: {reason}") from None

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        """``session`` for a write that adds one row: counted in ``written`` once committed."""
        with self.session() as session:
            yield session
        self.written += 1

    def _hardware_row(self, session: Session, hardware: Hardware) -> HardwareRow:
        return _get_or_add(session, HardwareRow, {"fingerprint": hardware.fingerprint},
                           created_at=datetime.now(UTC), **asdict(hardware))

    def _workload_row(self, session: Session, workload: Workload) -> WorkloadRow:
        key = WorkloadRow.key_of(workload)
        return _get_or_add(session, WorkloadRow, {k: key.pop(k) for k in _UNIQUE_SHAPE}, **key)

    def add_measurement(
        self, hardware: Hardware, measurement: Measurement, round_id: str | None = None
    ) -> int:
        """Keep a successful measurement (marked if ``measurement.disturbed``), run in the
        interleaved round ``round_id``; returns its id."""
        m = measurement
        with self._writing() as session:
            row = MeasurementRow(
                hardware=self._hardware_row(session, hardware),
                workload=self._workload_row(session, m.workload),
                **config_columns(normal(m.workload, m.config)), status="ok", error=None,
                median_ms=m.median_ms, p10_ms=m.p10_ms, p90_ms=m.p90_ms, compute_ms=m.compute_ms,
                comm_ms=m.comm_ms, peak_bytes=m.peak_bytes, max_error=m.max_error, samples_ms=m.samples_ms,
                warmup=m.warmup, repeats=m.repeats, engine=m.engine, cptune_version=__version__,
                measured_at=_utc(datetime.fromisoformat(m.measured_at)), oversubscribed=m.oversubscribed,
                round_id=round_id, disturbed=m.disturbed, forward_ms=m.forward_ms,
                facts=bounded_facts(m.host),
            )
            session.add(row)
            session.flush()
            return row.id

    def add_failure(
        self, hardware: Hardware, workload: Workload, config: CPConfig, status: str, error: str, engine: str,
        oversubscribed: bool = False, round_id: str | None = None,
    ) -> int:
        """Keep a run that failed (``status`` from ``STATUSES``) with its reason; returns its id."""
        if status not in STATUSES or status == "ok":
            raise ValueError(f"failure status must be one of {STATUSES[1:]}, got {status!r}")
        with self._writing() as session:
            row = MeasurementRow(
                hardware=self._hardware_row(session, hardware),
                workload=self._workload_row(session, workload),
                **config_columns(normal(workload, config)), status=status, error=error, engine=engine,
                cptune_version=__version__, measured_at=datetime.now(UTC), oversubscribed=oversubscribed,
                round_id=round_id,
            )
            session.add(row)
            session.flush()
            return row.id

    def add_calibration(self, hardware: Hardware, calibration: Calibration) -> int:
        """Keep a calibration of ``hardware``, its facts in a column of their own; returns its id.
        The pieces a stopped calibration of the same hardware and engine kept
        (``add_calibration_piece``) go with it: it is done."""
        data = calibration.to_dict()
        facts = bounded_facts(data.pop("facts"))
        with self._writing() as session:
            hardware_id = self._hardware_row(session, hardware).id
            row = CalibrationRow(
                hardware_id=hardware_id, engine=calibration.engine,
                data=data, facts=facts, cptune_version=__version__,
                measured_at=_utc(datetime.fromisoformat(calibration.measured_at)),
            )
            session.add(row)
            done = delete(CalibrationPieceRow).filter_by(hardware_id=hardware_id, engine=calibration.engine)
            session.execute(done)
            session.flush()
            return row.id

    def add_calibration_piece(self, hardware: Hardware, engine: str, key: str,
                              seconds: Sequence[float]) -> None:
        """Keep one step of a calibration of ``hardware`` by ``engine`` that is under way, timed
        clean (``cptune.calibration.CalibrationPieces``); a piece kept already under ``key`` stays."""
        with self._writing() as session:
            hardware_id = self._hardware_row(session, hardware).id
            kept = select(CalibrationPieceRow.id).filter_by(hardware_id=hardware_id, engine=engine, key=key)
            if session.scalar(kept) is None:
                session.add(CalibrationPieceRow(hardware_id=hardware_id, engine=engine, key=key,
                                                seconds=[float(t) for t in seconds],
                                                measured_at=datetime.now(UTC)))

    def calibration_pieces(self, fingerprint: str, engine: str) -> dict[str, tuple[float, ...]]:
        """The steps a stopped calibration of the hardware ``fingerprint`` by ``engine`` timed
        clean, by key (empty when none is under way); a damaged one is left out, to be timed again."""
        query = (select(CalibrationPieceRow.key, CalibrationPieceRow.seconds)
                 .join(HardwareRow, CalibrationPieceRow.hardware_id == HardwareRow.id)
                 .where(HardwareRow.fingerprint == fingerprint, CalibrationPieceRow.engine == engine))
        with self.session() as session:
            rows = session.execute(query).all()
        return {key: tuple(float(t) for t in seconds) for key, seconds in rows
                if isinstance(seconds, list) and all(isinstance(t, (int, float)) for t in seconds)}

    def calibration(self, fingerprint: str) -> Calibration | None:
        """The latest calibration of the hardware with ``fingerprint``, if any, with its facts
        (none for one stored before they were kept)."""
        query = (
            select(CalibrationRow.data, CalibrationRow.facts)
            .join(HardwareRow, CalibrationRow.hardware_id == HardwareRow.id)
            .where(HardwareRow.fingerprint == fingerprint).order_by(CalibrationRow.id.desc()).limit(1)
        )

        def parse(data: dict, facts: object) -> Calibration:
            return Calibration.from_dict({**data, "facts": bounded_facts(facts)})

        return self._parsed(query, parse, f"calibration of {fingerprint}",
                            "run cptune calibrate again to store a fresh one")

    def add_node_verdict(self, hardware: Hardware, engine: str, verdict: NodeVerdict) -> None:
        """Keep what ``engine``'s probes found on ``hardware`` (``Engine.check_node``),
        replacing the verdict kept before for the two. Two writers at once: the later insert
        fails on the unique pair inside a savepoint and replaces the other's instead."""
        with self._writing() as session:
            hardware_id = self._hardware_row(session, hardware).id
            query = select(NodeCheckRow).filter_by(hardware_id=hardware_id, engine=engine)
            fields = {"verdict": verdict.to_dict(), "cptune_version": __version__,
                      "created_at": datetime.now(UTC)}
            row = session.scalar(query)
            if row is None:
                try:
                    with session.begin_nested():
                        session.add(NodeCheckRow(hardware_id=hardware_id, engine=engine, **fields))
                    return
                except IntegrityError:
                    row = session.scalar(query)
                    assert row is not None
            for key, value in fields.items():
                setattr(row, key, value)

    def node_verdict(self, fingerprint: str, engine: str) -> NodeVerdict | None:
        """What ``engine``'s probes last found on the hardware with ``fingerprint``, if they ran."""
        query = (
            select(NodeCheckRow.verdict).join(HardwareRow, NodeCheckRow.hardware_id == HardwareRow.id)
            .where(HardwareRow.fingerprint == fingerprint, NodeCheckRow.engine == engine)
        )
        return self._parsed(query, NodeVerdict.from_dict, f"node check of {fingerprint} ({engine})",
                            f"run cptune doctor --backend {engine} --db ... again to store a fresh one")

    def _parsed(self, query: Select, parse: Callable[..., T], what: str, fix: str) -> T | None:
        """The JSON ``query`` finds (its first row's columns), as ``parse`` reads it; None when
        nothing is stored, a ``StoreError`` naming ``what`` was damaged and the ``fix`` when it
        cannot be read."""
        with self.session() as session:
            row = session.execute(query).first()
        if row is None or row[0] is None:
            return None
        try:
            return parse(*row)
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"the stored {what} in {self.url} is damaged ({exc!r}); {fix}") from None

    def hardware(self) -> dict[str, Hardware]:
        """Every hardware with something stored, by fingerprint."""
        with self.session() as session:
            return {row.fingerprint: row.to_hardware() for row in session.scalars(select(HardwareRow))}

    def revision(self) -> tuple[int, int]:
        """Changes whenever a measurement or calibration is added: the newest ids of each."""
        query = select(func.max(MeasurementRow.id), select(func.max(CalibrationRow.id)).scalar_subquery())
        with self.session() as session:
            measurements, calibrations = session.execute(query).one()
        return measurements or 0, calibrations or 0

    def _rows(self, session: Session, ids: Iterable[int]) -> list[MeasurementRow]:
        """The rows with ``ids``; a ``StoreError`` naming any that do not exist."""
        wanted = sorted(set(ids))
        rows = list(session.scalars(select(MeasurementRow).where(MeasurementRow.id.in_(wanted))))
        if unknown := sorted(set(wanted) - {row.id for row in rows}):
            raise StoreError(f"no measurement with id {', '.join(map(str, unknown))} in "
                             f"{display_url(self.url)} (cptune results lists the ids); nothing was changed")
        return rows

    def set_excluded(self, ids: Iterable[int], excluded: bool = True) -> list[int]:
        """Exclude (or include again) the measurements ``ids``: an excluded row stays stored
        but the model, the picks and the search's resume ignore it. Returns the ids whose
        mark changed; all ids must exist, else nothing changes."""
        with self.session() as session:
            changed = [row for row in self._rows(session, ids) if row.excluded != excluded]
            for row in changed:
                row.excluded = excluded
            return [row.id for row in changed]

    def delete(self, ids: Iterable[int]) -> list[Result]:
        """Delete the measurements ``ids`` for good; returns what they were. All ids must
        exist, else nothing is deleted."""
        with self.session() as session:
            rows = self._rows(session, ids)
            gone = [_result(row, row.workload, row.hardware) for row in rows]
            for row in rows:
                session.delete(row)
        return gone

    def results(self, **filters: object) -> list[Result]:
        """Stored rows, oldest first. Filters: any Workload field (the mask's parts as
        ``Workload`` takes them: ``window`` a pair, ``documents`` their lengths or one for
        all), ``strategy``, ``ranks``, ``layout``, ``status``, ``oversubscribed``, ``excluded``,
        ``disturbed`` (True: marked by the contention guard, False: clean), ``hardware``
        (fingerprint) and ``workload``: exactly that workload, its mask included (where the
        fields alone leave a mask they do not name unfiltered)."""
        workload_fields = set(Workload.__dataclass_fields__) - {"window", "documents"}
        query = select(MeasurementRow, WorkloadRow, HardwareRow).join(WorkloadRow).join(HardwareRow)
        mask_filters = {key: filters.pop(key) for key in ("window", "documents") if key in filters}
        for key, value in filters.items():
            if value is None:
                continue
            if key in workload_fields:
                query = query.where(getattr(WorkloadRow, key) == value)
            elif key in ("strategy", "ranks", "head_group", "layout", "status", "oversubscribed", "excluded"):
                query = query.where(getattr(MeasurementRow, key) == value)
            elif key == "disturbed":
                marked = MeasurementRow.disturbed.is_not(None)
                query = query.where(marked if value else ~marked)
            elif key == "hardware":
                query = query.where(HardwareRow.fingerprint == value)
            elif key == "workload" and isinstance(value, Workload):
                exact = {k: v for k, v in WorkloadRow.key_of(value).items() if k in _UNIQUE_SHAPE}
                query = query.where(*(getattr(WorkloadRow, k) == v for k, v in exact.items()))
            else:
                raise ValueError(f"unknown filter {key!r}")
        with self.session() as session:
            found = [_result(m, w, h) for m, w, h in session.execute(query.order_by(MeasurementRow.id)).all()]
        if "window" in mask_filters:
            window = check_window(mask_filters["window"])
            found = [r for r in found if r.workload.window == window]
        if "documents" in mask_filters:
            documents = Documents.of(mask_filters["documents"])  # type: ignore[arg-type]
            found = [r for r in found if r.workload.documents == documents]
        return found


def _result(m: MeasurementRow, w: WorkloadRow, h: HardwareRow) -> Result:
    return Result(
        id=m.id, hardware=h.fingerprint, workload=w.to_workload(), config=stored_config(m, w.heads),
        status=m.status, median_ms=m.median_ms, p10_ms=m.p10_ms, p90_ms=m.p90_ms,
        compute_ms=m.compute_ms, comm_ms=m.comm_ms, forward_ms=m.forward_ms, peak_bytes=m.peak_bytes,
        max_error=m.max_error, error=m.error, engine=m.engine,
        measured_at=_utc(m.measured_at).isoformat(timespec="seconds"),
        oversubscribed=m.oversubscribed, excluded=m.excluded, round_id=m.round_id, disturbed=m.disturbed,
        ranks_per_node=h.ranks_per_node, facts=bounded_facts(m.facts),
    )
