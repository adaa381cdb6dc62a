"""``strategy: fsdp``: a Hugging Face model trained with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``),
optionally with DTensor tensor parallelism inside each data-parallel replica (``actor.tp``): every parameter is a
DTensor sharded on dim 0 over the data-parallel ranks (ZeRO-3), all-gathered one decoder layer at a
time for forward and backward, gradients reduce-scattered (averaged, as DDP's all-reduce) into the shards; the
optimizer holds only this rank's shard of its states. Per-rank memory for weights, gradients and Adam states is
``1 / D`` of DDP's.

Generation needs each replica's whole model (training layout 1-t-D, generation layout 1-t-D with the data-parallel
shards gathered: the rollout runs tensor-parallel over the same TP group): `gathered` all-gathers every layer once and
keeps them until the rollout is done, instead of re-gathering each layer at every decoding step, and frees them after.

Checkpoints stay in the ``ddp`` format (`hybridflow.core.checkpoint`): `full_model_state` and
`full_optimizer_state` gather full tensors to rank 0 (collectives: every rank calls them) with the optimizer
state keyed by parameter index in ``model.parameters()`` order, as ``torch.optim.Optimizer.state_dict()`` gives it
for an unsharded model; `load_full_state` scatters them back. A ``ddp`` checkpoint resumes an ``fsdp`` run and back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_model(model: torch.nn.Module, tp: int = 1) -> dist.ProcessGroup:
    """Shard `model` in place with FSDP2 over torch.distributed's default group: each decoder layer (Llama/Qwen2
    ``model.model.layers``, or any ``ModuleList`` named ``layers``) is one all-gather unit, the rest (embeddings,
    final norm, output or value head) the root's. Build the optimizer after this call (the parameters become
    DTensors).

    With ``tp > 1`` the ranks form a (data-parallel, tensor-parallel) mesh, ``rank = dp * tp + tp_rank``: each
    layer's projections are first split over the TP dimension as the model's config names them
    (``base_model_tp_plan``: q/k/v/gate/up column-parallel, o/down row-parallel, `torch.distributed.tensor.parallel`),
    then FSDP shards over the data-parallel dimension (2D parallelism); embeddings and norms are replicated over TP.

    Returns:
        The data-parallel process group (gradient averaging and batch splitting go over it).

    Raises:
        ValueError: the model has no ``layers`` ``ModuleList``, or no tensor-parallel plan when ``tp > 1``."""
    named = model.named_modules()
    layers = next((m for n, m in named if n.endswith("layers") and isinstance(m, torch.nn.ModuleList)), None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder 'layers' ModuleList: strategy fsdp cannot shard it")
    device = next(model.parameters()).device.type
    world = dist.get_world_size()
    mesh = init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        plan = {
            key.removeprefix("layers.*."): styles[style]()
            for key, style in (getattr(model.config, "base_model_tp_plan", None) or {}).items()
            if key.startswith("layers.*.") and style in styles
        }
        if not plan:
            raise ValueError(f"{type(model).__name__} has no tensor-parallel plan: use actor.tp=1 with strategy fsdp")
        for layer in layers:
            parallelize_module(layer, mesh["tp"], plan)
    for layer in layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh["dp"].get_group()


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
