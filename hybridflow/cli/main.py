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

import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.table import Table

from hybridflow.cli import server
from hybridflow.cli.common import (
    DbOption,
    DryRunOption,
    PrefectOption,
    _get_run,
    _store,
    console,
    error_cause,
    styled,
)
from hybridflow.cli.config_show import config_app
from hybridflow.cli.data_check import data_app
from hybridflow.cli.runs import runs_app
from hybridflow.engine.fast_exit import exit_process

app = typer.Typer(help="HybridFlow: RLHF (PPO, GRPO, RLOO) with a single controller.", no_args_is_help=True)
models_app = typer.Typer(help="Embedded models (no model hub needed).", no_args_is_help=True)
server_app = typer.Typer(help="The local Prefect server (UI and flow-run history).", no_args_is_help=True)
rm_app = typer.Typer(help="Reward models: train one on preference pairs.", no_args_is_help=True)
sft_app = typer.Typer(help="Supervised fine-tuning: train a policy on conversations.", no_args_is_help=True)
plans_app = typer.Typer(help="Placement plans from the run store (hf plan, placement.auto).", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(data_app, name="data")
app.add_typer(models_app, name="models")
app.add_typer(plans_app, name="plans")
app.add_typer(rm_app, name="rm")
app.add_typer(runs_app, name="runs")
app.add_typer(sft_app, name="sft")
app.add_typer(server_app, name="server")


ExecutorOption = Annotated[
    str | None,
    typer.Option(help="where the worker groups run: local or slurm (same as -o placement.executor=...)"),
]

_local_server: server.ServerInfo | None = None  # this home's server the CLI connected to (None: --prefect-api)


def _connect_prefect(prefect_api: str | None) -> None:
    """Point the process at the Prefect server `prefect_api`, else at this home's local server (started if need
    be: its line is printed; exit 1 if it cannot start), which `_train` then keeps up (`server.ServerWatch`)."""
    global _local_server
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
    _local_server = info


def _load_config(config: Path, override: list[str] | None, executor: str | None, schema=None):
    """The validated config of `config` with the ``-o`` overrides and ``--executor``; on an error: the message
    (naming the file and the keys), exit 2."""
    from hybridflow.engine.config import ConfigError, load_config

    try:
        return load_config(config, _overrides(override, executor), schema)
    except ConfigError as e:
        message = str(e) if str(e).startswith(str(config)) else f"{config}: {e}"
        console.print(message, style="red")
        raise typer.Exit(2) from None


# ---------------------------------------------------------------------------------------------------- run
@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="YAML run configuration", exists=True, dir_okay=False)],
    override: Annotated[list[str] | None, typer.Option("-o", "--override", help="key.sub=value (repeatable)")] = None,
    executor: ExecutorOption = None,
    db: DbOption = None,
    prefect_api: PrefectOption = None,
    dry_run: DryRunOption = False,
) -> None:
    """Record a run in the store and train it (Prefect flow, worker groups).

    Everything that can be checked before work starts is checked first (the config, the model folder, the prompt
    files and their columns, the reward function, the Slurm partition, the output folder): a mistake prints one
    message naming the key and the fix, exits 2 and records no run."""
    cfg = _load_config(config, override, executor)
    store = None if dry_run else _store(db)
    if cfg.placement.auto:
        cfg = _auto_place(config, override, executor, cfg, store)
    _record_and_train(cfg, store, prefect_api)


def _record_and_train(cfg, store, prefect_api: str | None) -> None:
    """Check the inputs, then (no `store`: a dry run) print the resolved config and stop, or record the run and
    train it."""
    if store is not None:
        _warm_local_ranks(cfg)
    _check_inputs(cfg)
    if store is None:
        console.print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), markup=False, end="")
        console.print("dry run: the config above is valid and its inputs are in place; no run recorded", style="dim")
        return
    _connect_prefect(prefect_api)  # before the run is recorded: a server that cannot start leaves no stray run
    run_id = store.create_run(cfg.model_dump(mode="json"), cfg.trainer.experiment_name, plan_id=cfg.placement.plan)
    console.print(styled("run ", (run_id, "bold"), f" recorded in {store.url}"))
    _train(store, run_id)


@app.command(context_settings={"ignore_unknown_options": True})
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
        cfg = load_config(None, translation.overrides + _overrides(override, executor))
    except (ConfigError, FileNotFoundError, ValueError) as e:
        console.print(str(e), style="red", markup=False)
        raise typer.Exit(2) from None
    for key, why in translation.no_effect:
        console.print(f"verl key {key}: no effect here ({why})", style="dim", markup=False)
    if cfg.placement.auto:
        console.print("hf verl does not plan placements: give trainer.n_gpus_per_node / nnodes", style="red")
        raise typer.Exit(2)
    _record_and_train(cfg, None if dry_run else _store(db), prefect_api)


@app.command()
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
        _load_config(config, override, None)  # a default that cannot run is refused now, not at 2 a.m.
    if db:
        os.environ["HYBRIDFLOW_DB_URL"] = db  # the flow runs' store (their db_url parameter stays empty)
    os.environ["HYBRIDFLOW_DEPLOY_DIR"] = os.getcwd()  # a run's relative config path is read from here
    _connect_prefect(prefect_api)
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


@app.command()
def resume(
    run_id: Annotated[str, typer.Argument(help="the run to continue (see `hf runs list`)")],
    override: Annotated[
        list[str] | None,
        typer.Option(
            "-o",
            "--override",
            help="key.sub=value (repeatable); only keys that leave the computation unchanged, e.g. "
            "trainer.total_iterations=40 to train a finished run further",
        ),
    ] = None,
    from_checkpoint: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="resume from this checkpoint (global_step_N, see hf runs show) instead of the newest usable one; "
            "the later ones are marked superseded; global_step_0 starts over",
        ),
    ] = None,
    db: DbOption = None,
    prefect_api: PrefectOption = None,
) -> None:
    """Continue RUN_ID from its newest usable checkpoint (a new flow run of the same run), for more iterations
    with ``-o trainer.total_iterations=N``. A checkpoint that fails verification is marked bad and the one before
    it is used. A run another controller is training is refused; one whose controller crashed is taken over."""
    from hybridflow.engine.config import ConfigError, resume_config
    from hybridflow.flows.store.run_store import LeaseHeldError, controller_state

    store = _store(db)
    record = _get_run(store, run_id)
    if controller_state(record) == "live":
        console.print(str(LeaseHeldError(record)), style="red")
        raise typer.Exit(2)
    if record.kind in _SUPERVISED:
        _resume_supervised(store, record, list(override or []), from_checkpoint, prefect_api)
        return
    try:
        cfg = resume_config(record.config, list(override or []))
    except ConfigError as e:
        console.print(f"{run_id}: {e}", style="red")
        raise typer.Exit(2) from None
    from_step = None if from_checkpoint is None else _checkpoint_step(store, run_id, from_checkpoint)
    ckpt = store.latest_checkpoint(run_id)
    if from_step is not None:
        ckpt = next((c for c in store.checkpoints(run_id) if c.step == from_step), None)
    done, total = (ckpt.step if ckpt else 0), cfg.trainer.total_iterations
    if total < done:
        console.print(
            f"{run_id}: trainer.total_iterations={total} is below the {done} iterations already done; "
            "give a larger number",
            style="red",
        )
        raise typer.Exit(2)
    if record.status == "completed" and total == done and from_step is None:
        console.print(
            f"run {run_id} is already completed ({done} iterations); to train it further: "
            f"hf resume {run_id} -o trainer.total_iterations=N"
        )
        raise typer.Exit(0)
    _warm_local_ranks(cfg)
    _check_inputs(cfg)
    config = cfg.model_dump(mode="json")
    if config != record.config:
        store.update_config(run_id, config)
    if controller_state(record) == "crashed":
        beat = f"{record.heartbeat_at:%Y-%m-%d %H:%M:%S} UTC" if record.heartbeat_at else "never"
        console.print(
            f"run {run_id}: its controller (host {record.lease_host}, pid {record.lease_pid}) crashed; last "
            f"heartbeat {beat}",
            style="yellow",
        )
    start = f"iteration {ckpt.step} ({ckpt.path})" if ckpt else "the start"
    console.print(f"resuming {run_id} from {start} to iteration {total}")
    _connect_prefect(prefect_api)
    _train(store, run_id, resume_from_step=from_step)


_SUPERVISED = {"rm": "RMTrainingConfig", "sft": "SFTTrainingConfig"}
"""The run kinds that train on a fixed set of rows (`hybridflow.flows.supervised`), and their config classes."""


def _resume_supervised(store, record, overrides: list[str], from_checkpoint: str | None, prefect_api) -> None:
    """`hf resume` of a reward-model or SFT run: from its newest usable checkpoint, for ``trainer.total_epochs``
    (``-o trainer.total_epochs=N`` trains a finished one on)."""
    from hybridflow.engine import config as configs

    if from_checkpoint is not None:
        console.print(
            f"--from: a run of kind {record.kind} resumes from its newest usable checkpoint only", style="red"
        )
        raise typer.Exit(2)
    try:
        cfg = configs.resume_config(record.config, overrides, getattr(configs, _SUPERVISED[record.kind]))
    except configs.ConfigError as e:
        console.print(f"{record.id}: {e}", style="red")
        raise typer.Exit(2) from None
    if record.status == "completed" and cfg.model_dump(mode="json") == record.config:
        console.print(
            f"run {record.id} is already completed ({cfg.trainer.total_epochs} epochs); to train it further: "
            f"hf resume {record.id} -o trainer.total_epochs=N"
        )
        raise typer.Exit(0)
    _warm_local_ranks(cfg)
    _check_inputs(cfg)
    if cfg.model_dump(mode="json") != record.config:
        store.update_config(record.id, cfg.model_dump(mode="json"))
    ckpt = store.latest_checkpoint(record.id)
    start = f"step {ckpt.step} ({ckpt.path})" if ckpt else "the start"
    console.print(f"resuming {record.id} from {start} to epoch {cfg.trainer.total_epochs}")
    _connect_prefect(prefect_api)
    _train(store, record.id)


def _checkpoint_step(store, run_id: str, name: str) -> int:
    """The step of ``--from global_step_N`` (or N); exit 2 naming the usable ones if the run has no such one."""
    text = name.rstrip("/").rsplit("/", 1)[-1].removeprefix("global_step_")
    usable = [c for c in store.checkpoints(run_id) if c.complete and c.bad_reason is None]
    names = ", ".join(f"global_step_{c.step}" for c in usable) or "none"
    if not text.isdigit():
        console.print(f"--from {name}: give a checkpoint as global_step_N; {run_id} has: {names}", style="red")
        raise typer.Exit(2)
    step = int(text)
    if step != 0 and step not in {c.step for c in usable}:
        console.print(f"--from {name}: {run_id} has no usable checkpoint of step {step}; usable: {names}", style="red")
        raise typer.Exit(2)
    return step


def _check_inputs(cfg) -> None:
    """The pre-flight check (`hybridflow.flows.preflight`) of an RL, reward-model or SFT config; on a problem: its
    message, exit 2."""
    from hybridflow.engine.config import RMTrainingConfig, SFTTrainingConfig
    from hybridflow.flows.preflight import InputError, check_rm_inputs, check_run_inputs, check_sft_inputs

    check = {RMTrainingConfig: check_rm_inputs, SFTTrainingConfig: check_sft_inputs}.get(type(cfg), check_run_inputs)
    try:
        with console.status("checking the model, data and reward function..."):
            check(cfg)
    except InputError as e:
        console.print(f"{e}", style="red")
        raise typer.Exit(2) from None


def _warm_local_ranks(cfg) -> None:
    """Start the fork server of local ranks (`hybridflow.slurm.local`) when `cfg`'s worker groups are local
    processes: its ~10 s of imports run beside the controller's own start (the input checks, the Prefect server,
    the flow) instead of before the first rank can serve. A command that stops before launching a group (a refused
    input) ends the fork server with it."""
    if cfg.placement.executor == "local":
        from hybridflow.slurm.local import warm_up

        warm_up()


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that a run stops as on Ctrl-C: recorded ``interrupted``, workers
    stopped, resumable from its last checkpoint."""


def _raise_terminated(signum: int, frame: object) -> None:
    """SIGTERM handler of the ``hf`` process (inside a flow run Prefect's own handler raises first, then hands the
    signal back to this one)."""
    raise _Terminated()


def _train(store, run_id: str, resume_from_step: int | None = None) -> None:
    """Run the run's flow (``hybridflow-rlhf``; ``hybridflow-rm`` / ``hybridflow-sft`` for a run of kind ``rm`` /
    ``sft``) with the live display; exit 1 (failed), 2 (another controller), 3 (stopped on Slurm's warning),
    130/143 (interrupted)."""
    from hybridflow.cli.progress import LiveProgress
    from hybridflow.flows import lifecycle, rlhf, rm, sft
    from hybridflow.flows.store.run_store import LeaseHeldError, LeaseLostError

    def say(line: str) -> None:
        console.print(line, style="yellow")

    watch = server.ServerWatch(_local_server, say) if _local_server is not None else contextlib.nullcontext()
    with LiveProgress(console) as progress, watch:
        lifecycle.listeners.append(progress.on_event)
        try:
            kind = store.get_run(run_id).kind
            if kind == "rm":
                rm.run_rm_flow(run_id=run_id)
            elif kind == "sft":
                sft.run_sft_flow(run_id=run_id)
            else:
                rlhf.run_flow(run_id=run_id, resume_from_step=resume_from_step)
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the flow has recorded the run as interrupted
            console.print(f"interrupted; continue with: hf resume {run_id}", style="yellow")
            raise typer.Exit(143 if isinstance(e, _Terminated) else 130) from None
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


def _auto_place(config: Path, override, executor, cfg, store):
    """``placement.auto``: plan the run over placement.nodes x placement.tasks_per_node devices of
    placement.hardware, record the plan (not in a dry run: `store` None), and return the config running it (what the
    run records: `hf resume` continues on the same pools). A plan that cannot be made: its message, exit 2."""
    from hybridflow.cli.plan import placement_label
    from hybridflow.engine.config import validate_config
    from hybridflow.flows.placement.auto import plan_config
    from hybridflow.flows.placement.hardware import BUILTIN, UnknownHardware, calibrated_profiles, hardware_profile
    from hybridflow.flows.placement.planner import PlanError

    placement = cfg.placement
    try:
        if placement.hardware is None:
            known = ", ".join([*BUILTIN, *calibrated_profiles()])
            raise UnknownHardware(
                f"placement.auto needs placement.hardware: the devices' profile, one of {known} (or fit one for "
                "this machine with hf plan CONFIG --calibrate --gpus-per-node 1)"
            )
        hw = hardware_profile(placement.hardware)
        tree = _config_tree(config, override, executor)
        planned = plan_config(cfg, tree, hw, placement.nodes, placement.tasks_per_node)
    except (UnknownHardware, PlanError, FileNotFoundError, ValueError) as e:
        console.print(f"{config}: {e}", style="red")
        raise typer.Exit(2) from None
    if planned.chosen is None:
        console.print(f"{config}: placement.auto: none of the plans runs in this version", style="red")
        raise typer.Exit(2)
    chosen = planned.chosen
    chose = (
        f": {placement_label(chosen)} on {' | '.join(map(str, chosen.devices))} devices, {chosen.seconds:.3g} s "
        "per iteration (estimated"
    )
    if store is None:
        console.print(f"placement.auto: the plan{chose}; a dry run records no plan)", markup=False)
        return validate_config(planned.tree)
    plan_id = planned.record(store, f"{config} (placement.auto)")
    console.print(styled("placement.auto: plan ", (plan_id, "bold"), f"{chose}; hf plans show {plan_id})"))
    return validate_config(planned.tree)


# ---------------------------------------------------------------------------------------------------- plan
@app.command()
def plan(
    config: Annotated[Path, typer.Argument(help="YAML run configuration", exists=True, dir_okay=False)],
    gpus_per_node: Annotated[int, typer.Option(min=1, help="devices per node (GPUs; on CPU: ranks)")],
    nodes: Annotated[int, typer.Option(min=1, help="nodes of the cluster")] = 1,
    gpu: Annotated[str | None, typer.Option(help="hardware profile: a100-80gb, h100-80gb, h200")] = None,
    gpu_memory_gb: Annotated[float | None, typer.Option(help="memory per device (GB); replaces the profile's")] = None,
    model: Annotated[
        str | None, typer.Option(help="plan every model at a preset size instead of the config's: llama-7b ...")
    ] = None,
    prompt_length: Annotated[
        int | None, typer.Option(help="prompt tokens (default: data.max_prompt_length)", min=1)
    ] = None,
    strategies: Annotated[
        str, typer.Option(help="runtime: strategies this version runs; all: the paper's (3D for every model)")
    ] = "runtime",
    top: Annotated[int, typer.Option(min=1, help="candidates shown")] = 10,
    output: Annotated[Path | None, typer.Option(help="write the config with the chosen plan here (YAML)")] = None,
    objective: Annotated[
        str,
        typer.Option(
            help="latency: the fewest devices among the plans within --tolerance of the fastest; throughput-per-gpu: "
            "the most sequences per second per device used"
        ),
    ] = "latency",
    tolerance: Annotated[
        float, typer.Option(min=0.0, help="plans within this fraction of the fastest count as equally fast")
    ] = 0.05,
    calibrate: Annotated[
        bool,
        typer.Option(
            help="fit a hardware profile for this machine (saved as --gpu NAME): time CONFIG's stages through the "
            "real stack at its batch and twice that on one device, and twice that on two (or those of --from-run "
            "runs), then plan with it"
        ),
    ] = False,
    from_run: Annotated[
        list[str] | None, typer.Option(help="with --calibrate: fit to these recorded runs instead (repeatable)")
    ] = None,
    override: Annotated[list[str] | None, typer.Option("-o", "--override", help="key.sub=value (repeatable)")] = None,
    executor: Annotated[str | None, typer.Option(help="local or slurm (same as -o placement.executor=...)")] = None,
    db: DbOption = None,
    prefect_api: PrefectOption = None,
) -> None:
    """Choose where the run's models live, how many devices each pool gets and each model's parallel strategy, by
    estimating the iteration's latency (HybridFlow paper, section 6, Algorithm 1). Prints the ranked plans and, with
    --output, writes the config with the fastest plan this version runs (run it with `hf run`)."""
    from hybridflow.cli.plan import show_plan
    from hybridflow.flows.placement.auto import plan_config
    from hybridflow.flows.placement.hardware import UnknownHardware, hardware_profile
    from hybridflow.flows.placement.planner import OBJECTIVES, PlanError

    def fail(message: str) -> None:
        console.print(message, style="red")
        raise typer.Exit(2)

    cfg = _load_config(config, override, executor)
    if strategies not in ("runtime", "all"):
        fail(f"--strategies {strategies!r}: use runtime or all")
    if objective not in OBJECTIVES:
        fail(f"--objective {objective!r}: use {' or '.join(OBJECTIVES)}")
    if cfg.placement.executor == "local" and nodes > 1:
        fail(
            f"--nodes {nodes} with placement.executor local: local groups run on this machine; pass --nodes 1, "
            "or --executor slurm to plan for a Slurm cluster"
        )
    store = _store(db)
    if calibrate:
        gpu = _calibrate(config, override, executor, gpu or "local", from_run or [], store, prefect_api).name
    tree = _config_tree(config, override, executor)
    try:
        hw = hardware_profile(gpu, gpu_memory_gb)
        planned = plan_config(
            cfg, tree, hw, nodes, gpus_per_node, strategies, model, prompt_length, objective, tolerance
        )
    except (UnknownHardware, PlanError, KeyError, FileNotFoundError, ValueError) as e:
        fail(str(e.args[0] if type(e) is KeyError else e))
    plan_id = planned.record(store, str(config))
    show_plan(console, planned.result, planned.chosen, top, plan_id, planned.search_s)
    if planned.chosen is None:
        fail("none of the plans runs in this version (see the last column); --strategies runtime plans only those")
    if output is not None:
        tmp = output.with_name(f".{output.name}.tmp")
        tmp.write_text(yaml.safe_dump(planned.tree, sort_keys=False))
        os.replace(tmp, output)
        console.print(styled(f"wrote {output}: run it with ", (f"hf run {output}", "bold")))


def _calibrate(config: Path, override, executor, name: str, run_ids: list[str], store, prefect_api):
    """Fit the hardware profile `name` to `run_ids`, or to runs of `config` made for it (3 iterations, every role in
    one pool: its batch on one rank, twice that on one rank, and, on a machine of 2 cores or more, twice that on 2
    ranks, which busy the cores the controller shares); save it under HYBRIDFLOW_HOME/hardware and print it."""
    from hybridflow.flows.placement.calibrate import Measured, fit_profile, measure_device
    from hybridflow.flows.placement.hardware import HardwareProfile, save_profile

    if not run_ids:
        base = _load_config(config, override, executor)
        _warm_local_ranks(base)
        _connect_prefect(prefect_api)
        batch = base.data.train_batch_size
        sizes = [(batch, 1), (2 * batch, 1)] + ([(2 * batch, 2)] if len(os.sched_getaffinity(0)) >= 2 else [])
        for prompts, ranks in sizes:
            sized = [
                *(override or []),
                f"data.train_batch_size={prompts}",
                "trainer.total_iterations=3",
                "trainer.val_before_train=false",
                "trainer.test_freq=0",
                "trainer.save_freq=0",
                "trainer.num_threads=1",
                f"trainer.experiment_name=calibrate-{name}",
                "placement={}",
                f"placement.tasks_per_node={ranks}",
            ]
            cfg = _load_config(config, sized, executor)
            run_id = store.create_run(cfg.model_dump(mode="json"), cfg.trainer.experiment_name)
            console.print(
                styled("calibration run ", (run_id, "bold"), f": {prompts} prompts per iteration, {ranks} rank(s)")
            )
            _train(store, run_id)
            run_ids.append(run_id)
    with console.status("measuring this machine's device (matmul, copy, gloo all-reduce)..."):
        peaks = measure_device(threads=1)
    base_profile = HardwareProfile(
        name=name,
        memory_bytes=float(_memory_per_core()),
        dtype_bytes=4,
        inter_node_bandwidth=peaks["intra_node_bandwidth"],
        source=f"hf plan --calibrate on {os.uname().nodename}, runs {', '.join(run_ids)}",
        **peaks,
    )
    profile = fit_profile(base_profile, [Measured.from_store(store, r) for r in run_ids], name)
    path = save_profile(profile)
    console.print(styled("profile ", (name, "bold"), f" saved in {path}:"))
    console.print_json(profile.model_dump_json())
    return profile


def _memory_per_core() -> int:
    """This machine's memory divided among its cores (bytes): a CPU device is one core."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages // (os.cpu_count() or 1)


def _config_tree(config: Path, override: list[str] | None, executor: str | None) -> dict:
    """`config` as plain data with the ``-o`` overrides and ``--executor`` applied (the tree a plan is written
    into; `_load_config` has validated it)."""
    from hybridflow.engine.config import apply_overrides

    return apply_overrides(yaml.safe_load(config.read_text()) or {}, _overrides(override, executor), str(config))


def _overrides(override: list[str] | None, executor: str | None) -> list[str]:
    return list(override or []) + ([f"placement.executor={executor}"] if executor else [])


@plans_app.command("list")
def plans_list(db: DbOption = None) -> None:
    """Every placement plan, newest first: where it came from, the cluster, the chosen placement and its estimate."""
    from hybridflow.cli.plan import placement_label
    from hybridflow.flows.placement.render import candidate_from_dict

    plans = _store(db).plans()
    if not plans:
        console.print("no plans yet: hf plan CONFIG --gpus-per-node G ... records one")
        return
    table = Table("plan", "created (UTC)", "source", "cluster", "models", "chosen", "s/iter", "candidates")
    for p in plans:
        cluster = p.inputs["cluster"]
        models = ", ".join(f"{role} {shape['name']}" for role, shape in p.inputs["models"].items())
        chosen = placement_label(candidate_from_dict(p.chosen)) if p.chosen else "-"
        table.add_row(
            p.id,
            f"{p.created_at:%Y-%m-%d %H:%M:%S}",
            p.source,
            f"{cluster['nodes']} x {cluster['gpus_per_node']} {p.inputs['hardware']['name']}",
            models,
            chosen,
            "-" if p.chosen_seconds is None else f"{p.chosen_seconds:.3g}",
            str(p.candidate_count),
        )
    console.print(table)


@plans_app.command("show")
def plans_show(
    plan_id: Annotated[str, typer.Argument(help="the plan (see `hf plans list`)")],
    top: Annotated[int, typer.Option(min=1, help="candidates shown")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="the stored record as JSON")] = False,
    db: DbOption = None,
) -> None:
    """One plan: its inputs, ranked candidates, rejected placements and the chosen one's simulated iteration."""
    from hybridflow.cli.plan import show_plan
    from hybridflow.flows.placement.render import candidate_from_dict, result_from_record
    from hybridflow.flows.store.run_store import UnknownPlanError

    try:
        plan = _store(db).get_plan(plan_id)
    except UnknownPlanError as e:
        console.print(str(e), style="red")
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(plan.to_dict(), indent=2))
        return
    result = result_from_record(plan.inputs, plan.candidates, plan.rejected)
    chosen = candidate_from_dict(plan.chosen) if plan.chosen else None
    console.print(f"source: {plan.source}; hardware: {result.hardware.name}; strategies: {result.space}")
    show_plan(console, result, chosen, top, plan.id, plan.search_s)


# ---------------------------------------------------------------------------------------------------- server
@server_app.command("start")
def server_start(port: int = server.DEFAULT_PORT) -> None:
    """Start this home's Prefect server (or report the running one); a taken port means a free one instead."""
    with console.status("starting the Prefect server..."):
        info = server.start(port)
    console.print(f"{info.describe()}  API {info.api_url}")


@server_app.command("stop")
def server_stop() -> None:
    """Stop this home's Prefect server (started by `hf server start` or `hf run`); never another home's."""
    home = server.hybridflow_home()
    console.print(
        f"stopped the Prefect server of {home}" if server.stop() else f"no Prefect server of {home} was running"
    )


@server_app.command("status")
def server_status() -> None:
    """Whether this home's Prefect server (the one `hf run` uses) is running, and where; exit 1 if not."""
    info = server.status()
    if info is None:
        console.print(f"no Prefect server of {server.hybridflow_home()} is running (hf server start)")
        default = server.ServerInfo(server.DEFAULT_PORT, 0)
        if server.healthy(default.api_url):
            console.print(
                f"the Prefect server at {default.ui_url} was not started by this home (another home's or someone "
                "else's): hf run does not use it (--prefect-api to use it)"
            )
        raise typer.Exit(1)
    console.print(f"running: Prefect server of {info.home}: API {info.api_url}  UI {info.ui_url}  (pid {info.pid})")


# ---------------------------------------------------------------------------------------------------- rm
@rm_app.command("train")
def rm_train(
    config: Annotated[Path, typer.Argument(help="YAML reward-model training config", exists=True, dir_okay=False)],
    override: Annotated[list[str] | None, typer.Option("-o", "--override", help="key.sub=value (repeatable)")] = None,
    executor: Annotated[
        str | None, typer.Option(help="where the worker group runs: local or slurm (-o placement.executor=...)")
    ] = None,
    db: DbOption = None,
    prefect_api: PrefectOption = None,
) -> None:
    """Train a reward model on preference pairs (Bradley-Terry loss; Prefect flow ``hybridflow-rm`` on a worker
    group), recorded in the run store as a run of kind ``rm``; the result is a Hugging Face folder that
    ``reward_model.path`` loads: ``<output_dir>/<experiment_name>/<run_id>/reward_model``."""
    from hybridflow.engine.config import RMTrainingConfig

    cfg = _load_config(config, override, executor, RMTrainingConfig)
    _warm_local_ranks(cfg)
    _check_inputs(cfg)
    folder = _train_new(cfg, "rm", "reward_model", db, prefect_api, "reward-model run")
    console.print(f"reward model: {folder} (use it with -o reward_model.path={folder})")


def _train_new(cfg, kind: str, result: str, db: str | None, prefect_api: str | None, what: str) -> Path:
    """Record a new run of `kind` with `cfg` (checked) and train it (`_train`); returns its result folder."""
    store = _store(db)
    _connect_prefect(prefect_api)
    run_id = store.create_run(cfg.model_dump(mode="json"), cfg.trainer.experiment_name, kind=kind)
    console.print(styled(f"{what} ", (run_id, "bold"), f" recorded in {store.url}"))
    _train(store, run_id)
    return Path(cfg.trainer.output_dir).resolve() / cfg.trainer.experiment_name / run_id / result


# ---------------------------------------------------------------------------------------------------- sft
@sft_app.command("train")
def sft_train(
    config: Annotated[Path, typer.Argument(help="YAML SFT config", exists=True, dir_okay=False)],
    override: Annotated[list[str] | None, typer.Option("-o", "--override", help="key.sub=value (repeatable)")] = None,
    executor: Annotated[
        str | None, typer.Option(help="where the worker group runs: local or slurm (-o placement.executor=...)")
    ] = None,
    db: DbOption = None,
    prefect_api: PrefectOption = None,
) -> None:
    """Fine-tune a policy on conversations, the loss on its assistant turns (Prefect flow ``hybridflow-sft`` on a
    worker group), recorded in the run store as a run of kind ``sft``; the result is a Hugging Face folder that
    ``model.path`` of an RL run loads: ``<output_dir>/<experiment_name>/<run_id>/model``."""
    from hybridflow.engine.config import SFTTrainingConfig
    from hybridflow.flows.preflight import conversation_sets

    cfg = _load_config(config, override, executor, SFTTrainingConfig)
    _warm_local_ranks(cfg)
    _check_inputs(cfg)
    sets = conversation_sets(cfg)
    console.print(f"{len(sets.train)} training and {len(sets.val)} held-out conversations {sets.counts}")
    folder = _train_new(cfg, "sft", "model", db, prefect_api, "SFT run")
    console.print(f"model: {folder} (start an RL run from it with -o model.path={folder})")


# ---------------------------------------------------------------------------------------------------- models
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


# ---------------------------------------------------------------------------------------------------- entry
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
    """HybridFlow: RLHF (PPO, GRPO, RLOO) with a single controller."""


def _forward_to_huggingface_hub(argv: list[str]) -> bool:
    """True if `argv` (without the program name) is a huggingface_hub `hf` command rather than ours."""
    if not argv or argv[0] not in _ours():
        return bool(argv)
    return argv[0] == "models" and len(argv) > 1 and argv[1] not in {"prepare", "--help", "-h"}


def _not_a_failed_run_record(record: logging.LogRecord) -> bool:
    """Prefect's ERROR records of a failed task or flow run (each with the whole traceback, eight of them for one
    failed stage) stay off the terminal: they are in the flow run's logs, and `hf run` prints the failure once, its
    first line and its cause."""
    return not (record.name in ("prefect.task_runs", "prefect.flow_runs") and record.levelno >= logging.ERROR)


def main() -> None:
    """Entry point of ``hf`` and ``hybridflow``."""
    # Warnings and errors on the terminal; INFO lines (the controller's and the workers') go to the flow run's logs
    # in the Prefect UI only (hybridflow.flows.reporting.FlowLogs).
    terminal = logging.StreamHandler()
    terminal.setLevel(logging.WARNING)
    terminal.addFilter(_not_a_failed_run_record)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", handlers=[terminal])
    os.umask(0o077)  # the run store, run folders, checkpoints and logs are readable by their owner only
    signal.signal(signal.SIGTERM, _raise_terminated)
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
