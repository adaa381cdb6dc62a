"""Each iteration's timeline: when every stage ran, and on which pool.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25

``stage_times``: ``run_id`` → runs (ON DELETE CASCADE), ``step``, ``stage`` (``gen``, ``ref``, ``values``,
``update_actor``...), ``pool`` (the worker group it ran on; NULL: the controller), ``started_at``, ``ended_at``;
unique (run_id, step, stage). Stages of roles in different resource pools run at the same time: their spans overlap.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    """Create ``stage_times``."""
    op.create_table(
        "stage_times",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("stage", sa.String(64), nullable=False),
        sa.Column("pool", sa.String(255), nullable=True),
        sa.Column("started_at", _TS, nullable=False),
        sa.Column("ended_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_stage_times"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_stage_times_run_id_runs", ondelete="CASCADE"),
        sa.UniqueConstraint("run_id", "step", "stage", name="uq_stage_times_run_id_step_stage"),
        sa.CheckConstraint("step >= 0", name="ck_stage_times_step_nonnegative"),
    )


def downgrade() -> None:
    """Drop ``stage_times``."""
    op.drop_table("stage_times")
