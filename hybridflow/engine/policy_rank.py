"""`PolicyRank`: what every rank of a one-group run that trains a policy shares (``hf sft train``, ``hf dpo
train``): its config, its one role (``actor``: the policy an RL run starts from), the policy's loading (with
``model.lora_rank`` > 0 a PEFT adapter on the frozen model, as an RL actor's) and its checkpoint part."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from hybridflow.engine.checkpoint import load_role, save_role
from hybridflow.engine.embedded_models import resolve_model_path
from hybridflow.engine.models import load_model, load_tokenizer, pick_device
from hybridflow.engine.transfer import Dispatch, register

ROLE = "actor"
"""The checkpoint folder of the policy: an RL run starts from it (``model.path``)."""


class PolicyRank:
    """One rank of a group training a policy; a subclass names its config class (`CONFIG`) and adds its update.

    Args:
        rank, world_size, data_dir: set by the worker group.
        config: the run's config as a dict (validated again here, as `CONFIG`).
        roles: ``["actor"]``, its one role.

    Raises:
        ValueError: another role.
    """

    CONFIG: ClassVar[type]

    def __init__(
        self, rank: int, world_size: int, data_dir: str, config: dict[str, Any], roles: list[str] | None = None
    ):
        if roles not in (None, [ROLE]):
            raise ValueError(f"a {type(self).__name__} rank hosts the role {ROLE} only, not {roles}")
        self.rank, self.world_size, self.data_dir = rank, world_size, data_dir
        self.config = self.CONFIG.model_validate(config)
        self.lora = None  # the adapter (`hybridflow.engine.backends.lora.LoraAdapter`) with model.lora_rank > 0

    def _load_policy(self) -> torch.device:
        """Set ``trainer.num_threads`` and the seed, load ``model.path`` as the trainable policy (fp32 weights:
        ``self.model``, ``self.tokenizer``; with ``model.lora_rank`` > 0 its adapter ``self.lora``, the only
        weights with gradients, seeded by ``trainer.seed`` alike on every rank); returns its device."""
        cfg = self.config
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        device = pick_device(cfg.trainer.device)
        path = resolve_model_path(cfg.model.path)
        torch.manual_seed(cfg.trainer.seed)
        self.model = load_model(path, torch.float32, device, trainable=True)
        self.tokenizer = load_tokenizer(path)
        if cfg.model.lora:  # before any data-parallel wrapping: only the adapter trains
            from hybridflow.engine.backends.lora import LoraAdapter

            self.lora = LoraAdapter(self.model, cfg.model, cfg.trainer.seed)
        return device

    def _parameter_counts(self) -> dict[str, int]:
        """``actor_params`` (the policy's elements, an adapter's included) and, with LoRA,
        ``actor_trainable_params`` (the adapter's): the run record's."""
        counts = {"actor_params": sum(p.numel() for p in self.model.parameters())}
        if self.lora is not None:
            counts["actor_trainable_params"] = self.lora.trainable_parameters()
        return counts

    @property
    def _saved(self):
        """What a checkpoint holds of the policy: the adapter alone (PEFT's layout) with LoRA, else the model."""
        return self.lora if self.lora is not None else self.model

    @register(Dispatch.RANK_ZERO)
    def save_checkpoint_part(self, staging: str) -> list[str]:
        """Write the policy (Hugging Face layout, with its tokenizer: ``model.path`` of an RL run loads it; with LoRA
        its adapter in PEFT's: ``model.lora_adapter_path``) and its optimizer state into a checkpoint's ``actor/``.
        The replicas are identical: rank 0 writes."""
        if self.rank != 0:
            return []
        save_role(staging, ROLE, self._saved, self.optimizer, self.lr_scheduler, self.tokenizer)
        return [ROLE]

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore the policy's weights, optimizer and scheduler states from a checkpoint's ``actor/`` on every
        rank."""
        load_role(path, ROLE, self._saved, self.optimizer, self.lr_scheduler)
