"""DPO on the ranks of a worker group (worker class of ``hf dpo train``).

Each rank holds the policy (fp32 weights, ``model.dtype`` compute, trained; with ``model.lora_rank`` > 0 a PEFT
adapter on it, the only weights trained) and the frozen reference (the same folder, or ``dpo.ref_model_path``; eval
mode, no gradient; with LoRA and no ``dpo.ref_model_path``, the policy with its adapter disabled). A step's pairs
are split evenly over the ranks; each rank computes, micro-batch by micro-batch, the log-probability of every chosen
and rejected response under both models (one forward of 2m sequences each), the per-pair loss
(`hybridflow.engine.dpo.loss.dpo_loss`) and backpropagates ``mean loss x pairs_in_micro_batch / pairs_on_rank``;
the gradient average over the ranks (``model.strategy``: DDP's all-reduce, or FSDP's reduce-scatter into each rank's
shard) gives the gradient of the whole step's mean loss. AdamW with the ``optim`` section's warm-up and clipping
(the actor's optimizer). The reference is a whole frozen copy on every rank, as an RL run's ref; with
``dpo.precompute_ref_log_probs`` it scores every pair once before the first step (`compute_ref_log_probs`) and is
freed (`free_reference`), and the batches carry its log-probs (`hybridflow.engine.dpo.pairs.REF_KEYS`).

This module never imports Prefect or submitit; ``hybridflow.flows.dpo`` drives it.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch

from hybridflow.engine.backends.training import build_optimizer, optimizer_step
from hybridflow.engine.config.dpo import DPOTrainingConfig
from hybridflow.engine.dpo.loss import dpo_loss, reward_metrics, sequence_log_probs
from hybridflow.engine.dpo.pairs import REF_KEYS, SIDES
from hybridflow.engine.embedded_models import resolve_model_path
from hybridflow.engine.models import autocast, load_model, pick_dtype
from hybridflow.engine.policy_rank import PolicyRank
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.torch_ops import logprobs_from_logits
from hybridflow.engine.transfer import Dispatch, register


class _SequenceLogProbs(torch.nn.Module):
    """Each response's summed and per-token mean log-probability, float32 [N] each (`sequence_log_probs`), as a
    module of its own so that DDP's forward arms its gradient all-reduce."""

    def __init__(self, model: torch.nn.Module, compute_dtype: torch.dtype | None):
        super().__init__()
        self.model, self.compute_dtype = model, compute_dtype

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(input_ids.device, self.compute_dtype):
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        tokens = logprobs_from_logits(logits[:, :-1].float(), input_ids[:, 1:])  # token t given those before it
        return sequence_log_probs(torch.nn.functional.pad(tokens, (1, 0)), loss_mask)


class DPOTrainer(PolicyRank):
    """One rank of a DPO group (`PolicyRank`: its config a `DPOTrainingConfig`); the reference is frozen, never
    checkpointed (its folder is read again on a resume)."""

    CONFIG = DPOTrainingConfig

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Load the policy (trainable; with LoRA its adapter only) and the reference (frozen: its folder, or with LoRA
        and no ``dpo.ref_model_path`` the policy with its adapter disabled, no second copy), wrap or shard the policy
        over the ranks (``model.strategy``), build the optimizer. Returns the parameter counts
        (`PolicyRank._parameter_counts`)."""
        cfg = self.config
        device = self._load_policy()
        compute = pick_dtype(cfg.model.dtype, device)
        self.policy = _SequenceLogProbs(self.model, compute)
        if self.lora is not None and cfg.dpo.ref_model_path is None:  # the base model, exactly, as in RL
            self.reference = None
        else:
            reference_path = resolve_model_path(cfg.dpo.ref_model_path or cfg.model.path)
            reference = load_model(reference_path, torch.float32, device, trainable=False)
            self.reference = _SequenceLogProbs(reference.eval().requires_grad_(False), compute)
        self.reference_freed = False
        self._data_parallel(self.policy)
        self.optimizer, self.lr_scheduler = build_optimizer(self.model, cfg.optim)
        return self._parameter_counts()

    def _log_probs(self, module: torch.nn.Module, micro: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen and rejected responses' log-probabilities [m] under `module` (sums; per-token means for
        ``ipo``), in one forward of the 2m sequences."""
        device = next(self.model.parameters()).device
        b = micro.batch
        sequences = [
            torch.cat([b[f"{side}_{key}"] for side in SIDES]).to(device)
            for key in ("input_ids", "attention_mask", "loss_mask")
        ]
        summed, mean = module(*sequences)
        both = mean if self.config.dpo.loss_type == "ipo" else summed
        return both[: len(micro)], both[len(micro) :]

    @torch.no_grad()
    def _reference_log_probs(self, micro: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen and rejected responses' log-probabilities [m] under the reference: the batch's precomputed
        `REF_KEYS` where it carries them, else a forward of the reference (with LoRA: the policy, adapter off).

        Raises:
            RuntimeError: the reference was freed (`free_reference`) and the batch carries no precomputed values.
        """
        if REF_KEYS[0] in micro.keys:
            device = next(self.model.parameters()).device
            return micro.batch[REF_KEYS[0]].to(device), micro.batch[REF_KEYS[1]].to(device)
        if self.reference_freed:
            raise RuntimeError(
                "the reference was freed once its log-probs were precomputed (dpo.precompute_ref_log_probs), and "
                f"this batch carries no {REF_KEYS}: collate its rows from the precomputed sets"
            )
        if self.reference is None:  # LoRA: the policy with its adapter off
            with self.lora.disabled():
                return self._log_probs(self.policy, micro)
        return self._log_probs(self.reference, micro)

    def _pair_losses(self, micro: DataProto, module: torch.nn.Module):
        dpo = self.config.dpo
        ref_chosen, ref_rejected = self._reference_log_probs(micro)
        chosen, rejected = self._log_probs(module, micro)
        out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, dpo.beta, dpo.loss_type, dpo.label_smoothing)
        return out, chosen.detach(), rejected.detach()

    @register(Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_ref_log_probs(self, data: DataProto) -> DataProto:
        """`REF_KEYS`, float32 [B]: this rank's pairs' log-probabilities under the reference (sums; per-token means
        for ``ipo``), micro-batch by micro-batch (``dpo.precompute_ref_log_probs``). With LoRA the reference is the
        policy, gathered whole first (as in `compute_dpo_scores`: no collective whatever a rank's share)."""
        whole = self._whole_policy() if self.reference is None else contextlib.nullcontext()
        with whole:
            parts = [self._reference_log_probs(micro) for micro in data.split(self.config.data.micro_batch_size)]
        return DataProto.from_dict({key: torch.cat([p[k] for p in parts]).cpu() for k, key in enumerate(REF_KEYS)})

    @register(Dispatch.ONE_TO_ALL)
    def free_reference(self) -> int:
        """Drop the reference once every pair's log-probs are precomputed; from now on every batch must carry
        `REF_KEYS`. Returns the parameters freed (0 with LoRA and no ``dpo.ref_model_path``: no second copy)."""
        freed = 0 if self.reference is None else sum(p.numel() for p in self.reference.parameters())
        self.reference, self.reference_freed = None, True
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return freed

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_dpo(self, data: DataProto) -> dict[str, float]:
        """One optimizer step on this rank's share of a step's pairs (`hybridflow.engine.dpo.pairs.PAIR_KEYS`).

        Returns:
            over this rank's pairs (the flow averages the ranks' equal shares): ``train/loss``, TRL's
            ``train/rewards/{chosen,rejected,margins,accuracies}`` and ``train/logps/{chosen,rejected}``; and
            ``train/grad_norm`` (before clipping), ``train/lr``.

        Raises:
            NonFiniteError: the gradient norm is NaN or infinite (nothing stepped).
        """
        sums: dict[str, float] = {}
        micros = data.split(self.config.data.micro_batch_size)
        for i, micro in enumerate(micros):
            share = len(micro) / len(data)
            with self._gradient_sync(i == len(micros) - 1):
                out, chosen, rejected = self._pair_losses(micro, self.train_module)
                loss = out.losses.mean()
                (loss * share).backward()
            metrics = {
                "loss": float(loss.detach()),
                **reward_metrics(out.chosen_rewards, out.rejected_rewards),
                "logps/chosen": float(chosen.mean()),
                "logps/rejected": float(rejected.mean()),
            }
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value * share
        step = optimizer_step(self.model, self.optimizer, self.lr_scheduler, self.config.optim.grad_clip)
        return {
            **{f"train/{k}": v for k, v in sums.items()},
            "train/grad_norm": step["grad_norm"],
            "train/lr": step["lr"],
        }

    @register(Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_dpo_scores(self, data: DataProto) -> DataProto:
        """``loss``, ``chosen_rewards``, ``rejected_rewards``, ``chosen_logps`` and ``rejected_logps`` float32 [B] of
        this rank's pairs (eval mode, no gradient): the held-out loss, the implicit rewards' pairwise accuracy, and
        the policy's own preference (before training: the base model's)."""
        self.model.eval()
        parts = []
        try:  # the unwrapped (or gathered) policy: evaluation runs no collective
            with self._whole_policy():
                for micro in data.split(self.config.data.micro_batch_size):
                    out, chosen, rejected = self._pair_losses(micro, self.policy)
                    parts.append((out.losses, out.chosen_rewards, out.rejected_rewards, chosen, rejected))
        finally:
            self.model.train()
        keys = ("loss", "chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps")
        return DataProto.from_dict({key: torch.cat([p[k] for p in parts]).cpu() for k, key in enumerate(keys)})
