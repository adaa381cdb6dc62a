"""The training loop of the runs that train one model on a fixed set of rows with one worker group: reward-model
training (``hf rm train``, `hybridflow.flows.rm`), DPO (``hf dpo train``, `hybridflow.flows.dpo`) and supervised
fine-tuning (``hf sft train``, `hybridflow.flows.sft`).

The controller reads the rows, cuts each step's batch (a pure function of the seed, the epoch and the step, so a
resumed run needs only its step count: `hybridflow.engine.epochs.epoch_batches`) and hands it to the worker group as
a data handle; each step is a Prefect task, each epoch ends with an evaluation on the held-out rows and a
checkpoint. The run is in the run store like an RL run (its kind, metrics, placement and checkpoints); ``hf resume
RUN_ID`` continues it from the newest usable checkpoint, and ``-o trainer.total_epochs=N`` trains a finished one on.
The result is the last checkpoint's model folder, copied to ``<run folder>/<result>/`` (without optimizer state).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.engine.checkpoint import OPTIM_STATE, read_trainer_state
from hybridflow.engine.epochs import epoch_batches
from hybridflow.engine.metrics import Timer
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
    record_stop,
    recover_or_raise,
    run_dir_of,
    save_checkpoint,
    take_over_flow_run,
    usable_checkpoint,
)
from hybridflow.flows.reporting import FlowLogs, RunReport
from hybridflow.flows.store.run_store import RunStore
from hybridflow.slurm.handles import DataHandle
from hybridflow.slurm.worker_group import WorkerGroup, WorkerGroupError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SupervisedRun:
    """What one kind of supervised run trains, and how.

    Attributes:
        kind: the run store's kind (``rm``, ``sft``).
        config_cls: its config class (`hybridflow.engine.config.RMTrainingConfig`, ...).
        worker_cls: the rank class (``"module:Class"``).
        role: the one role (and pool) of its worker group, and its folder in a checkpoint.
        result: the folder of the trained model in the run folder.
        load_sets: ``cfg -> sets`` with ``tokenizer``, ``train`` and ``val`` (lists of rows).
        collate: ``(rows, sets, cfg) -> DataProto``: a step's or an evaluation batch's tensors.
        update: the step's Prefect task, ``(group, handle) -> metrics``.
        evaluate: the evaluation's Prefect task, ``(group, [handles]) -> metrics``.
        update_stage, evaluate_stage: their stage names (task-run names, timings).
        prepare: ``(group, sets, cfg, run_dir, data_dir) -> sets``, run in each session once the worker group is up
            and before its first step or evaluation (DPO's precomputed reference log-probs), or None.
    """

    kind: str
    config_cls: type
    worker_cls: str
    role: str
    result: str
    load_sets: Callable[[Any], Any]
    collate: Callable[[list, Any, Any], DataProto]
    update: Callable[[WorkerGroup, DataHandle], dict[str, float]]
    evaluate: Callable[[WorkerGroup, list[DataHandle]], dict[str, float]]
    update_stage: str
    evaluate_stage: str
    prepare: Callable[[WorkerGroup, Any, Any, Path, Path], Any] | None = None


def steps_per_epoch(cfg: Any, sets: Any) -> int:
    """Optimizer steps in one pass over the training rows (whole batches of ``data.train_batch_size``)."""
    return len(sets.train) // cfg.data.train_batch_size


def train_supervised(run_id: str, db_url: str | None, spec: SupervisedRun) -> dict[str, float]:
    """Train run `run_id` (of kind ``spec.kind``) from its newest usable checkpoint, if any (module docstring), in
    controller sessions: when its worker group loses ranks (killed, silent, its Slurm job or node gone) the run
    recovers by itself, on record, up to ``trainer.max_recoveries`` times (`recover_or_raise`): the group is
    relaunched and the run goes on from the newest usable checkpoint, as ``hf resume`` would.

    Returns:
        the last step's metrics.

    Raises:
        LeaseHeldError: another controller is training the run. LeaseLostError: another took it over meanwhile.
        NonFiniteError: a step's gradient norm is not finite (the run is recorded failed, resumable).
        WorkerGroupError: a rank raised, or ranks were lost once more than ``trainer.max_recoveries`` allows.
    """
    store = RunStore(db_url)
    cfg = spec.config_cls.model_validate(store.get_run(run_id).config)
    recoveries = 0
    while True:
        try:
            return _session(store, cfg, run_id, spec)
        except WorkerGroupError as error:
            recoveries = recover_or_raise(store, run_id, error, recoveries, cfg.trainer)


def _session(store: RunStore, cfg: Any, run_id: str, spec: SupervisedRun) -> dict[str, float]:
    """One controller session: take the lease, launch the worker group, restore, train to the end, release."""
    lease = RunLease(store, run_id).acquire()
    umask = os.umask(0o077)
    workers = report = logs = None
    completed = interrupted = False
    try:
        run_dir = private_dir(run_dir_of(cfg, run_id))
        logs = FlowLogs(run_dir).__enter__()
        data_dir = run_dir / "data"
        shutil.rmtree(data_dir, ignore_errors=True)  # batch files of an earlier session
        data_dir.mkdir()
        take_over_flow_run(store, run_id)
        store.set_status(run_id, "running")
        notify("flow", run_id=run_id, ui_url=flow_run_ui_url())
        sets = spec.load_sets(cfg)
        per_epoch = steps_per_epoch(cfg, sets)
        total = cfg.trainer.total_epochs * per_epoch
        pools = {spec.role: cfg.placement.pool(spec.role, [spec.role])}
        workers = launch_workers(cfg, run_id, store, run_dir, pools, spec.worker_cls)
        group = workers[spec.role]
        if spec.prepare is not None:
            sets = spec.prepare(group, sets, cfg, run_dir, data_dir)
        size = cfg.data.val_batch_size
        val_batches = [
            DataHandle.put(spec.collate(sets.val[i : i + size], sets, cfg), data_dir, "val")
            for i in range(0, len(sets.val), size)
        ]
        logs.pump()
        start = _resume(store, run_id, workers, spec.role)
        report = RunReport(store, run_id, cfg, run_dir, sets.tokenizer, start + 1 if start else 0)
        notify("start", run_id=run_id, total=total, start_step=start)
        logger.info("run %s: %s steps %d to %d (%d per epoch)", run_id, spec.kind, start + 1, total, per_epoch)
        metrics: dict[str, float] = {}
        if start == 0 and cfg.trainer.val_before_train and val_batches:
            enter_stage(spec.evaluate_stage, 0, 0)
            val = spec.evaluate(group, val_batches)
            report.step(0, val)
            notify("validation", metrics=val)
        for step in range(start, total):
            lease.check()
            store.start_iteration(run_id, step + 1)
            epoch, index = divmod(step, per_epoch)
            rows = epoch_batches(len(sets.train), cfg.data.train_batch_size, epoch, cfg.data.seed, cfg.data.shuffle)
            batch = spec.collate([sets.train[i] for i in rows[index]], sets, cfg)
            timer = Timer()
            with timer("step"):
                handle = DataHandle.put(batch, data_dir, "batch")
                enter_stage(spec.update_stage, step + 1, step)
                metrics = spec.update(group, handle)
                handle.delete()
            metrics.update(timer.metrics())
            metrics["training/global_step"] = step + 1
            metrics["training/epoch"] = epoch + (index + 1) / per_epoch
            epoch_end = index + 1 == per_epoch
            if epoch_end and val_batches:
                enter_stage(spec.evaluate_stage, step + 1, step + 1)
                metrics.update(spec.evaluate(group, val_batches))
            logs.pump()
            report.step(step + 1, metrics)
            save_freq = cfg.trainer.save_freq
            if epoch_end or (save_freq and (step + 1) % save_freq == 0):
                save_checkpoint(store, run_id, cfg, lease, workers, step + 1, {"global_steps": step + 1})
            store.end_iteration(run_id, step + 1)
            notify("iteration", step=step + 1, metrics=metrics)
        latest = store.latest_checkpoint(run_id)
        if latest is not None:
            export_model(Path(latest.path) / spec.role, run_dir / spec.result)
        store.set_status(run_id, "completed")
        completed = True
        return metrics
    except BaseException as e:
        interrupted = record_stop(store, run_id, lease, e)
        raise
    finally:
        os.umask(umask)
        end_session(lease, workers, report, logs, interrupted, completed)


def _resume(store: RunStore, run_id: str, workers: Workers, role: str) -> int:
    """Load the newest usable checkpoint (`usable_checkpoint`: a corrupt one is marked bad and the one before it
    used) into the group; returns its step (0: none, start from ``model.path``)."""
    path = usable_checkpoint(store, run_id)
    if path is None:
        return 0
    workers[role].load_checkpoint(str(path))
    step = int(read_trainer_state(path)["global_steps"])
    logger.info("run %s resumes after step %d from %s", run_id, step, path)
    notify("resumed", step=step, path=str(path))
    return step


def export_model(source: Path, target: Path) -> Path:
    """Copy a checkpoint's model folder `source` (weights, config, tokenizer; not the optimizer state) to `target`,
    replacing what was there only once the copy is complete. Returns `target`."""
    staging = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns(OPTIM_STATE))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target
