"""The critic: a value model V(s_t) per response token, trained with the clipped value loss of PPO."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.engine.algorithms.losses import compute_value_loss
from hybridflow.engine.backends.training import (
    MetricLog,
    build_optimizer,
    data_parallel,
    dp_world,
    optimizer_step,
    sync_gradients,
    update_steps,
)
from hybridflow.engine.config import CriticConfig
from hybridflow.engine.models import compute_values, response_values
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.torch_ops import masked_mean

UPDATE_KEYS = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]
VALUE_COLUMNS = ("values", "returns")
"""The critic's value column and regression target; Safe-RLHF's cost critic has ``cost_values``/``cost_returns``."""


def value_loss(
    vpreds: torch.Tensor, batch, config: CriticConfig, log: MetricLog, columns: tuple[str, str] = VALUE_COLUMNS
) -> torch.Tensor:
    """One micro-batch's clipped value loss (`compute_value_loss` with ``critic.cliprange_value`` and
    ``critic.loss_agg_mode``; `batch` has the `columns` (old values, returns) and ``response_mask`` [b, T]), logging
    ``vf_loss``, ``vf_clipfrac`` and ``vpred_mean`` into `log`. `vpreds`: float32 [b, T]. Returns the scalar loss."""
    vf_loss, vf_clipfrac = compute_value_loss(
        vpreds=vpreds,
        values=batch[columns[0]],
        returns=batch[columns[1]],
        response_mask=batch["response_mask"],
        cliprange_value=config.cliprange_value,
        loss_agg_mode=config.loss_agg_mode,
    )
    log.add(vf_loss=vf_loss, vf_clipfrac=vf_clipfrac, vpred_mean=masked_mean(vpreds.detach(), batch["response_mask"]))
    return vf_loss


class Critic:
    """PPO critic around a token-classification model with one label (see `models.load_critic`).

    Args:
        model: the value model (trained in place).
        config: the ``critic`` config section.
        rollout_n: responses per prompt, to turn ``ppo_mini_batch_size`` (prompts) into sequences.
        seed: seeds the mini-batch shuffling (with ``meta_info["global_steps"]``).
        compute_dtype: dtype of the forwards (``torch.bfloat16``: under autocast, fp32 weights); None: no autocast.
        name: the metrics' prefix (``critic``; Safe-RLHF's cost critic: ``cost_critic``).
        columns: the batch columns of its values and returns (`VALUE_COLUMNS`; the cost critic:
            ``("cost_values", "cost_returns")``).

    Under torch.distributed the model is wrapped in DDP here (a collective, see `training`);
    ``ppo_mini_batch_size x rollout_n`` must be a multiple of the number of ranks.
    """

    def __init__(
        self,
        model,
        config: CriticConfig,
        rollout_n: int,
        seed: int = 0,
        compute_dtype: torch.dtype | None = None,
        name: str = "critic",
        columns: tuple[str, str] = VALUE_COLUMNS,
    ):
        self.model = model
        self.name, self.columns = name, columns
        self.config = config
        self.seed = seed
        self.compute_dtype = compute_dtype
        # DDP or FSDP2 across the group's ranks (see `training`), else `model`; FSDP shards the parameters, so the
        # optimizer is built on them afterwards
        self.train_module, self.dp_group = data_parallel(model, config.strategy, getattr(config, "tp", 1))
        dp = dist.get_world_size(self.dp_group) if self.dp_group is not None else dp_world()[1]
        # sequences per rank per optimizer step: the global mini-batch is split over the data-parallel ranks
        self.mini_batch_size = config.ppo_mini_batch_size * rollout_n // dp
        self.optimizer, self.lr_scheduler = build_optimizer(model, config.optim)

    def compute_values(self, data: DataProto) -> DataProto:
        """Returns DataProto with ``values`` (the first of `columns`) float32 [B, T] for the responses in
        `data`."""
        self.model.eval()
        cfg = self.config
        values = compute_values(
            self.model, data, cfg.forward_micro_batch_size, self.compute_dtype, share_prompts=cfg.shares_prompts
        )
        return DataProto.from_dict({self.columns[0]: values})

    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Clipped value-loss update (PPO; ``critic.cliprange_value``) toward ``returns`` (the second of
        `columns`).

        One optimizer step per mini-batch, its loss accumulated over micro-batches weighted by
        `training.micro_batch_weights` (token-mean: by response tokens).

        Returns:
            ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/grad_norm``, ``critic/lr``
            (``cost_critic/...`` for the cost critic).
        """
        cfg = self.config
        data = data.select(batch_keys=[*UPDATE_KEYS, *self.columns])
        self.model.train()
        log = MetricLog()
        for micros, weights in update_steps(
            data, self.mini_batch_size, cfg, self.seed, 1, self.dp_group, self.lr_scheduler
        ):
            for i, (micro, loss_scale) in enumerate(zip(micros, weights, strict=True)):
                batch = micro.batch
                with sync_gradients(self.train_module, sync=i == len(micros) - 1):
                    vpreds = response_values(self.train_module, micro, self.compute_dtype, cfg.shares_prompts)
                    (value_loss(vpreds, batch, cfg, log, self.columns) * loss_scale).backward()
            clip = cfg.optim.grad_clip
            log.add(**optimizer_step(self.model, self.optimizer, self.lr_scheduler, clip, self.name, log))
        return log.mean(self.name)
