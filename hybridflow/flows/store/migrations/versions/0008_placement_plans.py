"""Placement plans: what the auto-mapping planner was given, what it weighed and what it chose.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25

``placement_plans``: ``id`` (``plan-YYYYmmdd-HHMMSS-<6 hex>``), ``created_at``, ``source`` (the config file, or the
experiment of a run with ``placement.auto``), ``inputs`` (JSON: models, workload, cluster, hardware profile, strategy
space), ``candidates`` (JSON: the fastest candidates with their estimates), ``candidate_count``, ``rejected`` (JSON:
placements with the reason), ``chosen`` (JSON, nullable), ``chosen_seconds`` (nullable), ``search_s``; index on
created_at.

``runs.plan_id`` (nullable): the plan a run's placement came from. Not a foreign key: a config planned against one
store may run against another, and SQLite cannot add a constraint to ``runs`` in place (see 0006).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create ``placement_plans``; add ``runs.plan_id``."""
    op.create_table(
        "placement_plans",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source", sa.String(255), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
        sa.Column("candidates", sa.JSON(), nullable=False),
        sa.Column("candidate_count", sa.Integer(), nullable=False),
        sa.Column("rejected", sa.JSON(), nullable=False),
        sa.Column("chosen", sa.JSON(), nullable=True),
        sa.Column("chosen_seconds", sa.Double(), nullable=True),
        sa.Column("search_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_placement_plans"),
        sa.CheckConstraint("candidate_count >= 0", name="ck_placement_plans_count_nonnegative"),
    )
    op.create_index("ix_placement_plans_created_at", "placement_plans", ["created_at"])
    op.add_column("runs", sa.Column("plan_id", sa.String(64), nullable=True))


def downgrade() -> None:
    """Drop them."""
    op.drop_column("runs", "plan_id")
    op.drop_index("ix_placement_plans_created_at", table_name="placement_plans")
    op.drop_table("placement_plans")
