"""What a run trains: ``runs.kind``.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24

``runs.kind``: ``rl`` (an RLHF run of ``hf run``: the ``hybridflow-rlhf`` flow) or ``rm`` (a reward-model training
run of ``hf rm train``: the ``hybridflow-rm`` flow); NOT NULL, ``rl`` for the runs recorded before it existed.

PostgreSQL gets the CHECK constraint ``ck_runs_kind``. SQLite cannot add a constraint to a table in place, and
recreating ``runs`` (Alembic's batch mode) would cascade-delete every child row under ``PRAGMA foreign_keys=ON``,
so there `RunStore.create_run` alone checks the value.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def upgrade() -> None:
    """Add ``runs.kind`` (existing runs: ``rl``), with its CHECK constraint where the database can add one."""
    op.add_column("runs", sa.Column("kind", sa.String(8), nullable=False, server_default="rl"))
    if not _sqlite():
        op.create_check_constraint("ck_runs_kind", "runs", "kind IN ('rl', 'rm')")


def downgrade() -> None:
    """Drop it (SQLite 3.35+ drops a column in place)."""
    if not _sqlite():
        op.drop_constraint("ck_runs_kind", "runs", type_="check")
    op.drop_column("runs", "kind")
