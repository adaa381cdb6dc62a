"""The reward-model role in placements.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24

``placements.role``: the CHECK constraint ``ck_placements_role`` also allows ``reward_model`` (the worker role that
hosts a model-based reward, the ``reward_model`` config section).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _roles(*roles: str) -> str:
    return "role IN (" + ", ".join(f"'{r}'" for r in roles) + ")"


_BEFORE = ("actor", "rollout", "ref", "critic", "reward")


def upgrade() -> None:
    """Replace the role constraint with one that includes ``reward_model``."""
    with op.batch_alter_table("placements") as batch:
        batch.drop_constraint("ck_placements_role", type_="check")
        batch.create_check_constraint("ck_placements_role", _roles(*_BEFORE, "reward_model"))


def downgrade() -> None:
    """Back to the five roles (fails while a ``reward_model`` placement row exists)."""
    with op.batch_alter_table("placements") as batch:
        batch.drop_constraint("ck_placements_role", type_="check")
        batch.create_check_constraint("ck_placements_role", _roles(*_BEFORE))
