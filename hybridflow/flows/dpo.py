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

import dataclasses
import logging
from pathlib import Path

from prefect import flow, tags

from hybridflow.engine.config.dpo import DPOTrainingConfig
from hybridflow.engine.dpo.pairs import REF_KEYS, collate_dpo_pairs
from hybridflow.engine.embedded_models import resolve_model_path
from hybridflow.engine.protocol import DataProto
from hybridflow.flows.preflight import PreferenceSets, preference_sets
from hybridflow.flows.reporting import untagged_task_runs
from hybridflow.flows.store.run_store import RunStore
from hybridflow.flows.supervised import SupervisedRun, train_supervised
from hybridflow.slurm.handles import DataHandle
from hybridflow.slurm.worker_group import WorkerGroup
from hybridflow.tasks import stages

logger = logging.getLogger(__name__)

DPO_WORKER_CLS = "hybridflow.engine.dpo.trainer:DPOTrainer"
REFERENCE_DIR = "reference_logps"
"""The run folder's precomputed reference log-probs: ``train.safetensors`` and ``val.safetensors``."""


def precompute_reference(
    group: WorkerGroup, sets: PreferenceSets, cfg: DPOTrainingConfig, run_dir: Path, data_dir: Path
) -> PreferenceSets:
    """With ``dpo.precompute_ref_log_probs`` (TRL's key), every training and held-out pair scored once under the
    frozen reference and the reference then freed on the ranks; `sets` as it is without.

    The scores (`REF_KEYS`, float32 [pairs], in the rows' order; sums, or per-token means for ``ipo``) are computed in
    batches of ``data.val_batch_size`` (`stages.precompute_ref_log_probs`) and kept in ``<run folder>/
    reference_logps/{train,val}.safetensors`` (written atomically), with what they depend on (``dpo.loss_type``,
    ``data.max_length``, the reference's folder, the rows' count): a resumed or recovered session reads them back and
    scores no pair again; one whose settings differ scores them anew. Returns the sets with each row carrying its
    two scores, which `collate_dpo_pairs` hands to the batches.
    """
    if not cfg.dpo.precompute_ref_log_probs:
        return sets
    reference = str(resolve_model_path(cfg.dpo.ref_model_path or cfg.model.path))
    scored = {}
    for split in ("train", "val"):
        rows = getattr(sets, split)
        if not rows:
            scored[split] = rows
            continue
        meta = {"loss_type": cfg.dpo.loss_type, "max_length": cfg.data.max_length, "reference": reference}
        meta["rows"] = len(rows)
        path = run_dir / REFERENCE_DIR / f"{split}.safetensors"
        saved = DataProto.load(path) if path.is_file() else None
        if saved is None or saved.meta_info != meta:
            size = cfg.data.val_batch_size
            batches = [
                DataHandle.put(collate_dpo_pairs(rows[i : i + size], sets.tokenizer, cfg.data.max_length), data_dir)
                for i in range(0, len(rows), size)
            ]
            both = stages.precompute_ref_log_probs(group, batches)
            for batch in batches:
                batch.delete()
            saved = DataProto.from_dict({key: both[key] for key in REF_KEYS}, meta_info=meta)
            saved.save(path)
            logger.info("the reference scored the %d %s pairs into %s", len(rows), split, path)
        chosen, rejected = (saved.batch[key].tolist() for key in REF_KEYS)
        scored[split] = [
            {**row, REF_KEYS[0]: c, REF_KEYS[1]: r} for row, c, r in zip(rows, chosen, rejected, strict=True)
        ]
    freed = group.free_reference()
    logger.info("the reference is freed on every rank (%d parameters each)", freed[0])
    return dataclasses.replace(sets, **scored)


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
    prepare=precompute_reference,
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
