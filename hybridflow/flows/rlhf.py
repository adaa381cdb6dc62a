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

import contextvars
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, tags
from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture, wait
from prefect.utilities.callables import get_call_parameters

from hybridflow.engine.advantage import build_kl_controller, build_lagrangian, reward_shaping
from hybridflow.engine.algorithms.kl import KLController
from hybridflow.engine.algorithms.lagrangian import LagrangeMultiplier
from hybridflow.engine.checkpoint import AHEAD_DIR, STREAM_FILE, read_trainer_state, verify_checkpoint
from hybridflow.engine.config import HybridFlowConfig
from hybridflow.engine.data import PromptSampler, collate_prompts, train_sampler
from hybridflow.engine.extensions import rollout_spec
from hybridflow.engine.generations import GENERATION_KEYS
from hybridflow.engine.iteration import Ahead, Call, RolloutQueue, last_push, run_iteration
from hybridflow.engine.metrics import Span, Timer
from hybridflow.engine.protocol import DataProto
from hybridflow.flows.lease import RunLease
from hybridflow.flows.lifecycle import (
    Workers,
    end_session,
    enter_stage,
    flow_run_ui_url,
    launch_workers,
    notify,
    private_dir,
    record_resubmission,
    record_stop,
    recover_or_raise,
    run_dir_of,
    save_checkpoint,
    supersede_after,
    take_over_flow_run,
    usable_checkpoint,
)
from hybridflow.flows.preflight import prompt_sets
from hybridflow.flows.reporting import (
    FlowLogs,
    IterationSubflows,
    RunReport,
    flow_run_name,
    flow_run_tags,
    untagged_task_runs,
)
from hybridflow.flows.store.run_store import RunStore
from hybridflow.slurm.handles import DataHandle
from hybridflow.slurm.worker_group import WorkerGroupError
from hybridflow.tasks import stages

logger = logging.getLogger(__name__)


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

    def ended(self, steps_done: int, trained: int, signals: str, metrics: dict[str, float]) -> Warned:
        """The session's end on the warning (`Warned`): the warned ranks of each group and where they run."""
        groups = self.workers.groups
        warned = {n: sorted(g.warning_signals) for n, g in groups.items() if g.warning_signals}
        nodes = sorted({node for n, ranks in warned.items() for node in groups[n].nodes_of(ranks)})
        return Warned(steps_done, trained, warned, nodes, signals, metrics)

    def before_stage(self, name: str) -> None:
        """Raise `Preempted` before a stage if warned and no update of this iteration has run."""
        if not self.updated and (found := self.signals()):
            raise Preempted("; ".join(found))
        self.updated |= name.startswith("update_")


@dataclass
class Warned:
    """How a controller session ended on Slurm's warning: checkpointed after `steps_done` iterations, `trained` of
    them in this session; `groups`: the warned ranks of each group, on `nodes`; `signals` what they got."""

    steps_done: int
    trained: int
    groups: dict[str, list[int]]
    nodes: list[str]
    signals: str
    metrics: dict[str, float]

    @property
    def at_time_limit(self) -> bool:
        """A rank got the time-limit warning (SIGUSR2, ``placement.slurm.signal_delay_s`` before the limit); SIGTERM
        alone is a preemption or an ``scancel``."""
        return "SIGUSR2" in self.signals


def allocations_short_of_time(short: int, ended: Warned) -> int:
    """How many allocations in a row reached their time limit before an iteration, after `short` of them and the
    session `ended` on Slurm's warning. An allocation that trained breaks the row; a preempted or cancelled one
    (SIGTERM) is neither: it says nothing of whether ``placement.slurm.time_min`` leaves time to train."""
    if ended.trained:
        return 0
    return short + 1 if ended.at_time_limit else short


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
    run_flow: FlowRunContext | None = None  # the run's flow run (outside the iteration's subflow), for `submit`

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

    def submit(self, call: Call, after: PrefectFuture | None = None) -> PrefectFuture:
        """Start `call` as a Prefect task future once `after` has ended (Prefect's ``wait_for``) and return at once:
        the overlapped modes' generations ahead and weight pushes, queued in order on the rollout's pool while the
        actor's trains; `result` waits for it. Such a call outlives its iteration, so it runs as a task of the run's
        flow run (`run_flow`), not of the iteration's subflow: Prefect runs no task of a flow run that has ended,
        and a subflow's task runner cancels what is left of its own at the end."""
        batch = call.args[0] if call.args and isinstance(call.args[0], DataHandle) else None
        steps = batch.meta_info.get("global_steps", self.step) if batch is not None else self.step
        enter_stage(call.stage, steps + 1, self.step)  # a generation ahead is named after the iteration it is for
        task = stages.ITERATION_TASKS[call.stage]
        args, wait_for = (self.workers[call.role], *call.args), [after] if after is not None else None
        if self.run_flow is None:
            return task.submit(*args, wait_for=wait_for)
        return contextvars.copy_context().run(_submit_in, self.run_flow, task, args, wait_for)

    def result(self, pending: Any) -> Any:
        """The result of a `submit`ted call once it has ended (its error raised); a result in hand as it is."""
        return pending.result() if isinstance(pending, PrefectFuture) else pending

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
        teacher = self.cfg.teacher if self.cfg.teacher.enabled else None
        return stages.advantage(
            batch, algorithm, self.kl_ctrl, self.data_dir, shaping, greedy, self.lagrangian, teacher
        )

    def policy_filtration(self, batch: DataHandle, step: int) -> tuple[list[int], dict[str, float]]:
        """PF-PPO's redraw (`hybridflow.tasks.stages.policy_filtration`), in the controller."""
        enter_stage("policy_filtration", step + 1, step)
        return stages.policy_filtration(batch, self.cfg.algorithm, self.cfg.trainer.seed, step)

    def view(self, batch: DataHandle) -> DataProto:
        """The columns `hybridflow.engine.metrics.batch_metrics` reads, loaded."""
        keys = ["token_level_scores", "token_level_rewards", "advantages", "returns", "response_mask"]
        keys += ["attention_mask", *_present(batch, "values", "rm_scores", "rollout_version", "rollout_token_versions")]
        keys += [k for k in batch.keys if k.startswith(("reward_extra/", "agent/"))]
        return batch.select(keys).load()


def _submit_in(run_flow: FlowRunContext, task, args: tuple, wait_for: list | None) -> PrefectFuture:
    """Submit `task` on `run_flow`'s task runner, as a task run of that flow run (called in a copied context)."""
    FlowRunContext.__var__.set(run_flow)
    return run_flow.task_runner.submit(task, get_call_parameters(task.fn, args, {}), wait_for)


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
    """Train the run in controller sessions (`_session`), each relaunching the worker groups and going on from the
    newest usable checkpoint, exactly as `hf resume` would:
    - when a worker group loses ranks (`WorkerGroupError.lost`) the run recovers by itself up to
      ``trainer.max_recoveries`` times, after ``trainer.recovery_backoff_s`` (doubling), on record
      (`record_recovery`); a rank that raised stops the run at once;
    - when Slurm warns (time limit, preemption) the session checkpoints and ends (`Warned`), and the run resubmits
      its groups (``trainer.resubmit_on_preemption``, on record: `record_resubmission`): a run longer than the
      partition's limit finishes across allocations. It stops, resumable, when two allocations in a row reach their
      time limit before an iteration (`allocations_short_of_time`: the limit leaves no time to train); a relaunched
      allocation that trained an iteration breaks the row, one that did not is neither."""
    store = RunStore(db_url)
    cfg = HybridFlowConfig.model_validate(store.get_run(run_id).config)
    trainer = cfg.trainer
    recoveries = short = 0
    while True:
        began = datetime.now(UTC)
        try:
            ended = _session(store, cfg, run_id, resume_from_step)
        except WorkerGroupError as error:
            recoveries = recover_or_raise(store, run_id, error, recoveries, trainer)
            if any(i.ended_at is not None and i.ended_at >= began for i in store.iterations(run_id)):
                short = 0  # the lost allocation had time to train
            resume_from_step = None  # the newest usable checkpoint
            continue
        if not isinstance(ended, Warned):
            return ended
        short = allocations_short_of_time(short, ended)
        if not trainer.resubmit_on_preemption or short >= 2:
            return _stop_preempted(store, run_id, ended, short >= 2)
        record_resubmission(store, run_id, ended.steps_done, ended.groups, ended.nodes, ended.signals)
        resume_from_step = None


def _session(
    store: RunStore, cfg: HybridFlowConfig, run_id: str, resume_from_step: int | None
) -> dict[str, float] | Warned:
    """One controller session: take the lease, launch the worker groups, restore, train to the end (its last
    metrics) or to Slurm's warning (checkpointed: `Warned`), release everything."""
    lease = RunLease(store, run_id).acquire()
    umask = os.umask(0o077)  # the run's files are its owner's only: weights, optimizer state, pickled job files
    workers = report = subflows = None
    interrupted = False
    completed = False
    logs = None
    try:
        run_dir = private_dir(run_dir_of(cfg, run_id))
        logs = FlowLogs(run_dir).__enter__()
        data_dir = run_dir / "data"
        shutil.rmtree(data_dir, ignore_errors=True)  # batch files of an earlier session: no handle to them survives
        data_dir.mkdir()
        take_over_flow_run(store, run_id)
        store.set_status(run_id, "running")
        notify("flow", run_id=run_id, ui_url=flow_run_ui_url())
        prompts = Prompts.build(cfg, data_dir)
        kl_ctrl = build_kl_controller(cfg.algorithm) if cfg.algorithm.use_kl_in_reward else None
        lagrangian = build_lagrangian(cfg.algorithm)  # Safe-RLHF's multiplier (None without algorithm.cost_limit)
        workers = launch_workers(cfg, run_id, store, run_dir)
        run_flow = FlowRunContext.get()  # the iterations' subflows submit their overlapped calls to it
        subflows = IterationSubflows()
        logs.pump()
        start, queue = _resume(store, run_id, cfg, workers, prompts, data_dir, kl_ctrl, lagrangian, resume_from_step)
        # a resume logs from the iteration after its checkpoint (from step 0, the validation before training, if none)
        report = RunReport(store, run_id, cfg, run_dir, prompt_sets(cfg).tokenizer, start + 1 if start else 0)
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
            queued_before = len(queue.ahead) if queue is not None else 0  # drawn before state_before's sampler cursor

            def started(step: int = step) -> tuple[dict[str, float], Any, list[Span]]:
                store.start_iteration(run_id, step + 1)  # in its subflow: an iteration on record has its subflow run
                return _iteration(cfg, workers, prompts, kl_ctrl, step, data_dir, logs, lagrangian, queue, run_flow)

            try:
                metrics, train_kept, timeline = subflows.run(step + 1, started)
            except Preempted as warned:  # nothing of this iteration reached the weights: keep the state it began at
                latest = store.latest_checkpoint(run_id)
                if step > 0 and (latest is None or latest.step < step):
                    if cfg.rollout.streaming:  # the stream holds this iteration's admissions: the sampler past them
                        state_before, queued_before = _trainer_state(step, prompts, kl_ctrl, lagrangian), None
                    ahead = _ready(queue, queued_before)
                    save_checkpoint(store, run_id, cfg, lease, workers, step, state_before, ahead)
                return PreemptionWatch(workers).ended(step, step - start, str(warned), metrics)
            last = step + 1 == trainer.total_iterations
            warned = PreemptionWatch(workers).signals()  # then the time left goes to the checkpoint, not validation
            due = last or (trainer.test_freq and (step + 1) % trainer.test_freq == 0)
            val_kept = None
            if prompts.val_batches and due and not warned:
                _settle(queue)  # the rollout's engine idle, with the weights pushed after this update
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
                save_checkpoint(store, run_id, cfg, lease, workers, step + 1, state, _ready(queue))
            store.end_iteration(run_id, step + 1)
            notify("iteration", step=step + 1, metrics=metrics)
            logger.info(
                "iteration %d done in %.1f s: critic/score/mean=%.4g",
                step + 1,
                metrics["timing_s/step"],
                metrics["critic/score/mean"],
            )
            if warned and not last:
                return PreemptionWatch(workers).ended(step + 1, step + 1 - start, "; ".join(warned), metrics)
        subflows.flush()
        store.set_status(run_id, "completed")
        completed = True
        return metrics
    except BaseException as e:
        interrupted = record_stop(store, run_id, lease, e)
        raise
    finally:
        os.umask(umask)
        if subflows is not None and (missing := subflows.missing_from_ui(run_id)):
            logger.warning(missing)
        end_session(lease, workers, report, logs, interrupted, completed)


def _settle(queue: RolloutQueue | None) -> None:
    """Wait until every call queued on the rollout's pool has ended (an error is left to whoever reads the
    result): no pool is in the middle of a call when a validation, a checkpoint or the shutdown calls it."""
    if queue is not None:
        pending = [p for a in queue.ahead for p in (a.admitted, a.rollout, a.greedy, *a.syncs)] + queue.syncs
        wait([p for p in pending if isinstance(p, PrefectFuture)])


def _ready(queue: RolloutQueue | None, first: int | None = None) -> dict[str, DataHandle]:
    """The batches generated ahead for a checkpoint, once generated (their errors raised), by file name: the
    iteration each is for (``"3"``), ReMax's greedy batch beside it (``"3.greedy"``). The queue's first `first`
    (those admitted before a stopped iteration's sampler state), else all. A streaming rollout's prompts not handed
    over yet are in its stream, which its group writes into the checkpoint itself."""
    if queue is None:
        return {}
    _settle(queue)
    ready = {}
    for a in list(queue.ahead)[:first] if first is not None else queue.ahead:
        if a.rollout is None:  # streaming: still in the stream
            continue
        ready[str(a.step)] = a.rollout.result() if isinstance(a.rollout, PrefectFuture) else a.rollout
        if a.greedy is not None:
            ready[f"{a.step}.greedy"] = a.greedy.result() if isinstance(a.greedy, PrefectFuture) else a.greedy
    return ready


def _trainer_state(steps_done: int, prompts: Prompts, kl_ctrl, lagrangian=None) -> dict[str, Any]:
    """What a checkpoint after `steps_done` iterations needs besides the weights: the data cursor, the KL coef,
    Safe-RLHF's Lagrange multiplier."""
    return {
        "global_steps": steps_done,
        "sampler": prompts.sampler.state_dict(),
        "kl_ctrl_value": kl_ctrl.value if kl_ctrl is not None else None,
        "lagrange_multiplier": lagrangian.state_dict() if lagrangian is not None else None,
    }


def _stop_preempted(store: RunStore, run_id: str, warned: Warned, short_of_time: bool) -> dict[str, float]:
    """End the run `interrupted` (resumable) after Slurm's warning: resubmitting is off, or (`short_of_time`) two
    allocations in a row reached their time limit before an iteration."""
    why = (
        "two allocations in a row reached their time limit before an iteration: raise placement.slurm.time_min (or "
        "lower placement.slurm.signal_delay_s), then "
        if short_of_time
        else ""
    )
    message = (
        f"stopped after iteration {warned.steps_done} on Slurm's warning ({warned.signals}); {why}continue with hf "
        f"resume {run_id}"
    )
    logger.warning(message)
    store.set_status(run_id, "interrupted", error=message)
    notify("preempted", message=message)
    return warned.metrics


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
    queue: RolloutQueue | None = None,
    run_flow: FlowRunContext | None = None,
) -> tuple[dict[str, float], Any, list[Span]]:
    """One iteration (`hybridflow.engine.iteration.run_iteration`, the one the single-process trainer runs too), its
    stages as tasks on the worker groups (`StageRunner`), with the overlapped modes' rollout `queue` (whose calls
    run as tasks of `run_flow`, the run's flow run, when this runs in a subflow of it). Returns its
    metrics (field-standard names), the first ``trainer.log_train_generations`` scored rollout rows (a `DataProto`;
    None when 0) and its timeline (the span of every stage that ended during it: a generation admitted ahead counts in
    the iteration it ends in). A failed or stopped iteration waits for the rollout's pool to end its calls before it
    raises.

    Raises:
        Preempted: Slurm warned the workers before the first update stage (nothing of the iteration applied).
        DynamicSamplingError: DAPO's draw limit was reached before enough varied groups (nothing applied).
    """
    timer = queue.timer if queue is not None else Timer()
    token = stages.TIMER.set(timer)
    watch = PreemptionWatch(workers)
    runner = StageRunner(cfg, workers, prompts, data_dir, step, kl_ctrl, lagrangian, watch, logs, run_flow)
    try:
        done = run_iteration(cfg, runner, step, timer, queue)
    except BaseException:
        _settle(queue)
        raise
    finally:
        stages.TIMER.reset(token)
        if queue is not None:  # generations and pushes still running record in the next iteration, when they end
            queue.timer = timer.hand_over()
    keep = cfg.trainer.log_train_generations
    kept = None
    if keep:  # before the batch files go: the first rows as scored, for the sample generations
        wanted = ("data_source", "reward_model", "uid", "rollout_version", "rm_scores", "judge_text", "reward_error")
        wanted += ("rollout_token_versions", *(("routed_experts",) if cfg.trainer.log_routed_experts else ()))
        columns = [*GENERATION_KEYS, *_present(done.batch, *wanted)]
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
    data_dir: Path,
    kl_ctrl,
    lagrangian: LagrangeMultiplier | None = None,
    from_step: int | None = None,
) -> tuple[int, RolloutQueue | None]:
    """Load the checkpoint the run continues from; return the iterations it holds (0: from the start) and, in the
    overlapped modes, the rollout queue: the batches it holds generated ahead (as handles in `data_dir`), its
    engine serving the restored actor (None: ``trainer.mode: sync``).

    That is the newest recorded checkpoint that verifies (`usable_checkpoint`): one that is missing, corrupt, or
    whose manifest differs from the sha256 the store recorded is marked bad in the store, and the one before it is
    tried (a warning says which and why). With `from_step`, the checkpoint of that step is used (and must verify);
    later ones are marked superseded. A run with no usable checkpoint of its own starts from
    ``trainer.resume_from`` when that names a checkpoint folder (a new run continuing another run's checkpoint).
    """
    if from_step is not None:
        supersede_after(store, run_id, from_step)
        path = None if from_step == 0 else usable_checkpoint(store, run_id, exact_step=from_step)
    else:
        path = usable_checkpoint(store, run_id)
        resume_from = cfg.trainer.resume_from
        if path is None and resume_from not in (None, "auto"):  # none of its own (usable): where it began
            path = Path(resume_from)
            verify_checkpoint(path)
    overlapped = cfg.trainer.mode != "sync"
    if path is None:
        return 0, RolloutQueue() if overlapped else None
    for group in workers.groups.values():
        group.load_checkpoint(str(path))
    state = read_trainer_state(path)
    if cfg.rollout_apart() and rollout_spec(cfg.rollout.name).syncs_weights:  # its engines serve the restored actor
        published = workers["actor"].publish_weights(int(state["global_steps"]))
        workers["rollout"].sync_rollout_weights(published, int(state["global_steps"]))
    prompts.sampler.load_state_dict(state["sampler"])
    if kl_ctrl is not None and state.get("kl_ctrl_value") is not None:
        kl_ctrl.value = state["kl_ctrl_value"]
    if lagrangian is not None and state.get("lagrange_multiplier") is not None:
        lagrangian.load_state_dict(state["lagrange_multiplier"])
    start = int(state["global_steps"])
    queue = RolloutQueue(engine_version=last_push(cfg, start)) if overlapped else None
    ahead_dir = path / AHEAD_DIR
    for step in sorted(int(f.stem) for f in ahead_dir.glob("*.safetensors") if f.stem.isdigit()):
        # generated before the checkpoint by the weights each row records: trained as they are, never again
        batch, greedy = (ahead_dir / f"{step}{kind}.safetensors" for kind in ("", ".greedy"))
        ahead = DataHandle.put(DataProto.load(batch), data_dir, "ahead").with_meta(global_steps=step)
        baseline = DataHandle.put(DataProto.load(greedy), data_dir, "ahead") if greedy.exists() else None
        if queue is not None:
            queue.ahead.append(Ahead(step, None, ahead, greedy=baseline))
    first_stream = ahead_dir / STREAM_FILE.format(rank=0)
    if queue is not None and first_stream.exists():  # admitted to the stream, not handed over yet
        admission = json.loads(first_stream.read_text())["admission"]  # every rank admits its share of each batch
        batches = admission["admitted_total"] // admission["batch_groups"]
        queue.ahead.extend(Ahead(t, None, None) for t in range(admission["trained"], batches))
    logger.info("run %s resumes after iteration %d from %s", run_id, start, path)
    notify("resumed", step=start, path=str(path))
    return start, queue
