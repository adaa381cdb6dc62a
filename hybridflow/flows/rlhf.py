"""The RLHF flow: one Prefect flow run per `hf run` / `hf resume`, one iteration per loop turn.

The loop body names the stages in order, as in the HybridFlow paper's PPO listing; the algorithm only decides
which stages run (PPO's critic, ReMax's greedy generation, DAPO's repeated draws). The controller holds data
handles and metrics, never bulk tensors; the worker groups are launched on first use and kept for the whole run.
Every iteration's metrics, the placement and every checkpoint go to the run store, so `hf resume RUN_ID` continues
from the last complete checkpoint.

Slurm's warnings (SIGUSR2 before a worker job's time limit, SIGTERM on preemption) stop the run cleanly at the next
stage boundary: before an update stage has run, nothing of the iteration has touched the weights, so the state the
iteration started from is checkpointed (if no checkpoint has it yet); once an update has run, the iteration is
finished and checkpointed. The run is then recorded ``interrupted`` and `hf resume` continues it exactly.
"""

from __future__ import annotations

import logging
import os
import shutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, tags
from prefect.exceptions import TerminationSignal
from prefect.futures import PrefectFuture, wait
from prefect.runtime import flow_run

from hybridflow.engine.advantage import build_kl_controller, build_lagrangian, reward_shaping
from hybridflow.engine.algorithms.kl import KLController
from hybridflow.engine.algorithms.lagrangian import LagrangeMultiplier
from hybridflow.engine.checkpoint import CheckpointError, read_trainer_state, verify_checkpoint
from hybridflow.engine.config import HybridFlowConfig, Pool, RMTrainingConfig
from hybridflow.engine.data import PromptSampler, collate_prompts, train_sampler
from hybridflow.engine.extensions import training_backend
from hybridflow.engine.generations import GENERATION_KEYS
from hybridflow.engine.iteration import Call, run_iteration
from hybridflow.engine.metrics import Span, Timer
from hybridflow.engine.protocol import DataProto
from hybridflow.flows.lease import RunLease
from hybridflow.flows.preflight import prompt_sets
from hybridflow.flows.reporting import FlowLogs, RunReport, flow_run_name, flow_run_tags, untagged_task_runs
from hybridflow.flows.store.run_store import LeaseLostError, RunStore
from hybridflow.slurm.channel import create_secret
from hybridflow.slurm.handles import DataHandle
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup, slurm_parameters
from hybridflow.tasks import stages

logger = logging.getLogger(__name__)

WORKER_CLS = "hybridflow.engine.worker:RLHFWorker"
INTERRUPT_GRACE_S = 3.0
"""Seconds a worker group gets to exit after Ctrl-C / SIGTERM before its job is cancelled and its ranks killed."""

# Progress listeners: callables (event, data) the CLI registers for its live display. Events: "flow" (run_id,
# ui_url), "fallback" (message: a checkpoint failed verification), "resumed" (step, path), "start" (run_id, total,
# start_step), "stage" (name, step), "iteration" (step, metrics), "validation" (metrics), "preempted" (message).
listeners: list[Callable[[str, dict[str, Any]], None]] = []


def notify(event: str, **data: Any) -> None:
    """Send a progress event (see `listeners`) to every listener."""
    for listener in listeners:
        listener(event, data)


class Preempted(Exception):
    """Slurm warned a worker group (time limit or preemption) before this iteration's first update stage."""


@dataclass
class PreemptionWatch:
    """Stage-boundary check for Slurm's warning signals, reported by the ranks in their heartbeats."""

    workers: Workers
    updated: bool = False  # an update stage of the current iteration has started

    def signals(self) -> list[str]:
        """``"<group> rank <r>: SIGUSR2"`` for every rank that reported a warning signal."""
        found = []
        for group in self.workers.groups.values():
            group.poll()
            found += [f"{group.spec.name} rank {r}: {', '.join(s)}" for r, s in sorted(group.warning_signals.items())]
        return found

    def before_stage(self, name: str) -> None:
        """Raise `Preempted` before a stage if warned and no update of this iteration has run."""
        if not self.updated and (found := self.signals()):
            raise Preempted("; ".join(found))
        self.updated |= name.startswith("update_")


def enter_stage(name: str, iteration: int, step: int) -> None:
    """Announce stage `name`; its Prefect task run is named ``<task>-<iteration>``."""
    notify("stage", name=name, step=step)
    stages.ITERATION.set(iteration)


@dataclass
class StageRunner:
    """The flow's `hybridflow.engine.iteration.Stages`: runs the stages of the iteration after `step` as Prefect
    tasks (`stages.ITERATION_TASKS`) on the run's worker groups, with data handles: each batch of
    independent stage calls at once where their roles live in different pools (``placement.concurrent``), after
    the preemption check, then forwards the workers' log lines to the flow's logs. The controller's stages
    (advantage, DAPO's filter) run here on the columns they need."""

    cfg: HybridFlowConfig
    workers: Workers
    prompts: Prompts
    data_dir: Path
    step: int
    kl_ctrl: KLController | None = None
    lagrangian: LagrangeMultiplier | None = None
    watch: PreemptionWatch | None = None
    logs: FlowLogs | None = None

    def __call__(self, *calls: Call) -> list[Any]:
        """Run `calls`, none of which needs another's result: those on one worker group one after another in the
        order given, those on different groups at the same time, submitted as Prefect task futures that this
        waits on (all in order when ``placement.concurrent`` is false). Returns their results in the order of
        `calls`, None for a skipped one.

        Raises:
            Preempted: Slurm warned the workers before this iteration's first update (no call has started).
            Exception: the first failed call's error, raised once every call of the batch has ended (no worker
                group is left in the middle of a call).
        """
        run = [c for c in calls if c.when]
        for c in run:
            if self.watch is not None:
                self.watch.before_stage(c.stage)
        enter_stage(" + ".join(c.stage for c in run), self.step + 1, self.step)
        try:
            results = self._run(run)
        finally:
            if self.logs is not None:
                self.logs.pump()
        done = dict(zip(map(id, run), results, strict=True))
        return [done.get(id(c)) for c in calls]

    def _run(self, calls: list[Call]) -> list[Any]:
        groups = [self.workers[c.role] for c in calls]
        tasks = [stages.ITERATION_TASKS[c.stage] for c in calls]
        if not self.cfg.placement.concurrent or len({id(g) for g in groups}) < 2:
            return [task(g, *c.args) for task, c, g in zip(tasks, calls, groups, strict=True)]
        futures: list[PrefectFuture] = []
        last: dict[int, PrefectFuture] = {}  # each group's previous call: a group serves one call at a time
        for task, c, g in zip(tasks, calls, groups, strict=True):
            before = last.get(id(g))
            last[id(g)] = task.submit(g, *c.args, wait_for=[before] if before is not None else None)
            futures.append(last[id(g)])
        wait(futures)
        return [f.result() for f in futures]

    def next_prompts(self, step: int) -> DataHandle:
        """The sampler's next batch, written to the run's data folder."""
        batch = DataHandle.put(self.prompts.sampler.next_batch(), self.data_dir, "prompts")
        return batch.with_meta(global_steps=step)

    def filter_groups(self, scored: DataHandle, step: int) -> list[int]:
        """DAPO's filter (`hybridflow.tasks.stages.filter_groups`), in the controller."""
        enter_stage("filter_groups", step + 1, step)
        return stages.filter_groups(scored, self.cfg.algorithm.filter_groups.metric, reward_shaping(self.cfg))

    def advantage(self, batch: DataHandle, greedy: DataHandle | None, step: int) -> tuple[DataHandle, dict]:
        """The advantage stage (`hybridflow.tasks.stages.advantage`), in the controller."""
        enter_stage("advantage", step + 1, step)
        shaping = reward_shaping(self.cfg)
        algorithm = self.cfg.algorithm
        return stages.advantage(batch, algorithm, self.kl_ctrl, self.data_dir, shaping, greedy, self.lagrangian)

    def view(self, batch: DataHandle) -> DataProto:
        """The columns `hybridflow.engine.metrics.batch_metrics` reads, loaded."""
        keys = ["token_level_scores", "token_level_rewards", "advantages", "returns", "response_mask"]
        keys += ["attention_mask", *_present(batch, "values", "rm_scores")]
        keys += [k for k in batch.keys if k.startswith("reward_extra/")]
        return batch.select(keys).load()


def flow_run_ui_url() -> str | None:
    """Link to this flow run in the Prefect UI (served by the API's server), or None outside a server."""
    api = os.environ.get("PREFECT_API_URL")
    if not api or not flow_run.id:
        return None
    return f"{api.rstrip('/').removesuffix('/api')}/runs/flow-run/{flow_run.id}"


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


@dataclass
class Prompts:
    """Controller-side prompt data: the train sampler (its cursor is checkpointed) and validation batches."""

    sampler: PromptSampler
    val_batches: list[DataHandle] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: HybridFlowConfig, data_dir: Path) -> Prompts:
        sets = prompt_sets(cfg)  # cached per process: under hf run, built by its pre-flight check
        sampler = train_sampler(sets.train, cfg)
        val_batches = []
        if sets.val is not None:
            size = cfg.data.val_batch_size
            for start in range(0, len(sets.val), size):
                items = [sets.val[i] for i in range(start, min(start + size, len(sets.val)))]
                val_batches.append(DataHandle.put(collate_prompts(items, sets.tokenizer), data_dir, "val"))
        return cls(sampler, val_batches)


def group_spec(cfg: HybridFlowConfig | RMTrainingConfig, pool: Pool, worker_cls: str = WORKER_CLS) -> GroupSpec:
    """The `GroupSpec` of the worker group of resource pool `pool` (its ranks serving `worker_cls`; its Slurm job
    with the pool's resources), with the ``placement`` section's executor, backend and limits."""
    placement = cfg.placement
    backend = placement.backend
    if backend == "auto":  # NCCL when the workers train on GPUs (trainer.device cuda, or auto with GPUs there)
        if cfg.trainer.device == "cpu":
            on_gpus = False
        elif placement.executor == "slurm":
            on_gpus = cfg.trainer.device == "cuda" or pool.slurm.gpus_per_node > 0
        else:
            on_gpus = _local_cuda(cfg)
        backend = "nccl" if on_gpus else "gloo"
    slurm = pool.slurm
    return GroupSpec(
        name=pool.name,
        worker_cls=worker_cls,
        nodes=pool.nodes,
        tasks_per_node=pool.tasks_per_node,
        executor=placement.executor,
        slurm=slurm_parameters(**slurm.model_dump(exclude={"time_min", "interface"})),
        timeout_min=slurm.time_min,
        backend=backend,
        heartbeat_timeout_s=placement.heartbeat_timeout_s,
        call_timeout_s=placement.call_timeout_s,
        interface=slurm.interface,
    )


def parallel_record(cfg: HybridFlowConfig | RMTrainingConfig, role: str) -> dict[str, Any] | None:
    """How `role`'s model is split over its pool's ranks, for the run store (``placements.parallel``): the
    strategy of the trained and scoring models (actor, critic, reward model; a reward model in training: ddp)
    and, for the actor, its training layout and, with ``megatron``, the generation layout, the resharding mode
    and the rank groups (`HybridLayout.describe`); None for ref and the score function (whole on every rank)."""
    if isinstance(cfg, RMTrainingConfig):
        return {"strategy": "ddp"}
    if role == "critic":
        return {"strategy": cfg.critic.strategy}
    if role == "reward_model":
        return {"strategy": cfg.reward_model.strategy}
    if role not in ("actor", "rollout"):
        return None
    world = cfg.pool_of("actor").world_size
    return {"strategy": cfg.actor.strategy, **training_backend(cfg.actor.strategy).layout_record(cfg, world)}


def _local_cuda(cfg: HybridFlowConfig) -> bool:
    import torch

    return torch.cuda.is_available()


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
    cfg: HybridFlowConfig | RMTrainingConfig,
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
        for name, group in workers.groups.items():
            group.init_model()
            rows = [
                {"role": role, **group.placement, "parallel": parallel_record(cfg, role)} for role in pools[name].roles
            ]
            store.record_placement(run_id, rows)
    except BaseException:
        workers.shutdown()
        raise
    return workers


def run_flow(run_id: str, db_url: str | None = None, resume_from_step: int | None = None) -> dict[str, float]:
    """`rlhf_flow` as ``hf run`` / ``hf resume`` start it: the flow run named ``<experiment>/<run_id>`` and tagged
    with the experiment, algorithm, model and executor (`orchestration.reporting`). Same arguments, returns and
    errors as `rlhf_flow`."""
    cfg = HybridFlowConfig.model_validate(RunStore(db_url).get_run(run_id).config)
    with tags(*flow_run_tags(cfg)):
        named = rlhf_flow.with_options(flow_run_name=flow_run_name(cfg, run_id))
        return named(run_id=run_id, db_url=db_url, resume_from_step=resume_from_step)


@flow(name="hybridflow-rlhf")
def rlhf_flow(run_id: str, db_url: str | None = None, resume_from_step: int | None = None) -> dict[str, float]:
    """Train the run `run_id` recorded in the run store, from its newest usable checkpoint if any.

    The controller first takes the run's lease (`orchestration.lease`): a run another live controller trains is
    refused, one whose controller crashed is taken over. The run's folder is private (0700, files 0600).

    Args:
        run_id: a run created with `RunStore.create_run` (``hf run`` does this).
        db_url: the store; None reads ``$HYBRIDFLOW_DB_URL`` or the default SQLite file (keeps passwords out of
            the flow's recorded parameters).
        resume_from_step: resume from the checkpoint of this step (``hf resume --from global_step_N``) instead of
            the newest usable one; the run's later checkpoints are marked superseded. 0 starts over.

    Returns:
        the last iteration's metrics.

    Raises:
        LeaseHeldError: another controller is training the run (nothing of the run is touched).
        LeaseLostError: another controller took the run over while this one ran (this one stops writing).
        CheckpointError: the checkpoint asked for with `resume_from_step` is missing or corrupt.
    """
    with untagged_task_runs():  # the tags name the flow run only (see untagged_task_runs)
        return _train_run(run_id, db_url, resume_from_step)


def _train_run(run_id: str, db_url: str | None, resume_from_step: int | None) -> dict[str, float]:
    store = RunStore(db_url)
    cfg = HybridFlowConfig.model_validate(store.get_run(run_id).config)
    lease = RunLease(store, run_id).acquire()
    umask = os.umask(0o077)  # the run's files are its owner's only: weights, optimizer state, pickled job files
    workers = report = None
    interrupted = False
    completed = False
    logs = None
    try:
        run_dir = private_dir(run_dir_of(cfg, run_id))
        logs = FlowLogs(run_dir).__enter__()
        data_dir = run_dir / "data"
        shutil.rmtree(data_dir, ignore_errors=True)  # batch files of an earlier session: no handle to them survives
        data_dir.mkdir()
        if flow_run.id:
            store.set_flow_run_id(run_id, str(flow_run.id))
        store.set_status(run_id, "running")
        notify("flow", run_id=run_id, ui_url=flow_run_ui_url())
        prompts = Prompts.build(cfg, data_dir)
        report = RunReport(store, run_id, cfg, run_dir, prompt_sets(cfg).tokenizer)
        kl_ctrl = build_kl_controller(cfg.algorithm) if cfg.algorithm.use_kl_in_reward else None
        lagrangian = build_lagrangian(cfg.algorithm)  # Safe-RLHF's multiplier (None without algorithm.cost_limit)
        workers = launch_workers(cfg, run_id, store, run_dir)
        logs.pump()
        start = _resume(store, run_id, cfg, workers, prompts, kl_ctrl, lagrangian, resume_from_step)
        trainer = cfg.trainer
        notify("start", run_id=run_id, total=trainer.total_iterations, start_step=start)
        groups = ", ".join(f"{n} ({g.spec.world_size} ranks, job {g.job_id})" for n, g in workers.groups.items())
        logger.info(
            "run %s: iterations %d to %d; worker groups %s", run_id, start + 1, trainer.total_iterations, groups
        )
        if cfg.skips_old_log_prob():
            logger.info(
                "stage old_log_prob skipped: the update is on-policy (one optimizer step per iteration), so its old "
                "log-probs are its own forward's, detached (actor.recompute_log_prob=true runs the stage)"
            )
        metrics: dict[str, float] = {}
        if start == 0 and trainer.val_before_train and prompts.val_batches:
            enter_stage("validate", 0, 0)
            val, kept = _validate(cfg, workers, prompts, 0)
            report.step(0, val, val=kept)
            notify("validation", metrics=val)
        for step in range(start, trainer.total_iterations):
            lease.check()
            state_before = _trainer_state(step, prompts, kl_ctrl, lagrangian)
            store.start_iteration(run_id, step + 1)
            try:
                metrics, train_kept, timeline = _iteration(
                    cfg, workers, prompts, kl_ctrl, step, data_dir, logs, lagrangian
                )
            except Preempted as warned:  # nothing of this iteration reached the weights: keep the state it began at
                latest = store.latest_checkpoint(run_id)
                if step > 0 and (latest is None or latest.step < step):
                    save_checkpoint(store, run_id, cfg, lease, workers, step, state_before)
                return _stop_preempted(store, run_id, step, str(warned), metrics)
            last = step + 1 == trainer.total_iterations
            warned = PreemptionWatch(workers).signals()  # then the time left goes to the checkpoint, not validation
            due = last or (trainer.test_freq and (step + 1) % trainer.test_freq == 0)
            val_kept = None
            if prompts.val_batches and due and not warned:
                enter_stage("validate", step + 1, step + 1)
                val, val_kept = _validate(cfg, workers, prompts, step + 1)
                metrics.update(val)
                logs.pump()
            report.step(step + 1, metrics, train=train_kept, val=val_kept, timeline=timeline)
            # The checkpoint comes last: once it is recorded, everything of this iteration is on record, and a crash
            # before that redoes the iteration from the previous checkpoint (metrics are upserted).
            warned = warned or PreemptionWatch(workers).signals()
            if last or warned or (trainer.save_freq and (step + 1) % trainer.save_freq == 0):
                state = _trainer_state(step + 1, prompts, kl_ctrl, lagrangian)
                save_checkpoint(store, run_id, cfg, lease, workers, step + 1, state)
            store.end_iteration(run_id, step + 1)
            notify("iteration", step=step + 1, metrics=metrics)
            logger.info(
                "iteration %d done in %.1f s: critic/score/mean=%.4g",
                step + 1,
                metrics["timing_s/step"],
                metrics["critic/score/mean"],
            )
            if warned and not last:
                return _stop_preempted(store, run_id, step + 1, "; ".join(warned), metrics)
        store.set_status(run_id, "completed")
        completed = True
        return metrics
    except BaseException as e:
        interrupted = record_stop(store, run_id, lease, e)
        raise
    finally:
        os.umask(umask)
        end_session(lease, workers, report, logs, interrupted, completed)


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


def private_dir(path: Path) -> Path:
    """Create `path` (and its parents) and make it its owner's only (0700); returns it."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _trainer_state(steps_done: int, prompts: Prompts, kl_ctrl, lagrangian=None) -> dict[str, Any]:
    """What a checkpoint after `steps_done` iterations needs besides the weights: the data cursor, the KL coef,
    Safe-RLHF's Lagrange multiplier."""
    return {
        "global_steps": steps_done,
        "sampler": prompts.sampler.state_dict(),
        "kl_ctrl_value": kl_ctrl.value if kl_ctrl is not None else None,
        "lagrange_multiplier": lagrangian.state_dict() if lagrangian is not None else None,
    }


def save_checkpoint(
    store: RunStore,
    run_id: str,
    cfg: HybridFlowConfig,
    lease: RunLease,
    workers: Workers,
    step: int,
    state: dict[str, Any],
) -> None:
    """Write and record the checkpoint of `step`. A ``global_step_<step>`` folder already on disk is replaced only
    when the store does not list it as a usable checkpoint (left by a crash before it was recorded, or marked bad
    or superseded); a usable recorded one is never overwritten.

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
    ckpt = stages.checkpoint(list(workers.groups.values()), str(checkpoint_dir_of(cfg, run_id)), step, state)
    store.add_checkpoint(run_id, step, ckpt["path"], ckpt["bytes"], ckpt["sha256"], complete=True)


def _stop_preempted(
    store: RunStore, run_id: str, steps_done: int, signals: str, metrics: dict[str, float]
) -> dict[str, float]:
    message = f"stopped after iteration {steps_done} on Slurm's warning ({signals}); continue with hf resume {run_id}"
    logger.warning(message)
    store.set_status(run_id, "interrupted", error=message)
    notify("preempted", message=message)
    return metrics


def _validate(cfg: HybridFlowConfig, workers: Workers, prompts: Prompts, step: int) -> tuple[dict[str, float], Any]:
    """The validation after iteration `step` (0: before training): its ``val/*`` metrics and the first
    ``trainer.log_val_generations`` scored rows (None when 0)."""
    return stages.validate(
        workers["rollout"],
        workers["reward"],
        prompts.val_batches,
        cfg.rollout.val_temperature,
        step,
        keep=cfg.trainer.log_val_generations,
    )


def _iteration(
    cfg: HybridFlowConfig,
    workers: Workers,
    prompts: Prompts,
    kl_ctrl,
    step: int,
    data_dir: Path,
    logs: FlowLogs | None = None,
    lagrangian: LagrangeMultiplier | None = None,
) -> tuple[dict[str, float], Any, list[Span]]:
    """One iteration (`hybridflow.engine.iteration.run_iteration`, the one the single-process trainer runs too), its
    stages as tasks on the worker groups (`StageRunner`). Returns its metrics (field-standard names), the first
    ``trainer.log_train_generations`` scored rollout rows (a `DataProto`; None when 0), and its timeline (every
    stage's span).

    Raises:
        Preempted: Slurm warned the workers before the first update stage (nothing of the iteration applied).
        DynamicSamplingError: DAPO's draw limit was reached before enough varied groups (nothing applied).
    """
    timer = Timer()
    token = stages.TIMER.set(timer)
    runner = StageRunner(cfg, workers, prompts, data_dir, step, kl_ctrl, lagrangian, PreemptionWatch(workers), logs)
    try:
        done = run_iteration(cfg, runner, step, timer)
    finally:
        stages.TIMER.reset(token)
    keep = cfg.trainer.log_train_generations
    kept = None
    if keep:  # before the batch files go: the first rows as scored, for the sample generations
        columns = [*GENERATION_KEYS, *_present(done.batch, "data_source", "reward_model")]
        kept = done.batch.select(columns).load(slice(0, keep))
    for handle in (done.batch, done.greedy, *done.drawn):  # this iteration's batch files: no stage reads them again
        if handle is not None:
            handle.delete()
    return done.metrics, kept, timer.spans


def _present(handle: DataHandle, *keys: str) -> list[str]:
    return [k for k in keys if k in handle.keys]


def _resume(
    store: RunStore,
    run_id: str,
    cfg: HybridFlowConfig,
    workers: Workers,
    prompts: Prompts,
    kl_ctrl,
    lagrangian: LagrangeMultiplier | None = None,
    from_step: int | None = None,
) -> int:
    """Load the checkpoint the run continues from and return the iterations it holds (0: from the start).

    That is the newest recorded checkpoint that verifies (`usable_checkpoint`): one that is missing, corrupt, or
    whose manifest differs from the sha256 the store recorded is marked bad in the store, and the one before it is
    tried (a warning says which and why). With `from_step`, the checkpoint of that step is used (and must verify);
    later ones are marked superseded. A run with no usable checkpoint of its own starts from
    ``trainer.resume_from`` when that names a checkpoint folder (a new run continuing another run's checkpoint).
    """
    if from_step is not None:
        _supersede_after(store, run_id, from_step)
        path = None if from_step == 0 else usable_checkpoint(store, run_id, exact_step=from_step)
    else:
        path = usable_checkpoint(store, run_id)
        resume_from = cfg.trainer.resume_from
        if path is None and resume_from not in (None, "auto"):  # none of its own (usable): where it began
            path = Path(resume_from)
            verify_checkpoint(path)
    if path is None:
        return 0
    for group in workers.groups.values():
        group.load_checkpoint(str(path))
    state = read_trainer_state(path)
    prompts.sampler.load_state_dict(state["sampler"])
    if kl_ctrl is not None and state.get("kl_ctrl_value") is not None:
        kl_ctrl.value = state["kl_ctrl_value"]
    if lagrangian is not None and state.get("lagrange_multiplier") is not None:
        lagrangian.load_state_dict(state["lagrange_multiplier"])
    logger.info("run %s resumes after iteration %d from %s", run_id, state["global_steps"], path)
    notify("resumed", step=int(state["global_steps"]), path=str(path))
    return int(state["global_steps"])


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
            logger.warning("run %s: %s", run_id, message)
            notify("fallback", message=message)
            continue
        return Path(ckpt.path)
    return None


def _supersede_after(store: RunStore, run_id: str, step: int) -> None:
    """Mark the run's checkpoints after `step` superseded (``hf resume --from global_step_<step>``)."""
    for ckpt in store.checkpoints(run_id):
        if ckpt.step > step and ckpt.bad_reason is None:
            store.mark_checkpoint_bad(run_id, ckpt.step, f"superseded: the run was resumed from global_step_{step}")
