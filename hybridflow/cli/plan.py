"""``hf plan CONFIG`` (with ``--calibrate``), ``hf plans list|show`` and ``placement.auto``: the paper's auto-mapping
from the command line, every plan on record."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from hybridflow.cli.common import DbOption, PrefectOption, _store, console, styled
from hybridflow.cli.training import checked_config, connect_prefect, start_workers_early, train, with_executor

plans_app = typer.Typer(help="Placement plans from the run store (hf plan, placement.auto).", no_args_is_help=True)


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
    from hybridflow.cli.plan_tables import show_plan
    from hybridflow.flows.placement.auto import plan_config
    from hybridflow.flows.placement.hardware import UnknownHardware, hardware_profile
    from hybridflow.flows.placement.planner import OBJECTIVES, PlanError

    def fail(message: str) -> None:
        console.print(message, style="red")
        raise typer.Exit(2)

    cfg = checked_config(config, override, executor)
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
        import yaml

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
        base = checked_config(config, override, executor)
        if base.placement.executor == "local":  # its runs' placements differ from the config's: no early job
            start_workers_early(base)
        connect_prefect(prefect_api)
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
            cfg = checked_config(config, sized, executor)
            run_id = store.create_run(cfg.model_dump(mode="json"), cfg.trainer.experiment_name)
            console.print(
                styled("calibration run ", (run_id, "bold"), f": {prompts} prompts per iteration, {ranks} rank(s)")
            )
            train(store, run_id)
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
    into; `checked_config` has validated it)."""
    import yaml

    from hybridflow.engine.config import apply_overrides

    return apply_overrides(yaml.safe_load(config.read_text()) or {}, with_executor(override, executor), str(config))


def auto_place(config: Path, override, executor, cfg, store):
    """``placement.auto``: plan the run over placement.nodes x placement.tasks_per_node devices of
    placement.hardware, record the plan (not in a dry run: `store` None), and return the config running it (what the
    run records: `hf resume` continues on the same pools). A plan that cannot be made: its message, exit 2."""
    from hybridflow.cli.plan_tables import placement_label
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


@plans_app.command("list")
def plans_list(db: DbOption = None) -> None:
    """Every placement plan, newest first: where it came from, the cluster, the chosen placement and its estimate."""
    from rich.table import Table

    from hybridflow.cli.plan_tables import placement_label
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
    from hybridflow.cli.plan_tables import estimate_beside_measured, plan_runs, show_plan
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
    ran = plan_runs(_store(db), plan.id)
    if chosen is not None and ran:
        console.print(estimate_beside_measured(chosen, result.hardware.name, ran))
