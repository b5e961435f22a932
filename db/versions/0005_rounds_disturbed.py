"""Measurement rounds and the contention guard's verdict.

``round_id`` names the interleaved round a measurement ran in (rows of one round ran
back to back, so their ratios cancel drift); ``disturbed`` says why the contention guard
judged a measurement disturbed by other load, NULL when it ran clean. Rows stored
before this revision have neither: they count as clean rounds of their own.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("measurements") as batch:
        batch.add_column(sa.Column("round_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("disturbed", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("measurements") as batch:
        batch.drop_column("disturbed")
        batch.drop_column("round_id")
