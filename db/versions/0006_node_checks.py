"""Node checks: what a node's probes found (``cptune doctor``), one verdict per hardware and
engine, the latest replacing the one before. Databases of earlier revisions have none: the
next search with a probing engine (``EngineSpec.probes``) probes its node first.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_checks",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("hardware_id", sa.Integer, sa.ForeignKey("hardware.id"), nullable=False),
        sa.Column("engine", sa.String(32), nullable=False),
        sa.Column("verdict", sa.JSON, nullable=False),
        sa.Column("cptune_version", sa.String(32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("hardware_id", "engine", name="uq_node_check_hardware_engine"),
    )


def downgrade() -> None:
    op.drop_table("node_checks")
