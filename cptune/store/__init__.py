"""Every measurement, kept: SQLAlchemy 2 over SQLite by default, any SQLAlchemy URL allowed.

``Store(db)`` opens (and migrates) a database, ``Store(db, reading=True)`` one to read without
changing it; ``Result`` is one stored row as it is handed out. The tables (``_schema``) are
this package's own; nothing outside it reads them.
"""

from cptune.store._result import RESULT_COLUMNS, STATUSES, Result
from cptune.store._schema import VERSION_TABLE, Base
from cptune.store._store import DiskFullError, Store, StoreError, disk_full, new_database
from cptune.store._urls import DEFAULT_DB, POSTGRES_DRIVER, database_url, display_url, missing_database

__all__ = [
    "DEFAULT_DB",
    "POSTGRES_DRIVER",
    "RESULT_COLUMNS",
    "STATUSES",
    "VERSION_TABLE",
    "Base",
    "DiskFullError",
    "Result",
    "Store",
    "StoreError",
    "database_url",
    "disk_full",
    "display_url",
    "missing_database",
    "new_database",
]
