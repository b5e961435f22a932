"""Training: a workload runs in a mode, ``forward`` (every row of earlier revisions) or
``train`` (the forward, then the backward), and a layer in each mode is a workload of its own;
a training run's measurement keeps its forward's share of the time (``forward_ms``; None for a
forward run, whose whole time it is).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_SHAPE = ["seq_len", "heads", "kv_heads", "head_dim", "batch", "dtype", "causal"]


def upgrade() -> None:
    with op.batch_alter_table("workloads") as table:
        table.add_column(sa.Column("mode", sa.String(8), nullable=False, server_default="forward"))
        table.drop_constraint("uq_workload_shape", type_="unique")
        table.create_unique_constraint("uq_workload_shape", [*_SHAPE, "mode"])
    with op.batch_alter_table("measurements") as table:
        table.add_column(sa.Column("forward_ms", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("measurements") as table:
        table.drop_column("forward_ms")
    op.execute("DELETE FROM measurements WHERE workload_id IN (SELECT id FROM workloads WHERE mode = 'train')")
    op.execute("DELETE FROM workloads WHERE mode = 'train'")
    with op.batch_alter_table("workloads") as table:
        table.drop_constraint("uq_workload_shape", type_="unique")
        table.create_unique_constraint("uq_workload_shape", _SHAPE)
        table.drop_column("mode")
