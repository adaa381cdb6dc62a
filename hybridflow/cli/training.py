"""What every ``hf`` command that trains shares: the checked config, the pre-flight input checks, the Prefect server,
and the flow run with its live display and exit codes."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from hybridflow.cli import run_log, server
from hybridflow.cli.common import _store, console, error_cause, styled

ExecutorOption = Annotated[
    str | None,
    typer.Option(help="where the worker groups run: local or slurm (same as -o placement.executor=...)"),
]


local_server: server.ServerInfo | None = None  # this home's server the CLI connected to (None: --prefect-api)


def connect_prefect(prefect_api: str | None) -> None:
    """Point the process at the Prefect server `prefect_api`, else at this home's local server (started if need
    be: its line is printed; exit 1 if it cannot start), which `train` then keeps up (`server.ServerWatch`)."""
    global local_server
    if prefect_api:
        server.use_server(prefect_api)
        return
    try:
        with console.status("starting the local Prefect server (first start ~20 s)..."):
            info = server.start()
    except RuntimeError as e:
        console.print(styled((str(e), "red"), "\nor point to a running server with --prefect-api URL"))
        raise typer.Exit(1) from None
    console.print(info.describe())
    server.use_server(info.api_url)
    local_server = info


def checked_config(config: Path, override: list[str] | None, executor: str | None, schema=None):
    """The validated config of `config` with the ``-o`` overrides and ``--executor``; on an error: the message
    (naming the file and the keys), exit 2."""
    from hybridflow.engine.config import ConfigError, load_config

    try:
        return load_config(config, with_executor(override, executor), schema)
    except ConfigError as e:
        message = str(e) if str(e).startswith(str(config)) else f"{config}: {e}"
        console.print(message, style="red")
        raise typer.Exit(2) from None


def with_executor(override: list[str] | None, executor: str | None) -> list[str]:
    """The ``-o`` overrides, then ``--executor``'s (``placement.executor=...``) when given."""
    return list(override or []) + ([f"placement.executor={executor}"] if executor else [])


def check_inputs(cfg) -> None:
    """The pre-flight check (`hybridflow.flows.preflight`) of an RL, reward-model or SFT config; on a problem: its
    message, exit 2."""
    from hybridflow.engine.config import DPOTrainingConfig, RMTrainingConfig, SFTTrainingConfig
    from hybridflow.flows import preflight

    checks = {
        RMTrainingConfig: preflight.check_rm_inputs,
        SFTTrainingConfig: preflight.check_sft_inputs,
        DPOTrainingConfig: preflight.check_dpo_inputs,
    }
    check = checks.get(type(cfg), preflight.check_run_inputs)
    try:
        with console.status("checking the model, data and reward function..."):
            check(cfg)
    except preflight.InputError as e:
        console.print(f"{e}", style="red")
        raise typer.Exit(2) from None


def start_workers_early(cfg) -> None:
    """Start what `cfg`'s worker groups need now (`hybridflow.flows.groups.start_early`): locally the fork server of
    the ranks, whose ~10 s of imports then run beside the controller's own start (the input checks, the Prefect
    server, the flow) instead of before the first rank can serve; on Slurm the run's allocations, whose queue wait
    and imports overlap it likewise. A command that stops before launching its groups (a refused input) ends them
    when it exits."""
    from hybridflow.flows.groups import start_early

    start_early(cfg)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that a run stops as on Ctrl-C: recorded ``interrupted``, workers
    stopped, resumable from its last checkpoint."""


def raise_terminated(signum: int, frame: object) -> None:
    """SIGTERM handler of the ``hf`` process (inside a flow run Prefect's own handler raises first, then hands the
    signal back to this one)."""
    raise Terminated()


def train(store, run_id: str, resume_from_step: int | None = None) -> None:
    """Run the run's flow (``hybridflow-rlhf``; ``hybridflow-rm`` / ``hybridflow-sft`` for a run of kind ``rm`` /
    ``sft``) with the live display; exit 1 (failed), 2 (another controller), 3 (stopped on Slurm's warning),
    130/143 (interrupted)."""
    from hybridflow.cli.progress import LiveProgress
    from hybridflow.flows import dpo, lifecycle, rlhf, rm, sft
    from hybridflow.flows.store.run_store import LeaseHeldError, LeaseLostError

    def say(line: str) -> None:
        console.print(line, style="yellow")

    log = run_log.run_log(run_id, quiet_reporting=local_server is not None)
    watch = server.ServerWatch(local_server, say) if local_server is not None else contextlib.nullcontext()
    with log, LiveProgress(console) as progress, watch:
        lifecycle.listeners.append(progress.on_event)
        try:
            kind = store.get_run(run_id).kind
            if kind == "rm":
                rm.run_rm_flow(run_id=run_id)
            elif kind == "sft":
                sft.run_sft_flow(run_id=run_id)
            elif kind == "dpo":
                dpo.run_dpo_flow(run_id=run_id)
            else:
                rlhf.run_flow(run_id=run_id, resume_from_step=resume_from_step)
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the flow has recorded the run as interrupted
            console.print(f"interrupted; continue with: hf resume {run_id}", style="yellow")
            raise typer.Exit(143 if isinstance(e, Terminated) else 130) from None
        except (LeaseHeldError, LeaseLostError) as e:  # the run is another controller's: nothing was recorded
            console.print(f"{e}", style="red")
            raise typer.Exit(2) from None
        except Exception as e:  # the flow has recorded the failure in the store
            if _prefect_only(store, run_id, e):  # trained and on record: only the server missed the flow's end
                console.print(
                    f"run {run_id} completed; the Prefect server did not take the flow run's last state "
                    f"({type(e).__name__}: {e}); history: hf runs show {run_id}",
                    style="yellow",
                )
                return
            summary = (str(e).strip().splitlines() or [""])[0]  # the traceback and log tail: the flow run's logs
            console.print(f"run {run_id} failed: {type(e).__name__}: {summary}", style="red")
            if (cause := error_cause(str(e))) is not None:
                console.print(f"cause: {cause}", style="red bold")
            console.print("the traceback and the workers' last log lines: the flow run's logs in the Prefect UI")
            if _recorded(store, run_id):
                console.print(f"fix the cause, then continue with: hf resume {run_id}")
            else:  # hf runs delete --force while it trained: nothing is left to resume
                console.print(f"run {run_id} is no longer in the run store {store.url} (deleted while it trained)")
            raise typer.Exit(1) from None
        finally:
            lifecycle.listeners.remove(progress.on_event)
    record = store.get_run(run_id)
    if record.status == "interrupted":  # stopped on Slurm's time-limit or preemption warning, checkpointed
        console.print(f"{record.error}", style="yellow")
        raise typer.Exit(3)
    console.print(f"run {run_id} completed; history: hf runs show {run_id}")
    if local_server is not None:
        console.print(local_server.idle_note())


def _prefect_only(store, run_id: str, error: Exception) -> bool:
    """Whether `error`, raised by the flow of run `run_id`, is only the Prefect server not answering (a connection
    error) after the run store recorded the run completed: the training is whole, the UI missed its end."""
    import httpx

    connection = isinstance(error, (httpx.TransportError, OSError))
    return connection and _recorded(store, run_id) and store.get_run(run_id).status == "completed"


def _recorded(store, run_id: str) -> bool:
    """Whether the run store still holds run `run_id` (False once ``hf runs delete`` removed it)."""
    from hybridflow.flows.store.run_store import UnknownRunError

    try:
        store.get_run(run_id)
    except UnknownRunError:
        return False
    return True


def print_policy(cfg, folder: Path, what: str) -> None:
    """Print the trained policy's folder of an ``hf sft train`` / ``hf dpo train`` run (`what`: its name) and the
    overrides an RL run starts from it with: ``model.path`` (with ``model.lora_rank`` > 0 the folder is the adapter,
    on ``model.path``'s model: ``model.lora_adapter_path``)."""
    if cfg.model.lora:
        start = f"-o model.path={cfg.model.path} -o model.lora_rank={cfg.model.lora_rank}"
        console.print(
            f"{what} adapter: {folder} (start an RL run from it with {start} -o model.lora_adapter_path={folder})"
        )
    else:
        console.print(f"{what}: {folder} (start an RL run from it with -o model.path={folder})")


def train_new(cfg, kind: str, result: str, db: str | None, prefect_api: str | None, what: str) -> Path:
    """Record a new run of `kind` with `cfg` (checked) and train it (`train`); returns its result folder."""
    store = _store(db)
    connect_prefect(prefect_api)
    run_id = store.create_run(cfg.model_dump(mode="json"), cfg.trainer.experiment_name, kind=kind)
    console.print(styled(f"{what} ", (run_id, "bold"), f" recorded in {store.url}"))
    train(store, run_id)
    return Path(cfg.trainer.output_dir).resolve() / cfg.trainer.experiment_name / run_id / result
