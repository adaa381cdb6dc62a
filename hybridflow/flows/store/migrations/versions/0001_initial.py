"""Initial run store schema: runs, iterations, metrics, checkpoints, placements.

Revision ID: 0001
Revises:
Create Date: 2026-11-22

Written by hand with explicit columns and constraint names (a migration is frozen: it must not import the models,
which move on). ``tests/test_store.py`` checks that the models in ``store.py`` describe the same schema.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 64-bit surrogate keys; SQLite only auto-increments a column declared exactly INTEGER PRIMARY KEY.
_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TS = sa.DateTime(timezone=True)


def _id() -> sa.Column:
    return sa.Column("id", _ID, primary_key=True, autoincrement=True)


def _run_fk() -> sa.Column:
    return sa.Column("run_id", sa.String(64), nullable=False)


def _fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=f"fk_{table}_run_id_runs", ondelete="CASCADE")


def upgrade() -> None:
    """Create the five tables."""
    op.create_table(
        "runs",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("experiment_name", sa.String(255), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("code_version", sa.String(255), nullable=False),
        sa.Column("prefect_flow_run_id", sa.String(64), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("started_at", _TS, nullable=True),
        sa.Column("ended_at", _TS, nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'completed', 'failed', 'interrupted')", name="ck_runs_status"
        ),
    )
    op.create_index("ix_runs_created_at", "runs", ["created_at"])

    op.create_table(
        "iterations",
        _id(),
        _run_fk(),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("started_at", _TS, nullable=False),
        sa.Column("ended_at", _TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_iterations"),
        _fk("iterations"),
        sa.UniqueConstraint("run_id", "step", name="uq_iterations_run_id_step"),
        sa.CheckConstraint("step >= 0", name="ck_iterations_step_nonnegative"),
    )

    op.create_table(
        "metrics",
        _id(),
        _run_fk(),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_metrics"),
        _fk("metrics"),
        sa.UniqueConstraint("run_id", "step", "name", name="uq_metrics_run_id_step_name"),
        sa.CheckConstraint("step >= 0", name="ck_metrics_step_nonnegative"),
    )
    op.create_index("ix_metrics_run_id_name_step", "metrics", ["run_id", "name", "step"])

    op.create_table(
        "checkpoints",
        _id(),
        _run_fk(),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("complete", sa.Boolean(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
        _fk("checkpoints"),
        sa.UniqueConstraint("run_id", "step", name="uq_checkpoints_run_id_step"),
        sa.CheckConstraint("step >= 0", name="ck_checkpoints_step_nonnegative"),
        sa.CheckConstraint("bytes >= 0", name="ck_checkpoints_bytes_nonnegative"),
    )

    op.create_table(
        "placements",
        _id(),
        _run_fk(),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("group_name", sa.String(255), nullable=False),
        sa.Column("ranks", sa.JSON(), nullable=False),
        sa.Column("executor", sa.String(16), nullable=False),
        sa.Column("slurm_job_id", sa.String(64), nullable=True),
        sa.Column("hosts", sa.JSON(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_placements"),
        _fk("placements"),
        sa.CheckConstraint("role IN ('actor', 'rollout', 'ref', 'critic', 'reward')", name="ck_placements_role"),
        sa.CheckConstraint("executor IN ('local', 'slurm')", name="ck_placements_executor"),
    )
    op.create_index("ix_placements_run_id", "placements", ["run_id"])


def downgrade() -> None:
    """Drop the five tables (all recorded runs are lost)."""
    op.drop_index("ix_placements_run_id", table_name="placements")
    op.drop_table("placements")
    op.drop_table("checkpoints")
    op.drop_index("ix_metrics_run_id_name_step", table_name="metrics")
    op.drop_table("metrics")
    op.drop_table("iterations")
    op.drop_index("ix_runs_created_at", table_name="runs")
    op.drop_table("runs")
