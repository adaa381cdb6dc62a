"""The DPO flow: one Prefect flow run (``hybridflow-dpo``) per ``hf dpo train`` / ``hf resume``.

The loop is `hybridflow.flows.supervised.train_supervised`: each step's preference pairs
(`hybridflow.engine.dpo.pairs`: each response's tokens after its prompt's) go to a worker group of data-parallel
ranks holding the policy and the frozen reference (`hybridflow.engine.dpo.trainer.DPOTrainer`, Prefect task
``update_dpo-<step>``); each epoch ends with the held-out pairs' loss and implicit rewards (``evaluate_dpo``:
``val/loss``, ``val/rewards/accuracies``, ...) and a checkpoint. The run is in the run store as kind ``dpo``.

The result: ``<trainer.output_dir>/<experiment_name>/<run_id>/model/``, a Hugging Face folder an RL run starts from
(``model.path``).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, tags

from hybridflow.engine.config.dpo import DPOTrainingConfig
from hybridflow.engine.dpo.pairs import collate_dpo_pairs
from hybridflow.flows.preflight import preference_sets
from hybridflow.flows.reporting import untagged_task_runs
from hybridflow.flows.store.run_store import RunStore
from hybridflow.flows.supervised import SupervisedRun, train_supervised
from hybridflow.tasks import stages

DPO_WORKER_CLS = "hybridflow.engine.dpo.trainer:DPOTrainer"

DPO_RUN = SupervisedRun(
    kind="dpo",
    config_cls=DPOTrainingConfig,
    worker_cls=DPO_WORKER_CLS,
    role="actor",
    result="model",
    load_sets=preference_sets,
    collate=lambda rows, sets, cfg: collate_dpo_pairs(rows, sets.tokenizer, cfg.data.max_length),
    update=stages.update_dpo,
    evaluate=stages.evaluate_dpo,
    update_stage="update_dpo",
    evaluate_stage="evaluate_dpo",
)
"""DPO as a `SupervisedRun`: one worker group hosting the policy (role ``actor``) and its frozen reference."""


def run_dpo_flow(run_id: str, db_url: str | None = None) -> dict[str, float]:
    """`dpo_flow` as ``hf dpo train`` / ``hf resume`` start it: named ``<experiment>/<run_id>``, tagged
    ``experiment:<name>``, ``kind:dpo``, ``model:<folder name>``, ``executor:<local|slurm>``."""
    cfg = DPOTrainingConfig.model_validate(RunStore(db_url).get_run(run_id).config)
    names = [f"experiment:{cfg.trainer.experiment_name}", "kind:dpo", f"model:{Path(cfg.model.path).name}"]
    with tags(*names, f"executor:{cfg.placement.executor}"):
        named = dpo_flow.with_options(flow_run_name=f"{cfg.trainer.experiment_name}/{run_id}")
        return named(run_id=run_id, db_url=db_url)


@flow(name="hybridflow-dpo")
def dpo_flow(run_id: str, db_url: str | None = None) -> dict[str, float]:
    """Train the policy of run `run_id` (kind ``dpo``) from its newest usable checkpoint, if any; returns the last
    step's metrics (errors: `hybridflow.flows.supervised.train_supervised`)."""
    with untagged_task_runs():  # the tags name the flow run only (see untagged_task_runs)
        return train_supervised(run_id, db_url, DPO_RUN)
