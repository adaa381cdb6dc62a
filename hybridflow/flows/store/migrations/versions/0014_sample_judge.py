"""Each sample records what a reward model said of it: ``samples.rm_score`` (nullable double) and
``samples.judge_text`` (nullable text).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-30

``rm_score``: the reward model's score of the response (``rm_scores`` summed over its tokens; NULL without a reward
model, and for samples recorded before this revision); ``judge_text``: a generative reward model's verdict, the text
its verdict function read (``reward_model.judge``; NULL otherwise).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``samples.rm_score`` and ``samples.judge_text`` (plain ``ALTER TABLE ... ADD COLUMN``, as 0013)."""
    op.add_column("samples", sa.Column("rm_score", sa.Double(), nullable=True))
    op.add_column("samples", sa.Column("judge_text", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop ``samples.judge_text`` and ``samples.rm_score``."""
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("judge_text")
        batch.drop_column("rm_score")
