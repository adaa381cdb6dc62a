"""``strategy: fsdp``: a Hugging Face model trained with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``),
optionally with DTensor tensor parallelism inside each data-parallel replica (``actor.tp``): every parameter is a
DTensor sharded on dim 0 over the data-parallel ranks (ZeRO-3), all-gathered one decoder layer at a
time for forward and backward, gradients reduce-scattered (averaged, as DDP's all-reduce) into the shards; the
optimizer holds only this rank's shard of its states. Per-rank memory for weights, gradients and Adam states is
``1 / D`` of DDP's.

Generation needs each replica's whole model (training layout 1-t-D, generation layout 1-t-D with the data-parallel
shards gathered: the rollout runs tensor-parallel over the same TP group): `gathered` all-gathers every layer once and
keeps them until the rollout is done, instead of re-gathering each layer at every decoding step, and frees them after.

Checkpoints stay in the ``ddp`` format (`hybridflow.engine.checkpoint`), through `hybridflow.engine.sharded_state`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


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
