"""``hf sft train CONFIG``: supervised fine-tuning of a policy on conversations."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridflow.cli.common import DbOption, ExecutorOption, OverrideOption, PrefectOption, console
from hybridflow.cli.training import check_inputs, checked_config, print_policy, start_workers_early, train_new

sft_app = typer.Typer(help="Supervised fine-tuning: train a policy on conversations.", no_args_is_help=True)


@sft_app.command("train")
def sft_train(
    config: Annotated[Path, typer.Argument(help="YAML SFT config", exists=True, dir_okay=False)],
    override: OverrideOption = None,
    executor: ExecutorOption = None,
    db: DbOption = None,
    prefect_api: PrefectOption = None,
) -> None:
    """Fine-tune a policy on conversations, the loss on its assistant turns (Prefect flow ``hybridflow-sft`` on a
    worker group), recorded in the run store as a run of kind ``sft``; the result is a Hugging Face folder that
    ``model.path`` of an RL run loads: ``<output_dir>/<experiment_name>/<run_id>/model``."""
    from hybridflow.engine.config import SFTTrainingConfig
    from hybridflow.flows.preflight import conversation_sets

    cfg = checked_config(config, override, executor, SFTTrainingConfig)
    start_workers_early(cfg)
    check_inputs(cfg)
    sets = conversation_sets(cfg)
    console.print(f"{len(sets.train)} training and {len(sets.val)} held-out conversations {sets.counts}")
    folder = train_new(cfg, "sft", "model", db, prefect_api, "SFT run")
    print_policy(cfg, folder, "model")
