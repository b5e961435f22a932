"""Where a store lives: database URLs from what users type, and URLs fit to show (no password)."""

from __future__ import annotations

import os
from contextlib import suppress
from pathlib import Path
from urllib.parse import quote, unquote, urlencode

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from cptune._passwords import KEY_PASSWORD, URL_PASSWORD, display_url
from cptune.errors import CPTuneError

DEFAULT_DB = "cptune.db"
#: The query arguments of a SQLite URL that SQLAlchemy's pysqlite driver passes to ``sqlite3.connect``.
DRIVER_ARGUMENTS = frozenset({"uri", "timeout", "isolation_level", "detect_types", "check_same_thread",
                              "cached_statements"})
#: The query arguments of SQLite's URI filenames (https://www.sqlite.org/uri.html), which SQLite
#: reads only from a ``file:`` name opened with ``uri=true``.
URI_ARGUMENTS = frozenset({"vfs", "mode", "cache", "psow", "nolock", "immutable", "modeof"})


class StoreError(CPTuneError):
    """The database cannot be opened or used; the message says which and what to do."""


#: The driver cptune installs for PostgreSQL (the ``postgres`` extra) and the URL form it takes.
POSTGRES_DRIVER = "postgresql+psycopg"


def passwords_in(url: str) -> list[str]:
    """Every form of ``url``'s password that an error message might echo, longest first."""
    found = {m[2] for m in URL_PASSWORD.finditer(url)} | {m[2] for m in KEY_PASSWORD.finditer(url)}
    with suppress(ArgumentError, ValueError):
        found.add(make_url(url).password or "")
    found |= {unquote(p) for p in found}
    return sorted((p for p in found if p), key=len, reverse=True)


def redact(text: str, passwords: list[str]) -> str:
    """``text`` (an error from SQLAlchemy or a driver, which may echo the URL or a DSN) on one
    line, with each of ``passwords`` and any password in a URL or DSN replaced by ``***``."""
    for password in passwords:
        text = text.replace(password, "***")
    return display_url(" ".join(text.split()))


def missing_driver_hint(backend: str) -> str:
    if backend == "postgresql":
        return ("pip install 'cptune[postgres]' (psycopg 3) and write the URL as "
                "postgresql://user:password@host/database")
    return "install the Python package that provides it"


def database_url(db: str | None = None) -> str:
    """The SQLAlchemy URL for ``db``: a URL as given (a plain ``postgresql://`` one gets
    psycopg 3, the driver of the ``postgres`` extra; a SQLite one as ``sqlite_arguments`` has
    it), a file path as SQLite, None as $CPTUNE_DB or ./cptune.db."""
    db = db or os.environ.get("CPTUNE_DB") or DEFAULT_DB
    if "://" in db:
        scheme, rest = db.split("://", 1)
        return f"{POSTGRES_DRIVER}://{rest}" if scheme in ("postgresql", "postgres") else sqlite_arguments(db)
    path = Path(db).expanduser()
    try:
        path = path.resolve()
    except (OSError, RuntimeError):  # a loop of symbolic links: ``Store`` names it
        path = Path(os.path.abspath(path))
    return f"sqlite:///{path}"


def sqlite_arguments(url: str) -> str:
    """``url`` so that SQLite honours every query argument of it: one of SQLite's URI form
    (``URI_ARGUMENTS``: ``sqlite:///db.db?mode=ro``) is read by SQLite only from a ``file:`` name
    with ``uri=true``, so without those the path becomes such a name (SQLAlchemy would warn and
    drop the argument, and open the file to write). An argument neither SQLite nor its driver
    takes is a ``StoreError``; a URL of another backend, or one that does not parse, is left
    to ``Store``."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return url
    if parsed.get_backend_name() != "sqlite" or not parsed.query:
        return url
    unknown = sorted(set(parsed.query) - DRIVER_ARGUMENTS - URI_ARGUMENTS)
    if unknown:
        raise StoreError(
            f"cannot use database {display_url(url)}: SQLite takes no query argument {', '.join(unknown)} "
            f"(its URI form takes {', '.join(sorted(URI_ARGUMENTS))}; its driver "
            f"{', '.join(sorted(DRIVER_ARGUMENTS))}); remove it from the URL")
    database = parsed.database or ""
    as_uri = _truthy(parsed.query.get("uri")) and database.startswith("file:")
    if as_uri or not set(parsed.query) & URI_ARGUMENTS or database in ("", ":memory:"):
        return url
    name = database if database.startswith("file:") else f"file:{quote(database)}"
    # SQLAlchemy unquotes the path of a URL once; SQLite unquotes the file: name again
    return f"sqlite:///{quote(name, safe='/:')}?{urlencode({**parsed.query, 'uri': 'true'}, doseq=True)}"


def _truthy(value: object) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


def in_memory(url: str) -> bool:
    """Whether a SQLite ``url`` keeps its database in memory (``sqlite://``,
    ``sqlite:///:memory:``, ``mode=memory``): gone when the process ends."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return False
    database = parsed.database or ""
    uri = _truthy(parsed.query.get("uri"))
    return database in ("", ":memory:") or (uri and (
        parsed.query.get("mode") == "memory" or database.removeprefix("file:").startswith(":memory:")))


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite ``url`` opens (relative as given); None for another backend or a
    database in memory. ``file:`` is read as a URI only with ``uri=true``, as SQLite does."""
    if in_memory(url):
        return None
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database or ""
    if _truthy(parsed.query.get("uri")) and database.startswith("file:"):
        database = unquote(database.removeprefix("file:"))
        if database.startswith("//"):  # file:///path or file://localhost/path
            database = "/" + database[2:].partition("/")[2]
    return Path(database)


def uri_arguments(url: str) -> dict[str, str]:
    """The query arguments of a SQLite ``url`` besides how it opens the file (``mode``,
    ``immutable``, ``uri``): what a reader's own URL (``reading_url``) keeps of the user's."""
    query = make_url(url).query
    return {key: str(value) for key, value in query.items() if key not in ("mode", "immutable", "uri")}


def read_only(url: str) -> str | None:
    """What in a SQLite ``url`` opens its file read-only (``immutable=1`` or ``mode=ro``), or None."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not _truthy(parsed.query.get("uri")) \
            or not (parsed.database or "").startswith("file:"):
        return None
    if _truthy(parsed.query.get("immutable")):
        return f"immutable={parsed.query['immutable']}"
    return "mode=ro" if parsed.query.get("mode") == "ro" else None


def missing_database(url: str) -> Path | None:
    """The file of a SQLite ``url`` when it does not exist (opening it would create it)."""
    path = sqlite_file(url)
    return None if path is None or path.exists() else path


