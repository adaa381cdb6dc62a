"""The run store: every HybridFlow run on record, in a SQLite file or a PostgreSQL database.

One `RunStore` per process (the Prefect flow, the ``hf`` command, a worker that reports checkpoints); several
processes may write to the same store at once. Opening a store migrates its database to the newest schema with
Alembic (``migrations/`` next to this file); opening an up-to-date one costs one query.

The package's modules: this one (`RunStore`: writes and queries), `schema` (the ORM models), `records` (what reads
return), `database` (URLs, engines, Alembic's configuration, the code version), `validation` (checks of what is
written), `constants` and `errors`; this module re-exports the public names (``__all__``).

Schema (revision ``0008``: ``migrations/versions/0001_initial.py`` to ``0008_placement_plans.py``; the ORM models
in `schema` describe the same tables):

- ``runs``: ``id`` (primary key, ``run-YYYYmmdd-HHMMSS-<6 hex>``, UTC), ``kind`` (rl: ``hf run``; rm: ``hf rm
  train``), ``experiment_name``, ``config`` (JSON: the full validated config), ``status`` (pending | running |
  completed | failed | interrupted), ``code_version`` (see `code_version`), ``prefect_flow_run_id`` (nullable),
  ``created_at``, ``started_at``, ``ended_at``, ``error`` (nullable text), the run lease ``lease_token``,
  ``lease_host``, ``lease_pid``, ``heartbeat_at`` (all nullable: see `RunStore.acquire_lease`), ``plan_id``
  (nullable: the placement plan its placement came from; not a foreign key); index on ``created_at``.
- ``iterations``: ``run_id`` → runs, ``step``, ``started_at``, ``ended_at`` (nullable); unique (run_id, step).
- ``metrics``: ``run_id`` → runs, ``step``, ``name``, ``value`` (double, nullable: NULL means the recorded value was
  NaN or ±inf); unique (run_id, step, name); index (run_id, name, step).
- ``checkpoints``: ``run_id`` → runs, ``step``, ``path``, ``bytes``, ``sha256`` (64 lowercase hex digits),
  ``complete``, ``created_at``, ``bad_reason`` (nullable text: why it must not be resumed from); unique (run_id, step).
- ``placements``: ``run_id`` → runs, ``role`` (actor | rollout | ref | critic | reward | reward_model),
  ``group_name``, ``ranks`` (JSON list of int), ``executor`` (local | slurm), ``slurm_job_id`` (nullable),
  ``hosts`` (JSON list of str), ``parallel`` (JSON, nullable: the role's training strategy, training and generation
  layouts and rank groups), ``created_at``; index on run_id.
- ``samples``: ``run_id`` → runs, ``step``, ``kind`` (train | val), ``idx``, ``data_source``, ``prompt``,
  ``response``, ``score`` (double, nullable), ``ground_truth``: sample generations (``trainer.log_val_generations``,
  ``trainer.log_train_generations``); unique (run_id, kind, step, idx); index (run_id, step).
- ``stage_times``: ``run_id``, ``step``, ``stage`` (``gen``, ``ref``, ``update_actor``...), ``pool`` (the worker
  group it ran on; NULL: the controller), ``started_at``, ``ended_at``: each iteration's timeline (stages of
  different pools overlap; a stage repeated in an iteration has a row per run); index (run_id, step).
- ``placement_plans``: ``id`` (``plan-YYYYmmdd-HHMMSS-<6 hex>``), ``created_at``, ``source``, ``inputs``,
  ``candidates``, ``rejected``, ``chosen`` (JSON), ``candidate_count``, ``chosen_seconds``, ``search_s``: every plan of
  ``hf plan`` and ``placement.auto`` (`Plan`).

The child tables have a 64-bit surrogate ``id`` primary key, a foreign key to ``runs.id`` (ON DELETE CASCADE;
SQLite enforces it because every connection turns ``PRAGMA foreign_keys`` on) and CHECK constraints on steps (>= 0),
bytes (>= 0) and the enumerated columns. Times are timezone-aware UTC datetimes taken from the writer's clock.

Decisions:

- Each write method is one transaction: on any error nothing of it is written. Re-recording a metric
  (run, step, name), an iteration (run, step) or a checkpoint (run, step) overwrites it (upsert), because a resumed
  run replays the step it was interrupted in. Placements are appended (a resumed run is placed again: history).
- Metric values: anything ``float()`` accepts except str/bytes/None (so numpy scalars and 0-d tensors work); NaN and
  ±inf are stored as NULL and read back as None (a diverged step stays on record; SQLite cannot store NaN anyway).
- SQLite: WAL journal, a 30 s busy timeout, foreign keys on, and write transactions start with ``BEGIN IMMEDIATE``
  (a deferred transaction that reads and then writes fails at once with "database is locked" when another process
  wrote in between; an immediate one waits for the lock instead).
- PostgreSQL: ``postgresql://`` and ``postgres://`` URLs are rewritten to ``postgresql+psycopg://`` (psycopg 3, a
  dependency; SQLAlchemy's default driver for the bare scheme is psycopg2). Concurrent migrations are serialised with
  a transaction-level advisory lock.
- Reads return frozen dataclasses (`Run`, `Iteration`, `Checkpoint`, `Placement`) and `MetricPoint` tuples, detached
  from any session; each has ``to_dict()`` (JSON-ready, ISO 8601 times) for ``hf runs ... --json``.

A new schema change is a new hand-written revision in ``migrations/versions`` (explicit columns, as in 0001)::

    from alembic import command
    from hybridflow.flows.store.run_store import alembic_config
    command.revision(alembic_config("sqlite:////tmp/scratch.db"), message="add foo", rev_id="0002")
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    delete,
    select,
    text,
    update,
)
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from hybridflow.flows.store.constants import (
    _PG_MIGRATION_LOCK,
    _SHA256,
    _WRITE_OPTION,
    EXECUTORS,
    FINAL_STATUSES,
    LEASE_RENEW_S,
    LEASE_TTL_S,
    MIGRATIONS_DIR,
    ROLES,
    RUN_KINDS,
    RUN_STATUSES,
    SAMPLE_KINDS,
)
from hybridflow.flows.store.database import (
    _create_engine,
    _parse_url,
    alembic_config,
    code_version,
    default_db_url,
    normalize_db_url,
)
from hybridflow.flows.store.errors import (
    LeaseHeldError,
    LeaseLostError,
    RunStoreError,
    UnknownPlanError,
    UnknownRunError,
)
from hybridflow.flows.store.records import (
    Checkpoint,
    Iteration,
    MetricPoint,
    Placement,
    Plan,
    Recovery,
    Run,
    Sample,
    StageTime,
    _checkpoint,
    _placement_record,
    _plan,
    _run,
    controller_state,
)
from hybridflow.flows.store.schema import (
    Base,
    CheckpointRow,
    IterationRow,
    MetricRow,
    PlacementRow,
    PlanRow,
    RecoveryRow,
    RunRow,
    SampleRow,
    StageTimeRow,
)
from hybridflow.flows.store.validation import _metric_value, _new_run_id, _now, _placement, _status, _step, _text

if TYPE_CHECKING:
    pass

__all__ = [
    "EXECUTORS",
    "LEASE_RENEW_S",
    "LEASE_TTL_S",
    "MIGRATIONS_DIR",
    "ROLES",
    "RUN_KINDS",
    "RUN_STATUSES",
    "Checkpoint",
    "Iteration",
    "LeaseHeldError",
    "LeaseLostError",
    "MetricPoint",
    "Placement",
    "Recovery",
    "Run",
    "RunStore",
    "RunStoreError",
    "Sample",
    "StageTime",
    "UnknownRunError",
    "alembic_config",
    "code_version",
    "controller_state",
    "default_db_url",
    "normalize_db_url",
]

# ------------------------------------------------------------------------------------------------------- the store


class RunStore:
    """Runs, iterations, metrics, checkpoints and placements in one database (see the module docstring).

    ``url``: ``sqlite:///path/runs.db`` (the folder is created) or ``postgresql://user:password@host:port/db``
    (normalised by `normalize_db_url`); None means `default_db_url`. With ``upgrade=True`` (the default) the
    database is migrated to the newest schema on opening.

    Raises ValueError for an unparsable or unsupported URL, and RunStoreError when the database cannot be reached or
    has a schema newer than this code. Usable as a context manager (`close` on exit).
    """

    def __init__(self, url: str | URL | None = None, *, upgrade: bool = True) -> None:
        self._url = _parse_url(default_db_url() if url is None else url)
        self._engine = _create_engine(self._url)
        self._write_engine = self._engine.execution_options(**{_WRITE_OPTION: True})
        self._reader = sessionmaker(self._engine, expire_on_commit=False)
        self._writer = sessionmaker(self._write_engine, expire_on_commit=False)
        if upgrade:
            try:
                self.upgrade()
            except BaseException:
                self._engine.dispose()
                raise

    @classmethod
    def open(cls, url: str | URL | None = None) -> RunStore:
        """Open the store at ``url`` (None: `default_db_url`) and migrate it to the newest schema."""
        return cls(url)

    # ---------------------------------------------------------------------------------------------- plumbing

    @property
    def url(self) -> str:
        """The database URL, password hidden (for messages)."""
        return self._url.render_as_string(hide_password=True)

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for inspection and tests; write through the methods)."""
        return self._engine

    def close(self) -> None:
        """Close the pooled connections. The store may not be used afterwards."""
        self._engine.dispose()

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RunStore({self.url!r})"

    def current_revision(self) -> str | None:
        """The database's Alembic revision (None for an empty database)."""
        from alembic.runtime.migration import MigrationContext

        with self._engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def upgrade(self) -> str:
        """Migrate the database to the newest revision, in one transaction, and return that revision.

        A no-op (one query) when the database is already there. Concurrent upgrades are safe: SQLite serialises them
        with its write lock, PostgreSQL with an advisory lock. Raises RunStoreError if the database cannot be reached
        or carries a revision this code does not know (written by a newer HybridFlow).
        """
        from alembic import command
        from alembic.script import ScriptDirectory
        from alembic.util import CommandError

        config = alembic_config(self._url.render_as_string(hide_password=False))
        script = ScriptDirectory.from_config(config)
        head = script.get_current_head()
        if head is None:
            raise RunStoreError(f"no migrations found in {MIGRATIONS_DIR}: this HybridFlow install is incomplete")
        try:
            current = self.current_revision()
            if current == head:
                return head
            if current is not None:
                try:
                    script.get_revision(current)
                except CommandError:
                    raise RunStoreError(
                        f"the run store {self.url} has schema revision {current!r}, unknown to this HybridFlow "
                        f"({code_version()}, newest revision {head!r}); upgrade HybridFlow, or point "
                        "HYBRIDFLOW_DB_URL at another database"
                    ) from None
            with self._write_engine.begin() as conn:
                if self._url.get_backend_name() == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
                config.attributes["connection"] = conn
                command.upgrade(config, "head")
        except OperationalError as err:
            if self._url.get_backend_name() == "sqlite":
                hint = f"check that the folder of {self._url.database} exists and is writable"
            else:
                hint = "check the URL (HYBRIDFLOW_DB_URL or --db), that the PostgreSQL server is running and reachable"
            reason = " ".join(str(err.orig).split())
            raise RunStoreError(f"cannot open the run store {self.url}: {reason}; {hint}") from None
        return head

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        """A session in one write transaction: committed on success, rolled back on any exception."""
        with self._writer() as session, session.begin():
            yield session

    @contextmanager
    def _reading(self) -> Iterator[Session]:
        with self._reader() as session:
            yield session

    def _require_run(self, session: Session, run_id: str) -> None:
        if session.scalar(select(RunRow.id).where(RunRow.id == run_id)) is None:
            raise UnknownRunError(run_id, self.url)

    def _insert(self, table: Any) -> Any:
        if self._url.get_backend_name() == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        return insert(table)

    def _upsert(self, session: Session, model: type[Base], keys: Sequence[str], values: dict[str, Any]) -> None:
        stmt = self._insert(model.__table__).values(**values)
        updates = {column: stmt.excluded[column] for column in values if column not in keys}
        session.execute(stmt.on_conflict_do_update(index_elements=list(keys), set_=updates))

    # ------------------------------------------------------------------------------------------------ writes

    def create_run(
        self, config: Mapping[str, Any], experiment_name: str, kind: str = "rl", plan_id: str | None = None
    ) -> str:
        """Record a new run with status ``pending`` and return its id (``run-YYYYmmdd-HHMMSS-<6 hex>``, UTC).

        ``kind`` is what it trains (`RUN_KINDS`: ``rl``, ``rm``, ``sft``, ``dpo``); ``plan_id`` the placement plan
        its placement came from (``placement.plan``), if any.

        ``config`` is the full validated config as plain JSON data (e.g. a pydantic model's
        ``model_dump(mode="json")``); it is stored as JSON and read back equal to ``json.loads(json.dumps(config))``.
        Raises ValueError if it is not a mapping or not JSON-serialisable (NaN included), or if ``experiment_name``
        is empty or longer than 255 characters.
        """
        if not isinstance(config, Mapping):
            raise ValueError(f"config must be a dict, got {type(config).__name__}; pass model_dump(mode='json')")
        try:
            stored = json.loads(json.dumps(dict(config), allow_nan=False))
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"config is not JSON-serialisable ({err}); pass plain data, e.g. the validated config's "
                "model_dump(mode='json')"
            ) from None
        name = _text(experiment_name, "experiment_name")
        if kind not in RUN_KINDS:
            raise ValueError(f"run kind must be one of {', '.join(RUN_KINDS)}, got {kind!r}")
        run_id = _new_run_id()  # a clash needs the same second and the same 24 random bits: an IntegrityError
        with self._writing() as session:
            session.add(
                RunRow(
                    id=run_id,
                    kind=kind,
                    experiment_name=name,
                    config=stored,
                    status="pending",
                    code_version=code_version(),
                    created_at=_now(),
                    plan_id=plan_id,
                )
            )
        return run_id

    def set_status(self, run_id: str, status: str, error: str | None = None) -> None:
        """Set a run's status (one of `RUN_STATUSES`) and its ``error`` (stored as given: None clears it).

        ``running`` sets ``started_at`` if unset and clears ``ended_at`` (a resumed run is running again);
        ``completed``, ``failed`` and ``interrupted`` set ``ended_at`` to now; ``pending`` changes no time.
        Raises ValueError for another status (listing the allowed ones), TypeError for a non-str error, and
        UnknownRunError for an unknown run.
        """
        status = _status(status)
        if error is not None and not isinstance(error, str):
            raise TypeError(f"error must be a str or None, got {type(error).__name__}; e.g. traceback.format_exc()")
        with self._writing() as session:
            row = session.get(RunRow, run_id, with_for_update=True)
            if row is None:
                raise UnknownRunError(run_id, self.url)
            now = _now()
            row.status = status
            row.error = error
            if status == "running":
                if row.started_at is None:
                    row.started_at = now
                row.ended_at = None
            elif status in FINAL_STATUSES:
                row.ended_at = now

    def set_flow_run_id(self, run_id: str, flow_run_id: str | uuid.UUID | None) -> None:
        """Record the id of the Prefect flow run driving this run (None clears it). Raises UnknownRunError."""
        value = None if flow_run_id is None else _text(str(flow_run_id), "flow_run_id", 64)
        with self._writing() as session:
            result = session.execute(update(RunRow).where(RunRow.id == run_id).values(prefect_flow_run_id=value))
            if result.rowcount == 0:
                raise UnknownRunError(run_id, self.url)

    def start_iteration(self, run_id: str, step: int) -> None:
        """Record that iteration ``step`` (int >= 0) starts now; a replayed step is restarted (``ended_at`` cleared).

        Raises ValueError for a bad step and UnknownRunError for an unknown run.
        """
        step = _step(step)
        with self._writing() as session:
            self._require_run(session, run_id)
            values = {"run_id": run_id, "step": step, "started_at": _now(), "ended_at": None}
            self._upsert(session, IterationRow, ("run_id", "step"), values)

    def end_iteration(self, run_id: str, step: int) -> None:
        """Record that iteration ``step`` ended now.

        Raises ValueError if the step was never started (call `start_iteration` first) and UnknownRunError for an
        unknown run.
        """
        step = _step(step)
        with self._writing() as session:
            self._require_run(session, run_id)
            result = session.execute(
                update(IterationRow)
                .where(IterationRow.run_id == run_id, IterationRow.step == step)
                .values(ended_at=_now())
            )
            if result.rowcount == 0:
                raise ValueError(
                    f"iteration {step} of run {run_id!r} was never started; call start_iteration({run_id!r}, {step}) "
                    "first"
                )

    def record_metrics(self, run_id: str, step: int, metrics: Mapping[str, Any]) -> None:
        """Record scalar metrics of one step, in one transaction; a (step, name) recorded before is overwritten.

        Values are anything ``float()`` accepts except str/bytes/None (numpy scalars, 0-d tensors); NaN and ±inf are
        stored as NULL and read back as None. Raises ValueError for a bad step, a name that is not a non-empty str of
        at most 255 characters, or a value that is not a number (and then records none of the batch), and
        UnknownRunError for an unknown run.
        """
        step = _step(step)
        if not isinstance(metrics, Mapping):
            raise ValueError(f"metrics must be a dict of name -> float, got {type(metrics).__name__}")
        with self._writing() as session:
            self._require_run(session, run_id)
            # Each item is checked as it is written: an error at any item rolls back the items before it.
            for name, value in metrics.items():
                values = {
                    "run_id": run_id,
                    "step": step,
                    "name": _text(name, "metric name"),
                    "value": _metric_value(step, name, value),
                }
                self._upsert(session, MetricRow, ("run_id", "step", "name"), values)

    def add_checkpoint(
        self,
        run_id: str,
        step: int,
        path: str | os.PathLike[str],
        bytes: int,  # the column's name (shadows the builtin here only)
        sha256: str,
        complete: bool = True,
    ) -> None:
        """Record the checkpoint of ``step`` (replacing one recorded before for that step).

        ``bytes``: its size in bytes (int >= 0); ``sha256``: its 64-hex-digit digest (stored lowercase);
        ``complete``: False while it is still being written (`latest_checkpoint` skips it), True once it is whole.
        Raises ValueError for a bad step, empty path, negative/non-int size, malformed digest or non-bool complete,
        and UnknownRunError for an unknown run.
        """
        step = _step(step)
        path_str = _text(os.fspath(path), "checkpoint path", 4096)
        if isinstance(bytes, bool) or not isinstance(bytes, int) or bytes < 0:
            raise ValueError(f"checkpoint bytes must be an int >= 0 (the size in bytes), got {bytes!r}")
        if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
            raise ValueError(f"sha256 must be 64 hex digits (hashlib.sha256(...).hexdigest()), got {sha256!r}")
        if not isinstance(complete, bool):
            raise ValueError(f"complete must be True or False, got {complete!r}")
        with self._writing() as session:
            self._require_run(session, run_id)
            values = {
                "run_id": run_id,
                "step": step,
                "path": path_str,
                "bytes": bytes,
                "sha256": sha256.lower(),
                "complete": complete,
                "created_at": _now(),
                "bad_reason": None,
            }
            self._upsert(session, CheckpointRow, ("run_id", "step"), values)

    def record_placement(self, run_id: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append where worker groups were placed, in one transaction.

        Each row: ``role`` (one of `ROLES`), ``group_name`` (str), ``ranks`` (non-empty list of ints >= 0),
        ``executor`` (``local`` or ``slurm``), optional ``slurm_job_id`` (str or int; stored as str) and ``hosts``
        (list of str, default []). Raises ValueError naming the bad row and key (nothing is recorded then), and
        UnknownRunError for an unknown run.
        """
        if isinstance(rows, Mapping) or not isinstance(rows, Sequence):
            raise ValueError(f"rows must be a list of dicts (one per worker group), got {type(rows).__name__}")
        now = _now()
        placements = [_placement(run_id, i, row, now) for i, row in enumerate(rows)]
        with self._writing() as session:
            self._require_run(session, run_id)
            session.add_all(placements)

    def acquire_lease(self, run_id: str, token: str, pid: int | None = None) -> Run:
        """Make the calling controller (this host, process `pid`, default this one) the one that trains `run_id`,
        identified by `token` (random, one per controller); a stale lease (`controller_state` ``"crashed"``) is taken
        over. Returns the run as it was before (its old lease tells whom this took over from).

        Raises:
            LeaseHeldError: another controller's lease is live (the message names its host and pid).
            UnknownRunError: no such run.
        """
        with self._writing() as session:
            row = session.get(RunRow, run_id, with_for_update=True)
            if row is None:
                raise UnknownRunError(run_id, self.url)
            before = _run(row)
            if row.lease_token not in (None, token) and controller_state(before) == "live":
                raise LeaseHeldError(before)
            row.lease_token, row.lease_host = token, socket.gethostname()
            row.lease_pid, row.heartbeat_at = os.getpid() if pid is None else pid, _now()
            return before

    def renew_lease(self, run_id: str, token: str) -> None:
        """Record a heartbeat of the lease `token` holds. Raises LeaseLostError if another controller took it."""
        with self._writing() as session:
            result = session.execute(
                update(RunRow).where(RunRow.id == run_id, RunRow.lease_token == token).values(heartbeat_at=_now())
            )
            if result.rowcount == 0:
                raise LeaseLostError(f"the lease on run {run_id} was taken over by another controller")

    def release_lease(self, run_id: str, token: str) -> None:
        """Give up the lease `token` holds (a no-op if it holds none): the run has no controller any more."""
        with self._writing() as session:
            session.execute(
                update(RunRow)
                .where(RunRow.id == run_id, RunRow.lease_token == token)
                .values(lease_token=None, lease_host=None, lease_pid=None, heartbeat_at=None)
            )

    def mark_checkpoint_bad(self, run_id: str, step: int, reason: str) -> None:
        """Record that the checkpoint of `step` must not be resumed from, and why (`latest_checkpoint` then skips
        it; recording the step's checkpoint anew clears the mark). Raises ValueError if no checkpoint of that step
        is recorded, UnknownRunError for an unknown run."""
        step = _step(step)
        reason = _text(reason, "reason", 4000)
        with self._writing() as session:
            self._require_run(session, run_id)
            result = session.execute(
                update(CheckpointRow)
                .where(CheckpointRow.run_id == run_id, CheckpointRow.step == step)
                .values(bad_reason=reason)
            )
            if result.rowcount == 0:
                raise ValueError(f"run {run_id} has no checkpoint of step {step} recorded (hf runs show {run_id})")

    def record_samples(self, run_id: str, step: int, kind: str, samples: Sequence[Mapping[str, Any]]) -> None:
        """Record the sample generations of one step, replacing any recorded before for (run, kind, step) (a redone
        iteration replaces its samples), in one transaction.

        Each sample is a mapping with ``prompt``, ``response`` (str), ``score`` (a number; NaN/±inf stored as NULL)
        and optionally ``data_source`` and ``ground_truth`` (str; "" when absent), ``uid`` (str: the prompt's id)
        and ``rollout_version`` (int: the actor updates in the generating weights), ``rm_score`` (a number: the reward
        model's score), ``judge_text`` (str: a generative reward model's verdict), ``reward_error`` (str: why the
        score function gave none; "" or None when it did) and ``token_versions`` (``[(version, tokens), ...]``: a
        streaming rollout's tokens by the version that sampled them) and ``routed_experts`` (``[token][MoE layer][k]``
        expert ids: the response tokens' routes). Raises ValueError for a bad step,
        a `kind` not in `SAMPLE_KINDS`, or a sample missing a key or with a non-numeric score (nothing is recorded),
        and UnknownRunError for an unknown run.
        """
        step = _step(step)
        if kind not in SAMPLE_KINDS:
            raise ValueError(f"sample kind must be one of {', '.join(SAMPLE_KINDS)}, got {kind!r}")
        rows = []
        for idx, sample in enumerate(samples):
            missing = [k for k in ("prompt", "response", "score") if k not in sample]
            if missing:
                raise ValueError(f"sample {idx} of step {step} has no {', '.join(missing)}")
            rows.append(
                SampleRow(
                    run_id=run_id,
                    step=step,
                    kind=kind,
                    idx=idx,
                    data_source=_text(sample.get("data_source") or "-", "data_source"),
                    prompt=str(sample["prompt"]),
                    response=str(sample["response"]),
                    score=_metric_value(step, f"sample {idx} score", sample["score"]),
                    ground_truth=str(sample.get("ground_truth") or ""),
                    uid=sample.get("uid"),
                    rollout_version=sample.get("rollout_version"),
                    rm_score=None
                    if sample.get("rm_score") is None
                    else _metric_value(step, f"sample {idx} rm_score", sample["rm_score"]),
                    judge_text=sample.get("judge_text"),
                    reward_error=sample.get("reward_error") or None,
                    token_versions=None
                    if sample.get("token_versions") is None
                    else json.dumps([[int(v), int(n)] for v, n in sample["token_versions"]]),
                    routed_experts=None
                    if sample.get("routed_experts") is None
                    else json.dumps(sample["routed_experts"], separators=(",", ":")),
                )
            )
        with self._writing() as session:
            self._require_run(session, run_id)
            session.execute(
                delete(SampleRow).where(SampleRow.run_id == run_id, SampleRow.kind == kind, SampleRow.step == step)
            )
            session.add_all(rows)

    def record_recovery(
        self,
        run_id: str,
        step: int,
        group_name: str,
        ranks: Sequence[int],
        cause: str,
        resumed_from: int,
        lost_s: float,
        nodes: Sequence[str] = (),
    ) -> None:
        """Record a recovery inside the flow (`Recovery`), failed now. Raises ValueError for a bad step or a negative
        `lost_s`, UnknownRunError for an unknown run."""
        step, resumed_from = _step(step), _step(resumed_from)
        if not math.isfinite(lost_s) or lost_s < 0:
            raise ValueError(f"lost_s must be seconds >= 0, got {lost_s!r}")
        with self._writing() as session:
            self._require_run(session, run_id)
            session.add(
                RecoveryRow(
                    run_id=run_id,
                    step=step,
                    group_name=_text(group_name, "group_name"),
                    ranks=[int(r) for r in ranks],
                    nodes=[str(n) for n in nodes],
                    cause=str(cause),
                    failed_at=_now(),
                    resumed_from=resumed_from,
                    lost_s=float(lost_s),
                )
            )

    def recoveries(self, run_id: str) -> list[Recovery]:
        """The run's recoveries inside the flow, oldest first. Raises UnknownRunError."""
        with self._reading() as session:
            self._require_run(session, run_id)
            rows = session.scalars(
                select(RecoveryRow).where(RecoveryRow.run_id == run_id).order_by(RecoveryRow.failed_at, RecoveryRow.id)
            )
            return [
                Recovery(
                    r.run_id,
                    r.step,
                    r.group_name,
                    list(r.ranks),
                    r.cause,
                    r.failed_at,
                    r.resumed_from,
                    r.lost_s,
                    list(r.nodes or []),
                )  # fmt: skip
                for r in rows
            ]

    def record_stage_times(self, run_id: str, step: int, spans: Sequence[Sequence[Any]]) -> None:
        """Record the timeline of iteration `step`, replacing any recorded before for it (a redone iteration
        replaces its timeline), in one transaction.

        Each span is ``(stage, pool, start, end)`` (a `hybridflow.engine.metrics.Span`): the stage's name, its pool
        (str, or None for the controller) and its start and end in seconds since the epoch. Raises ValueError for a
        bad step, a span that is not four fields, or one that ends before it starts (nothing is recorded), and
        UnknownRunError for an unknown run.
        """
        step = _step(step)
        rows = []
        for index, span in enumerate(spans):
            if isinstance(span, str | bytes) or not isinstance(span, Sequence) or len(span) != 4:
                raise ValueError(f"span {index} of step {step} must be (stage, pool, start, end), got {span!r}")
            stage, pool, start, end = span
            if not all(isinstance(t, int | float) and math.isfinite(t) for t in (start, end)) or end < start:
                raise ValueError(
                    f"span {index} ({stage!r}) of step {step}: start {start!r} to end {end!r} is not a time span"
                )
            rows.append(
                StageTimeRow(
                    run_id=run_id,
                    step=step,
                    stage=_text(stage, f"span {index} stage", 64),
                    pool=None if pool is None else _text(pool, f"span {index} pool"),
                    started_at=datetime.fromtimestamp(start, UTC),
                    ended_at=datetime.fromtimestamp(end, UTC),
                )
            )
        with self._writing() as session:
            self._require_run(session, run_id)
            session.execute(delete(StageTimeRow).where(StageTimeRow.run_id == run_id, StageTimeRow.step == step))
            session.add_all(rows)

    def stage_times(self, run_id: str, step: int | None = None) -> list[StageTime]:
        """The run's stage timeline ordered by step and start; only iteration `step` if given. Raises
        UnknownRunError."""
        query = select(StageTimeRow).where(StageTimeRow.run_id == run_id)
        if step is not None:
            query = query.where(StageTimeRow.step == step)
        with self._reading() as session:
            self._require_run(session, run_id)
            rows = session.scalars(query.order_by(StageTimeRow.step, StageTimeRow.started_at, StageTimeRow.id))
            return [StageTime(r.run_id, r.step, r.stage, r.pool, r.started_at, r.ended_at) for r in rows]

    def record_plan(
        self,
        source: str,
        inputs: Mapping[str, Any],
        candidates: Sequence[Mapping[str, Any]],
        candidate_count: int,
        rejected: Sequence[Mapping[str, Any]],
        chosen: Mapping[str, Any] | None,
        search_s: float,
    ) -> str:
        """Record a placement plan (plain JSON data, as `hybridflow.flows.placement.render.plan_record` makes it) and
        return
        its id (``plan-YYYYmmdd-HHMMSS-<6 hex>``). Raises ValueError for data that is not JSON-serialisable or a
        negative count."""
        try:
            data = json.loads(
                json.dumps([dict(inputs), [dict(c) for c in candidates], [dict(r) for r in rejected],
                            None if chosen is None else dict(chosen)], allow_nan=False)
            )  # fmt: skip
        except (TypeError, ValueError) as err:
            raise ValueError(f"plan is not JSON-serialisable ({err})") from None
        if not isinstance(candidate_count, int) or candidate_count < 0:
            raise ValueError(f"candidate_count must be an int >= 0, got {candidate_count!r}")
        plan_id = f"plan-{_now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
        with self._writing() as session:
            session.add(
                PlanRow(
                    id=plan_id,
                    created_at=_now(),
                    source=_text(source, "source"),
                    inputs=data[0],
                    candidates=data[1],
                    candidate_count=candidate_count,
                    rejected=data[2],
                    chosen=data[3],
                    chosen_seconds=None if chosen is None else float(chosen["seconds"]),
                    search_s=float(search_s),
                )
            )
        return plan_id

    def plans(self) -> list[Plan]:
        """Every placement plan, newest first."""
        with self._reading() as session:
            return [_plan(r) for r in session.scalars(select(PlanRow).order_by(PlanRow.created_at.desc()))]

    def get_plan(self, plan_id: str) -> Plan:
        """One placement plan. Raises UnknownPlanError."""
        with self._reading() as session:
            row = session.get(PlanRow, plan_id)
            if row is None:
                raise UnknownPlanError(plan_id, self.url)
            return _plan(row)

    def update_config(self, run_id: str, config: Mapping[str, Any]) -> None:
        """Replace a run's stored config (``hf resume -o ...`` extending a run; the caller has checked that the
        change leaves the computation as it was). Raises ValueError as `create_run` and UnknownRunError."""
        if not isinstance(config, Mapping):
            raise ValueError(f"config must be a dict, got {type(config).__name__}; pass model_dump(mode='json')")
        stored = json.loads(json.dumps(dict(config), allow_nan=False))
        with self._writing() as session:
            result = session.execute(update(RunRow).where(RunRow.id == run_id).values(config=stored))
            if result.rowcount == 0:
                raise UnknownRunError(run_id, self.url)

    def delete_run(self, run_id: str) -> None:
        """Delete a run and everything recorded of it (iterations, metrics, checkpoints' records, placements,
        samples: the foreign keys cascade), in one transaction. Files on disk are the caller's.

        Raises UnknownRunError."""
        with self._writing() as session:
            if session.execute(delete(RunRow).where(RunRow.id == run_id)).rowcount == 0:
                raise UnknownRunError(run_id, self.url)

    # ------------------------------------------------------------------------------------------------- reads

    def get_run(self, run_id: str) -> Run:
        """The run ``run_id``. Raises UnknownRunError (a KeyError) naming the id if there is none."""
        with self._reading() as session:
            row = session.get(RunRow, run_id)
            if row is None:
                raise UnknownRunError(run_id, self.url)
            return _run(row)

    def list_runs(self, limit: int | None = 50) -> list[Run]:
        """The newest ``limit`` runs (None: all), newest first. Raises ValueError for a limit < 1."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")
        with self._reading() as session:
            rows = session.scalars(select(RunRow).order_by(RunRow.created_at.desc(), RunRow.id.desc()).limit(limit))
            return [_run(row) for row in rows]

    def iterations(self, run_id: str) -> list[Iteration]:
        """The run's iterations ordered by step. Raises UnknownRunError."""
        with self._reading() as session:
            self._require_run(session, run_id)
            rows = session.scalars(
                select(IterationRow).where(IterationRow.run_id == run_id).order_by(IterationRow.step)
            )
            return [Iteration(r.run_id, r.step, r.started_at, r.ended_at) for r in rows]

    def metrics(self, run_id: str, name: str | None = None) -> list[MetricPoint]:
        """The run's metrics as ``(step, name, value)`` ordered by step (then name); only ``name`` if given.

        ``value`` is None where NaN or ±inf was recorded. Raises UnknownRunError.
        """
        query = select(MetricRow.step, MetricRow.name, MetricRow.value).where(MetricRow.run_id == run_id)
        if name is not None:
            query = query.where(MetricRow.name == name)
        with self._reading() as session:
            self._require_run(session, run_id)
            rows = session.execute(query.order_by(MetricRow.step, MetricRow.name))
            return [MetricPoint(step, metric, value) for step, metric, value in rows]

    def checkpoints(self, run_id: str) -> list[Checkpoint]:
        """The run's checkpoints ordered by step, complete or not. Raises UnknownRunError."""
        with self._reading() as session:
            self._require_run(session, run_id)
            rows = session.scalars(
                select(CheckpointRow).where(CheckpointRow.run_id == run_id).order_by(CheckpointRow.step)
            )
            return [_checkpoint(r) for r in rows]

    def latest_checkpoint(self, run_id: str) -> Checkpoint | None:
        """The complete checkpoint with the highest step not marked bad (None if there is none): where a resume
        starts.

        Raises UnknownRunError."""
        with self._reading() as session:
            self._require_run(session, run_id)
            row = session.scalars(
                select(CheckpointRow)
                .where(
                    CheckpointRow.run_id == run_id,
                    CheckpointRow.complete.is_(True),
                    CheckpointRow.bad_reason.is_(None),
                )
                .order_by(CheckpointRow.step.desc())
                .limit(1)
            ).first()
            return None if row is None else _checkpoint(row)

    def samples(self, run_id: str, step: int | None = None, kind: str | None = None) -> list[Sample]:
        """The run's sample generations ordered by step, kind (train before val) and place; only `step` / `kind`
        if given. Raises UnknownRunError."""
        query = select(SampleRow).where(SampleRow.run_id == run_id)
        if step is not None:
            query = query.where(SampleRow.step == step)
        if kind is not None:
            query = query.where(SampleRow.kind == kind)
        with self._reading() as session:
            self._require_run(session, run_id)
            rows = session.scalars(query.order_by(SampleRow.step, SampleRow.kind, SampleRow.idx))
            return [
                Sample(
                    r.run_id,
                    r.step,
                    r.kind,
                    r.idx,
                    r.data_source,
                    r.prompt,
                    r.response,
                    r.score,
                    r.ground_truth,
                    r.uid,
                    r.rollout_version,
                    r.rm_score,
                    r.judge_text,
                    r.reward_error,
                    None if r.token_versions is None else [tuple(run) for run in json.loads(r.token_versions)],
                    None if r.routed_experts is None else json.loads(r.routed_experts),
                )
                for r in rows
            ]

    def placements(self, run_id: str) -> list[Placement]:
        """The run's placements in the order recorded. Raises UnknownRunError."""
        with self._reading() as session:
            self._require_run(session, run_id)
            rows = session.scalars(
                select(PlacementRow)
                .where(PlacementRow.run_id == run_id)
                .order_by(PlacementRow.created_at, PlacementRow.id)
            )
            return [_placement_record(r) for r in rows]
