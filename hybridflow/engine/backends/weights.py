"""The weight sources of the Hugging Face backends (`hybridflow.engine.extensions.WeightSource`): where a rollout
reads the actor's current weights under ``ddp`` (the model itself) and ``fsdp`` (its layers' full weights gathered for
the duration). Megatron's is the 3D-HybridEngine (`hybridflow.engine.backends.hybrid_actor.HybridActorRollout`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class ModelWeights:
    """The `WeightSource` of a model that holds its full weights (``ddp``, a single process): the model itself."""

    def __init__(self, model: torch.nn.Module, lora=None):
        self.model = model
        self.generation_config = model.generation_config
        self.lora = lora  # the model's LoRA adapter (`hybridflow.engine.backends.lora.LoraAdapter`), or None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextlib.contextmanager
    def generation_model(self) -> Iterator[torch.nn.Module]:
        yield self.model


class GatheredWeights(ModelWeights):
    """The `WeightSource` of an FSDP-sharded model (``fsdp``): every layer's full weights are all-gathered for the
    duration of `generation_model` (`hybridflow.engine.backends.fsdp.gathered`), and the shards own the memory after
    it."""

    @contextlib.contextmanager
    def generation_model(self) -> Iterator[torch.nn.Module]:
        from hybridflow.engine.backends.fsdp import gathered

        with gathered(self.model):
            yield self.model
