"""Placements record the group's parallel layout: ``placements.parallel`` (JSON, nullable).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22

The actor's training strategy, its training layout p-t-d, the generation layout p_g-t_g-d_g of the 3D-HybridEngine
and their rank groups (see ``hybridflow.engine.parallel_layout.HybridLayout.describe``); NULL for rows recorded
before it, and for groups that do not split a model.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the nullable ``parallel`` column."""
    with op.batch_alter_table("placements") as batch:
        batch.add_column(sa.Column("parallel", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop it."""
    with op.batch_alter_table("placements") as batch:
        batch.drop_column("parallel")
