"""Runs started from Prefect: the ``hybridflow-launch`` flow and its deployment.

``hf deploy`` serves `launch_flow` as a Prefect deployment on the controller host (the login node on Slurm): a run
started from the Prefect UI (Deployments -> hybridflow-launch -> Run), by ``prefect deployment run
hybridflow-launch/hybridflow -p config=...``, through Prefect's API (`prefect.deployments.run_deployment`) or on a
schedule, is checked, recorded in the run store and trained exactly as ``hf run CONFIG -o ...`` does: the training
is the ``hybridflow-rlhf`` flow, a subflow of the launch. It is listed by ``hf runs list`` and continued by
``hf resume RUN_ID`` like any run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import flow

from hybridflow.engine.config import HybridFlowConfig, load_config
from hybridflow.flows.preflight import check_run_inputs
from hybridflow.flows.rlhf import run_flow
from hybridflow.flows.store.run_store import RunStore

DEPLOY_DIR_ENV = "HYBRIDFLOW_DEPLOY_DIR"
"""Set by ``hf deploy`` to the folder it runs in: a relative ``config`` parameter is read from there."""


def record_run(config: str, overrides: list[str] | None = None, db_url: str | None = None) -> str:
    """Check a run config (file `config`, relative to `DEPLOY_DIR_ENV`, with ``key=value`` `overrides`) and its
    inputs, record the run; its id.

    Raises:
        ConfigError: an invalid config or override (the key named).
        InputError: a missing model, data file or reward function (preflight: the key and the fix named).
        ValueError: ``placement.auto`` (plan it first: ``hf plan CONFIG --output plan.yaml``)."""
    path = Path(os.environ.get(DEPLOY_DIR_ENV, ".")) / Path(config).expanduser()  # an absolute `config` stays
    cfg: HybridFlowConfig = load_config(path, list(overrides or []))
    if cfg.placement.auto:
        raise ValueError(
            f"{config}: placement.auto plans at hf run; a deployment runs a planned placement: write one with "
            "hf plan CONFIG --output PLAN.yaml and pass that file"
        )
    check_run_inputs(cfg)
    store = RunStore(db_url)
    return store.create_run(cfg.model_dump(mode="json"), cfg.trainer.experiment_name, plan_id=cfg.placement.plan)


@flow(name="hybridflow-launch")
def launch_flow(config: str, overrides: list[str] | None = None, db_url: str | None = None) -> dict[str, Any]:
    """Record and train a run, as ``hf run CONFIG -o KEY=VALUE ...`` does, for a run started from Prefect.

    Args:
        config: a run config file (YAML) on the controller host; a relative path is read from the folder
            ``hf deploy`` runs in (`DEPLOY_DIR_ENV`).
        overrides: ``key.sub=value`` items (``-o`` of hf run), e.g. ``["actor.optim.lr=1e-6", "rollout.n=8"]``.
        db_url: the run store; None: ``$HYBRIDFLOW_DB_URL`` of the serving process (``hf deploy --db``), else the
            default SQLite file (keeps passwords out of the flow run's recorded parameters).

    Returns:
        ``{"run_id": ..., "metrics": the last iteration's}``.

    Raises:
        ConfigError: an invalid config or override (`record_run`; nothing recorded).
        InputError: a missing model, data file or reward function (`record_run`; nothing recorded).
        WorkerGroupError: a stage failed (`hybridflow.flows.rlhf.rlhf_flow`); the recorded run is resumable with
            ``hf resume RUN_ID``."""
    run_id = record_run(config, overrides, db_url)
    return {"run_id": run_id, "metrics": run_flow(run_id=run_id, db_url=db_url)}
