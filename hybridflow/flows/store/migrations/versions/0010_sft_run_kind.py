"""Supervised fine-tuning runs: ``runs.kind`` may be ``sft`` (``hf sft train``: the ``hybridflow-sft`` flow).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26

PostgreSQL's CHECK constraint ``ck_runs_kind`` is replaced by one that allows ``sft``; SQLite has none (see 0006:
`RunStore.create_run` checks the value there).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _replace_check(kinds: str) -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    op.drop_constraint("ck_runs_kind", "runs", type_="check")
    op.create_check_constraint("ck_runs_kind", "runs", f"kind IN ({kinds})")


def upgrade() -> None:
    """Allow ``sft``."""
    _replace_check("'rl', 'rm', 'sft'")


def downgrade() -> None:
    """Allow ``rl`` and ``rm`` only (an ``sft`` run left in the table makes this fail: delete it first)."""
    _replace_check("'rl', 'rm'")
