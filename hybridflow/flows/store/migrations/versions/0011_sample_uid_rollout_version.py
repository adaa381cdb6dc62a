"""Each sample records its prompt's id and the weight version that generated it: ``samples.uid`` (nullable
string) and ``samples.rollout_version`` (nullable integer).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26

``uid``: the prompt's id in the run (``<epoch>-<position>``, shared by its group's responses); ``rollout_version``:
the actor updates in the rollout's weights when it generated the row (``trainer.mode: one_step_off | async``
generate train batches ahead). Both NULL for samples recorded before this revision and for validation.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``samples.uid`` and ``samples.rollout_version``."""
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("uid", sa.String(64), nullable=True))
        batch.add_column(sa.Column("rollout_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop ``samples.uid`` and ``samples.rollout_version``."""
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("rollout_version")
        batch.drop_column("uid")
