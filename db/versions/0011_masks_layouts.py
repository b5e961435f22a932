"""Masks and layouts: a workload's mask beyond full or causal (a sliding ``window`` as
``window_left``/``window_right``, ``sinks``, packed ``documents`` as JSON, joint ``text``) and
``mask_key``, what tells two masks apart in the workload's unique shape ("" for none, what every
row of earlier revisions reads as: full or causal); a measurement's configuration's ``layout``
(NULL: the workload's default, as every earlier row ran).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_SHAPE = ["seq_len", "heads", "kv_heads", "head_dim", "batch", "dtype", "causal", "mode"]


def upgrade() -> None:
    with op.batch_alter_table("workloads") as table:
        table.add_column(sa.Column("window_left", sa.Integer, nullable=True))
        table.add_column(sa.Column("window_right", sa.Integer, nullable=True))
        table.add_column(sa.Column("sinks", sa.Integer, nullable=False, server_default="0"))
        table.add_column(sa.Column("documents", sa.JSON, nullable=True))
        table.add_column(sa.Column("text", sa.Integer, nullable=False, server_default="0"))
        table.add_column(sa.Column("mask_key", sa.String(64), nullable=False, server_default=""))
        table.drop_constraint("uq_workload_shape", type_="unique")
        table.create_unique_constraint("uq_workload_shape", [*_SHAPE, "mask_key"])
    with op.batch_alter_table("measurements") as table:
        table.add_column(sa.Column("layout", sa.String(32), nullable=True))


def downgrade() -> None:
    # what an older cptune cannot name goes: runs in a layout of their own, and masked workloads
    op.execute("DELETE FROM measurements WHERE layout IS NOT NULL")
    with op.batch_alter_table("measurements") as table:
        table.drop_column("layout")
    op.execute("DELETE FROM measurements WHERE workload_id IN "
               "(SELECT id FROM workloads WHERE mask_key != '')")
    op.execute("DELETE FROM workloads WHERE mask_key != ''")
    with op.batch_alter_table("workloads") as table:
        table.drop_constraint("uq_workload_shape", type_="unique")
        table.create_unique_constraint("uq_workload_shape", _SHAPE)
        for name in ("mask_key", "text", "documents", "sinks", "window_right", "window_left"):
            table.drop_column(name)
