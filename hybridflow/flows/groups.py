"""The run's worker groups as specs, and what can start before the controller launches them (no Prefect here: the
``hf`` commands call `start_early` as soon as a config is read).

- `group_spec`: a resource pool's `GroupSpec` (where and how its ranks run).
- `start_early`: locally, the fork server that imports the engine for the ranks; on Slurm, each pool's allocation
  (`hybridflow.slurm.allocation.submit_early`), so that its job waits in the queue and its node agents import the engine
  while the controller checks its inputs, connects to Prefect and starts its flow. The groups launched later take
  them; one that no group takes is closed when the controller exits.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hybridflow.engine.config import HybridFlowConfig, Pool, RMTrainingConfig, SFTTrainingConfig
from hybridflow.slurm.worker_group import GroupSpec, slurm_parameters

logger = logging.getLogger(__name__)

WORKER_CLS = "hybridflow.engine.worker:RLHFWorker"
"""The worker class an RLHF run's groups serve."""


def start_early(cfg: HybridFlowConfig | RMTrainingConfig | SFTTrainingConfig) -> None:
    """Start, now, what `cfg`'s worker groups will need (see the module docstring); returns at once. On Slurm this
    is done for an RLHF run's pools (`HybridFlowConfig.pools`); reward-model and SFT runs submit their one job when
    they launch it."""
    from hybridflow.slurm import allocation
    from hybridflow.slurm.forked import warm_up

    if cfg.placement.executor == "local":
        warm_up(vllm=builds_vllm_engines(cfg))
        return
    if not isinstance(cfg, HybridFlowConfig):
        return
    folder = Path(cfg.trainer.output_dir).resolve() / cfg.trainer.experiment_name / "allocations"
    for pool in cfg.pools().values():
        spec = group_spec(cfg, pool)
        try:
            early = allocation.Allocation(spec, folder / f"{os.getpid()}-{spec.name}")
            allocation.submit_early(early)
        except Exception as e:  # a partition or account the input checks name next; the group submits its own job
            logger.debug("no early allocation for pool %s: %s", pool.name, e)


def group_spec(
    cfg: HybridFlowConfig | RMTrainingConfig | SFTTrainingConfig, pool: Pool, worker_cls: str = WORKER_CLS
) -> GroupSpec:
    """The `GroupSpec` of the worker group of resource pool `pool` (its ranks serving `worker_cls`; its Slurm job
    with the pool's resources), with the ``placement`` section's executor, backend and limits."""
    placement = cfg.placement
    backend = placement.backend
    if backend == "auto":  # NCCL when the workers train on GPUs (trainer.device cuda, or auto with GPUs there)
        if cfg.trainer.device == "cpu":
            on_gpus = False
        elif placement.executor == "slurm":
            on_gpus = cfg.trainer.device == "cuda" or pool.slurm.gpus_per_node > 0
        else:
            on_gpus = _local_cuda(cfg)
        backend = "nccl" if on_gpus else "gloo"
    slurm = pool.slurm
    return GroupSpec(
        name=pool.name,
        worker_cls=worker_cls,
        nodes=pool.nodes,
        tasks_per_node=pool.tasks_per_node,
        executor=placement.executor,
        slurm=slurm_parameters(**slurm.model_dump(exclude={"time_min", "interface"})),
        timeout_min=slurm.time_min,
        backend=backend,
        heartbeat_timeout_s=placement.heartbeat_timeout_s,
        call_timeout_s=placement.call_timeout_s,
        rendezvous_timeout_s=placement.rendezvous_timeout_s,
        interface=slurm.interface,
        vllm=builds_vllm_engines(cfg, pool),
    )


def builds_vllm_engines(cfg: HybridFlowConfig | RMTrainingConfig | SFTTrainingConfig, pool: Pool | None = None) -> bool:
    """Whether the run's ranks (those of `pool`, if given) may build vLLM engines: an RLHF run whose rollout is
    vLLM (``auto`` is resolved when the config is loaded), on the pool that hosts the rollout."""
    uses_vllm = isinstance(cfg, HybridFlowConfig) and cfg.rollout.name == "vllm"
    return uses_vllm and (pool is None or "rollout" in pool.roles)


def _local_cuda(cfg: HybridFlowConfig) -> bool:
    import torch

    return torch.cuda.is_available()
