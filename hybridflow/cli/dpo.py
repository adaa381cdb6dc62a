"""``hf dpo train CONFIG``: direct preference optimisation of a policy on preference pairs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridflow.cli.common import DbOption, ExecutorOption, OverrideOption, PrefectOption, console
from hybridflow.cli.training import check_inputs, checked_config, print_policy, start_workers_early, train_new

dpo_app = typer.Typer(help="DPO: train a policy on preference pairs against a frozen reference.", no_args_is_help=True)


@dpo_app.command("train")
def dpo_train(
    config: Annotated[Path, typer.Argument(help="YAML DPO config", exists=True, dir_okay=False)],
    override: OverrideOption = None,
    executor: ExecutorOption = None,
    db: DbOption = None,
    prefect_api: PrefectOption = None,
) -> None:
    """Train a policy on preference pairs (the ``hf rm train`` layout) with the DPO or IPO loss against a frozen
    reference (Prefect flow ``hybridflow-dpo`` on a worker group), recorded in the run store as a run of kind
    ``dpo``; the result is a Hugging Face folder that ``model.path`` of an RL run loads (with ``model.lora_rank`` > 0
    the adapter, for ``model.lora_adapter_path``): ``<output_dir>/<experiment_name>/<run_id>/model``."""
    from hybridflow.engine.config import DPOTrainingConfig
    from hybridflow.flows.preflight import preference_sets

    cfg = checked_config(config, override, executor, DPOTrainingConfig)
    start_workers_early(cfg)
    check_inputs(cfg)
    sets = preference_sets(cfg)
    console.print(f"{len(sets.train)} training and {len(sets.val)} held-out pairs")
    folder = train_new(cfg, "dpo", "model", db, prefect_api, "DPO run")
    print_policy(cfg, folder, "policy")
