"""Each sample can record the experts its response's tokens were routed to: ``samples.routed_experts``
(nullable text).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07

``routed_experts``: with ``trainer.log_routed_experts`` and router replay (``actor.router_replay.mode`` R2 or R3),
the experts each response token went to in each MoE layer, as JSON ``[[[e, ...] * M] * T]``: for each of the
response's T tokens, for each of the model's M MoE layers, its top-k expert ids (-1: nothing recorded, as a
response's last token under R3); NULL when not requested and for samples recorded before this revision.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | Sequence[str] | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``samples.routed_experts`` (plain ``ALTER TABLE ... ADD COLUMN``, as 0016)."""
    op.add_column("samples", sa.Column("routed_experts", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop ``samples.routed_experts``."""
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("routed_experts")
