"""``hf runs ...``: run history from the run store: list, show, compare, delete, metrics, samples, timeline, plot."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.table import Column, Table

from hybridflow.cli.common import DbOption, _get_run, _status_text, _store, console, error_cause, styled

runs_app = typer.Typer(help="Run history from the run store.", no_args_is_help=True)


@runs_app.command("list")
def runs_list(db: DbOption = None, limit: int = 50) -> None:
    """The newest runs: id, kind (rl: ``hf run``; rm: ``hf rm train``), experiment, status (a ``running`` run whose
    controller died shows ``crashed`` and its last heartbeat, UTC), iterations (rm: steps) done, times."""
    table = Table("kind", "experiment", "status", "iterations", "created (UTC)", "duration")
    table.columns.insert(0, Column("run id", no_wrap=True))
    store = _store(db)
    for r in store.list_runs(limit=limit):
        done = len([i for i in store.iterations(r.id) if i.ended_at is not None])
        total = r.config.get("trainer", {}).get("total_iterations", "?") if r.kind == "rl" else "?"
        duration = f"{r.duration_s:.0f} s" if r.duration_s is not None else ""
        created = f"{r.created_at:%Y-%m-%d %H:%M:%S}"
        table.add_row(r.id, r.kind, r.experiment_name, _status_text(r), f"{done}/{total}", created, duration)
    console.print(table)


def _parallel_summary(parallel: dict | None) -> str:
    """``megatron p1-t2-d2 -> gen p1-t1 x4 (hybridflow)`` from a placement's ``parallel`` record (``fsdp`` for a
    model with a strategy and no layout on record; ``... -> rollout engine tp2 x2`` with a tensor-parallel vLLM
    engine; ``vllm x2, weights by gloo broadcast`` (``vllm tp2 x1, ...``) for a rollout pool of its own), then
    ``; trains N of M parameters`` when not every parameter trains (LoRA); '' when absent."""
    if not parallel:
        return ""
    if "engine" in parallel:  # a rollout in a pool of its own: its engines, fed published weights
        sent = {"file": "a file", "gloo": "gloo broadcast"}.get(parallel.get("weights", "file"), parallel["weights"])
        tp = f" tp{parallel['tp']}" if parallel.get("tp") else ""
        text = f"{parallel['engine']}{tp} x{parallel.get('dp')}, weights by {sent}"
    elif "train" not in parallel:
        text = str(parallel.get("strategy", ""))
    else:
        train, gen = parallel.get("train", {}), parallel.get("generate", {})
        text = f"{parallel.get('strategy', '?')} p{train.get('pp')}-t{train.get('tp')}-d{train.get('dp')}"
        if gen:
            text += f" -> gen p{gen.get('pp')}-t{gen.get('tp')} x{gen.get('replicas')} ({parallel.get('reshard')})"
        if engine := parallel.get("rollout_engine"):  # a rollout engine tensor-parallel over blocks of ranks
            text += f" -> rollout engine tp{engine.get('tp')} x{engine.get('replicas')}"
    params, trainable = parallel.get("params"), parallel.get("trainable_params")
    if params and trainable is not None and trainable != params:  # a LoRA adapter: what trains, of what
        text += f"; trains {trainable:,} of {params:,} parameters"
    return text


SHOWN_METRICS = [
    "critic/score/mean",
    "critic/rm_score/mean",
    "rm/loss",
    "rm/acc",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/entropy",
    "response_length/mean",
    "timing_s/step",
    "rollout/weight_sync_bytes",  # a rollout with weights of its own (vLLM): bytes per sync (LoRA: the adapter's)
    "timing_s/weight_sync",
]
"""The metrics ``hf runs show`` and ``hf runs compare`` put in their tables (those a run recorded), with every
validation accuracy (``val/*/acc``)."""

LATEST = 10
"""Iterations ``hf runs show`` lists (the newest); ``hf runs metrics`` has all."""


@runs_app.command("show")
def runs_show(
    run_id: str,
    config: Annotated[bool, typer.Option("--config", help="also print the run's whole config (YAML)")] = False,
    db: DbOption = None,
) -> None:
    """A run at a glance: status, what it trains, timings, placement, its latest metrics, checkpoints and
    recoveries; its whole config with --config."""
    store = _store(db)
    r = _get_run(store, run_id)
    console.print(styled((r.id, "bold"), f"  {r.experiment_name}  status={_status_text(r)}  kind={r.kind}"))
    iterations = store.iterations(r.id)
    console.print(_what_it_trains(r, iterations))
    console.print(_timings(r, iterations))
    if r.lease_host is not None:
        beat = f"{r.heartbeat_at:%Y-%m-%d %H:%M:%S} UTC" if r.heartbeat_at else "never"
        console.print(f"controller: host {r.lease_host}, pid {r.lease_pid}, last heartbeat {beat}")
    if r.error:
        console.print(error_cause(r.error) or r.error.strip().splitlines()[-1], style="red")
    if r.plan_id:
        console.print(_plan_line(store, r.plan_id, r.id, iterations))
    placement = Table("role", "pool", "ranks", "executor", "slurm job", "hosts", "parallel", title="placement")
    for p in store.placements(run_id):
        placement.add_row(
            p.role,
            p.group_name,
            str(p.ranks),
            p.executor,
            p.slurm_job_id or "",
            ", ".join(p.hosts),
            _parallel_summary(p.parallel),
        )
    console.print(placement)
    points = store.metrics(run_id)
    names = _table_metrics({p.name for p in points})
    by_step: dict[int, dict[str, float | None]] = {}
    for p in points:
        by_step.setdefault(p.step, {})[p.name] = p.value
    steps = sorted(by_step)
    title = "metrics (hf runs metrics RUN_ID --name NAME for any other)"
    if len(steps) > LATEST:
        title = f"metrics of the last {LATEST} of {len(steps)} steps (all: hf runs metrics {run_id})"
    table = Table("step", *names, title=title)
    for step in steps[-LATEST:]:
        table.add_row(str(step), *[_fmt(by_step[step].get(name)) for name in names])
    console.print(table)
    ckpts = Table("step", "path", "bytes", "sha256", "usable", title="checkpoints")
    for c in store.checkpoints(run_id):
        usable = "yes" if c.complete and c.bad_reason is None else f"no: {c.bad_reason or 'incomplete'}"
        ckpts.add_row(str(c.step), c.path, f"{c.bytes:,}", c.sha256[:16], usable)
    console.print(ckpts)
    recoveries = store.recoveries(run_id)
    if recoveries:
        healed = Table("iteration", "group", "ranks", "nodes", "cause", "went on from", "lost s", title="recoveries")
        for rec in recoveries:
            start = f"global_step_{rec.resumed_from}" if rec.resumed_from else "the start"
            nodes = ", ".join(rec.nodes) or "?"
            healed.add_row(str(rec.step), rec.group_name, str(rec.ranks), nodes, rec.cause, start, f"{rec.lost_s:.1f}")
        console.print(healed)
    samples = store.samples(run_id)
    if samples:
        steps = sorted({s.step for s in samples})
        console.print(f"{len(samples)} sample generations at steps {steps[0]}..{steps[-1]}: hf runs samples {run_id}")
    console.print(
        f"code {r.code_version}; Prefect flow run {r.prefect_flow_run_id}; config: hf runs show {run_id} --config"
    )
    if config:
        console.print(yaml.safe_dump(r.config, sort_keys=False).rstrip())


def _table_metrics(recorded: set[str]) -> list[str]:
    """`SHOWN_METRICS` a run recorded, then its validation accuracies."""
    vals = sorted(name for name in recorded if name.startswith("val/") and name.endswith("/acc"))
    return [name for name in SHOWN_METRICS if name in recorded] + vals


def _what_it_trains(r, iterations) -> str:
    """``grpo on smollm2 (actor fsdp), 3/5 iterations`` from a run's config and its recorded `iterations`."""
    cfg = r.config
    model = cfg.get("model", {}).get("path", "?")
    done = len([i for i in iterations if i.ended_at is not None])
    if r.kind != "rl":
        return f"{r.kind} training of {model}, {done} steps recorded"
    algorithm = cfg.get("algorithm", {}).get("adv_estimator", "?")
    strategy = cfg.get("actor", {}).get("strategy", "?")
    total = cfg.get("trainer", {}).get("total_iterations", "?")
    mode = cfg.get("trainer", {}).get("mode", "sync")
    return f"{algorithm} on {model} (actor {strategy}, {mode}), {done}/{total} iterations"


def _plan_line(store, plan_id: str, run_id: str, iterations) -> str:
    """Which plan placed the run, and its estimated seconds per iteration beside the run's measured median
    (``timing_s/step``; the first iteration, which warms caches up, left out when there are others)."""
    from hybridflow.flows.placement.calibrate import Measured
    from hybridflow.flows.store.run_store import UnknownPlanError

    line = f"placement from plan {plan_id} (hf plans show {plan_id})"
    try:
        plan = store.get_plan(plan_id)
    except UnknownPlanError:
        return f"{line}; the plan is not in this store"
    if plan.chosen_seconds is None or not iterations:
        return line
    measured = Measured.from_store(store, run_id).step_s
    return (
        f"{line}: {plan.chosen_seconds:.3g} s per iteration estimated ({plan.inputs['hardware']['name']}), "
        f"{measured:.3g} s measured (median), {measured / plan.chosen_seconds:.3g} x the estimate"
    )


def _timings(r, iterations) -> str:
    """Created / started / ended (UTC), the run's seconds and the median of its recorded `iterations`' seconds."""
    import statistics

    parts = [f"created {r.created_at:%Y-%m-%d %H:%M:%S}"]
    if r.started_at:
        parts.append(f"started {r.started_at:%H:%M:%S}")
    if r.ended_at:
        parts.append(f"ended {r.ended_at:%H:%M:%S}")
    if r.duration_s is not None:
        parts.append(f"{r.duration_s:.0f} s")
    spans = [i.duration_s for i in iterations if i.duration_s is not None]
    if spans:
        parts.append(f"median iteration {statistics.median(spans):.1f} s")
    return "UTC: " + ", ".join(parts)


@runs_app.command("compare")
def runs_compare(
    run_a: Annotated[str, typer.Argument(help="a run id")],
    run_b: Annotated[str, typer.Argument(help="another run id")],
    db: DbOption = None,
) -> None:
    """Two runs side by side: the config keys whose values differ, then each run's last value of the usual metrics
    (and their last step)."""
    from hybridflow.engine.config import dotted_leaves

    store = _store(db)
    a, b = _get_run(store, run_a), _get_run(store, run_b)
    left, right = dotted_leaves(a.config), dotted_leaves(b.config)
    differ = sorted(k for k in left.keys() | right.keys() if left.get(k) != right.get(k))
    table = Table("config key", a.id, b.id, title=f"config: {len(differ)} keys differ")
    for key in differ:
        table.add_row(key, _cell(left.get(key, "(unset)")), _cell(right.get(key, "(unset)")))
    console.print(table)
    last_a, last_b = _last_values(store, a.id), _last_values(store, b.id)
    metrics = Table("metric (last value)", a.id, b.id, title="metrics")
    metrics.add_row("status", _status_text(a), _status_text(b))
    metrics.add_row("last step", str(last_a.get("step", "")), str(last_b.get("step", "")))
    for name in _table_metrics(set(last_a) | set(last_b)):
        metrics.add_row(name, _fmt(last_a.get(name)), _fmt(last_b.get(name)))
    console.print(metrics)


def _cell(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _last_values(store, run_id: str) -> dict:
    """Each metric's value at its last step, and ``step``: the run's last step."""
    last: dict = {}
    for p in sorted(store.metrics(run_id), key=lambda p: p.step):
        last[p.name] = p.value
        last["step"] = p.step
    return last


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


@runs_app.command("delete")
def runs_delete(
    run_id: str,
    files: Annotated[bool, typer.Option("--files", help="also remove the run's output folder")] = False,
    force: Annotated[bool, typer.Option("--force", help="delete a run even while its controller runs")] = False,
    db: DbOption = None,
) -> None:
    """Delete a run's records (metrics, iterations, checkpoints' records, placements) from the store and, with
    ``--files``, its output folder ``<trainer.output_dir>/<experiment_name>/<run_id>``."""
    from hybridflow.flows.store.run_store import controller_state

    store = _store(db)
    record = _get_run(store, run_id)
    if controller_state(record) == "live" and not force:
        console.print(
            f"run {run_id} is being trained (host {record.lease_host}, pid {record.lease_pid}): stop that "
            "controller first, or pass --force",
            style="red",
        )
        raise typer.Exit(2)
    folder = _run_folder(store, record)
    store.delete_run(run_id)
    console.print(f"deleted run {run_id} from {store.url}")
    if files:
        if folder is not None and folder.is_dir():
            shutil.rmtree(folder)
            console.print(f"removed {folder}")
        else:
            console.print(f"no output folder of {run_id} found (looked for {folder})")


def _run_folder(store, record) -> Path | None:
    """The run's output folder: where its recorded checkpoints are (``<folder>/checkpoints/global_step_N``), else
    the config's ``<trainer.output_dir>/<experiment_name>/<run_id>`` from the current directory. Only a folder named
    after the run is ever returned."""
    ckpts = store.checkpoints(record.id)
    if ckpts:
        folder = Path(ckpts[-1].path).parent.parent
    else:
        trainer = record.config.get("trainer", {})
        folder = Path(trainer.get("output_dir", "outputs")).resolve() / trainer.get("experiment_name", "") / record.id
    return folder if folder.name == record.id else None


@runs_app.command("metrics")
def runs_metrics(
    run_id: str,
    name: Annotated[list[str] | None, typer.Option("--name", help="metric name (repeatable); default all")] = None,
    fmt: Annotated[str, typer.Option("--format", help="csv or json")] = "csv",
    db: DbOption = None,
) -> None:
    """A run's metrics as CSV (step,name,value) or JSON, for plotting or spreadsheets."""
    store = _store(db)
    _get_run(store, run_id)
    points = [p for n in (name or [None]) for p in store.metrics(run_id, n)]
    if fmt == "json":
        print(json.dumps([{"step": p.step, "name": p.name, "value": p.value} for p in points]))
    elif fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["step", "name", "value"])
        writer.writerows([p.step, p.name, p.value] for p in points)
        print(out.getvalue(), end="")
    else:
        console.print(f"--format must be csv or json, got {fmt!r}", style="red")
        raise typer.Exit(2)


@runs_app.command("samples")
def runs_samples(
    run_id: str,
    step: Annotated[int | None, typer.Option("--step", help="only this step (0: validation before training)")] = None,
    kind: Annotated[str | None, typer.Option("--kind", help="train or val; default both")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line")] = False,
    routes: Annotated[
        bool,
        typer.Option("--routes", help="each response token's experts per MoE layer (trainer.log_routed_experts)"),
    ] = False,
    db: DbOption = None,
) -> None:
    """A run's sample generations (prompt, response, score, ground truth; a reward model's score, a judge's verdict
    and the score function's error where there is one), kept with trainer.log_val_generations=N
    and trainer.log_train_generations=N; with --routes, the experts each response token went to in each MoE layer
    (kept with trainer.log_routed_experts)."""
    store = _store(db)
    record = _get_run(store, run_id)
    if kind not in (None, "train", "val"):
        console.print(f"--kind must be train or val, got {kind!r}", style="red")
        raise typer.Exit(2)
    samples = store.samples(run_id, step=step, kind=kind)
    if as_json:
        for sample in samples:
            print(json.dumps(sample.to_dict()))
        return
    if not samples:
        trainer = record.config.get("trainer", {})
        keep = {k: trainer.get(f"log_{k}_generations", 0) for k in ("val", "train")}
        where = f" at step {step}" if step is not None else ""
        console.print(
            f"no samples of {run_id}{where} (trainer.log_val_generations={keep['val']}, "
            f"trainer.log_train_generations={keep['train']}; set them to N to keep N samples per step)"
        )
        return
    for s in samples:
        console.rule(f"step {s.step} {s.kind} #{s.idx}  {s.data_source}  score={_fmt(s.score)}", align="left")
        console.print("prompt", style="bold")
        console.print(s.prompt, highlight=False)
        console.print("response", style="bold")
        console.print(s.response, highlight=False)
        console.print(styled(("ground truth", "bold"), f" {s.ground_truth}"), highlight=False)
        if s.rm_score is not None:
            console.print(styled(("reward model", "bold"), f" {_fmt(s.rm_score)}"), highlight=False)
        if s.judge_text is not None:
            console.print("judge's verdict", style="bold")
            console.print(s.judge_text, highlight=False)
        if s.reward_error:
            console.print(styled(("reward error", "bold red"), f" {s.reward_error} (scored 0.0)"), highlight=False)
        if s.kind == "train" and s.rollout_version is not None and s.rollout_version != s.step - 1:
            lag = s.step - 1 - s.rollout_version  # generated ahead (trainer.mode one_step_off | async)
            console.print(
                styled(("generated by", "bold"), f" the actor after {s.rollout_version} updates ({lag} stale)")
            )
        if s.token_versions is not None and len(s.token_versions) > 1:  # a partial rollout continued across pushes
            runs = ", then ".join(f"version {version} ({tokens} tokens)" for version, tokens in s.token_versions)
            console.print(styled(("sampled by", "bold"), f" {runs}"))
        if s.routed_experts is not None:
            _print_routes(s.routed_experts, routes)
    if routes and not any(s.routed_experts is not None for s in samples):
        console.print("no routed experts kept: run with trainer.log_routed_experts=true (and router replay R2 or R3)")


def _print_routes(routes: list[list[list[int]]], each_token: bool) -> None:
    """A sample's routed experts (``[token][MoE layer][k]``): a line saying how many were kept, and with
    `each_token` one line per response token, ``layer:experts`` for each MoE layer (-1: nothing recorded)."""
    layers = len(routes[0]) if routes else 0
    console.print(
        styled(("routed experts", "bold"), f" of {len(routes)} response tokens in {layers} MoE layers"),
        highlight=False,
    )
    if each_token:
        for j, token in enumerate(routes):
            cells = " ".join(f"{i}:{','.join(str(e) for e in chosen)}" for i, chosen in enumerate(token))
            console.print(f"  token {j}: {cells}", highlight=False)


@runs_app.command("timeline")
def runs_timeline(
    run_id: str,
    step: Annotated[list[int] | None, typer.Option("--step", help="iteration (repeatable); default the last")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per stage")] = False,
    db: DbOption = None,
) -> None:
    """When each stage of an iteration ran and on which resource pool: stages of different pools that ran at the
    same time overlap on the time axis."""
    from hybridflow.cli.timeline import timeline_table

    store = _store(db)
    _get_run(store, run_id)
    recorded = store.stage_times(run_id)
    steps = step or sorted({s.step for s in recorded})[-1:]
    if as_json:
        for s in recorded:
            if s.step in steps:
                print(json.dumps({**s.to_dict(), "duration_s": s.duration_s}))
        return
    if not recorded:
        console.print(f"no stage timeline of {run_id} on record (recorded from the first iteration on)")
        raise typer.Exit(1)
    for k in steps:
        stages = [s for s in recorded if s.step == k]
        if not stages:
            console.print(f"no timeline of iteration {k}; recorded: {sorted({s.step for s in recorded})}", style="red")
            raise typer.Exit(2)
        console.print(timeline_table(k, stages))


@runs_app.command("plot")
def runs_plot(
    run_ids: Annotated[list[str], typer.Argument(help="one or more runs, overlaid")],
    name: Annotated[
        list[str] | None,
        typer.Option(
            "--name",
            help="metric name or glob, e.g. val/*/acc (repeatable); default: reward, held-out "
            "accuracy, KL, entropy, response length",
        ),
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="PNG to write (default: plot-<first run>.png)")] = None,
    show: Annotated[bool, typer.Option(help="also draw it in the terminal when it shows images")] = True,
    smooth: Annotated[
        float, typer.Option(help="TensorBoard's smoothing weight in [0, 1), e.g. 0.6: an EMA over the raw points")
    ] = 0.0,
    db: DbOption = None,
) -> None:
    """Plot metrics of one or more runs against the iteration (one panel per metric, runs overlaid) into a PNG."""
    from hybridflow.cli.plots import DEFAULT_METRICS, plot_runs, resolve_names, show_in_terminal

    store = _store(db)
    series: dict[str, dict[str, list[tuple[int, float | None]]]] = {}
    for run_id in run_ids:
        _get_run(store, run_id)
        metrics: dict[str, list[tuple[int, float | None]]] = {}
        for point in store.metrics(run_id):
            metrics.setdefault(point.name, []).append((point.step, point.value))
        series[run_id] = metrics
    available = {n for metrics in series.values() for n in metrics}
    try:
        names = resolve_names(name or DEFAULT_METRICS, available, explicit=bool(name))
        path = plot_runs(series, names, out or Path(f"plot-{run_ids[0]}.png"), smooth)
    except ValueError as e:
        console.print(f"{e}", style="red")
        raise typer.Exit(2) from None
    if not (show and show_in_terminal(path)):
        console.print(f"wrote {path} ({', '.join(names)})")
