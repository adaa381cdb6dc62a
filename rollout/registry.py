"""The rollout extension point: the `Rollout` protocol, the `WeightSource` it generates from, and the registry of
rollouts by ``rollout.name``.

A rollout samples responses with the actor's current weights. It takes them from a `WeightSource`, which the
actor's training engine provides:

- ``ddp``: the actor's own model (`ModelWeights`), no copy;
- ``fsdp``: the actor's model with every layer's full weights gathered for the duration (`GatheredWeights`);
- ``megatron``: the 3D-HybridEngine (`hybridflow.backends.hybrid_actor.HybridActorRollout`), which reshards the
  training shards into the generation layout (HybridFlow paper, section 5) and back.

A rollout that keeps weights of its own (vLLM: the engine's copy) loads them from the source in `Rollout.
update_weights`, after every actor update; one that generates with the source's model directly (``hf``) has
nothing to load. The controller asks the registry (`rollout_spec(name).syncs_weights`), never the rollout's name,
whether an iteration needs the ``weight_sync`` stage.

Register a new rollout with `register_rollout`; ``rollout.name`` accepts every registered name (and ``auto``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # this module is imported by the config: no torch at import
    import torch

    from hybridflow.core.config import HybridFlowConfig
    from hybridflow.core.protocol import DataProto


class WeightSource(Protocol):
    """Where a rollout reads the actor's current weights.

    Attributes:
        generation_config: the model's ``transformers.GenerationConfig`` (eos ids, options to refuse).
        device: the device the weights live on.
    """

    generation_config: object
    device: torch.device

    def generation_model(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """A context yielding a Hugging Face causal LM with the actor's current weights in the generation layout;
        the memory it takes is given back on exit."""
        ...


class Rollout(Protocol):
    """What the worker and the single-process trainer call on a rollout."""

    def generate_sequences(
        self, prompts: DataProto, n: int | None = None, temperature: float | None = None, stream: str = "train"
    ) -> DataProto:
        """`prompts` [B] -> B*n sampled sequences (`hybridflow.rollout.hf` documents the layout and seeding)."""
        ...

    def update_weights(self) -> dict[str, float]:
        """Load the source's current weights into the rollout's own copy; returns its check's metrics ({} when the
        rollout generates from the source directly)."""
        ...

    def sleep(self) -> None:
        """Give the rollout's memory (KV cache) back while the models train."""
        ...

    def wake(self) -> None:
        """Take the memory `sleep` gave back, before generating."""
        ...


@contextlib.contextmanager
def awake(rollout: Rollout) -> Iterator[Rollout]:
    """`rollout` woken for the duration of the context and put back to sleep after it."""
    rollout.wake()
    try:
        yield rollout
    finally:
        rollout.sleep()


class ModelWeights:
    """The `WeightSource` of a model that holds its full weights (``ddp``, a single process): the model itself."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.generation_config = model.generation_config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextlib.contextmanager
    def generation_model(self) -> Iterator[torch.nn.Module]:
        yield self.model


class GatheredWeights(ModelWeights):
    """The `WeightSource` of an FSDP-sharded model (``fsdp``): every layer's full weights are all-gathered for the
    duration of `generation_model` (`hybridflow.backends.fsdp.gathered`), and the shards own the memory after it."""

    @contextlib.contextmanager
    def generation_model(self) -> Iterator[torch.nn.Module]:
        from hybridflow.backends.fsdp import gathered

        with gathered(self.model):
            yield self.model


@dataclass(frozen=True)
class RolloutSpec:
    """A registered rollout.

    Attributes:
        build: ``build(cfg, weights, tokenizer, model_path, compute_dtype) -> Rollout``.
        syncs_weights: the rollout keeps weights of its own, loaded by `Rollout.update_weights` after each update.
        reports_log_probs: it returns ``rollout_log_probs`` (needed by ``actor.tis_cap``).
        tensor_parallel: it can generate tensor-parallel over ``rollout.gen_tp`` ranks of the 3D-HybridEngine.
    """

    build: Callable[..., Rollout]
    syncs_weights: bool
    reports_log_probs: bool
    tensor_parallel: bool


_ROLLOUTS: dict[str, RolloutSpec] = {}


def register_rollout(
    name: str, *, syncs_weights: bool, reports_log_probs: bool = False, tensor_parallel: bool = False
) -> Callable[[Callable[..., Rollout]], Callable[..., Rollout]]:
    """Register a rollout builder under ``rollout.name: <name>`` (see `RolloutSpec` for the flags).

    Raises:
        ValueError: `name` is registered already.
    """

    def decorate(build: Callable[..., Rollout]) -> Callable[..., Rollout]:
        if name in _ROLLOUTS:
            raise ValueError(f"rollout {name!r} is registered already")
        _ROLLOUTS[name] = RolloutSpec(build, syncs_weights, reports_log_probs, tensor_parallel)
        return build

    return decorate


def rollout_names() -> list[str]:
    """The registered ``rollout.name`` values, sorted."""
    return sorted(_ROLLOUTS)


def rollout_spec(name: str) -> RolloutSpec:
    """The registered rollout `name`.

    Raises:
        ValueError: `name` is not registered (names ``rollout.name`` and the registered names).
    """
    if name not in _ROLLOUTS:
        raise ValueError(f"unknown rollout.name {name!r}; registered: {rollout_names()}")
    return _ROLLOUTS[name]


def build_rollout(
    cfg: HybridFlowConfig,
    weights: WeightSource,
    tokenizer,
    model_path: str | Path,
    compute_dtype: torch.dtype | None = None,
) -> Rollout:
    """The rollout ``rollout.name`` names, generating from `weights`, seeded with ``trainer.seed``.

    Raises:
        ValueError: an unregistered ``rollout.name``; ImportError: its engine is not installed (message says how).
    """
    return rollout_spec(cfg.rollout.name).build(cfg, weights, tokenizer, model_path, compute_dtype)


@register_rollout("hf", syncs_weights=False, tensor_parallel=True)
def _hf_rollout(cfg: HybridFlowConfig, weights: WeightSource, tokenizer, model_path, compute_dtype) -> Rollout:
    from hybridflow.rollout.hf import HFRollout

    return HFRollout(weights, tokenizer, cfg.rollout, seed=cfg.trainer.seed, compute_dtype=compute_dtype)


@register_rollout("vllm", syncs_weights=True, reports_log_probs=True)
def _vllm_rollout(cfg: HybridFlowConfig, weights: WeightSource, tokenizer, model_path, compute_dtype) -> Rollout:
    from hybridflow.rollout.vllm import VLLMRollout

    return VLLMRollout(weights, tokenizer, str(model_path), cfg.rollout, cfg.data.max_prompt_length, cfg.trainer.seed)
