"""Sample generations: what the model wrote at an iteration or a validation.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24

``samples``: ``run_id`` → runs (ON DELETE CASCADE), ``step``, ``kind`` (train | val), ``idx`` (the sample's place in
the step's list), ``data_source``, ``prompt``, ``response``, ``score`` (double, nullable: NaN or ±inf), and
``ground_truth``; unique (run_id, kind, step, idx); index (run_id, step).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    """Create ``samples``."""
    op.create_table(
        "samples",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("data_source", sa.String(255), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("response", sa.Text(), nullable=False),
        sa.Column("score", sa.Double(), nullable=True),
        sa.Column("ground_truth", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_samples"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_samples_run_id_runs", ondelete="CASCADE"),
        sa.UniqueConstraint("run_id", "kind", "step", "idx", name="uq_samples_run_id_kind_step_idx"),
        sa.CheckConstraint("step >= 0", name="ck_samples_step_nonnegative"),
        sa.CheckConstraint("idx >= 0", name="ck_samples_idx_nonnegative"),
        sa.CheckConstraint("kind IN ('train', 'val')", name="ck_samples_kind"),
    )
    op.create_index("ix_samples_run_id_step", "samples", ["run_id", "step"])


def downgrade() -> None:
    """Drop ``samples``."""
    op.drop_index("ix_samples_run_id_step", table_name="samples")
    op.drop_table("samples")
