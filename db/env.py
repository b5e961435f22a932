"""Alembic environment: migrations run on the connection ``cptune.store`` hands over."""

from alembic import context

from cptune.store import VERSION_TABLE, Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,  # Optuna's tables use alembic_version in the same database
    render_as_batch=True,  # SQLite alters tables by copying them
)
context.run_migrations()
