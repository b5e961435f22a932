"""Hardware, workloads and measurements.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "hardware",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("fingerprint", sa.String(32), nullable=False, unique=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("cpu_model", sa.String(255), nullable=False),
        sa.Column("cpu_count", sa.Integer, nullable=False),
        sa.Column("gpu_model", sa.String(255)),
        sa.Column("gpu_count", sa.Integer, nullable=False),
        sa.Column("interconnect", sa.String(255), nullable=False),
        sa.Column("mpi_library", sa.String(255)),
        sa.Column("nccl_version", sa.String(64)),
        sa.Column("tensorrt_version", sa.String(64)),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "workloads",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("seq_len", sa.Integer, nullable=False),
        sa.Column("heads", sa.Integer, nullable=False),
        sa.Column("kv_heads", sa.Integer, nullable=False),
        sa.Column("head_dim", sa.Integer, nullable=False),
        sa.Column("batch", sa.Integer, nullable=False),
        sa.Column("dtype", sa.String(8), nullable=False),
        sa.Column("causal", sa.Boolean, nullable=False),
        sa.UniqueConstraint("seq_len", "heads", "kv_heads", "head_dim", "batch", "dtype", "causal",
                            name="uq_workload_shape"),
    )
    op.create_table(
        "measurements",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("hardware_id", sa.Integer, sa.ForeignKey("hardware.id"), nullable=False),
        sa.Column("workload_id", sa.Integer, sa.ForeignKey("workloads.id"), nullable=False),
        sa.Column("strategy", sa.String(32), nullable=False),
        sa.Column("ranks", sa.Integer, nullable=False),
        sa.Column("head_group", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.Text),
        sa.Column("median_ms", sa.Float),
        sa.Column("p10_ms", sa.Float),
        sa.Column("p90_ms", sa.Float),
        sa.Column("compute_ms", sa.Float),
        sa.Column("comm_ms", sa.Float),
        sa.Column("peak_bytes", sa.Integer),
        sa.Column("max_error", sa.Float),
        sa.Column("samples_ms", sa.JSON),
        sa.Column("warmup", sa.Integer),
        sa.Column("repeats", sa.Integer),
        sa.Column("engine", sa.String(32), nullable=False),
        sa.Column("cptune_version", sa.String(32), nullable=False),
        sa.Column("measured_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index(
        "ix_measurements_hardware_workload", "measurements", ["hardware_id", "workload_id", "status"]
    )
    op.create_index("ix_measurements_config", "measurements", ["strategy", "ranks", "head_group"])


def downgrade() -> None:
    op.drop_table("measurements")
    op.drop_table("workloads")
    op.drop_table("hardware")
