"""Clusters: a measured host may be several nodes, each running the same number of ranks,
joined by a network. Rows of earlier revisions are one node (1, no ranks per node, no network).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hardware") as table:
        table.add_column(sa.Column("nodes", sa.Integer, nullable=False, server_default="1"))
        table.add_column(sa.Column("ranks_per_node", sa.Integer, nullable=True))
        table.add_column(sa.Column("network", sa.String(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hardware") as table:
        table.drop_column("network")
        table.drop_column("ranks_per_node")
        table.drop_column("nodes")
