"""The run's lifecycle, shared by the RLHF flow (`hybridflow.flows.rlhf`) and the reward-model flow
(`hybridflow.flows.rm`): launching the worker groups of the run's pools and ending them, the run's folders,
checkpoints (written, verified, chosen for a resume), recording how a run stopped, and the progress events the CLI
listens to.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run

from hybridflow.engine.checkpoint import CheckpointError, verify_checkpoint
from hybridflow.engine.config import HybridFlowConfig, Pool, RMTrainingConfig, SFTTrainingConfig
from hybridflow.engine.extensions import engine_tp, training_backend
from hybridflow.flows.groups import WORKER_CLS, group_spec
from hybridflow.flows.lease import RunLease
from hybridflow.flows.reporting import FlowLogs, RunReport
from hybridflow.flows.store.run_store import LeaseLostError, RunStore
from hybridflow.slurm.channel import create_secret
from hybridflow.slurm.handles import DataHandle
from hybridflow.slurm.worker_group import WorkerGroup, WorkerGroupError
from hybridflow.tasks import stages

logger = logging.getLogger(__name__)


INTERRUPT_GRACE_S = 3.0
"""Seconds a worker group gets to exit after Ctrl-C / SIGTERM before its job is cancelled and its ranks killed."""


# Progress listeners: callables (event, data) the CLI registers for its live display. Events: "flow" (run_id,
# ui_url), "fallback" (message: a checkpoint failed verification), "resumed" (step, path), "start" (run_id, total,
# start_step), "stage" (name, step), "iteration" (step, metrics), "validation" (metrics), "preempted" (message),
# "recovery" (cause, attempt, limit, resumed_from: a worker group lost ranks, or Slurm warned it (attempt 0), and
# the flow relaunches the groups).
listeners: list[Callable[[str, dict[str, Any]], None]] = []


def notify(event: str, **data: Any) -> None:
    """Send a progress event (see `listeners`) to every listener."""
    for listener in listeners:
        listener(event, data)


def enter_stage(name: str, iteration: int, step: int) -> None:
    """Announce stage `name`; its Prefect task run is named ``<task>-<iteration>``."""
    notify("stage", name=name, step=step)
    stages.ITERATION.set(iteration)


def flow_run_ui_url() -> str | None:
    """Link to this flow run in the Prefect UI (served by the API's server), or None outside a server."""
    api = os.environ.get("PREFECT_API_URL")
    if not api or not flow_run.id:
        return None
    return f"{api.rstrip('/').removesuffix('/api')}/runs/flow-run/{flow_run.id}"


def take_over_flow_run(store: RunStore, run_id: str) -> None:
    """Record this flow run as the run's Prefect flow run. The one recorded before, still RUNNING (or PENDING) in
    Prefect, belonged to a controller that died without a word (SIGKILL, a lost node: nothing could tell the
    server, which would show it running forever); it is set Crashed, naming the flow run that took over, and so is
    the subflow of the iteration it was in. This controller holds the run's lease, so that controller is gone.
    Prefect unreachable: a warning, never a failure (reporting must not cost training)."""
    if not flow_run.id:
        return
    previous = store.get_run(run_id).prefect_flow_run_id
    store.set_flow_run_id(run_id, str(flow_run.id))
    if not previous or previous == str(flow_run.id):
        return
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    live = (StateType.RUNNING, StateType.PENDING)
    try:
        with get_client(sync_client=True) as client:
            old = client.read_flow_run(UUID(previous))
            if old.state is not None and old.state.type in live:
                message = f"its controller died; run {run_id} continues in flow run {flow_run.id}"
                client.set_flow_run_state(UUID(previous), Crashed(message=message), force=True)
                # the iteration it was in: its subflow
                of_old = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[UUID(previous)]))
                for sub in client.read_flow_runs(flow_run_filter=of_old):
                    if sub.state is not None and sub.state.type in live:
                        client.set_flow_run_state(sub.id, Crashed(message=message), force=True)
    except Exception as error:  # noqa: BLE001 - the server's bookkeeping, not the run's
        logger.warning("could not mark the earlier flow run %s of run %s crashed: %s", previous, run_id, error)


def run_dir_of(cfg: HybridFlowConfig, run_id: str) -> Path:
    """``<trainer.output_dir>/<trainer.experiment_name>/<run_id>``: logs, batches, checkpoints of one run."""
    return Path(cfg.trainer.output_dir).resolve() / cfg.trainer.experiment_name / run_id


def checkpoint_dir_of(cfg: HybridFlowConfig, run_id: str) -> Path:
    """Where the run's ``global_step_<N>`` checkpoints go: ``<trainer.checkpoint_dir>/<run_id>`` when
    ``trainer.checkpoint_dir`` is set (e.g. a larger file system; one folder per run, so runs never mix), else
    ``<run folder>/checkpoints``."""
    if cfg.trainer.checkpoint_dir:
        return Path(cfg.trainer.checkpoint_dir).resolve() / run_id
    return run_dir_of(cfg, run_id) / "checkpoints"


def parallel_record(cfg: HybridFlowConfig | RMTrainingConfig | SFTTrainingConfig, role: str) -> dict[str, Any] | None:
    """How `role`'s model is split over its pool's ranks, for the run store (``placements.parallel``): the
    strategy of the trained and scoring models (actor, critic, reward model; a reward model in training: ddp; the
    policy of an SFT or DPO run: ``model.strategy``) and, for the actor, its training layout and, with
    ``megatron``, the generation layout, the resharding mode and the rank groups (`HybridLayout.describe`); for a
    rollout in a pool of its own, its engine, replicas and how its weights arrive
    (``rollout.checkpoint_engine.backend``); None for ref and the score function (whole on every rank)."""
    if not isinstance(cfg, HybridFlowConfig):  # one group: a reward model (ddp), a policy (SFT, DPO: model.strategy)
        return {"strategy": getattr(cfg.model, "strategy", "ddp")}
    if role == "critic":
        return {"strategy": cfg.critic.strategy}
    if role == "reward_model":
        return {"strategy": cfg.reward_model.strategy}
    if role not in ("actor", "rollout"):
        return None
    if role == "rollout" and cfg.rollout_apart():  # engines of its own pool (each over tp ranks), fed published weights
        tp = engine_tp(cfg)
        return {
            "engine": cfg.rollout.name,
            "dp": cfg.pool_of("rollout").world_size // tp,
            "weights": cfg.rollout.checkpoint_engine.backend,
            **({"tp": tp} if tp > 1 else {}),
        }
    world = cfg.pool_of("actor").world_size
    return {"strategy": cfg.actor.strategy, **training_backend(cfg.actor.strategy).layout_record(cfg, world)}


def _with_counts(parallel: dict[str, Any] | None, role: str, counts: dict[str, Any]) -> dict[str, Any] | None:
    """`parallel` with `role`'s parameter counts from its worker's ``init_model``: ``params`` (all of the model's,
    a LoRA adapter's included) and ``trainable_params`` (what its optimizer updates), where the rank could tell."""
    found = {key: counts[f"{role}_{key}"] for key in ("params", "trainable_params") if f"{role}_{key}" in counts}
    if not found:
        return parallel
    return {**(parallel or {}), **found}


@dataclass
class Workers:
    """The run's worker groups, and which group serves each role."""

    groups: dict[str, WorkerGroup] = field(default_factory=dict)
    by_role: dict[str, WorkerGroup] = field(default_factory=dict)

    def __getitem__(self, role: str) -> WorkerGroup:
        return self.by_role[role]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Shut every group down (each gets `timeout_s` seconds to exit before its job is cancelled); one that fails
        to stop does not keep the others running."""
        for name, group in self.groups.items():
            try:
                group.shutdown(timeout_s)
            except Exception:  # log it and go on to the next group's job
                logger.exception("shutting down worker group %s (job %s) failed", name, group.job_id)


def launch_workers(
    cfg: HybridFlowConfig | RMTrainingConfig | SFTTrainingConfig,
    run_id: str,
    store: RunStore,
    run_dir: Path,
    pools: dict[str, Pool] | None = None,
    worker_cls: str = WORKER_CLS,
) -> Workers:
    """Start one worker group per resource pool of `pools` (default: the run's, `HybridFlowConfig.pools`), each a
    submitit job of ranks serving `worker_cls` with ``(config, roles)``, load their models, and record the
    placement (pool, ranks, strategy, Slurm job) in the store. Every pool's job is submitted before any is waited
    for, so on Slurm no group sits allocated while another waits in the queue. If anything fails, the groups
    already started are shut down."""
    # A new secret for every controller session: a message captured from an earlier session (whose nonces this
    # controller never saw) cannot be replayed to this one.
    secret = run_dir / "secret"
    secret.unlink(missing_ok=True)
    create_secret(secret)
    workers = Workers()
    pools = pools or cfg.pools()
    try:
        for name, pool in pools.items():
            workers.groups[name] = WorkerGroup(
                group_spec(cfg, pool, worker_cls),
                run_dir=run_dir,
                data_dir=run_dir / "data",
                secret_path=secret,
                worker_kwargs={"config": cfg.model_dump(mode="json"), "roles": list(pool.roles)},
                wait=False,
            )
            workers.by_role.update({role: workers.groups[name] for role in pool.roles})
        for group in workers.groups.values():
            group.wait_ready()
        # every group loads its models at once (separate processes): a run of four pools waits for the slowest
        with ThreadPoolExecutor(max_workers=len(workers.groups)) as pool_loads:
            loads = {name: pool_loads.submit(group.init_model) for name, group in workers.groups.items()}
        for name, group in workers.groups.items():
            counts = loads[name].result()[0]  # rank 0's parameter counts of its roles
            rows = [
                {"role": role, **group.placement, "parallel": _with_counts(parallel_record(cfg, role), role, counts)}
                for role in pools[name].roles
            ]
            store.record_placement(run_id, rows)
    except BaseException:
        workers.shutdown()
        raise
    return workers


def end_session(
    lease: RunLease,
    workers: Workers | None,
    report: RunReport | None,
    logs: FlowLogs | None,
    interrupted: bool,
    completed: bool,
) -> None:
    """A controller session's last steps, each done even if one before it fails: shut the worker groups down (a
    group stopped by the user gets `INTERRUPT_GRACE_S` seconds: a rank busy in a stage is not waited for), close
    the trackers (`completed`: the run finished), stop forwarding logs, release the run's lease."""
    try:
        if workers is not None:
            workers.shutdown(timeout_s=INTERRUPT_GRACE_S if interrupted else 30.0)
    finally:
        try:
            if report is not None:
                report.close(ok=completed)
            if logs is not None:
                logs.__exit__(None, None, None)
        finally:
            lease.release()


def record_stop(store: RunStore, run_id: str, lease: RunLease, error: BaseException) -> bool:
    """Record why a controller session ends early: ``interrupted`` for Ctrl-C or SIGTERM (resumable from the last
    checkpoint), ``failed`` with the traceback's tail otherwise; nothing when another controller took the run over
    (`LeaseLostError`, or the lease is lost). Returns whether the run was interrupted by the user."""
    if isinstance(error, LeaseLostError) or lease.lost:
        return False
    if isinstance(error, KeyboardInterrupt | TerminationSignal):
        stopped = "SIGTERM" if isinstance(error, TerminationSignal) else "an interrupt (Ctrl-C)"
        store.set_status(run_id, "interrupted", error=f"stopped by {stopped}; continue with hf resume {run_id}")
        return True
    store.set_status(run_id, "failed", error="".join(traceback.format_exception(error))[-4000:])
    return False


def recover_or_raise(store: RunStore, run_id: str, error: WorkerGroupError, recoveries: int, trainer: Any) -> int:
    """After a controller session of run `run_id` failed with `error`: raise it when relaunching cannot help (a
    rank raised: its code, its data, a NaN guard; ``error.lost`` is false) or the run has already recovered
    ``trainer.max_recoveries`` times; else put the recovery on record (`record_recovery`), wait
    ``trainer.recovery_backoff_s`` (doubled for each earlier recovery) and return the recoveries so far: the caller
    then relaunches its worker groups and goes on from the newest usable checkpoint.

    Args:
        recoveries: the recoveries of this run by this controller before this one.
        trainer: the run config's ``trainer`` section (``max_recoveries``, ``recovery_backoff_s``).

    Raises:
        WorkerGroupError: `error`, when it is not recovered from.
    """
    if not error.lost or recoveries >= trainer.max_recoveries:
        raise error
    recoveries += 1
    record_recovery(store, run_id, error, recoveries, trainer.max_recoveries)
    time.sleep(trainer.recovery_backoff_s * 2 ** (recoveries - 1))
    return recoveries


def record_recovery(store: RunStore, run_id: str, error: WorkerGroupError, attempt: int, limit: int) -> None:
    """A recovery inside the flow, put on record before the flow relaunches its groups: in the run store
    (`RunStore.record_recovery`: the failed iteration, the group and ranks lost, the cause's first line, the
    checkpoint the run goes on from and the seconds of training since it), as a Prefect event
    (``hybridflow.run.recovered``, on the run and its flow run) and a warning in the flow run's logs, and to the
    CLI (``recovery``)."""
    cause = str(error).strip().splitlines()[0]
    group, event = error.group or "?", "hybridflow.run.recovered"
    resumed_from = _record_relaunch(store, run_id, group, error.ranks, error.nodes, cause, event)
    logger.warning(
        "run %s: %s\nrecovering by itself (%d of %d, trainer.max_recoveries): relaunching the worker groups, going "
        "on from %s",
        run_id,
        cause,
        attempt,
        limit,
        f"global_step_{resumed_from}" if resumed_from else "the start",
    )
    notify("recovery", cause=cause, attempt=attempt, limit=limit, resumed_from=resumed_from)


def record_resubmission(
    store: RunStore, run_id: str, steps_done: int, warned: dict[str, list[int]], nodes: list[str], signals: str
) -> None:
    """Slurm warned the `warned` groups' ranks (``{group: ranks}``, on `nodes`; `signals`: which signal each got) and
    the run
    checkpointed after `steps_done` iterations: on record as a recovery of iteration ``steps_done + 1``
    (`record_recovery`'s places; cause ``Slurm's warning (...)``, event ``hybridflow.run.resubmitted``) before the
    flow resubmits its groups (``trainer.resubmit_on_preemption``)."""
    cause = f"Slurm's warning ({signals})"
    ranks = sorted({r for group_ranks in warned.values() for r in group_ranks})
    group = ", ".join(warned) or "?"
    event = "hybridflow.run.resubmitted"
    resumed_from = _record_relaunch(store, run_id, group, ranks, nodes, cause, event, step=steps_done + 1)
    logger.warning(
        "run %s: %s\nresubmitting the worker groups (trainer.resubmit_on_preemption): new allocations, going on "
        "from global_step_%d",
        run_id,
        cause,
        resumed_from,
    )
    notify("recovery", cause=cause, attempt=0, limit=0, resumed_from=resumed_from)


def _record_relaunch(
    store: RunStore,
    run_id: str,
    group: str,
    ranks: list[int],
    nodes: list[str],
    cause: str,
    event: str,
    step: int | None = None,
) -> int:
    """Put a relaunch of the run's groups on record (the run store's recoveries, the Prefect `event`) for iteration
    `step` (None: the one that was running); returns the checkpoint's step the run goes on from (0: the start)."""
    from datetime import UTC, datetime

    started = [i for i in store.iterations(run_id) if i.ended_at is None]
    if step is None:
        step = started[-1].step if started else 0
    checkpoint = store.latest_checkpoint(run_id)
    since = checkpoint.created_at if checkpoint is not None else (started[0].started_at if started else None)
    lost_s = max(0.0, (datetime.now(UTC) - since).total_seconds()) if since is not None else 0.0
    resumed_from = checkpoint.step if checkpoint is not None else 0
    store.record_recovery(run_id, step, group, ranks, cause, resumed_from, lost_s, nodes)
    try:
        from prefect.events import emit_event

        related = [{"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.role": "flow-run"}]
        emit_event(
            event=event,
            resource={"prefect.resource.id": f"hybridflow.run.{run_id}", "prefect.resource.name": run_id},
            related=related if flow_run.id else None,
            payload={
                "cause": cause,
                "group": group,
                "ranks": ranks,
                "nodes": nodes,
                "step": step,
                "lost_s": lost_s,
            },  # fmt: skip
        )
    except Exception as failure:  # noqa: BLE001 - the server's bookkeeping, not the run's
        logger.warning("could not emit the %s event of run %s to Prefect: %s", event, run_id, failure)
    return resumed_from


def private_dir(path: Path) -> Path:
    """Create `path` (and its parents) and make it its owner's only (0700); returns it."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def save_checkpoint(
    store: RunStore,
    run_id: str,
    cfg: HybridFlowConfig,
    lease: RunLease,
    workers: Workers,
    step: int,
    state: dict[str, Any],
    ahead: dict[str, DataHandle] | None = None,
) -> None:
    """Write and record the checkpoint of `step` (with `ahead`, the batches the overlapped modes generated for the
    iterations after it, by file name: `hybridflow.tasks.stages.checkpoint`). A ``global_step_<step>`` folder
    already on disk is replaced only when the store does not list it as a usable checkpoint (left by a crash before
    it was recorded, or marked bad or superseded); a usable recorded one is never overwritten.

    Raises:
        LeaseLostError: another controller took the run over.
        RuntimeError: the store lists a usable checkpoint of `step` already.
    """
    lease.check()
    recorded = {c.step: c for c in store.checkpoints(run_id)}.get(step)
    if recorded is not None and recorded.complete and recorded.bad_reason is None:
        raise RuntimeError(
            f"run {run_id} already has a usable checkpoint of iteration {step} on record ({recorded.path}); "
            "refusing to overwrite it"
        )
    enter_stage("checkpoint", step, step)
    groups = list(workers.groups.values())
    ckpt = stages.checkpoint(groups, str(checkpoint_dir_of(cfg, run_id)), step, state, ahead)
    store.add_checkpoint(run_id, step, ckpt["path"], ckpt["bytes"], ckpt["sha256"], complete=True)


def usable_checkpoint(store: RunStore, run_id: str, exact_step: int | None = None) -> Path | None:
    """The newest recorded, complete checkpoint of the run that verifies: its folder exists, every file matches
    ``manifest.json`` (sha256) and the manifest's sha256 is the one the store recorded. Each one that fails is
    marked bad in the store with the reason, and a warning names it and the fallback. None when none is usable
    (the run starts over, with a warning if there were checkpoints).

    With `exact_step`, only that step's checkpoint is considered.

    Raises:
        CheckpointError, FileNotFoundError: `exact_step` has no usable recorded checkpoint, or it does not verify.
    """
    candidates = [c for c in store.checkpoints(run_id) if c.complete and c.bad_reason is None]
    if exact_step is not None:
        candidates = [c for c in candidates if c.step == exact_step]
        if not candidates:
            steps = ", ".join(f"global_step_{c.step}" for c in store.checkpoints(run_id) if c.bad_reason is None)
            raise CheckpointError(
                f"run {run_id} has no usable checkpoint global_step_{exact_step}; usable: {steps or 'none'} "
                f"(hf runs show {run_id})"
            )
    for ckpt in reversed(candidates):
        try:
            info = verify_checkpoint(ckpt.path)
            if info.sha256 != ckpt.sha256:
                raise CheckpointError(
                    f"checkpoint {ckpt.path}: its manifest's sha256 {info.sha256[:16]}... is not the "
                    f"{ckpt.sha256[:16]}... recorded when it was written (edited since)"
                )
        except (CheckpointError, FileNotFoundError) as e:  # FileNotFoundError: the folder is gone
            store.mark_checkpoint_bad(run_id, ckpt.step, str(e))
            if exact_step is not None:
                raise
            older = [c for c in candidates if c.step < ckpt.step]
            fallback = f"global_step_{older[-1].step}" if older else "the start (no older checkpoint)"
            message = f"checkpoint global_step_{ckpt.step} is unusable ({e}); marked bad, falling back to {fallback}"
            logger.info("run %s: %s", run_id, message)  # the log file and the UI; the terminal: the notice below
            notify("fallback", message=message)
            continue
        return Path(ckpt.path)
    return None


def supersede_after(store: RunStore, run_id: str, step: int) -> None:
    """Mark the run's checkpoints after `step` superseded (``hf resume --from global_step_<step>``)."""
    for ckpt in store.checkpoints(run_id):
        if ckpt.step > step and ckpt.bad_reason is None:
            store.mark_checkpoint_bad(run_id, ckpt.step, f"superseded: the run was resumed from global_step_{step}")
