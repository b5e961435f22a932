"""Peak bytes as a 64-bit integer: a rank's peak passes 2 GiB at long sequences, which a
32-bit INTEGER column refuses on PostgreSQL ("integer out of range").

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("measurements") as batch:
        batch.alter_column("peak_bytes", type_=sa.BigInteger(), existing_type=sa.Integer())


def downgrade() -> None:
    with op.batch_alter_table("measurements") as batch:
        batch.alter_column("peak_bytes", type_=sa.Integer(), existing_type=sa.BigInteger())
