"""``hf plan``'s tables: the ranked candidates, the rejected placements, the chosen plan's stages."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from hybridflow.cli.common import styled
from hybridflow.flows.placement.calibrate import Measured
from hybridflow.flows.placement.hardware import GB
from hybridflow.flows.placement.planner import Candidate, PlanResult


def _seconds(value: float) -> str:
    """Three significant digits: 0.0123, 1.23, 123."""
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def placement_label(candidate: Candidate) -> str:
    """``actor+ref | critic``: the models of each pool."""
    return " | ".join("+".join(models) for models in candidate.placement)


def strategies_label(candidate: Candidate) -> str:
    return ", ".join(f"{model} {s.label()}" for model, s in candidate.strategies.items())


def ranked_by(result: PlanResult) -> str:
    """How the candidates are ordered, in words."""
    if result.objective == "throughput-per-gpu":
        return "most sequences per second per device first"
    if result.tolerance:
        return f"fewest devices first among those within {result.tolerance:.0%} of the fastest, then fastest first"
    return "fastest first"


def candidates_table(result: PlanResult, top: int) -> Table:
    """The `top` candidates in the objective's order: placement, devices per pool, strategies, seconds per iteration
    and per stage, peak GB per device of each pool, and whether this version runs it."""
    stages = result.stage_names
    title = f"plans for {result.nodes} x {result.gpus_per_node} {result.hardware.name}, {ranked_by(result)}"
    table = Table(title=title)
    for column in ("#", "placement", "devices", "strategies", "s/iter", *[f"{s} s" for s in stages], "peak GB"):
        table.add_column(column, justify="right" if column not in ("placement", "strategies") else "left")
    table.add_column("runs here")
    for rank, c in enumerate(result.candidates[:top], 1):
        table.add_row(
            str(rank),
            placement_label(c),
            " | ".join(map(str, c.devices)),
            strategies_label(c),
            _seconds(c.seconds),
            *[_seconds(c.stage_s.get(s, 0.0)) for s in stages],
            " | ".join(f"{p / GB:.2f}" for p in c.peak_bytes),
            "yes" if c.not_runnable is None else c.not_runnable,
        )
    return table


def rejected_table(result: PlanResult) -> Table:
    table = Table(title="placements rejected")
    table.add_column("placement")
    table.add_column("why")
    for r in result.rejected:
        table.add_row(" | ".join("+".join(m) for m in r.placement), r.reason)
    return table


def timeline_table(candidate: Candidate) -> Table:
    """The chosen plan's simulated iteration: each stage's start and end (seconds)."""
    table = Table(title="the chosen plan's iteration, simulated")
    for column in ("stage", "start s", "end s"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for stage, (start, end) in candidate.spans.items():
        table.add_row(stage, _seconds(start), _seconds(end))
    return table


def show_plan(
    console: Console, result: PlanResult, chosen: Candidate | None, top: int, plan_id: str, search_s: float
) -> None:
    """Print a search: its size and inputs, the ranked candidates, the rejected placements, the chosen plan."""
    w = result.workload
    models = ", ".join(f"{m} {s.name}" for m, s in result.models.items())
    console.print(
        styled(
            "plan ",
            (plan_id, "bold"),
            f": {result.placements} placements, {result.allocations} allocations, {len(result.candidates)} feasible "
            f"plans in {search_s:.2f} s; models: {models}; {w.sequences} sequences of {w.prompt_length} + "
            f"{w.response_length} tokens per iteration",
        )
    )
    console.print(candidates_table(result, top))
    if result.rejected:
        console.print(rejected_table(result))
    if chosen is not None:
        console.print(timeline_table(chosen))
        idle = result.devices - chosen.used
        console.print(
            f"chosen: {placement_label(chosen)} on {' | '.join(map(str, chosen.devices))} devices, "
            f"{_seconds(chosen.seconds)} s per iteration (estimated); {idle} of the cluster's {result.devices} "
            "devices idle"
        )


def plan_runs(store, plan_id: str) -> list[tuple[str, Measured]]:
    """The recorded runs whose placement came from plan `plan_id` and trained at least one iteration, newest first,
    each with its measured timings (`Measured.from_store`: medians, the first iteration left out when there are
    others)."""
    runs = [r for r in store.list_runs(None) if r.plan_id == plan_id]
    return [(r.id, Measured.from_store(store, r.id)) for r in runs if store.iterations(r.id)]


def estimate_beside_measured(chosen: Candidate, hardware: str, runs: list[tuple[str, Measured]]) -> Table:
    """The chosen plan's estimated seconds per stage and per iteration (hardware profile `hardware`) beside each
    run's measured median (``timing_s/<stage>``, ``timing_s/step``) and the ratio measured / estimated."""
    table = Table("stage", f"estimated s ({hardware})", title="the plan's estimate beside the runs that ran it")
    for run_id, _ in runs:
        table.add_column(f"{run_id} s")
        table.add_column("measured / estimated")
    rows = [(stage, seconds, lambda m, s=stage: m.stage_s.get(s)) for stage, seconds in chosen.stage_s.items()]
    rows.append(("iteration", chosen.seconds, lambda m: m.step_s))
    for stage, estimated, measured_of in rows:
        cells = []
        for _, measured in runs:
            value = measured_of(measured)
            cells += ["-", "-"] if value is None else [_seconds(value), f"{value / estimated:.3g}"]
        table.add_row(stage, _seconds(estimated), *cells)
    return table
