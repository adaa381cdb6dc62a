"""The distillation teacher's role in placements.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04

``placements.role``: the CHECK constraint ``ck_placements_role`` also allows ``teacher`` (the worker role that hosts
on-policy distillation's teacher, the ``teacher`` config section).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BEFORE = ("actor", "rollout", "ref", "critic", "reward", "reward_model")


def _constrain(*roles: str) -> None:
    with op.batch_alter_table("placements") as batch:
        batch.drop_constraint("ck_placements_role", type_="check")
        batch.create_check_constraint("ck_placements_role", "role IN (" + ", ".join(f"'{r}'" for r in roles) + ")")


def upgrade() -> None:
    """Allow ``teacher``."""
    _constrain(*_BEFORE, "teacher")


def downgrade() -> None:
    """Back to the six roles (fails while a ``teacher`` placement row exists)."""
    _constrain(*_BEFORE)
