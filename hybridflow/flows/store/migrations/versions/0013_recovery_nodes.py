"""The nodes of a recovery: where the lost (or warned) ranks ran.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27

``recoveries.nodes``: JSON list of node names (the Slurm node, else the host), one per rank of ``ranks`` the group
knew; null for recoveries recorded before this revision.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``recoveries.nodes`` (a plain ``ALTER TABLE ... ADD COLUMN``, which SQLite has: its batch mode's table
    copy lost the race of two processes migrating one file, "database is locked")."""
    op.add_column("recoveries", sa.Column("nodes", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop ``recoveries.nodes``."""
    with op.batch_alter_table("recoveries") as batch:
        batch.drop_column("nodes")
