"""``hf verl KEY=VALUE ...``: a verl command line (its Hydra overrides translated to ours), run as ``hf run`` runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridflow.cli.common import DbOption, DryRunOption, PrefectOption, _store, console
from hybridflow.cli.run import record_and_train
from hybridflow.cli.training import ExecutorOption, with_executor


def verl(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="verl's Hydra overrides, as given to python3 -m verl.trainer.main_ppo (key=value ...)"),
    ] = None,
    config_path: Annotated[
        Path | None, typer.Option("--config-path", help="Hydra's: the folder of a verl config file")
    ] = None,
    config_name: Annotated[
        str | None,
        typer.Option(
            "--config-name",
            help="Hydra's: the verl config file's name (.yaml optional); verl's own ppo_trainer and "
            "ppo_megatron_trainer need no file",
        ),
    ] = None,
    override: Annotated[
        list[str] | None, typer.Option("-o", "--override", help="HybridFlow's own key.sub=value, after verl's keys")
    ] = None,
    executor: ExecutorOption = None,
    db: DbOption = None,
    prefect_api: PrefectOption = None,
    dry_run: DryRunOption = False,
) -> None:
    """Run a verl command line: replace ``python3 -m verl.trainer.main_ppo`` by ``hf verl`` and keep its overrides.

    Each verl key is translated to ours (docs/verl-keys.md, or hf config verl-keys); keys that only tune verl's
    speed or memory are accepted and listed; any other key is refused, with the nearest supported one, before
    anything runs. Keys not given take verl's defaults where those change what is computed (adv_estimator gae,
    train_batch_size 1024, rollout.n 1, ...). The run is then recorded and trained as hf run does."""
    from hybridflow.engine.config import ConfigError, load_config
    from hybridflow.engine.config.verl import VERL_CONFIG_NAMES, translate

    config_file = verls_own = None
    if config_name:
        name = config_name if config_name.endswith(".yaml") else f"{config_name}.yaml"
        config_file = (config_path or Path(".")) / name
        if not config_file.is_file() and (stem := name.removesuffix(".yaml")) in VERL_CONFIG_NAMES:
            config_file, verls_own = None, stem  # verl's own, as its scripts name it
        elif not config_file.is_file():
            console.print(
                f"--config-path/--config-name: {config_file} is not a file, nor one of verl's own config files "
                f"({', '.join(VERL_CONFIG_NAMES)})",
                style="red",
                markup=False,
            )
            raise typer.Exit(2)
    try:
        translation = translate(list(overrides or []), config_file, verls_own)
        cfg = load_config(None, translation.overrides + with_executor(override, executor))
    except (ConfigError, FileNotFoundError, ValueError) as e:
        console.print(str(e), style="red", markup=False)
        raise typer.Exit(2) from None
    for key, why in translation.no_effect:
        console.print(f"verl key {key}: no effect here ({why})", style="dim", markup=False)
    if cfg.placement.auto:
        console.print("hf verl does not plan placements: give trainer.n_gpus_per_node / nnodes", style="red")
        raise typer.Exit(2)
    record_and_train(cfg, None if dry_run else _store(db), prefect_api)
