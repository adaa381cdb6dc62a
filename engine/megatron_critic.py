"""The PPO critic on megatron-core: a ``GPTModel`` ending in a value head
(`hybridflow.engine.megatron_model.build_gpt_model` with ``value_head=True``), with the update semantics of
`hybridflow.engine.critic.Critic`: clipped value loss toward ``returns``; mini-batches of
``critic.ppo_mini_batch_size x n / D`` sequences per data-parallel rank, each one AdamW step; micro-batch losses
weighted over megatron's data-parallel group. It runs through megatron's schedule like
`hybridflow.engine.megatron_actor.MegatronActor`.
"""

from __future__ import annotations

import torch

from hybridflow.engine.config import CriticConfig
from hybridflow.engine.core_algos import compute_value_loss, masked_mean
from hybridflow.engine.critic import UPDATE_KEYS
from hybridflow.engine.megatron_actor import optimizer_step, response_values, run_schedule
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.training import MetricLog, build_optimizer, micro_batch_weights, mini_batches


class MegatronCritic:
    """Values and the value update on this rank's ``GPTModel`` shard (see the module docstring).

    Args:
        model: this rank's value model (``build_gpt_model(..., value_head=True)``).
        config: the ``critic`` section.
        rollout_n: responses per prompt.
        seed: seeds the mini-batch shuffling (with ``meta_info["global_steps"]``).
    """

    def __init__(self, model, config: CriticConfig, rollout_n: int, seed: int = 0):
        from megatron.core import parallel_state

        self.model = model
        self.config = config
        self.seed = seed
        self.dp_group = parallel_state.get_data_parallel_group()
        self.mini_batch_size = config.ppo_mini_batch_size * rollout_n // torch.distributed.get_world_size(self.dp_group)
        self.optimizer, self.lr_scheduler = build_optimizer(model, config.optim)

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> DataProto | None:
        """``values`` float32 [B, T] on the last pipeline stage (None on the others: not collected), forward only in
        micro-batches of ``critic.forward_micro_batch_size``."""
        from megatron.core import parallel_state

        self.model.eval()
        collected: list[torch.Tensor] = []

        def keep(index: int, values: torch.Tensor):
            collected.append(values)
            return values.sum() * 0.0, {}

        micros = data.split(self.config.forward_micro_batch_size)
        run_schedule(self.model, micros, keep, forward_only=True, head=response_values)
        if not parallel_state.is_pipeline_last_stage():
            return None
        return DataProto.from_dict({"values": torch.cat(collected).float()})

    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Clipped value-loss update on this data-parallel rank's rows. Returns ``critic/vf_loss``,
        ``critic/vf_clipfrac``, ``critic/vpred_mean`` (last stage), ``critic/grad_norm``, ``critic/lr``."""
        cfg = self.config
        data = data.select(batch_keys=UPDATE_KEYS)
        seed = (self.seed, int(data.meta_info.get("global_steps", 0)), 1)
        self.model.train()
        log = MetricLog()
        for mini in mini_batches(data, self.mini_batch_size, cfg.ppo_epochs, cfg.shuffle, seed):
            micros = mini.split(cfg.ppo_micro_batch_size)
            scales = micro_batch_weights(micros, cfg.loss_agg_mode, group=self.dp_group)

            def loss_of(index: int, vpreds: torch.Tensor, micros=micros, scales=scales):
                batch = micros[index].batch
                vf_loss, vf_clipfrac = compute_value_loss(
                    vpreds=vpreds,
                    values=batch["values"],
                    returns=batch["returns"],
                    response_mask=batch["response_mask"],
                    cliprange_value=cfg.cliprange_value,
                    loss_agg_mode=cfg.loss_agg_mode,
                )
                log.add(
                    vf_loss=vf_loss,
                    vf_clipfrac=vf_clipfrac,
                    vpred_mean=masked_mean(vpreds.detach(), batch["response_mask"]),
                )
                # the schedule divides each micro-batch's loss by their number: undo it, then weigh
                return vf_loss * scales[index] * len(micros), {}

            run_schedule(self.model, micros, loss_of, forward_only=False, head=response_values)
            log.add(**optimizer_step(self.model, self.optimizer, self.lr_scheduler, self.dp_group, cfg.optim.grad_clip))
        return log.mean("critic")
