"""The run lease (one controller per run) and unusable checkpoints.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

``runs``: ``lease_token`` (the holding controller's random token), ``lease_host``, ``lease_pid`` and
``heartbeat_at`` (renewed by the controller while it runs; see ``hybridflow.flows.lease``), all NULL while no
controller holds the run. ``checkpoints.bad_reason``: why a recorded checkpoint must not be resumed from (corrupt,
missing, superseded by ``hf resume --from``); NULL for a usable one.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the nullable lease columns and ``checkpoints.bad_reason``."""
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("lease_token", sa.String(64), nullable=True))
        batch.add_column(sa.Column("lease_host", sa.String(255), nullable=True))
        batch.add_column(sa.Column("lease_pid", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("bad_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("bad_reason")
    with op.batch_alter_table("runs") as batch:
        for column in ("heartbeat_at", "lease_pid", "lease_host", "lease_token"):
            batch.drop_column(column)
