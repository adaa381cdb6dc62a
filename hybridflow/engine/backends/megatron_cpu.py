"""Run megatron-core on CPU (gloo): a runtime patch of its hard-coded CUDA calls; no megatron file is edited.

megatron-core assumes CUDA in places no config flag reaches: ``torch.cuda.current_device()`` as a device,
the tensor-parallel RNG tracker's CUDA generator state, ``device="cuda"`` literals in its schedules and buffers,
and CUDA streams/events in its DDP. `install` redirects each to CPU equivalents for the rest of the process:

- ``torch.cuda.current_device`` returns the CPU device;
- the CUDA RNG API reads and writes a separate CPU generator (so the tracker's forks never disturb torch's own
  CPU RNG);
- ``synchronize`` / ``empty_cache`` are no-ops, streams and events are inert stand-ins;
- a `torch.overrides.TorchFunctionMode` rewrites ``device="cuda..."`` arguments and ``.cuda()`` / ``.to("cuda")``
  to CPU;
- the alltoall MoE token dispatcher's split sizes become host arrays as on a GPU (megatron's
  ``maybe_move_tensor_to_cpu`` converts only CUDA tensors, and gloo's ``all_to_all_single`` refuses tensor splits);
- gathers and reduce-scatters of uneven sizes along the first dimension (the dispatcher's over expert-TP ranks)
  run as gloo can: gloo's ``all_gather`` and ``reduce_scatter`` take only equal sizes, so the pieces are padded to
  the largest and cut after the gather, and the reduce-scatter is an all-reduce of which each rank keeps its piece.

Only for CPU processes (tests, CPU benchmarks): a process with a GPU never calls `install`. Known limit: megatron's
distributed optimizer does not run on CPU even so; use the plain optimizer.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_installed: list[TorchFunctionMode] = []


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of factory functions and ``Tensor.to`` / ``Tensor.cuda`` to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


class _InertStream:
    """Stands in for CUDA streams and events: every operation is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, *args):
        pass

    def wait_stream(self, *args):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args):
        return _InertStream()

    def record(self, *args):
        pass

    def query(self):
        return True


def _host_splits(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's ``maybe_move_tensor_to_cpu`` for tensors already on the CPU: a numpy array when asked, as the
    CUDA path returns (the dispatcher passes it to ``all_to_all_single`` as split sizes)."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _uneven_collectives(mappings) -> None:
    """Route megatron's uneven first-dimension gather and reduce-scatter through equal-size gloo collectives."""
    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1 or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        widest = max(output_split_sizes)
        padded = input_.new_zeros((widest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in range(group.size())]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes, strict=True)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or len(set(input_split_sizes)) <= 1 or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        summed = input_.contiguous().clone()
        torch.distributed.all_reduce(summed, group=group)
        return summed.split(list(input_split_sizes))[group.rank()].clone()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def install() -> None:
    """Patch this process for megatron-core on CPU (idempotent). Import megatron only after calling it."""
    if _installed or torch.cuda.is_available():
        return
    generator = torch.Generator()
    torch.cuda.current_device = lambda: _CPU
    torch.cuda.get_rng_state = lambda device="cuda": generator.get_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": generator.set_state(state)
    torch.cuda.manual_seed = lambda seed: generator.manual_seed(seed)
    torch.cuda.manual_seed_all = lambda seed: generator.manual_seed(seed)
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _InertStream()
    torch.cuda.Stream = _InertStream
    torch.cuda.Event = _InertStream
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    import megatron.core.tensor_parallel.random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *args, clone=False, **kwargs: generator.get_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: generator.set_state(state)
    import megatron.core.tensor_parallel.mappings as mappings
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    dispatcher.maybe_move_tensor_to_cpu = _host_splits
    _uneven_collectives(mappings)
    mode = _CudaToCpu()
    mode.__enter__()
    _installed.append(mode)
