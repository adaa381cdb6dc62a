"""The ``hf`` command (also installed as ``hybridflow``).

- ``hf run CONFIG [-o key=value ...]``: record a run in the store and train it with the Prefect flow.
- ``hf deploy``: serve the ``hybridflow-launch`` Prefect deployment here: runs started from the Prefect UI or API.
- ``hf verl KEY=VALUE ...``: a verl command line (its Hydra overrides translated to ours), run as ``hf run`` runs.
- ``hf config show RUN_ID|CONFIG [--as-verl]`` / ``hf config verl-keys``: a config, in our keys or verl's.
- ``hf resume RUN_ID``: continue a run from its last complete checkpoint.
- ``hf runs list | show RUN_ID | metrics RUN_ID --name NAME | samples RUN_ID | plot RUN_ID ...``: run history from
  the store: metrics, sample generations, plots.
- ``hf server start | stop | status``: the local Prefect server (its UI shows every flow run).
- ``hf data check CONFIG``: a config's prompts: rows, train/validation duplicates, lengths, label audit.
- ``hf models prepare NAME``: make an embedded model (``smollm2``, ``tiny``) available as a local HF folder.

huggingface_hub installs a command named ``hf`` too; every subcommand this CLI does not define (``hf download``,
``hf auth``, ``hf models ls``, ...) is forwarded to it, so both keep working.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated

import typer

from hybridflow.cli import deploy, dpo, models, plan, rm, run, run_log, server, sft, training, verl, warm_start
from hybridflow.cli.common import console
from hybridflow.cli.config_show import config_app
from hybridflow.cli.data_check import data_app
from hybridflow.cli.runs import runs_app
from hybridflow.engine.fast_exit import exit_process

HELP = (
    "HybridFlow: RLHF and its relatives (PPO, GRPO, DAPO, RLOO, ReMax, REINFORCE++, Safe-RLHF ...) with a single "
    "controller, locally or on Slurm."
)

app = typer.Typer(help=HELP, no_args_is_help=True)
app.command()(run.run)
app.command(context_settings={"ignore_unknown_options": True})(verl.verl)  # verl's Hydra keys are arguments
for command in (deploy.deploy, run.resume, plan.plan):
    app.command()(command)
for name, group in (
    ("config", config_app),
    ("data", data_app),
    ("dpo", dpo.dpo_app),
    ("models", models.models_app),
    ("plans", plan.plans_app),
    ("rm", rm.rm_app),
    ("runs", runs_app),
    ("sft", sft.sft_app),
    ("server", server.server_app),
):
    app.add_typer(group, name=name)


_OPTIONS = {"--help", "-h", "--version", "-V", "--install-completion", "--show-completion"}


def _ours() -> set[str]:
    """Our commands and command groups (``run``, ``plan``, ``runs`` ...) and top-level options."""
    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    return commands | {g.name for g in app.registered_groups} | _OPTIONS


def version() -> str:
    """HybridFlow's installed version (the package metadata's)."""
    from importlib.metadata import version as package_version

    return package_version("hybridflow")


def _print_version(value: bool) -> None:
    if value:
        print(f"hybridflow {version()}")
        raise typer.Exit()


@app.callback()
def _main(
    show_version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_print_version, is_eager=True, help="print HybridFlow's version"),
    ] = False,
) -> None:
    """The ``hf`` app's own options (its help is `HELP`)."""


def _forward_to_huggingface_hub(argv: list[str]) -> bool:
    """True if `argv` (without the program name) is a huggingface_hub `hf` command rather than ours."""
    if not argv or argv[0] not in _ours():
        return bool(argv)
    return argv[0] == "models" and len(argv) > 1 and argv[1] not in {"prepare", "--help", "-h"}


def main() -> None:
    """Entry point of ``hf`` and ``hybridflow``."""
    try:
        status = warm_start.forward(sys.argv[1:])  # hf run / hf resume: forked by a warm process, where one serves
    except ValueError as e:
        console.print(f"{e}", style="red")
        exit_process(2)
    if status is not None:
        warm_start.exit_like(status)
    run_log.setup_terminal()
    os.umask(0o077)  # the run store, run folders, checkpoints and logs are readable by their owner only
    signal.signal(signal.SIGTERM, training.raise_terminated)
    if _forward_to_huggingface_hub(sys.argv[1:]):
        from huggingface_hub.cli.hf import main as huggingface_hub_main

        huggingface_hub_main()
        return
    try:
        app()
    except SystemExit as done:
        _leave_an_unreachable_prefect_server(done.code)
        exit_process(done.code)  # without the 2 s teardown of torch's modules (hybridflow.engine.fast_exit)


def _leave_an_unreachable_prefect_server(code: int | str | None) -> None:
    """Exit now with `code` when this command used a Prefect server that no longer answers: Prefect's exit hook
    would otherwise try each event its flow runs queued (task-run states) against the dead server, ~7 s apiece, for
    as long as an hour. The run's record is whole in the run store; only the server's view of it is cut short."""
    api = os.environ.get("PREFECT_API_URL")
    if "prefect" not in sys.modules or not api or server.healthy(api):
        return
    console.print(
        f"the Prefect server at {api} does not answer: the flow run's events not yet sent to it are dropped (the "
        "run's record is whole in the run store: hf runs show)",
        style="yellow",
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)
