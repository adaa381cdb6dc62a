"""``hf rm train CONFIG``: train a reward model on preference pairs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridflow.cli.common import DbOption, ExecutorOption, OverrideOption, PrefectOption, console
from hybridflow.cli.training import check_inputs, checked_config, start_workers_early, train_new

rm_app = typer.Typer(help="Reward models: train one on preference pairs.", no_args_is_help=True)


@rm_app.command("train")
def rm_train(
    config: Annotated[Path, typer.Argument(help="YAML reward-model training config", exists=True, dir_okay=False)],
    override: OverrideOption = None,
    executor: ExecutorOption = None,
    db: DbOption = None,
    prefect_api: PrefectOption = None,
) -> None:
    """Train a reward model on preference pairs (Bradley-Terry loss; Prefect flow ``hybridflow-rm`` on a worker
    group), recorded in the run store as a run of kind ``rm``; the result is a Hugging Face folder that
    ``reward_model.path`` loads: ``<output_dir>/<experiment_name>/<run_id>/reward_model``."""
    from hybridflow.engine.config import RMTrainingConfig

    cfg = checked_config(config, override, executor, RMTrainingConfig)
    start_workers_early(cfg)
    check_inputs(cfg)
    folder = train_new(cfg, "rm", "reward_model", db, prefect_api, "reward-model run")
    console.print(f"reward model: {folder} (use it with -o reward_model.path={folder})")
