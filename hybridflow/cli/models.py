"""``hf models prepare NAME``: an embedded model (no model hub) as a local Hugging Face folder."""

from __future__ import annotations

from typing import Annotated

import typer

from hybridflow.cli.common import console

models_app = typer.Typer(help="Embedded models (no model hub needed).", no_args_is_help=True)


@models_app.command("prepare")
def models_prepare(
    name: Annotated[str, typer.Argument(help="embedded model: smollm2 or tiny")],
    force: Annotated[bool, typer.Option(help="rebuild even if already prepared")] = False,
) -> None:
    """Convert an embedded model into a cached Hugging Face folder (idempotent) and print its path."""
    from hybridflow.engine.embedded_models import prepare_model

    try:
        with console.status(f"preparing {name} (once; ~30 s for smollm2)..."):
            path = prepare_model(name, force=force)
    except (ValueError, FileNotFoundError) as e:
        console.print(f"{e}", style="red")
        raise typer.Exit(2) from None
    print(path)
