"""Run facts: what each measurement and calibration ran with (``facts``, a JSON object of
short strings: the attention kernel, the process group, on a GPU the cuDNN and NCCL versions,
the engine's software and the host's). Rows of earlier revisions have none (NULL, read as
no facts).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for name in ("measurements", "calibrations"):
        with op.batch_alter_table(name) as table:
            table.add_column(sa.Column("facts", sa.JSON, nullable=True))


def downgrade() -> None:
    for name in ("calibrations", "measurements"):
        with op.batch_alter_table(name) as table:
            table.drop_column("facts")
