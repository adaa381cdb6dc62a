"""The reward-model training flow: one Prefect flow run (``hybridflow-rm``) per ``hf rm train`` / ``hf resume``.

The controller reads the preference pairs, cuts each step's batch (a pure function of the seed, the epoch and the
step, so a resumed run needs only its step count) and hands it to a worker group of data-parallel ranks
(`hybridflow.engine.reward.rm_training.RewardModelTrainer`) as a data handle; each step is a Prefect task
(``update_reward_model-<step>``), each epoch ends with an evaluation on the held-out pairs
(``evaluate_reward_model``: ``val/rm/acc``, ``val/rm/margin``, ``val/rm/loss``) and a checkpoint. The run is in the
run store like an RL run (kind ``rm``): its metrics, placement and checkpoints; ``hf resume RUN_ID`` continues it
from the newest usable checkpoint, and ``-o trainer.total_epochs=N`` trains a finished one on.

The result: ``<trainer.output_dir>/<experiment_name>/<run_id>/reward_model/``, a Hugging Face folder that
``AutoModelForSequenceClassification`` and ``reward_model.path`` load (the last checkpoint's weights and tokenizer).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from prefect import flow, tags
from prefect.runtime import flow_run

from hybridflow.engine.checkpoint import OPTIM_STATE, read_trainer_state
from hybridflow.engine.config import RMTrainingConfig
from hybridflow.engine.metrics import Timer
from hybridflow.engine.reward.preference import collate_pairs, epoch_batches
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
    run_dir_of,
    save_checkpoint,
    usable_checkpoint,
)
from hybridflow.flows.preflight import PreferenceSets, preference_sets
from hybridflow.flows.reporting import FlowLogs, RunReport, untagged_task_runs
from hybridflow.flows.store.run_store import RunStore
from hybridflow.slurm.handles import DataHandle
from hybridflow.tasks import stages

logger = logging.getLogger(__name__)

RM_WORKER_CLS = "hybridflow.engine.reward.rm_training:RewardModelTrainer"
POOL = "reward_model"
"""The one pool of a reward-model training run: its worker group hosts the reward model being trained."""
"""One worker group, named after its one role."""


def rm_flow_run_tags(cfg: RMTrainingConfig) -> list[str]:
    """``experiment:<name>``, ``kind:rm``, ``model:<folder name>``, ``executor:<local|slurm>``."""
    return [
        f"experiment:{cfg.trainer.experiment_name}",
        "kind:rm",
        f"model:{Path(cfg.model.path).name}",
        f"executor:{cfg.placement.executor}",
    ]


def run_rm_flow(run_id: str, db_url: str | None = None) -> dict[str, float]:
    """`rm_flow` as ``hf rm train`` / ``hf resume`` start it: named ``<experiment>/<run_id>``, tagged
    (`rm_flow_run_tags`). Same arguments, returns and errors as `rm_flow`."""
    cfg = RMTrainingConfig.model_validate(RunStore(db_url).get_run(run_id).config)
    with tags(*rm_flow_run_tags(cfg)):
        named = rm_flow.with_options(flow_run_name=f"{cfg.trainer.experiment_name}/{run_id}")
        return named(run_id=run_id, db_url=db_url)


def steps_per_epoch(cfg: RMTrainingConfig, sets: PreferenceSets) -> int:
    """Optimizer steps in one pass over the training pairs (whole batches of ``data.train_batch_size``)."""
    return len(sets.train) // cfg.data.train_batch_size


@flow(name="hybridflow-rm")
def rm_flow(run_id: str, db_url: str | None = None) -> dict[str, float]:
    """Train the reward model of run `run_id` (kind ``rm``) from its newest usable checkpoint, if any.

    Args:
        run_id: a run recorded with ``kind="rm"`` (``hf rm train`` does this).
        db_url: the store; None reads ``$HYBRIDFLOW_DB_URL`` or the default SQLite file.

    Returns:
        the last step's metrics.

    Raises:
        LeaseHeldError: another controller is training the run. LeaseLostError: another took it over meanwhile.
        NonFiniteError: a step's gradient norm is not finite (the run is recorded failed, resumable).
    """
    with untagged_task_runs():  # the tags name the flow run only (see untagged_task_runs)
        return _train_rm(run_id, db_url)


def _train_rm(run_id: str, db_url: str | None) -> dict[str, float]:
    store = RunStore(db_url)
    cfg = RMTrainingConfig.model_validate(store.get_run(run_id).config)
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
        if flow_run.id:
            store.set_flow_run_id(run_id, str(flow_run.id))
        store.set_status(run_id, "running")
        notify("flow", run_id=run_id, ui_url=flow_run_ui_url())
        sets = preference_sets(cfg)
        per_epoch = steps_per_epoch(cfg, sets)
        total = cfg.trainer.total_epochs * per_epoch
        size = cfg.data.val_batch_size
        val_batches = [
            DataHandle.put(collate_pairs(sets.val[i : i + size], sets.tokenizer, cfg.data.max_length), data_dir, "val")
            for i in range(0, len(sets.val), size)
        ]
        report = RunReport(store, run_id, cfg, run_dir, sets.tokenizer)
        workers = launch_workers(cfg, run_id, store, run_dir, {POOL: cfg.placement.pool(POOL, [POOL])}, RM_WORKER_CLS)
        group = workers["reward_model"]
        logs.pump()
        start = _resume(store, run_id, workers)
        notify("start", run_id=run_id, total=total, start_step=start)
        logger.info("run %s: reward-model steps %d to %d (%d per epoch)", run_id, start + 1, total, per_epoch)
        metrics: dict[str, float] = {}
        if start == 0 and cfg.trainer.val_before_train and val_batches:
            enter_stage("evaluate_reward_model", 0, 0)
            val = stages.evaluate_reward_model(group, val_batches)
            report.step(0, val)
            notify("validation", metrics=val)
        for step in range(start, total):
            lease.check()
            store.start_iteration(run_id, step + 1)
            epoch, index = divmod(step, per_epoch)
            rows = epoch_batches(len(sets.train), cfg.data.train_batch_size, epoch, cfg.data.seed, cfg.data.shuffle)
            pairs = collate_pairs([sets.train[i] for i in rows[index]], sets.tokenizer, cfg.data.max_length)
            timer = Timer()
            with timer("step"):
                handle = DataHandle.put(pairs, data_dir, "pairs")
                enter_stage("update_reward_model", step + 1, step)
                metrics = stages.update_reward_model(group, handle)
                handle.delete()
            metrics.update(timer.metrics())
            metrics["training/global_step"] = step + 1
            metrics["training/epoch"] = epoch + (index + 1) / per_epoch
            epoch_end = index + 1 == per_epoch
            if epoch_end and val_batches:
                enter_stage("evaluate_reward_model", step + 1, step + 1)
                metrics.update(stages.evaluate_reward_model(group, val_batches))
            logs.pump()
            report.step(step + 1, metrics)
            save_freq = cfg.trainer.save_freq
            if epoch_end or (save_freq and (step + 1) % save_freq == 0):
                save_checkpoint(store, run_id, cfg, lease, workers, step + 1, {"global_steps": step + 1})
            store.end_iteration(run_id, step + 1)
            notify("iteration", step=step + 1, metrics=metrics)
        latest = store.latest_checkpoint(run_id)
        if latest is not None:
            export_reward_model(Path(latest.path), run_dir / "reward_model")
        store.set_status(run_id, "completed")
        completed = True
        return metrics
    except BaseException as e:
        interrupted = record_stop(store, run_id, lease, e)
        raise
    finally:
        os.umask(umask)
        end_session(lease, workers, report, logs, interrupted, completed)


def _resume(store: RunStore, run_id: str, workers: Workers) -> int:
    """Load the newest usable checkpoint (`usable_checkpoint`: a corrupt one is marked bad and the one before it
    used) into the group; returns its step (0: none, start from ``model.path``)."""
    path = usable_checkpoint(store, run_id)
    if path is None:
        return 0
    workers["reward_model"].load_checkpoint(str(path))
    step = int(read_trainer_state(path)["global_steps"])
    logger.info("run %s resumes after step %d from %s", run_id, step, path)
    notify("resumed", step=step, path=str(path))
    return step


def export_reward_model(checkpoint: Path, target: Path) -> Path:
    """Copy a checkpoint's ``reward_model/`` (weights, config, tokenizer; not the optimizer state) to `target`,
    replacing what was there only once the copy is complete. Returns `target`."""
    staging = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(checkpoint / "reward_model", staging, ignore=shutil.ignore_patterns(OPTIM_STATE))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target
