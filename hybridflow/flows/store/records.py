"""What the run store's reads return: plain records of runs, iterations, metrics, checkpoints, samples, stage
times, plans and placements, detached from the session."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from hybridflow.flows.store.constants import LEASE_TTL_S
from hybridflow.flows.store.schema import CheckpointRow, PlacementRow, PlanRow, RunRow
from hybridflow.flows.store.validation import _now

if TYPE_CHECKING:
    pass


# --------------------------------------------------------------------------------------------------- read results


def _jsonable(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


class _Record:
    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (datetimes as ISO 8601 strings with ``+00:00``)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return (end - start).total_seconds() if start is not None and end is not None else None


@dataclass(frozen=True, slots=True)
class Run(_Record):
    """A run as stored. Times are UTC; ``started_at``/``ended_at`` are None until the run starts/ends.

    ``lease_host``, ``lease_pid``, ``heartbeat_at``: the controller holding the run and its last heartbeat (None
    while no controller holds it); `controller_state` tells a live controller from a crashed one.
    """

    id: str
    experiment_name: str
    config: dict[str, Any]
    status: str
    code_version: str
    prefect_flow_run_id: str | None
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    error: str | None
    lease_host: str | None = None
    lease_pid: int | None = None
    heartbeat_at: datetime | None = None
    kind: str = "rl"
    plan_id: str | None = None

    @property
    def duration_s(self) -> float | None:
        """Seconds from start to end, or None while not both are set."""
        return _seconds(self.started_at, self.ended_at)


@dataclass(frozen=True, slots=True)
class Iteration(_Record):
    """One iteration (step) of a run; ``ended_at`` is None while it runs or if it was interrupted."""

    run_id: str
    step: int
    started_at: datetime
    ended_at: datetime | None

    @property
    def duration_s(self) -> float | None:
        """Seconds the iteration took, or None if it has not ended."""
        return _seconds(self.started_at, self.ended_at)


class MetricPoint(NamedTuple):
    """One metric value: ``(step, name, value)``; ``value`` is None where NaN or ±inf was recorded."""

    step: int
    name: str
    value: float | None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict."""
        return self._asdict()


@dataclass(frozen=True, slots=True)
class Checkpoint(_Record):
    """A checkpoint: ``bytes`` is its size in bytes, ``sha256`` its lowercase hex digest (of its ``manifest.json``);
    ``bad_reason`` is None for a usable one, else why a resume must not start from it."""

    run_id: str
    step: int
    path: str
    bytes: int
    sha256: str
    complete: bool
    created_at: datetime
    bad_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Sample(_Record):
    """One sample generation: the prompt and response text, its score (None: NaN or ±inf) and ground truth, at
    iteration ``step`` (``kind`` train) or the validation after it (``kind`` val; step 0: before training);
    ``uid``: its prompt's id in the run (``<epoch>-<position>``, shared by the prompt's responses) and
    ``rollout_version``: the actor updates in the weights that generated it (None: not recorded); ``rm_score``: the
    reward model's score of it and ``judge_text``: a generative reward model's verdict (None: no such model);
    ``reward_error``: why its score function gave no score (it raised or timed out and the sample scored 0.0; None:
    it was scored); ``token_versions``: a streaming rollout's response tokens by the weight version that sampled
    them, ``[(version, tokens), ...]`` in response order (more than one: a partial rollout continued across a
    push; None: all of ``rollout_version``); ``routed_experts``: the experts each response token went to,
    ``[token][MoE layer][k]`` expert ids, -1 where nothing was recorded (kept with ``trainer.log_routed_experts``;
    None: not kept)."""

    run_id: str
    step: int
    kind: str
    idx: int
    data_source: str
    prompt: str
    response: str
    score: float | None
    ground_truth: str
    uid: str | None = None
    rollout_version: int | None = None
    rm_score: float | None = None
    judge_text: str | None = None
    reward_error: str | None = None
    token_versions: list[tuple[int, int]] | None = None
    routed_experts: list[list[list[int]]] | None = None


@dataclass(frozen=True, slots=True)
class Recovery(_Record):
    """A recovery inside the flow: at iteration ``step`` worker group ``group_name`` lost ``ranks`` (``cause``: the
    group's error line), the flow relaunched its groups and went on from the checkpoint of step ``resumed_from``;
    ``lost_s``: seconds of training since that checkpoint, done again; ``nodes``: where those ranks ran (the Slurm
    node, else the host; empty when unknown)."""

    run_id: str
    step: int
    group_name: str
    ranks: list[int]
    cause: str
    failed_at: datetime
    resumed_from: int
    lost_s: float
    nodes: list[str]


@dataclass(frozen=True, slots=True)
class StageTime(_Record):
    """One stage of iteration ``step``: its name (``gen``, ``ref``, ``update_actor``...), the pool (worker group)
    it ran on (None: the controller, e.g. ``adv``), when it started and ended."""

    run_id: str
    step: int
    stage: str
    pool: str | None
    started_at: datetime
    ended_at: datetime

    @property
    def duration_s(self) -> float:
        """Seconds the stage took."""
        return (self.ended_at - self.started_at).total_seconds()


@dataclass(frozen=True, slots=True)
class Plan(_Record):
    """A placement plan as stored: where it came from (``source``: the config file, or ``placement.auto`` of a
    run's experiment), the planner's ``inputs`` (models, workload, cluster, hardware profile, strategy space), the
    ``candidates`` kept (fastest first; ``candidate_count`` were feasible), the ``rejected`` placements with the
    reason, the ``chosen`` candidate (None: none runs in this version) and its estimated seconds per iteration, and
    the search's seconds."""

    id: str
    created_at: datetime
    source: str
    inputs: dict[str, Any]
    candidates: list[Any]
    candidate_count: int
    rejected: list[Any]
    chosen: dict[str, Any] | None
    chosen_seconds: float | None
    search_s: float


@dataclass(frozen=True, slots=True)
class Placement(_Record):
    """Where one worker group ran: its role, global ranks, executor, Slurm job id and hosts, and how the role's model
    is split over the ranks (``parallel``: strategy, layouts and groups; None when not recorded)."""

    run_id: str
    role: str
    group_name: str
    ranks: list[int]
    executor: str
    slurm_job_id: str | None
    hosts: list[str]
    parallel: dict[str, Any] | None
    created_at: datetime


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): kill(0) said it exists


def controller_state(run: Run, now: datetime | None = None) -> str | None:
    """Whether the controller holding `run`'s lease is alive: ``"live"``, ``"crashed"`` (its heartbeat is older
    than `LEASE_TTL_S`, or it ran on this host and its process is gone), or None when no controller holds it."""
    if run.lease_host is None or run.lease_pid is None:
        return None
    age = ((now or _now()) - run.heartbeat_at).total_seconds() if run.heartbeat_at else float("inf")
    if age > LEASE_TTL_S:
        return "crashed"
    if run.lease_host == socket.gethostname() and not _pid_alive(run.lease_pid):
        return "crashed"
    return "live"


def _plan(row: PlanRow) -> Plan:
    return Plan(
        row.id, row.created_at, row.source, row.inputs, row.candidates, row.candidate_count, row.rejected, row.chosen,
        row.chosen_seconds, row.search_s,
    )  # fmt: skip


def _run(row: RunRow) -> Run:
    return Run(
        id=row.id,
        experiment_name=row.experiment_name,
        config=row.config,
        status=row.status,
        code_version=row.code_version,
        prefect_flow_run_id=row.prefect_flow_run_id,
        created_at=row.created_at,
        started_at=row.started_at,
        ended_at=row.ended_at,
        error=row.error,
        lease_host=row.lease_host,
        lease_pid=row.lease_pid,
        heartbeat_at=row.heartbeat_at,
        kind=row.kind,
        plan_id=row.plan_id,
    )


def _checkpoint(row: CheckpointRow) -> Checkpoint:
    return Checkpoint(
        row.run_id, row.step, row.path, row.bytes, row.sha256, row.complete, row.created_at, row.bad_reason
    )


def _placement_record(row: PlacementRow) -> Placement:
    return Placement(
        run_id=row.run_id,
        role=row.role,
        group_name=row.group_name,
        ranks=list(row.ranks),
        executor=row.executor,
        slurm_job_id=row.slurm_job_id,
        hosts=list(row.hosts),
        parallel=row.parallel,
        created_at=row.created_at,
    )
