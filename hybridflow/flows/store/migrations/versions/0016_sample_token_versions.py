"""Each sample records the weight versions that sampled its response's tokens: ``samples.token_versions``
(nullable text).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03

``token_versions``: a streaming rollout's (``rollout.streaming``) response tokens by the weight version that
sampled them, as JSON runs ``[[version, tokens], ...]`` in response order (more than one run: a partial rollout
continued across a weight push); NULL for a sample generated in one call, whose tokens are all of
``rollout_version``, and for samples recorded before this revision.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``samples.token_versions`` (plain ``ALTER TABLE ... ADD COLUMN``, as 0015)."""
    op.add_column("samples", sa.Column("token_versions", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop ``samples.token_versions``."""
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("token_versions")
