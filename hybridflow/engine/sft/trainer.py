"""Supervised fine-tuning on the ranks of a worker group (worker class of ``hf sft train``).

The loss is the token-mean cross-entropy of the tokens whose ``loss_mask`` is 1 (the assistant turns), over the
whole step's tokens: each micro-batch's mean is weighted by its share of the step's tokens, counted over every rank
(`hybridflow.engine.backends.training.micro_batch_weights`), so every token weighs the same however the step is
split. AdamW with the ``optim`` section's warm-up and clipping (the actor's optimizer); ``model.strategy`` ddp
(replicas) or fsdp (shards) over the ranks.

This module never imports Prefect or submitit; ``hybridflow.flows.sft`` drives it.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.engine.backends.training import build_optimizer, micro_batch_weights, optimizer_step
from hybridflow.engine.config import SFTTrainingConfig
from hybridflow.engine.models import autocast, pick_dtype
from hybridflow.engine.policy_rank import PolicyRank
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.torch_ops import logprobs_from_logits
from hybridflow.engine.transfer import Dispatch, register


class _TokenNLL(torch.nn.Module):
    """Per-token negative log-likelihood of a batch, float32 [b, L] (0 at position 0 and where ``loss_mask`` is 0),
    as a module of its own so that DDP's forward arms its gradient all-reduce."""

    def __init__(self, model: torch.nn.Module, compute_dtype: torch.dtype | None):
        super().__init__()
        self.model, self.compute_dtype = model, compute_dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        with autocast(input_ids.device, self.compute_dtype):
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        nll = -logprobs_from_logits(logits[:, :-1].float(), input_ids[:, 1:])  # token t from the positions before it
        return torch.nn.functional.pad(nll * loss_mask[:, 1:], (1, 0))


class SFTTrainer(PolicyRank):
    """One rank of a supervised fine-tuning group (`PolicyRank`: its config an `SFTTrainingConfig`)."""

    CONFIG = SFTTrainingConfig

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Load ``model.path`` (fp32 weights, ``model.dtype`` compute), wrap or shard it over the ranks
        (``model.strategy``), build the optimizer. Returns its parameter count."""
        device = self._load_policy()
        self.nll = _TokenNLL(self.model, pick_dtype(self.config.model.dtype, device))
        self._data_parallel(self.nll)
        self.optimizer, self.lr_scheduler = build_optimizer(self.model, self.config.optim)
        return self._parameter_counts()

    def _micro_tensors(self, micro: DataProto) -> tuple[torch.Tensor, ...]:
        device = next(self.model.parameters()).device
        return tuple(micro.batch[k].to(device) for k in ("input_ids", "attention_mask", "loss_mask"))

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_sft(self, data: DataProto) -> dict[str, float]:
        """One optimizer step on this rank's share of a step's conversations (``input_ids``, ``attention_mask``,
        ``loss_mask`` int64 [b, L]).

        Returns:
            ``train/loss`` (token-mean over this rank's learned tokens), ``train/tokens`` (their count),
            ``train/grad_norm`` (before clipping), ``train/lr``.

        Raises:
            NonFiniteError: the gradient norm is NaN or infinite (nothing stepped).
        """
        micros = data.split(self.config.data.micro_batch_size)
        weights = micro_batch_weights(micros, "token-mean", mask_key="loss_mask")
        total, tokens = 0.0, 0.0
        for i, (micro, weight) in enumerate(zip(micros, weights, strict=True)):
            input_ids, attention_mask, loss_mask = self._micro_tensors(micro)
            count = float(loss_mask[:, 1:].sum())
            with self._gradient_sync(i == len(micros) - 1):
                nll = self.train_module(input_ids, attention_mask, loss_mask)
                (nll.sum() / max(count, 1.0) * weight).backward()
            total, tokens = total + float(nll.detach().sum()), tokens + count
        step = optimizer_step(self.model, self.optimizer, self.lr_scheduler, self.config.optim.grad_clip, "sft")
        return {
            "train/loss": total / max(tokens, 1.0),
            "train/tokens": tokens,
            "train/grad_norm": step["grad_norm"],
            "train/lr": step["lr"],
        }

    @register(Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_nll(self, data: DataProto) -> DataProto:
        """``nll_sum`` and ``tokens`` float32 [B]: each conversation's summed loss over its learned tokens, and their
        count (eval mode, no gradient), for the held-out token-mean loss."""
        self.model.eval()
        sums, counts = [], []
        try:  # the unwrapped (or gathered) module: evaluation runs no collective
            with self._whole_policy():
                for micro in data.split(self.config.data.micro_batch_size):
                    input_ids, attention_mask, loss_mask = self._micro_tensors(micro)
                    sums.append(self.nll(input_ids, attention_mask, loss_mask).sum(-1).cpu())
                    counts.append(loss_mask[:, 1:].sum(-1).float().cpu())
        finally:
            self.model.train()
        return DataProto.from_dict({"nll_sum": torch.cat(sums), "tokens": torch.cat(counts)})
