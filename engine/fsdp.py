"""``strategy: fsdp``: a Hugging Face model trained with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``):
every parameter is a DTensor sharded on dim 0 over the group's ranks (ZeRO-3), all-gathered one decoder layer at a
time for forward and backward, gradients reduce-scattered (averaged, as DDP's all-reduce) into the shards; the
optimizer holds only this rank's shard of its states. Per-rank memory for weights, gradients and Adam states is
``1 / D`` of DDP's.

Generation needs the whole model on every rank (training layout 1-1-D, generation layout 1-1-D with the full
weights): `gathered` all-gathers every layer once and keeps them until the rollout is done, instead of
re-gathering each layer at every decoding step, and frees them after.

Checkpoints stay in the ``ddp`` format (`hybridflow.engine.checkpoint`): `full_model_state` and
`full_optimizer_state` gather full tensors to rank 0 (collectives: every rank calls them) with the optimizer
state keyed by parameter index in ``model.parameters()`` order, as ``torch.optim.Optimizer.state_dict()`` gives it
for an unsharded model; `load_full_state` scatters them back. A ``ddp`` checkpoint resumes an ``fsdp`` run and back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Shard `model` in place with FSDP2 over torch.distributed's default group: each decoder layer (Llama/Qwen2
    ``model.model.layers``, or any ``ModuleList`` named ``layers``) is one all-gather unit, the rest (embeddings,
    final norm, output or value head) the root's. Build the optimizer after this call (the parameters become
    DTensors). Returns `model`.

    Raises:
        ValueError: the model has no ``layers`` ``ModuleList`` to shard by."""
    named = model.named_modules()
    layers = next((m for n, m in named if n.endswith("layers") and isinstance(m, torch.nn.ModuleList)), None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder 'layers' ModuleList: strategy fsdp cannot shard it")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` was sharded by `shard_model`."""
    return isinstance(model, FSDPModule)


def gradient_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Context for one micro-batch's backward: reduce-scatter gradients only when `sync` (the mini-batch's last
    micro-batch); the others accumulate unsharded gradients locally."""

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        model.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return scope()


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Keep every layer's full weights on this rank inside the context (one all-gather per layer), for generation;
    the shards own the memory again after it. A no-op for an unsharded model."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    model.set_reshard_after_forward(False, recurse=True)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        model.set_reshard_after_forward(True, recurse=True)


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
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]
    return {"state": {index[n]: s for n, s in by_name["state"].items()}, "param_groups": groups}


def load_full_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
) -> None:
    """Scatter full `weights` (and an index-keyed `optimizer_state`, as `full_optimizer_state` writes it) into the
    sharded model and optimizer. Every rank passes the same full values.

    Raises:
        RuntimeError: the weights do not fit the model (missing or unexpected names, wrong shapes)."""
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    if optimizer is None or optimizer_state is None:
        return
    names = [name for name, _ in model.named_parameters()]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]
    by_name = {"state": {names[i]: s for i, s in optimizer_state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
