"""`PolicyRank`: what every rank of a one-group run that trains a policy shares (``hf sft train``, ``hf dpo
train``): its config, its one role (``actor``: the policy an RL run starts from), the policy's loading (with
``model.lora_rank`` > 0 a PEFT adapter on the frozen model, as an RL actor's), how the ranks hold it
(``model.strategy``: ddp replicas or fsdp shards) and its checkpoint part."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch

from hybridflow.engine.backends.fsdp import gathered
from hybridflow.engine.backends.training import data_parallel, sync_gradients
from hybridflow.engine.checkpoint import load_role
from hybridflow.engine.embedded_models import resolve_model_path
from hybridflow.engine.extensions import training_backend
from hybridflow.engine.models import load_model, load_tokenizer, pick_device
from hybridflow.engine.sharded_state import is_sharded
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

    def _data_parallel(self, forward: torch.nn.Module) -> None:
        """Set ``self.train_module``, the module a step trains through. ``model.strategy`` ddp: `forward` (a module
        that calls ``self.model``) wrapped in ``DistributedDataParallel``; fsdp: ``self.model`` sharded in place
        (FSDP2, `hybridflow.engine.backends.fsdp.shard_model`) and `forward` itself. Build the optimizer after this
        call: fsdp's parameters become DTensors. One rank: `forward`, unwrapped."""
        if self.config.model.strategy == "fsdp":
            data_parallel(self.model, "fsdp")
            self.train_module = forward
        else:
            self.train_module, _ = data_parallel(forward, "ddp")

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Context of one micro-batch's backward: the gradients are averaged over the ranks in a step's `last` one
        only (DDP's all-reduce, FSDP's reduce-scatter; `sync_gradients`)."""
        return sync_gradients(self.model if is_sharded(self.model) else self.train_module, last)

    def _whole_policy(self) -> contextlib.AbstractContextManager:
        """Context in which ``self.model`` is whole on this rank: fsdp's shards gathered once (`gathered`), so that
        evaluation's forwards run no collective whatever the number of rows a rank gets; nothing to do under ddp."""
        return gathered(self.model)

    @register(Dispatch.RANK_ZERO)
    def save_checkpoint_part(self, staging: str) -> list[str]:
        """Write the policy (Hugging Face layout, with its tokenizer: ``model.path`` of an RL run loads it; with LoRA
        its adapter in PEFT's: ``model.lora_adapter_path``) and its optimizer state into a checkpoint's ``actor/``.
        Every rank takes part: ddp's replicas are identical and rank 0 writes; fsdp's shards (weights and Adam
        states) are gathered to rank 0 first, which writes them in ddp's layout (`HFBackend.save`)."""
        return training_backend(self.config.model.strategy).save(staging, ROLE, self, self.tokenizer, self.rank)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore the policy's weights, optimizer and scheduler states from a checkpoint's ``actor/`` on every
        rank (fsdp: each rank its shards of them)."""
        load_role(path, ROLE, self._saved, self.optimizer, self.lr_scheduler)
