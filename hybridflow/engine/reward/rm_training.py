"""Reward-model training: the Bradley-Terry update on preference pairs, run by the ranks of a worker group.

The loss of a pair is ``-log sigmoid(r(chosen) - r(rejected))`` (Ouyang et al. 2022, "Training language models to
follow instructions with human feedback", eq. 1; Bradley and Terry 1952), averaged over the step's pairs; r is the
model's output at the last real token of the rendered text (`hybridflow.engine.reward.reward_model.last_token_scores`,
the
same position scoring reads). AdamW with the ``optim`` section's warm-up and gradient clipping (the actor's
optimizer, `hybridflow.engine.backends.training.build_optimizer`).

Data parallelism: ``ddp`` over the group's ranks; each rank takes an equal share of a step's pairs, backpropagates
``share_loss x pairs_in_micro_batch / pairs_on_rank`` per micro-batch, and DDP's gradient average over the ranks
gives the gradient of the whole step's mean loss, as one rank would compute it.

This module never imports Prefect or submitit; ``hybridflow.flows.rm`` drives it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridflow.engine.backends.training import build_optimizer, data_parallel, optimizer_step, sync_gradients
from hybridflow.engine.checkpoint import load_role, save_role
from hybridflow.engine.config import RMTrainingConfig
from hybridflow.engine.embedded_models import resolve_model_path
from hybridflow.engine.models import pick_device
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.reward.reward_model import last_token_scores
from hybridflow.engine.transfer import Dispatch, register


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Mean over pairs of ``-log sigmoid(chosen - rejected)`` (Ouyang et al. 2022, eq. 1): float [N] scores in, a
    scalar out (differentiable)."""
    return -torch.nn.functional.logsigmoid(chosen.float() - rejected.float()).mean()


def load_trainable_reward_model(path: str | Path, seed: int) -> tuple[Any, Any]:
    """``(model, tokenizer)``: a one-label ``AutoModelForSequenceClassification`` in fp32 from `path`, in train mode.

    A causal LM folder (``*ForCausalLM``) keeps its decoder and gets a new ``score`` head, initialised from `seed`
    (the same head on every rank and on every run with that seed); a reward model folder continues as it is. The pad
    token falls back to EOS.

    Raises:
        ValueError: the folder's model has no ``score`` head over a decoder (naming ``model.path``).
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    if not hasattr(model, "score"):
        raise ValueError(
            f"model.path={path}: {type(model).__name__} has no 'score' head over a decoder; reward models are "
            "trained from decoder-only models (Llama, Qwen, Mistral, SmolLM2, ...)"
        )
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.train(), tokenizer


class _TokenScores(torch.nn.Module):
    """The classifier's last-token score as a module of its own, so that DDP's forward (which arms its gradient
    all-reduce) runs the decoder and the head."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return last_token_scores(self.model, input_ids, attention_mask)


class RewardModelTrainer:
    """One rank of a reward-model training group (worker class of ``hf rm train``).

    Args:
        rank, world_size, data_dir: set by the worker group.
        config: the run's `RMTrainingConfig` as a dict (validated again here).
        roles: ``["reward_model"]``, its one role (as the flows' groups are launched with roles).

    Raises:
        ValueError: another role.
    """

    def __init__(
        self, rank: int, world_size: int, data_dir: str, config: dict[str, Any], roles: list[str] | None = None
    ):
        if roles not in (None, ["reward_model"]):
            raise ValueError(f"a reward-model training rank hosts the role reward_model only, not {roles}")
        self.rank, self.world_size, self.data_dir = rank, world_size, data_dir
        self.config = RMTrainingConfig.model_validate(config)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Load the model (a new score head from ``trainer.seed`` on a causal LM), wrap it for data parallelism,
        build the optimizer. Returns its parameter count."""
        cfg = self.config
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        device = pick_device(cfg.trainer.device)
        self.model, self.tokenizer = load_trainable_reward_model(resolve_model_path(cfg.model.path), cfg.trainer.seed)
        self.model.to(device)
        self.scorer = _TokenScores(self.model)
        self.train_module, _ = data_parallel(self.scorer, "ddp")  # the scorer itself on one rank
        self.optimizer, self.lr_scheduler = build_optimizer(self.model, cfg.optim)
        return {"reward_model_params": sum(p.numel() for p in self.model.parameters())}

    def _scores(self, module: torch.nn.Module, micro: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen and rejected scores [m] of a micro-batch of pairs, in one forward of 2m sequences."""
        b = micro.batch
        input_ids = torch.cat([b["chosen_input_ids"], b["rejected_input_ids"]])
        attention_mask = torch.cat([b["chosen_attention_mask"], b["rejected_attention_mask"]])
        scores = module(input_ids, attention_mask).float()
        return scores[: len(micro)], scores[len(micro) :]

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_reward_model(self, data: DataProto) -> dict[str, float]:
        """One optimizer step on this rank's share of a step's pairs
        (`hybridflow.engine.reward.preference.PAIR_TENSORS`).

        Returns:
            ``rm/loss``, ``rm/acc`` (chosen scored higher), ``rm/margin``, ``rm/chosen_score``,
            ``rm/rejected_score`` over this rank's pairs (the flow averages the ranks' equal shares), and
            ``rm/grad_norm`` (before clipping), ``rm/lr``.

        Raises:
            NonFiniteError: the gradient norm is NaN or infinite (nothing stepped).
        """
        sums = dict.fromkeys(("loss", "acc", "margin", "chosen_score", "rejected_score"), 0.0)
        micros = data.split(self.config.data.micro_batch_size)
        for i, micro in enumerate(micros):
            share = len(micro) / len(data)
            with sync_gradients(self.train_module, i == len(micros) - 1):
                chosen, rejected = self._scores(self.train_module, micro)
                loss = bradley_terry_loss(chosen, rejected)
                (loss * share).backward()
            diff = (chosen - rejected).detach()
            sums["loss"] += float(loss.detach()) * share
            sums["acc"] += float((diff > 0).float().mean()) * share
            sums["margin"] += float(diff.mean()) * share
            sums["chosen_score"] += float(chosen.detach().mean()) * share
            sums["rejected_score"] += float(rejected.detach().mean()) * share
        step = optimizer_step(self.model, self.optimizer, self.lr_scheduler, self.config.optim.grad_clip, "rm")
        return {**{f"rm/{k}": v for k, v in sums.items()}, "rm/grad_norm": step["grad_norm"], "rm/lr": step["lr"]}

    @register(Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_pair_scores(self, data: DataProto) -> DataProto:
        """``chosen_scores`` and ``rejected_scores`` float32 [B] of this rank's pairs (eval mode, no gradient)."""
        self.model.eval()
        try:  # the unwrapped scorer: evaluation runs no collective
            parts = [self._scores(self.scorer, m) for m in data.split(self.config.data.micro_batch_size)]
        finally:
            self.model.train()
        chosen, rejected = (torch.cat([p[k] for p in parts]).cpu() for k in (0, 1))
        return DataProto.from_dict({"chosen_scores": chosen, "rejected_scores": rejected})

    @register(Dispatch.RANK_ZERO)
    def save_checkpoint_part(self, staging: str) -> list[str]:
        """Write the model (Hugging Face layout, with its tokenizer: ``AutoModelForSequenceClassification`` and
        ``reward_model.path`` load it) and its optimizer state into a checkpoint's ``reward_model/``. The replicas
        are identical: rank 0 writes."""
        if self.rank != 0:
            return []
        save_role(staging, "reward_model", self.model, self.optimizer, self.lr_scheduler, self.tokenizer)
        return ["reward_model"]

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore weights, optimizer and scheduler states from a checkpoint's ``reward_model/`` on every rank."""
        load_role(path, "reward_model", self.model, self.optimizer, self.lr_scheduler)
