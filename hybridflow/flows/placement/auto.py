"""Planning a run config end to end: its models and workload into the search, the fastest plan this version runs
chosen, and the config with that plan (`hf plan` and ``placement.auto`` at `hf run`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from hybridflow.engine.shapes import run_models
from hybridflow.flows.placement.cost import Workload
from hybridflow.flows.placement.hardware import HardwareProfile
from hybridflow.flows.placement.planner import (
    RUNTIME_KINDS,
    TOLERANCE,
    Candidate,
    Objective,
    Planner,
    PlanResult,
    StrategySpace,
)
from hybridflow.flows.placement.render import apply_plan, plan_record


@dataclass
class PlannedRun:
    """A search's result, the chosen candidate (None: none runs in this version) with the config `tree` running it,
    and the search's seconds."""

    result: PlanResult
    chosen: Candidate | None
    tree: dict[str, Any] | None
    search_s: float

    def record(self, store, source: str) -> str:
        """Record the plan in the run store; the written config names it (``placement.plan``). Returns its id."""
        plan_id = store.record_plan(source, **plan_record(self.result, self.chosen, self.search_s))
        if self.tree is not None:
            self.tree["placement"]["plan"] = plan_id
        return plan_id


def plan_config(
    cfg,
    tree: dict[str, Any],
    hardware: HardwareProfile,
    nodes: int,
    gpus_per_node: int,
    space: StrategySpace = "runtime",
    preset: str | None = None,
    prompt_length: int | None = None,
    objective: Objective = "latency",
    tolerance: float = TOLERANCE,
) -> PlannedRun:
    """Plan the run config `cfg` (validated; `tree` is the same as plain data) on `nodes` x `gpus_per_node` devices
    of `hardware`. Candidates are tried in the `objective`'s order (`hybridflow.flows.placement.planner.rank`): one
    whose strategies this version lacks, or whose config does not validate, is marked with the reason
    (``Candidate.not_runnable``) and the next is tried.

    Raises:
        PlanError: nothing fits (the message names the memory needed and available per device).
        KeyError, FileNotFoundError, ValueError: an unknown preset, a missing model folder, a config without
            decoder dimensions."""
    from hybridflow.engine.config import ConfigError, validate_config

    models = run_models(cfg, preset)
    planner = Planner(
        models, Workload.from_config(cfg, prompt_length), hardware, nodes, gpus_per_node, space,
        cfg.placement.concurrent, objective, tolerance,
    )  # fmt: skip
    started = time.perf_counter()
    result = planner.search()
    search_s = time.perf_counter() - started
    for candidate in result.candidates:
        outside = [f"{m} {s.kind}" for m, s in candidate.strategies.items() if s.kind not in RUNTIME_KINDS[m]]
        if outside:
            candidate.not_runnable = f"not in this version: {', '.join(outside)}"
            continue
        try:
            planned = apply_plan(tree, candidate, gpus_per_node)
            validate_config(planned)
        except ConfigError as e:
            candidate.not_runnable = str(e).splitlines()[0]
            continue
        return PlannedRun(result, candidate, planned, search_s)
    return PlannedRun(result, None, None, search_s)
