"""The extension points of the engine that the config names: rollouts (``rollout.name``) and training backends
(``actor.strategy``, ``critic.strategy``, ``reward_model.strategy``), with the interfaces they implement.

A registry entry holds a name, the flags the controller and the config read (does the rollout keep weights of its
own, may it run tensor-parallel, ...) and where the implementation lives: an object, or its import path
``"package.module:name"``, loaded the first time it is built or asked for its rules, as Python entry points are. So
this module and the config import no implementation, and an implementation may import the config: the engine's
imports run one way (``tests/test_layering.py``). The built-ins are registered at the bottom of this module:

- rollouts: ``hf`` (`hybridflow.engine.rollout.hf`: transformers ``generate`` on the weight source's model) and
  ``vllm`` (`hybridflow.engine.rollout.vllm`: an in-process vLLM engine, synced after every update);
- training backends: ``ddp``, ``fsdp`` and ``megatron`` (`hybridflow.engine.backends.engines`).

A rollout samples responses with the actor's current weights, which it reads from a `WeightSource` the actor's
backend provides (ddp: the model itself; fsdp: its gathered weights; megatron: the 3D-HybridEngine, HybridFlow paper
section 5). A rollout that keeps weights of its own (vLLM) loads them in `Rollout.update_weights` after every actor
update; the controller asks `rollout_spec(name).syncs_weights`, never the name, whether an iteration needs the
``weight_sync`` stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hybridflow.engine.imports import load_object

if TYPE_CHECKING:  # the config imports this module: no torch at import
    import torch

    from hybridflow.engine.protocol import DataProto


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
        """`prompts` [B] -> B*n sampled sequences (`hybridflow.engine.rollout.hf` documents the layout, seeding)."""
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


def _load(target: Any, key: str) -> Any:
    return load_object(target, key) if isinstance(target, str) else target


# ---------------------------------------------------------------------------------------------------- rollouts
@dataclass(frozen=True)
class RolloutSpec:
    """A registered rollout.

    Attributes:
        build: ``build(cfg, weights, tokenizer, model_path, compute_dtype) -> Rollout``, or its import path.
        syncs_weights: the rollout keeps weights of its own, loaded by `Rollout.update_weights` after each update.
        reports_log_probs: it returns ``rollout_log_probs`` (needed by ``algorithm.rollout_correction``; agent
            loops always do).
        tensor_parallel: it can generate tensor-parallel over ``rollout.gen_tp`` ranks of the 3D-HybridEngine.
        engine_tp: its engine splits whole weights over ``rollout.gen_tp`` consecutive ranks of the actor's pool
            itself (vLLM's SPMD mode), so any actor that lends whole weights (ddp, fsdp) can feed it.
    """

    build: Callable[..., Rollout] | str
    syncs_weights: bool
    reports_log_probs: bool = False
    tensor_parallel: bool = False
    engine_tp: bool = False


_ROLLOUTS: dict[str, RolloutSpec] = {}


def register_rollout(
    name: str,
    build: Callable[..., Rollout] | str | None = None,
    *,
    syncs_weights: bool,
    reports_log_probs: bool = False,
    tensor_parallel: bool = False,
    engine_tp: bool = False,
) -> Callable[..., Any]:
    """Register a rollout builder under ``rollout.name: <name>`` (see `RolloutSpec` for the flags): give `build`
    (a function or its ``"module:name"`` path), or use the call as a decorator of the builder.

    Raises:
        ValueError: `name` is registered already.
    """

    def add(target: Callable[..., Rollout] | str) -> Callable[..., Rollout] | str:
        if name in _ROLLOUTS:
            raise ValueError(f"rollout {name!r} is registered already")
        _ROLLOUTS[name] = RolloutSpec(target, syncs_weights, reports_log_probs, tensor_parallel, engine_tp)
        return target

    return add if build is None else add(build)


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
    cfg: Any,
    weights: WeightSource,
    tokenizer: Any,
    model_path: str | Path,
    compute_dtype: torch.dtype | None = None,
) -> Rollout:
    """The rollout ``rollout.name`` names, generating from `weights`, seeded with ``trainer.seed`` (`cfg`: the run's
    `hybridflow.engine.config.HybridFlowConfig`, which imports this module, so it is not named in the signature).

    With ``rollout.multi_turn.enable`` the rollout runs agent loops on that engine
    (`hybridflow.engine.agent.rollout.AgentLoopRollout`).

    Raises:
        ValueError: an unregistered ``rollout.name``; ImportError: its engine is not installed (message says how);
            the errors of `hybridflow.engine.agent.rollout.AgentLoopRollout` (tools, chat template).
    """
    build = _load(rollout_spec(cfg.rollout.name).build, "rollout.name")
    rollout = build(cfg, weights, tokenizer, model_path, compute_dtype)
    if cfg.rollout.multi_turn.enable:
        agent_rollout = load_object("hybridflow.engine.agent.rollout:AgentLoopRollout", "rollout.multi_turn.enable")
        rollout = agent_rollout(rollout, cfg, tokenizer)
    return rollout


def engine_tp(cfg: Any) -> int:
    """The tensor-parallel size of a rollout engine that splits the actor's whole weights itself (vLLM, `RolloutSpec.
    engine_tp`): beside a ddp or fsdp actor ``rollout.gen_tp`` where it differs from ``actor.tp`` (at ``actor.tp``
    generation runs in the training layout); beside a megatron actor ``rollout.gen_tp`` (default ``actor.tp``), the
    3D-HybridEngine then resharding to whole replicas (its t_g = 1) that feed the engine; in a rollout pool of its
    own ``rollout.gen_tp`` (default 1), over that pool's ranks. 1 otherwise."""
    rollout, actor = cfg.rollout, cfg.actor
    if rollout.name == "auto" or not rollout_spec(rollout.name).engine_tp:
        return 1
    if cfg.rollout_apart():  # engines of a pool of their own, fed whole published weights
        return rollout.gen_tp or 1
    if training_backend(actor.strategy).hf_model:
        return 1 if rollout.gen_tp in (None, actor.tp) else rollout.gen_tp
    return rollout.gen_tp or actor.tp


# ---------------------------------------------------------------------------------------------------- backends
_BACKENDS: dict[str, Any] = {}


def register_backend(name: str, backend: Any) -> None:
    """Register a training backend (a `hybridflow.engine.backends.engines.TrainingBackend`, or its ``"module:name"``
    path) under ``strategy: <name>``.

    Raises:
        ValueError: the name is registered already.
    """
    if name in _BACKENDS:
        raise ValueError(f"training backend {name!r} is registered already")
    _BACKENDS[name] = backend


def backend_names() -> list[str]:
    """The registered ``strategy`` values, in registration order."""
    return list(_BACKENDS)


def training_backend(name: str, key: str = "actor.strategy") -> Any:
    """The registered backend `name` (a `hybridflow.engine.backends.engines.TrainingBackend`), loaded on first use.

    Raises:
        ValueError: `name` is not registered (names `key` and the registered names).
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown {key} {name!r}; registered: {backend_names()}")
    backend = _BACKENDS[name] = _load(_BACKENDS[name], key)
    return backend


register_rollout(
    "hf", "hybridflow.engine.rollout.hf:build", syncs_weights=False, reports_log_probs=True, tensor_parallel=True
)
register_rollout(
    "vllm", "hybridflow.engine.rollout.vllm:build", syncs_weights=True, reports_log_probs=True, engine_tp=True
)
register_backend("ddp", "hybridflow.engine.backends.engines:DDP")
register_backend("fsdp", "hybridflow.engine.backends.engines:FSDP")
register_backend("megatron", "hybridflow.engine.backends.engines:MEGATRON")
