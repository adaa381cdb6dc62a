"""The run store's tables as SQLAlchemy ORM models (Alembic's migrations create them: `migrations/`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from hybridflow.flows.store.constants import _NAME_MAX, EXECUTORS, ROLES, RUN_STATUSES, SAMPLE_KINDS

if TYPE_CHECKING:
    pass


# ------------------------------------------------------------------------------------------------------ ORM models


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware datetime stored as UTC; read back as UTC whatever the backend or session time zone.

    SQLite keeps no offset, so values go in as naive UTC and come out with ``tzinfo=UTC``. Raises ValueError on a
    naive datetime (its zone would be a guess).
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware one, e.g. datetime.now(UTC)")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


_ID = BigInteger().with_variant(Integer(), "sqlite")  # SQLite auto-increments only "INTEGER PRIMARY KEY"


def _in(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    """Declarative base of the run store tables; constraint names follow ``metadata``'s naming convention."""

    metadata = MetaData(
        naming_convention={
            "pk": "pk_%(table_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        }
    )


class RunRow(Base):
    """One run (table ``runs``)."""

    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(_in("status", RUN_STATUSES), name="status"),
        Index(None, "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8), server_default="rl")  # CHECK on PostgreSQL only: see 0006, 0010
    experiment_name: Mapped[str] = mapped_column(String(_NAME_MAX))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    code_version: Mapped[str] = mapped_column(String(255))
    prefect_flow_run_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    error: Mapped[str | None] = mapped_column(Text)
    lease_token: Mapped[str | None] = mapped_column(String(64))
    lease_host: Mapped[str | None] = mapped_column(String(255))
    lease_pid: Mapped[int | None] = mapped_column(Integer)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    plan_id: Mapped[str | None] = mapped_column(String(64))  # not a foreign key: see 0008


def _run_fk() -> Mapped[str]:
    return mapped_column(String(64), ForeignKey("runs.id", ondelete="CASCADE"))


class IterationRow(Base):
    """One training iteration of a run (table ``iterations``)."""

    __tablename__ = "iterations"
    __table_args__ = (UniqueConstraint("run_id", "step"), CheckConstraint("step >= 0", name="step_nonnegative"))

    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = _run_fk()
    step: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class MetricRow(Base):
    """One scalar metric at one step (table ``metrics``); ``value`` NULL = NaN or ±inf was recorded."""

    __tablename__ = "metrics"
    __table_args__ = (
        UniqueConstraint("run_id", "step", "name"),
        Index(None, "run_id", "name", "step"),
        CheckConstraint("step >= 0", name="step_nonnegative"),
    )

    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = _run_fk()
    step: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(_NAME_MAX))
    value: Mapped[float | None] = mapped_column(Double)


class CheckpointRow(Base):
    """One checkpoint of a run (table ``checkpoints``)."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "step"),
        CheckConstraint("step >= 0", name="step_nonnegative"),
        CheckConstraint("bytes >= 0", name="bytes_nonnegative"),
    )

    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = _run_fk()
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    complete: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    bad_reason: Mapped[str | None] = mapped_column(Text)


class PlacementRow(Base):
    """Where one worker group of a run was placed (table ``placements``)."""

    __tablename__ = "placements"
    __table_args__ = (
        CheckConstraint(_in("role", ROLES), name="role"),
        CheckConstraint(_in("executor", EXECUTORS), name="executor"),
        Index(None, "run_id"),
    )

    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = _run_fk()
    role: Mapped[str] = mapped_column(String(16))
    group_name: Mapped[str] = mapped_column(String(_NAME_MAX))
    ranks: Mapped[list[int]] = mapped_column(JSON)
    executor: Mapped[str] = mapped_column(String(16))
    slurm_job_id: Mapped[str | None] = mapped_column(String(64))
    hosts: Mapped[list[str]] = mapped_column(JSON)
    parallel: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class SampleRow(Base):
    """One sample generation of a run at one step (table ``samples``)."""

    __tablename__ = "samples"
    __table_args__ = (
        UniqueConstraint("run_id", "kind", "step", "idx"),
        Index(None, "run_id", "step"),
        CheckConstraint("step >= 0", name="step_nonnegative"),
        CheckConstraint("idx >= 0", name="idx_nonnegative"),
        CheckConstraint(_in("kind", SAMPLE_KINDS), name="kind"),
    )

    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = _run_fk()
    step: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(8))
    idx: Mapped[int] = mapped_column(Integer)
    data_source: Mapped[str] = mapped_column(String(_NAME_MAX))
    prompt: Mapped[str] = mapped_column(Text)
    response: Mapped[str] = mapped_column(Text)
    score: Mapped[float | None] = mapped_column(Double)
    ground_truth: Mapped[str] = mapped_column(Text)
    uid: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the prompt's id: <epoch>-<position>
    rollout_version: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the generating weights' updates
    rm_score: Mapped[float | None] = mapped_column(Double, nullable=True)  # the reward model's score of it
    judge_text: Mapped[str | None] = mapped_column(Text, nullable=True)  # a generative reward model's verdict
    reward_error: Mapped[str | None] = mapped_column(Text, nullable=True)  # why the score function gave none
    token_versions: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON [[version, tokens], ...]
    routed_experts: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON [token][MoE layer][k] expert ids


class StageTimeRow(Base):
    """When one stage of one iteration ran, and on which pool (table ``stage_times``): the iteration's timeline."""

    __tablename__ = "stage_times"
    __table_args__ = (
        Index("ix_stage_times_run_id_step", "run_id", "step"),  # a stage may run more than once per iteration
        CheckConstraint("step >= 0", name="step_nonnegative"),
    )

    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = _run_fk()
    step: Mapped[int] = mapped_column(Integer)
    stage: Mapped[str] = mapped_column(String(64))
    pool: Mapped[str | None] = mapped_column(String(_NAME_MAX))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime] = mapped_column(UTCDateTime)


class RecoveryRow(Base):
    """One recovery of a run inside its flow (table ``recoveries``): a worker group lost a rank at iteration
    ``step``, the flow relaunched the groups and went on from the checkpoint of step ``resumed_from``."""

    __tablename__ = "recoveries"
    __table_args__ = (Index(None, "run_id"), CheckConstraint("step >= 0", name="step_nonnegative"))

    id: Mapped[int] = mapped_column(_ID, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = _run_fk()
    step: Mapped[int] = mapped_column(Integer)  # the iteration that failed
    group_name: Mapped[str] = mapped_column(String(_NAME_MAX))
    ranks: Mapped[list[Any]] = mapped_column(JSON)
    nodes: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)  # where those ranks ran (null: unknown)
    cause: Mapped[str] = mapped_column(Text)
    failed_at: Mapped[datetime] = mapped_column(UTCDateTime)
    resumed_from: Mapped[int] = mapped_column(Integer)  # the checkpoint's step (0: from the start)
    lost_s: Mapped[float] = mapped_column(Double)  # training since that checkpoint, done again


class PlanRow(Base):
    """One placement plan (table ``placement_plans``): the planner's inputs, its candidates, its choice."""

    __tablename__ = "placement_plans"
    __table_args__ = (Index(None, "created_at"), CheckConstraint("candidate_count >= 0", name="count_nonnegative"))

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    source: Mapped[str] = mapped_column(String(_NAME_MAX))
    inputs: Mapped[dict[str, Any]] = mapped_column(JSON)
    candidates: Mapped[list[Any]] = mapped_column(JSON)
    candidate_count: Mapped[int] = mapped_column(Integer)
    rejected: Mapped[list[Any]] = mapped_column(JSON)
    chosen: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    chosen_seconds: Mapped[float | None] = mapped_column(Double)
    search_s: Mapped[float] = mapped_column(Double)
