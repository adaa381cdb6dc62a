"""DPO runs: ``runs.kind`` may be ``dpo`` (``hf dpo train``: the ``hybridflow-dpo`` flow).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03

PostgreSQL's CHECK constraint ``ck_runs_kind`` is replaced by one that allows ``dpo``; SQLite has none (see 0006:
`RunStore.create_run` checks the value there).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _allow(kinds: str) -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    op.drop_constraint("ck_runs_kind", "runs", type_="check")
    op.create_check_constraint("ck_runs_kind", "runs", f"kind IN ({kinds})")


def upgrade() -> None:
    """Allow ``dpo``."""
    _allow("'rl', 'rm', 'sft', 'dpo'")


def downgrade() -> None:
    """Allow ``rl``, ``rm`` and ``sft`` only (a ``dpo`` run left in the table makes this fail: delete it first)."""
    _allow("'rl', 'rm', 'sft'")
