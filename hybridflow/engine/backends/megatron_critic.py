"""The PPO critic on megatron-core: a ``GPTModel`` ending in a value head
(`hybridflow.engine.backends.megatron_model.build_gpt_model` with ``value_head=True``), with the update semantics of
`hybridflow.engine.backends.critic.Critic`: clipped value loss toward ``returns``; mini-batches of
``critic.ppo_mini_batch_size x n / D`` sequences per data-parallel rank, each one AdamW step; micro-batch losses
weighted over megatron's data-parallel group. It runs through megatron's schedule like
`hybridflow.engine.backends.megatron_actor.MegatronActor`.
"""

from __future__ import annotations

import torch

from hybridflow.engine.backends.critic import UPDATE_KEYS, VALUE_COLUMNS, value_loss
from hybridflow.engine.backends.megatron_actor import (
    MegatronRole,
    averaged_optimizer_step,
    response_values,
    run_schedule,
)
from hybridflow.engine.backends.training import MetricLog, update_steps
from hybridflow.engine.protocol import DataProto


class MegatronCritic(MegatronRole):
    """Values and the value update on this rank's value-model shard (``build_gpt_model(..., value_head=True)``),
    see the module docstring. Arguments as `MegatronRole` (``config``: the ``critic`` section)."""

    def compute_values(self, data: DataProto) -> DataProto | None:
        """``values`` float32 [B, T] in micro-batches of ``critic.forward_micro_batch_size``; last pipeline stage
        only (see `MegatronRole.forward_only`)."""
        return self.forward_only(data, self.config.forward_micro_batch_size, response_values, "values")

    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Clipped value-loss update on this data-parallel rank's rows. Returns ``critic/vf_loss``,
        ``critic/vf_clipfrac``, ``critic/vpred_mean`` (last stage), ``critic/grad_norm``, ``critic/lr``."""
        cfg = self.config
        data = data.select(batch_keys=[*UPDATE_KEYS, *VALUE_COLUMNS])
        self.model.train()
        log = MetricLog()
        for micros, scales in update_steps(
            data, self.mini_batch_size, cfg, self.seed, 1, self.dp_group, self.lr_scheduler
        ):

            def loss_of(index: int, vpreds: torch.Tensor, micros=micros, scales=scales):
                # the schedule divides each micro-batch's loss by their number: undo it, then weigh
                return value_loss(vpreds, micros[index].batch, cfg, log) * scales[index] * len(micros), {}

            run_schedule(self.model, micros, loss_of, forward_only=False, head=response_values)
            step = averaged_optimizer_step(
                self.model, self.optimizer, self.lr_scheduler, self.dp_group, cfg.optim.grad_clip, log, "critic"
            )
            log.add(**step)
        return log.mean("critic")
