"""Each sample records why its score function gave no score: ``samples.reward_error`` (nullable text).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02

``reward_error``: the error of the sample's score (or cost) function, e.g. ``timeout after 30 s`` or ``ValueError:
...`` (the sample then scored 0.0: ``reward.timeout_s``, ``reward.max_failed_fraction``); NULL for a sample scored,
and for samples recorded before this revision.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``samples.reward_error`` (plain ``ALTER TABLE ... ADD COLUMN``, as 0014)."""
    op.add_column("samples", sa.Column("reward_error", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop ``samples.reward_error``."""
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("reward_error")
