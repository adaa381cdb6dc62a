"""The reward-model training flow: one Prefect flow run (``hybridflow-rm``) per ``hf rm train`` / ``hf resume``.

The loop is `hybridflow.flows.supervised.train_supervised`: each step's preference pairs go to a worker group of
data-parallel ranks (`hybridflow.engine.reward.rm_training.RewardModelTrainer`) as a data handle (Prefect task
``update_reward_model-<step>``); each epoch ends with an evaluation on the held-out pairs (``evaluate_reward_model``:
``val/rm/acc``, ``val/rm/margin``, ``val/rm/loss``) and a checkpoint. The run is in the run store as kind ``rm``.

The result: ``<trainer.output_dir>/<experiment_name>/<run_id>/reward_model/``, a Hugging Face folder that
``AutoModelForSequenceClassification`` and ``reward_model.path`` load (the last checkpoint's weights and tokenizer).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, tags

from hybridflow.engine.config import RMTrainingConfig
from hybridflow.engine.reward.preference import collate_pairs
from hybridflow.flows.preflight import preference_sets
from hybridflow.flows.reporting import untagged_task_runs
from hybridflow.flows.store.run_store import RunStore
from hybridflow.flows.supervised import SupervisedRun, train_supervised
from hybridflow.tasks import stages

RM_WORKER_CLS = "hybridflow.engine.reward.rm_training:RewardModelTrainer"

RM_RUN = SupervisedRun(
    kind="rm",
    config_cls=RMTrainingConfig,
    worker_cls=RM_WORKER_CLS,
    role="reward_model",
    result="reward_model",
    load_sets=preference_sets,
    collate=lambda rows, sets, cfg: collate_pairs(rows, sets.tokenizer, cfg.data.max_length),
    update=stages.update_reward_model,
    evaluate=stages.evaluate_reward_model,
    update_stage="update_reward_model",
    evaluate_stage="evaluate_reward_model",
)
"""Reward-model training as a `SupervisedRun`: one worker group hosting the reward model."""


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


@flow(name="hybridflow-rm")
def rm_flow(run_id: str, db_url: str | None = None) -> dict[str, float]:
    """Train the reward model of run `run_id` (kind ``rm``) from its newest usable checkpoint, if any.

    Args:
        run_id: a run recorded with ``kind="rm"`` (``hf rm train`` does this).
        db_url: the store; None reads ``$HYBRIDFLOW_DB_URL`` or the default SQLite file.

    Returns:
        the last step's metrics.

    Raises:
        the errors of `hybridflow.flows.supervised.train_supervised`.
    """
    with untagged_task_runs():  # the tags name the flow run only (see untagged_task_runs)
        return train_supervised(run_id, db_url, RM_RUN)
