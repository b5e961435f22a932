"""Calibration pieces: each step a calibration timed clean, kept until the calibration is
stored, so that one a busy host stopped is gone on from by the next (``CalibrationPieces``).
Databases of earlier revisions have none: their next calibration starts from the beginning.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "calibration_pieces",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("hardware_id", sa.Integer, sa.ForeignKey("hardware.id"), nullable=False),
        sa.Column("engine", sa.String(32), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("seconds", sa.JSON, nullable=False),
        sa.Column("measured_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("hardware_id", "engine", "key", name="uq_calibration_piece"),
    )


def downgrade() -> None:
    op.drop_table("calibration_pieces")
