"""``hf deploy``: serve HybridFlow as a Prefect deployment, so that runs start from the Prefect UI, its API or a
schedule."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from hybridflow.cli.common import DbOption, PrefectOption, console
from hybridflow.cli.training import checked_config, connect_prefect


def deploy(
    name: Annotated[str, typer.Option(help="the deployment's name: hybridflow-launch/NAME")] = "hybridflow",
    config: Annotated[
        Path | None,
        typer.Option(help="the config a run gets when the caller gives none (a schedule's runs)", dir_okay=False),
    ] = None,
    override: Annotated[
        list[str] | None, typer.Option("-o", "--override", help="its overrides, key.sub=value (repeatable)")
    ] = None,
    cron: Annotated[str | None, typer.Option(help="also start a run on this cron schedule, e.g. '0 2 * * *'")] = None,
    limit: Annotated[int, typer.Option(help="runs this host trains at once", min=1)] = 1,
    db: DbOption = None,
    prefect_api: PrefectOption = None,
) -> None:
    """Serve HybridFlow as a Prefect deployment on this host (the controller host: the login node on Slurm) until
    Ctrl-C. A run started from the Prefect UI (Deployments), by ``prefect deployment run hybridflow-launch/NAME -p
    config=FILE -p 'overrides=["rollout.n=8"]'``, through Prefect's API or on the --cron schedule is checked,
    recorded in the run store and trained as hf run does: hf runs list shows it, hf resume continues it."""
    if cron and config is None:
        console.print("--cron needs --config: the file each scheduled run trains", style="red")
        raise typer.Exit(2)
    if config is not None:
        checked_config(config, override, None)  # a default that cannot run is refused now, not at 2 a.m.
    if db:
        os.environ["HYBRIDFLOW_DB_URL"] = db  # the flow runs' store (their db_url parameter stays empty)
    os.environ["HYBRIDFLOW_DEPLOY_DIR"] = os.getcwd()  # a run's relative config path is read from here
    connect_prefect(prefect_api)
    from prefect.deployments.runner import EntrypointType  # after the server is chosen (server.use_server)

    from hybridflow.flows.launch import launch_flow

    defaults = {"config": str(config.resolve()), "overrides": list(override or [])} if config else None
    launch_flow.serve(
        name=name,
        cron=cron,
        parameters=defaults,
        limit=limit,
        tags=["hybridflow"],
        description="Record and train a HybridFlow run (as hf run CONFIG -o KEY=VALUE ...)",
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
