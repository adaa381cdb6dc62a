"""Recoveries inside the flow: a worker group lost ranks, the flow relaunched its groups and went on.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27

``recoveries``: ``run_id`` → runs (ON DELETE CASCADE), ``step`` (the iteration that failed), ``group_name``,
``ranks`` (JSON list), ``cause`` (the group's error line), ``failed_at``, ``resumed_from`` (the checkpoint's step, 0:
the start), ``lost_s`` (seconds of training since that checkpoint, done again).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    """Create ``recoveries``."""
    op.create_table(
        "recoveries",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("group_name", sa.String(255), nullable=False),
        sa.Column("ranks", sa.JSON(), nullable=False),
        sa.Column("cause", sa.Text(), nullable=False),
        sa.Column("failed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resumed_from", sa.Integer(), nullable=False),
        sa.Column("lost_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_recoveries"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_recoveries_run_id_runs", ondelete="CASCADE"),
        sa.CheckConstraint("step >= 0", name="ck_recoveries_step_nonnegative"),
    )
    op.create_index("ix_recoveries_run_id", "recoveries", ["run_id"])


def downgrade() -> None:
    """Drop ``recoveries``."""
    op.drop_index("ix_recoveries_run_id", table_name="recoveries")
    op.drop_table("recoveries")
