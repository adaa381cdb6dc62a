"""An FSDP-sharded model's state in the ``ddp`` checkpoint format (`hybridflow.engine.checkpoint`): `full_model_state`
and `full_optimizer_state` gather full tensors to rank 0 (collectives: every rank calls them) with the optimizer state
keyed by parameter index in ``model.parameters()`` order, as ``torch.optim.Optimizer.state_dict()`` gives it for an
unsharded model; `load_full_state` scatters them back. A ``ddp`` checkpoint resumes an ``fsdp`` run and back.
Pure torch: the checkpoint and the fsdp backend (`hybridflow.engine.backends.fsdp`) both read it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` was sharded by `shard_model`."""
    return isinstance(model, FSDPModule)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights on CPU, by name, on rank 0 (empty elsewhere). A collective. A weight tied to another
    (``lm_head`` to the embedding) appears once, under its first name, as ``save_pretrained`` writes it."""
    state = get_model_state_dict(model, options=_FULL)
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            state.pop(name, None)
        seen.add(id(tensor))
    return state


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state with full tensors on CPU, keyed by parameter index in ``model.parameters()`` order (the
    layout of ``optimizer.state_dict()`` for the unsharded model), on rank 0 (empty elsewhere). A collective."""
    if not optimizer.state:  # before the first step: nothing to gather (and torch's gathering would initialise
        return optimizer.state_dict()  # the states with a zero-gradient step, shifting Adam's step count)
    by_name = get_optimizer_state_dict(model, optimizer, options=_FULL)
    if not by_name:  # with cpu_offload only rank 0 receives the full state
        return {}
    index = {name: i for i, name in enumerate(_trained_names(model))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]
    return {"state": {index[n]: s for n, s in by_name["state"].items()}, "param_groups": groups}


def _trained_names(model: torch.nn.Module) -> list[str]:
    """The names of the parameters an optimizer over ``requires_grad`` parameters holds, in its index order (all of
    them for a fully trained model; the adapter's for LoRA)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def load_full_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
    strict: bool = True,
) -> None:
    """Scatter full `weights` (and an index-keyed `optimizer_state`, as `full_optimizer_state` writes it) into the
    sharded model and optimizer. Every rank passes the same full values.

    An `optimizer_state` with no per-parameter state (saved before the optimizer's first step) leaves the optimizer
    as it was then: its state cleared, its param groups' hyperparameters (lr, betas, ...) the saved ones.

    Args:
        strict: `weights` must name every parameter; False: those it names (a LoRA adapter's).

    Raises:
        RuntimeError: the weights do not fit the model (missing or unexpected names, wrong shapes)."""
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=strict))
    if optimizer is None or optimizer_state is None:
        return
    if not optimizer_state["state"]:
        # saved before the optimizer's first step: it starts afresh, as it did then. set_optimizer_state_dict would
        # keep the state the optimizer has now for every parameter the saved state does not name (here: all).
        optimizer.state.clear()
        for group, saved in zip(optimizer.param_groups, optimizer_state["param_groups"], strict=True):
            group.update({key: value for key, value in saved.items() if key != "params"})
        return
    names = _trained_names(model)
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]
    by_name = {"state": {names[i]: s for i, s in optimizer_state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
