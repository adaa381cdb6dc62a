"""A stage may run more than once in an iteration (DAPO's draws generate and score again; ReMax scores its greedy
responses too): ``stage_times`` keeps one row per run of a stage.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25

``stage_times``: the unique (run_id, step, stage) constraint is dropped; an index on (run_id, step) serves the
timeline queries. SQLite cannot drop a constraint in place, so Alembic's batch mode copies the table (it has no
child tables: nothing cascades).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Drop the unique constraint, add the index."""
    with op.batch_alter_table("stage_times") as batch:
        batch.drop_constraint("uq_stage_times_run_id_step_stage", type_="unique")
        batch.create_index("ix_stage_times_run_id_step", ["run_id", "step"])


def downgrade() -> None:
    """Restore the unique constraint (fails on a database that holds a repeated stage)."""
    with op.batch_alter_table("stage_times") as batch:
        batch.drop_index("ix_stage_times_run_id_step")
        batch.create_unique_constraint("uq_stage_times_run_id_step_stage", ["run_id", "step", "stage"])
