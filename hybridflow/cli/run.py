"""``hf run CONFIG`` and ``hf resume RUN_ID``: record a run and train it; continue one from its newest usable
checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridflow.cli.common import DbOption, DryRunOption, PrefectOption, _get_run, _store, console, styled
from hybridflow.cli.plan import auto_place
from hybridflow.cli.training import (
    ExecutorOption,
    check_inputs,
    checked_config,
    connect_prefect,
    start_workers_early,
    train,
)


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
    cfg = checked_config(config, override, executor)
    store = None if dry_run else _store(db)
    if cfg.placement.auto:
        cfg = auto_place(config, override, executor, cfg, store)
    record_and_train(cfg, store, prefect_api)


def placement_summary(cfg) -> list[str]:
    """The placement a run config (`HybridFlowConfig`) would start: each pool's ranks and roles on its executor, the
    actor's training and generation layouts (``p-t-d``, ``p_g-t_g``) and the rollout engine."""
    from hybridflow.engine.extensions import engine_tp

    lines = [f"placement ({cfg.placement.executor} executor):"]
    for pool in cfg.pools().values():
        lines.append(f"  pool {pool.name}: {pool.nodes} x {pool.tasks_per_node} ranks: {', '.join(pool.roles)}")
    layout = cfg.actor_layout()
    lines.append(
        f"  actor: {cfg.actor.strategy}, training p{layout.p}-t{layout.t}-d{layout.d}, generation "
        f"p{layout.p_g}-t{layout.t_g}"
    )
    tp = engine_tp(cfg)
    engine = f", one engine per {tp} ranks (tensor parallel)" if tp > 1 else ""
    lines.append(f"  rollout: {cfg.rollout.name}{engine}")
    return lines


def record_and_train(cfg, store, prefect_api: str | None) -> None:
    """Check the inputs, then (no `store`: a dry run) print the resolved config and its placement
    (`placement_summary`) and stop, or record the run and train it."""
    if store is not None:
        start_workers_early(cfg)
    check_inputs(cfg)
    if store is None:
        import yaml

        console.print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), markup=False, end="")
        for line in placement_summary(cfg):  # YAML comments: the output stays the config
            console.print(f"# {line}", markup=False)
        console.print("dry run: the config above is valid and its inputs are in place; no run recorded", style="dim")
        return
    connect_prefect(prefect_api)  # before the run is recorded: a server that cannot start leaves no stray run
    run_id = store.create_run(cfg.model_dump(mode="json"), cfg.trainer.experiment_name, plan_id=cfg.placement.plan)
    console.print(styled("run ", (run_id, "bold"), f" recorded in {store.url}"))
    train(store, run_id)


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
    start_workers_early(cfg)
    check_inputs(cfg)
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
    connect_prefect(prefect_api)
    train(store, run_id, resume_from_step=from_step)


_SUPERVISED = {"rm": "RMTrainingConfig", "sft": "SFTTrainingConfig", "dpo": "DPOTrainingConfig"}
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
    start_workers_early(cfg)
    check_inputs(cfg)
    if cfg.model_dump(mode="json") != record.config:
        store.update_config(record.id, cfg.model_dump(mode="json"))
    ckpt = store.latest_checkpoint(record.id)
    start = f"step {ckpt.step} ({ckpt.path})" if ckpt else "the start"
    console.print(f"resuming {record.id} from {start} to epoch {cfg.trainer.total_epochs}")
    connect_prefect(prefect_api)
    train(store, record.id)


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
