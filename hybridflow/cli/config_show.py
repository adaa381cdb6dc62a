"""``hf config``: a run's or a file's config, in our keys or in verl's (``--as-verl``), and the table of verl's keys."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer
import yaml

from hybridflow.cli.common import DbOption, _get_run, _store, console

config_app = typer.Typer(help="Configs: show one in our keys or verl's; the verl key table.", no_args_is_help=True)


@config_app.command("show")
def config_show(
    target: Annotated[str, typer.Argument(help="a run id (hf runs list) or a YAML config file")],
    as_verl: Annotated[
        bool, typer.Option("--as-verl", help="print verl's overrides (hf verl ... or python3 -m verl...)")
    ] = False,
    override: Annotated[list[str] | None, typer.Option("-o", "--override", help="key.sub=value (files)")] = None,
    db: DbOption = None,
) -> None:
    """Print the config of a recorded run or of a config file (with its ``defaults`` and ``-o`` overrides
    resolved): YAML in our keys, or with ``--as-verl`` one verl override per line, ready to paste after
    ``hf verl`` (keys with no verl counterpart, such as data.reasoning_gym or placement.pools, are left out)."""
    from hybridflow.engine.config import ConfigError, load_config, validate_config
    from hybridflow.engine.config.verl import override_value, to_verl

    try:
        if Path(target).is_file():
            cfg = load_config(Path(target), list(override or []))
        else:
            cfg = validate_config(_get_run(_store(db), target).config)
    except ConfigError as e:
        console.print(str(e), style="red")
        raise typer.Exit(2) from None
    tree = cfg.model_dump(mode="json")
    if not as_verl:
        console.print(yaml.safe_dump(tree, sort_keys=False), end="")
        return
    lines = [f"{key}={override_value(value)}" for key, value in to_verl(tree).items()]
    console.print("hf verl \\\n    " + " \\\n    ".join(shlex.quote(line) for line in lines))


@config_app.command("verl-keys")
def config_verl_keys() -> None:
    """Print the Markdown table of every verl key hf verl takes and its HybridFlow key (docs/verl-keys.md is this
    output)."""
    from hybridflow.engine.config.verl_keys import key_table

    console.print(key_table(), end="")
