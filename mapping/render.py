"""A plan as run configuration: the ``placement.pools`` section and the strategy keys (``actor.strategy``,
``actor.tp``, ``actor.pp``, ``rollout.gen_tp``, ``critic.strategy``, ``reward_model.strategy``)."""

from __future__ import annotations

import copy
from typing import Any

from hybridflow.mapping.planner import Candidate

ROLES_OF = {"actor": ("actor", "rollout"), "critic": ("critic",), "ref": ("ref",), "reward_model": ("reward_model",)}
REPLACED = ("colocate", "critic_nodes", "critic_tasks_per_node", "nodes", "tasks_per_node")  # pools carry these


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
    placement = out.setdefault("placement", {})
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
    rollout = out.setdefault("rollout", {})
    if actor.kind == "megatron":
        rollout["gen_tp"] = actor.gen_tp
    else:
        rollout.pop("gen_tp", None)
    for model in ("critic", "reward_model"):
        if model in plan.strategies:
            out.setdefault(model, {})["strategy"] = plan.strategies[model].kind
    return out
