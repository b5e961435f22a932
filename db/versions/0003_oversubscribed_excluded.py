"""Measurements marked oversubscribed (more ranks than cores) or excluded by the user.

Both kinds are kept but left out of the cost model and of measured picks by default.
Rows stored before this revision that ran more ranks than their host's cores are marked
oversubscribed here.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("measurements") as batch:
        batch.add_column(sa.Column("oversubscribed", sa.Boolean, nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("excluded", sa.Boolean, nullable=False, server_default=sa.false()))
    measurements = sa.table("measurements", sa.column("hardware_id", sa.Integer),
                            sa.column("ranks", sa.Integer), sa.column("oversubscribed", sa.Boolean))
    hardware = sa.table("hardware", sa.column("id", sa.Integer), sa.column("cpu_count", sa.Integer))
    cores = (sa.select(hardware.c.cpu_count).where(hardware.c.id == measurements.c.hardware_id)
             .scalar_subquery())
    op.execute(measurements.update().where(measurements.c.ranks > cores).values(oversubscribed=True))


def downgrade() -> None:
    with op.batch_alter_table("measurements") as batch:
        batch.drop_column("excluded")
        batch.drop_column("oversubscribed")
