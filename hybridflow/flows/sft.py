"""The supervised fine-tuning flow: one Prefect flow run (``hybridflow-sft``) per ``hf sft train`` / ``hf resume``.

The SFT of SFT -> RM -> RL: the loop is `hybridflow.flows.supervised.train_supervised`; each step's conversations
(`hybridflow.engine.sft.conversations`: token rows laid out as a multi-turn rollout lays them out, the loss on the
assistant turns) go to a worker group of data-parallel ranks (`hybridflow.engine.sft.trainer.SFTTrainer`, Prefect
task ``update_sft-<step>``); each epoch ends with the held-out loss (``evaluate_sft``: ``val/loss``) and a
checkpoint. The run is in the run store as kind ``sft``.

The result: ``<trainer.output_dir>/<experiment_name>/<run_id>/model/``, a Hugging Face folder an RL run starts from
(``model.path``).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, tags

from hybridflow.engine.config import SFTTrainingConfig
from hybridflow.engine.sft.conversations import collate_conversations
from hybridflow.flows.preflight import conversation_sets
from hybridflow.flows.reporting import untagged_task_runs
from hybridflow.flows.store.run_store import RunStore
from hybridflow.flows.supervised import SupervisedRun, train_supervised
from hybridflow.tasks import stages

SFT_WORKER_CLS = "hybridflow.engine.sft.trainer:SFTTrainer"

SFT_RUN = SupervisedRun(
    kind="sft",
    config_cls=SFTTrainingConfig,
    worker_cls=SFT_WORKER_CLS,
    role="actor",
    result="model",
    load_sets=conversation_sets,
    collate=lambda rows, sets, cfg: collate_conversations(rows, sets.tokenizer.pad_token_id),
    update=stages.update_sft,
    evaluate=stages.evaluate_sft,
    update_stage="update_sft",
    evaluate_stage="evaluate_sft",
)
"""Supervised fine-tuning as a `SupervisedRun`: one worker group hosting the policy (role ``actor``)."""


def run_sft_flow(run_id: str, db_url: str | None = None) -> dict[str, float]:
    """`sft_flow` as ``hf sft train`` / ``hf resume`` start it: named ``<experiment>/<run_id>``, tagged
    ``experiment:<name>``, ``kind:sft``, ``model:<folder name>``, ``executor:<local|slurm>``."""
    cfg = SFTTrainingConfig.model_validate(RunStore(db_url).get_run(run_id).config)
    names = [f"experiment:{cfg.trainer.experiment_name}", "kind:sft", f"model:{Path(cfg.model.path).name}"]
    with tags(*names, f"executor:{cfg.placement.executor}"):
        named = sft_flow.with_options(flow_run_name=f"{cfg.trainer.experiment_name}/{run_id}")
        return named(run_id=run_id, db_url=db_url)


@flow(name="hybridflow-sft")
def sft_flow(run_id: str, db_url: str | None = None) -> dict[str, float]:
    """Fine-tune the model of run `run_id` (kind ``sft``) from its newest usable checkpoint, if any; returns the
    last step's metrics (errors: `hybridflow.flows.supervised.train_supervised`)."""
    with untagged_task_runs():  # the tags name the flow run only (see untagged_task_runs)
        return train_supervised(run_id, db_url, SFT_RUN)
