"""A plan as run configuration (the ``placement.pools`` section and the strategy keys ``actor.strategy``,
``actor.tp``, ``actor.pp``, ``actor.ep`` (with the alltoall dispatcher), ``rollout.gen_tp``,
``rollout.micro_batch_size`` where memory cuts the rollout's batch, ``critic.strategy``, ``reward_model.strategy``)
and as the run store's record (plain JSON data: `plan_record`, `candidate_from_dict`)."""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Any

from hybridflow.engine.shapes import ModelShape
from hybridflow.flows.placement.cost import Strategy, Workload
from hybridflow.flows.placement.hardware import HardwareProfile
from hybridflow.flows.placement.planner import Candidate, PlanResult, Rejected

KEPT = 100  # candidates a stored plan keeps (fastest first; the count of all is stored beside them)

ROLES_OF = {"actor": ("actor", "rollout"), "critic": ("critic",), "ref": ("ref",), "reward_model": ("reward_model",)}
ROLES_OF["teacher"] = ("teacher",)
REPLACED = ("colocate", "critic_nodes", "critic_tasks_per_node", "nodes", "tasks_per_node", "auto")  # pools carry these


def pool_name(models: tuple[str, ...]) -> str:
    """``actor_rollout_ref`` for (actor, ref): the roles of the pool joined."""
    return "_".join(role for model in models for role in ROLES_OF[model])


def node_shape(devices: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, tasks per node) of a pool of `devices`: within one node, or whole nodes."""
    return (1, devices) if devices <= gpus_per_node else (devices // gpus_per_node, gpus_per_node)


def apply_plan(tree: dict[str, Any], plan: Candidate, gpus_per_node: int) -> dict[str, Any]:
    """A copy of the config `tree` (plain data, as read from YAML) running `plan`: its pools (each with its nodes
    and ranks per node, and on a GPU Slurm cluster ``gpus_per_node`` = its ranks per node) and every model's
    strategy. Keys the pools replace (``placement.colocate``, ``nodes``, ...) are removed."""
    out = copy.deepcopy(tree)
    if not isinstance(out.get("placement"), dict):  # absent, or `placement: auto`
        out["placement"] = {}
    placement = out["placement"]
    for key in REPLACED:
        placement.pop(key, None)
    gpus = bool((placement.get("slurm") or {}).get("gpus_per_node"))
    pools = {}
    for models, devices in zip(plan.placement, plan.devices, strict=True):
        nodes, tasks = node_shape(devices, gpus_per_node)
        pool: dict[str, Any] = {
            "roles": [r for m in models for r in ROLES_OF[m]],
            "nodes": nodes,
            "tasks_per_node": tasks,
        }
        if gpus:
            pool["slurm"] = {"gpus_per_node": tasks}
        pools[pool_name(models)] = pool
    placement["pools"] = pools
    actor = plan.strategies["actor"]
    out.setdefault("actor", {}).update({"strategy": actor.kind, "tp": actor.tp, "pp": actor.pp})
    if actor.ep > 1:  # the cost model prices megatron-core's alltoall dispatcher (cost.dispatch_s)
        out["actor"]["ep"] = actor.ep
        out["actor"].setdefault("moe", {})["token_dispatcher_type"] = "alltoall"
    else:
        out["actor"].pop("ep", None)
    rollout = out.setdefault("rollout", {})
    if actor.kind == "megatron":
        rollout["gen_tp"] = actor.gen_tp
    else:
        rollout.pop("gen_tp", None)
    if actor.gen_batch:  # the KV cache has room for no more beside what the pool holds (planner._fit_rollout)
        rollout["micro_batch_size"] = actor.gen_batch
    for model in ("critic", "reward_model"):
        if model in plan.strategies:
            out.setdefault(model, {})["strategy"] = plan.strategies[model].kind
    return out


def candidate_dict(c: Candidate) -> dict[str, Any]:
    """A candidate as JSON data (seconds; peak memory in bytes per device of each pool)."""
    return {
        "placement": [list(models) for models in c.placement],
        "devices": list(c.devices),
        "strategies": {model: asdict(s) for model, s in c.strategies.items()},
        "seconds": c.seconds,
        "stage_s": c.stage_s,
        "spans": {stage: list(span) for stage, span in c.spans.items()},
        "peak_bytes": list(c.peak_bytes),
        "not_runnable": c.not_runnable,
    }


def candidate_from_dict(data: dict[str, Any]) -> Candidate:
    """The inverse of `candidate_dict`."""
    return Candidate(
        placement=tuple(tuple(models) for models in data["placement"]),
        devices=tuple(data["devices"]),
        strategies={model: Strategy(**s) for model, s in data["strategies"].items()},
        stage_s=dict(data["stage_s"]),
        spans={stage: (span[0], span[1]) for stage, span in data["spans"].items()},
        seconds=data["seconds"],
        peak_bytes=tuple(data["peak_bytes"]),
        not_runnable=data.get("not_runnable"),
    )


def plan_record(result: PlanResult, chosen: Candidate | None, search_s: float) -> dict[str, Any]:
    """`RunStore.record_plan`'s keyword arguments (but ``source``) for a search's `result` and its `chosen` one."""
    inputs = {
        "models": {role: asdict(shape) for role, shape in result.models.items()},
        "workload": asdict(result.workload),
        "cluster": {"nodes": result.nodes, "gpus_per_node": result.gpus_per_node},
        "hardware": result.hardware.model_dump(),
        "space": result.space,
        "placements": result.placements,
        "allocations": result.allocations,
        "objective": result.objective,
        "tolerance": result.tolerance,
    }
    return {
        "inputs": inputs,
        "candidates": [candidate_dict(c) for c in result.candidates[:KEPT]],
        "candidate_count": len(result.candidates),
        "rejected": [{"placement": [list(m) for m in r.placement], "reason": r.reason} for r in result.rejected],
        "chosen": None if chosen is None else candidate_dict(chosen),
        "search_s": search_s,
    }


def result_from_record(inputs: dict[str, Any], candidates: list[Any], rejected: list[Any]) -> PlanResult:
    """A stored plan's search result again (its kept candidates only), for `hf plans show`."""
    result = PlanResult(
        candidates=[candidate_from_dict(c) for c in candidates],
        rejected=[Rejected(tuple(tuple(m) for m in r["placement"]), r["reason"]) for r in rejected],
        models={role: ModelShape(**shape) for role, shape in inputs["models"].items()},
        workload=Workload(**inputs["workload"]),
        hardware=HardwareProfile(**inputs["hardware"]),
        nodes=inputs["cluster"]["nodes"],
        gpus_per_node=inputs["cluster"]["gpus_per_node"],
        space=inputs["space"],
    )
    result.placements, result.allocations = inputs["placements"], inputs["allocations"]
    result.objective = inputs.get("objective", "latency")  # plans recorded before the objective: fastest first
    result.tolerance = inputs.get("tolerance", 0.0)
    return result
