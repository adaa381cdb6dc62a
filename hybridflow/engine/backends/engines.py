"""The training engines (``actor.strategy`` / ``critic.strategy``, registered in `hybridflow.engine.extensions`).

A backend owns what differs between ways of training a model over a worker group's ranks:

- building the actor (with the `hybridflow.engine.extensions.WeightSource` its rollout generates from) and a critic;
- wrapping a Hugging Face model for data parallelism (`data_parallel`);
- writing and restoring a trained role in a checkpoint.

Here: ``ddp`` (a replica per rank, gradients all-reduced), ``fsdp`` (FSDP2 shards, optionally
tensor-parallel) and ``megatron`` (megatron-core tensor and pipeline parallel, generating through the
3D-HybridEngine). The worker calls the backend its config names and never branches on the name itself;
``actor.strategy`` and ``critic.strategy`` accept every registered name (`hybridflow.engine.extensions.backend_names`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.engine.extensions import engine_tp

if TYPE_CHECKING:  # no torch at import
    import torch
    import torch.distributed as dist

    from hybridflow.engine.config import HybridFlowConfig
    from hybridflow.engine.extensions import WeightSource


_VALUE_COLUMNS = ("values", "returns")


class TrainingBackend:
    """The interface of a training engine; `HFBackend` and `MegatronBackend` implement it.

    Attributes:
        name: its ``strategy`` value.
        hf_model: it trains a Hugging Face model in place (`data_parallel`); False: a model of its own.
        sharded: the model's weights are split over the ranks at rest.
        packs_rows: its forward packs a prompt's samples into rows that compute the prompt once
            (``actor.share_prompts``, `hybridflow.engine.packing`).
        hosted_by_actor: a critic of this backend lives in the actor's processes and parallel layout.
    """

    name: str
    hf_model: bool = True
    sharded: bool = False
    packs_rows: bool = True
    hosted_by_actor: bool = False

    def check_layout(self, cfg: HybridFlowConfig, world: int) -> None:
        """Refuse an actor layout (``actor.tp``/``pp``, ``rollout.gen_tp``/``gen_pp``) this backend cannot train or
        generate in, on an actor pool of `world` ranks.

        Raises:
            ValueError: naming the keys and the fix.
        """
        actor, rollout = cfg.actor, cfg.rollout
        _check_expert_parallel(cfg, world, megatron=False)
        if (actor.tp, actor.pp, _generation_tp(cfg) or 1, rollout.gen_pp) != (1, 1, 1, 1):
            raise ValueError(
                "actor.tp, actor.pp, rollout.gen_tp and rollout.gen_pp split the model for the 3D-HybridEngine and "
                f"need actor.strategy=megatron (or fsdp for actor.tp); got strategy {actor.strategy!r}"
            )

    def layout_record(self, cfg: HybridFlowConfig, world: int) -> dict[str, Any]:
        """How the actor is split over its pool's `world` ranks, for the run store (``placements.parallel``)."""
        tp = cfg.actor.tp
        record: dict[str, Any] = {"train": {"pp": 1, "tp": tp, "dp": world // tp}}
        if engine_tp(cfg) > 1:
            record["rollout_engine"] = {"tp": engine_tp(cfg), "replicas": world // engine_tp(cfg)}
        return record

    def mesh_coords(self, cfg: HybridFlowConfig, world: int, rank: int, mesh: str) -> tuple[int, int, bool]:
        """`rank`'s ``(data-parallel index, size, collect)`` on the actor's `mesh` (``train`` or ``generate``,
        `hybridflow.engine.transfer`) over a pool of `world` ranks: the 3D-HybridEngine's layouts
        (`hybridflow.engine.parallel_layout.HybridLayout.mesh_coords`), except that a rollout engine splitting whole
        weights itself (`engine_tp`) generates over blocks of ``rollout.gen_tp`` consecutive ranks (vLLM's
        tensor-parallel groups), whose first rank collects.

        Raises:
            ValueError: an unknown mesh, or `rank` outside the pool."""
        tp = engine_tp(cfg)
        if mesh == "generate" and tp > 1:
            return rank // tp, world // tp, rank % tp == 0
        return cfg.actor_layout(world).mesh_coords(rank, mesh)

    def data_parallel(self, model: torch.nn.Module, tp: int = 1) -> tuple[torch.nn.Module, dist.ProcessGroup | None]:
        """The module to train `model` through and its data-parallel group (None: the default group, or no group on
        one rank).

        Raises:
            ValueError: the backend trains a model of its own (megatron).
        """
        raise ValueError(f"strategy {self.name!r} does not train a Hugging Face model in place; use ddp or fsdp")

    def build_actor(
        self, cfg: HybridFlowConfig, model_path: Path, tokenizer, device: torch.device, compute_dtype: torch.dtype
    ) -> tuple[Any, WeightSource]:
        """The actor (``update_policy``, ``compute_log_prob``, ``model``/``optimizer``/``lr_scheduler``) and the
        weight source its rollout generates from."""
        raise NotImplementedError

    def build_critic(
        self,
        cfg: HybridFlowConfig,
        actor: Any,
        critic_path: Path,
        device: torch.device,
        compute_dtype: torch.dtype,
        name: str = "critic",
        columns: tuple[str, str] = ("values", "returns"),
    ) -> Any:
        """A critic (``compute_values``, ``update_critic``) writing `columns`, its metrics under ``<name>/``."""
        raise NotImplementedError

    def parameter_count(self, role: str, trained: Any) -> int | None:
        """The parameter count of `role`'s model for the run record; None where this rank cannot tell."""
        return sum(p.numel() for p in trained.model.parameters())

    def trainable_count(self, role: str, trained: Any) -> int | None:
        """The parameters the optimizer of `role` updates (a LoRA actor: its adapter's); None where this rank
        cannot tell."""
        lora = getattr(trained, "lora", None)
        if lora is not None:
            return lora.trainable_parameters()
        return self.parameter_count(role, trained)

    def save(self, staging: str | Path, role: str, trained: Any, tokenizer, rank: int) -> list[str]:
        """Write `role` into a checkpoint's staging folder; every rank calls it. Returns the roles written (rank 0)."""
        from hybridflow.engine.checkpoint import save_role
        from hybridflow.engine.sharded_state import full_model_state, full_optimizer_state, is_sharded

        lora = getattr(trained, "lora", None)  # a LoRA actor saves its adapter (`hybridflow.engine.backends.lora`)
        full_state = None
        if is_sharded(trained.model):  # FSDP: gather full tensors, a collective of every rank
            weights = lora.state() if lora is not None else full_model_state(trained.model)
            full_state = weights, full_optimizer_state(trained.model, trained.optimizer)
        if rank != 0:
            return []
        model = lora if lora is not None else trained.model
        save_role(staging, role, model, trained.optimizer, trained.lr_scheduler, tokenizer, full_state)
        return [role]

    def load(self, path: str | Path, role: str, trained: Any) -> dict[str, Any]:
        """Restore `role` from checkpoint `path`, or return the `hybridflow.engine.checkpoint.load_checkpoint`
        keyword arguments that restore it (the caller loads every role in one call)."""
        from hybridflow.engine.checkpoint import role_states

        return role_states(**{role: trained})


class HFBackend(TrainingBackend):
    """``ddp`` and ``fsdp``: a Hugging Face model trained by `hybridflow.engine.backends.actor.Actor` and
    `hybridflow.engine.backends.critic.Critic`, replicated (``DistributedDataParallel``) or sharded (FSDP2,
    tensor-parallel
    over groups of ``actor.tp`` ranks) over the group; the rollout generates with the actor's model itself
    (gathered from its shards under fsdp)."""

    def __init__(self, name: str, sharded: bool):
        self.name, self.sharded = name, sharded

    def check_layout(self, cfg, world):
        """``ddp``: every rank a whole replica (no tp/pp). ``fsdp``: tensor parallelism (``actor.tp``) only, and
        generation in the training layout."""
        _check_expert_parallel(cfg, world, megatron=False)
        if engine_tp(cfg) > 1 and not cfg.rollout_apart():
            return self._check_engine_tp(cfg, world)
        if not self.sharded:
            return super().check_layout(cfg, world)
        actor, rollout = cfg.actor, cfg.rollout
        if (actor.pp, rollout.gen_pp) != (1, 1) or _generation_tp(cfg) not in (None, actor.tp):
            raise ValueError(
                f"actor.strategy={self.name} trains with tensor parallelism (actor.tp) only and generates in the same "
                "layout: leave actor.pp, rollout.gen_pp at 1 and rollout.gen_tp unset (or set rollout.name=vllm "
                "for a vLLM engine tensor-parallel over rollout.gen_tp ranks), or use actor.strategy=megatron for "
                "pipelines and resharding"
            )
        if world % actor.tp:
            raise ValueError(
                f"the actor pool's {world} ranks (nodes x tasks_per_node) are not a multiple of actor.tp = {actor.tp}"
            )

    def _check_engine_tp(self, cfg, world) -> None:
        """A rollout engine tensor-parallel over ``rollout.gen_tp`` ranks beside this data-parallel actor: a rollout
        that can (vLLM), an actor without tensor or pipeline parallelism of its own, and whole blocks of ranks."""
        actor, rollout = cfg.actor, cfg.rollout
        if (actor.tp, actor.pp, rollout.gen_pp) != (1, 1, 1):
            raise ValueError(
                f"rollout.gen_tp={rollout.gen_tp} (vLLM's tensor parallelism) beside actor.strategy={self.name} needs "
                f"actor.tp=1, actor.pp=1 and rollout.gen_pp=1 (got {actor.tp}, {actor.pp}, {rollout.gen_pp}); for "
                "other layouts use actor.strategy=megatron"
            )
        _check_engine_blocks(cfg, world)

    def data_parallel(self, model: torch.nn.Module, tp: int = 1) -> tuple[torch.nn.Module, dist.ProcessGroup | None]:
        """``ddp``: `model` wrapped in ``DistributedDataParallel`` (rank 0's weights broadcast to all; buffers not
        broadcast in forward, so the rollout may run any number of forwards on the unwrapped model). ``fsdp``:
        `model` itself, sharded in place (`hybridflow.engine.backends.fsdp.shard_model`, tensor-parallel over groups of
        `tp`
        ranks when ``tp > 1``) and the data-parallel group; build its optimizer after this call. One rank: `model`."""
        import torch

        from hybridflow.engine.backends.training import dp_world

        if dp_world()[1] == 1:
            return model, None
        if self.sharded:
            from hybridflow.engine.backends.fsdp import shard_model

            return model, shard_model(model, tp)
        device_ids = [model.device.index] if getattr(model, "device", torch.device("cpu")).type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False), None

    def build_actor(self, cfg, model_path, tokenizer, device, compute_dtype):
        from hybridflow.engine.backends.actor import Actor
        from hybridflow.engine.backends.weights import GatheredWeights, ModelWeights
        from hybridflow.engine.models import checkpoint_layers, load_model

        policy = load_model(model_path, compute_dtype, device, trainable=True)
        if cfg.model.gradient_checkpointing:
            checkpoint_layers(policy)
        lora = None
        if cfg.model.lora:  # the adapter goes in before DDP/FSDP wrap the model (only it will train)
            from hybridflow.engine.backends.lora import LoraAdapter

            lora = LoraAdapter(policy, cfg.model, cfg.trainer.seed)
        actor = Actor(
            policy,
            cfg.actor,
            cfg.rollout.n,
            cfg.trainer.seed,
            compute_dtype=compute_dtype,
            lora=lora,
            rollout_correction=cfg.algorithm.rollout_correction,
            teacher=cfg.teacher if cfg.distills_in_loss() else None,
        )
        return actor, GatheredWeights(policy, lora) if self.sharded else ModelWeights(policy, lora)

    def build_critic(self, cfg, actor, critic_path, device, compute_dtype, name="critic", columns=_VALUE_COLUMNS):
        from hybridflow.engine.backends.critic import Critic
        from hybridflow.engine.models import checkpoint_layers, load_critic

        model = load_critic(critic_path, compute_dtype, device, trainable=True)
        if cfg.critic.gradient_checkpointing:
            checkpoint_layers(model)
        return Critic(model, cfg.critic, cfg.rollout.n, cfg.trainer.seed, compute_dtype, name=name, columns=columns)


class MegatronBackend(TrainingBackend):
    """``megatron``: `hybridflow.engine.backends.hybrid_actor.HybridActorRollout`, the megatron-core actor and its
    3D-HybridEngine (the rollout's weight source); a megatron critic lives in the actor's processes and layout."""

    name = "megatron"
    hf_model = False
    sharded = True
    packs_rows = False
    hosted_by_actor = True

    def check_layout(self, cfg, world):
        """megatron-core installed; the pool a multiple of tp x pp; generation without pipelines, tensor-parallel
        only where the rollout can (`hybridflow.engine.extensions.RolloutSpec.tensor_parallel`); gen_tp dividing tp;
        no entropy bonus yet."""
        import importlib.util

        from hybridflow.engine.extensions import rollout_spec

        actor, rollout = cfg.actor, cfg.rollout
        if importlib.util.find_spec("megatron.core") is None:
            raise ValueError(
                "actor.strategy=megatron needs megatron-core: pip install megatron-core (bash .ci/setup installs it), "
                "or set actor.strategy=ddp"
            )
        if world % (actor.tp * actor.pp):
            raise ValueError(
                f"the actor pool's {world} ranks (nodes x tasks_per_node) are not a multiple of "
                f"actor.tp x actor.pp = {actor.tp * actor.pp}"
            )
        _check_expert_parallel(cfg, world, megatron=True)
        if actor.entropy_coeff != 0:
            raise ValueError(
                "actor.strategy=megatron does not compute the vocabulary-parallel entropy bonus yet: set "
                "actor.entropy_coeff=0"
            )
        if rollout.gen_pp != 1:
            raise ValueError("rollout.gen_pp > 1 (pipelined generation) is not implemented: set rollout.gen_pp=1")
        spec = rollout_spec(rollout.name)
        if not spec.tensor_parallel and not spec.engine_tp and (rollout.gen_tp or actor.tp) != 1:
            raise ValueError(
                f"actor.strategy=megatron feeds the {rollout.name} rollout without tensor parallelism only: set "
                "rollout.gen_tp=1, or rollout.name=hf or vllm to generate tensor-parallel"
            )
        if engine_tp(cfg) > 1:
            _check_engine_blocks(cfg, world)
        cfg.actor_layout()  # gen_tp must divide tp

    def layout_record(self, cfg, world):
        """The training and generation layouts, the resharding mode and the rank groups (`HybridLayout.describe`)."""
        record = {"reshard": cfg.rollout.reshard, **cfg.actor_layout().describe()}
        if engine_tp(cfg) > 1:
            record["rollout_engine"] = {"tp": engine_tp(cfg), "replicas": world // engine_tp(cfg)}
        return record

    def build_actor(self, cfg, model_path, tokenizer, device, compute_dtype):
        from hybridflow.engine.backends.hybrid_actor import HybridActorRollout

        actor = HybridActorRollout(cfg, model_path, tokenizer, device)
        return actor, actor

    def build_critic(self, cfg, actor, critic_path, device, compute_dtype, name="critic", columns=_VALUE_COLUMNS):
        actor.add_critic(critic_path, device)
        return actor.critic

    def parameter_count(self, role, trained):
        """The actor's whole model (`HybridActorRollout.parameter_count`); None for the critic (a shard here)."""
        return trained.parameter_count() if role == "actor" else None

    def save(self, staging, role, trained, tokenizer, rank):
        """The actor writes itself and a megatron critic (`HybridActorRollout.save`: shards gathered, every rank
        takes part); the critic has nothing more to write."""
        if role != "actor":
            return []
        trained.save(staging)
        return ["actor", "critic"] if trained.critic is not None else ["actor"]

    def load(self, path, role, trained):
        """The actor loads its shards and a megatron critic's (`HybridActorRollout.load`)."""
        if role == "actor":
            trained.load(path)
        return {}


def _generation_tp(cfg: HybridFlowConfig) -> int | None:
    """``rollout.gen_tp`` where the actor's ranks generate; None where the rollout has a pool of its own (its
    engines' tensor parallelism is over that pool, `engine_tp`)."""
    return None if cfg.rollout_apart() else cfg.rollout.gen_tp


def _check_expert_parallel(cfg: HybridFlowConfig, world: int, megatron: bool) -> None:
    """``actor.ep`` / ``actor.etp`` only on megatron, and as megatron-core lays out its expert ranks
    (``parallel_state.initialize_model_parallel``): each pipeline stage's tp x dp ranks are also etp x ep x expert-DP
    ranks, so etp x ep divides tp x dp; an EP group may span TP ranks and replicas (with etp 1 at tp 2, EP 4 spans
    two replicas of 2 TP ranks each). The expert count is checked against the model's config before work
    (`hybridflow.engine.preflight`)."""
    actor = cfg.actor
    if actor.ep == 1 and actor.etp is None:
        return
    if not megatron:
        raise ValueError(
            f"actor.ep / actor.etp split experts over megatron-core's expert-parallel ranks; actor.strategy="
            f"{actor.strategy} shards experts as any weight: set actor.strategy=megatron or remove actor.ep / actor.etp"
        )
    etp = actor.etp or actor.tp
    if etp not in (1, actor.tp):
        raise ValueError(
            f"actor.etp={actor.etp}: the 3D-HybridEngine reshards experts split as the dense layers are (actor.etp "
            f"unset, or {actor.tp}) or whole on their ranks (actor.etp=1); pick one of those"
        )
    if actor.ep > 1 and cfg.rollout.reshard != "hybridflow":
        raise ValueError(
            f"actor.ep={actor.ep} reshards only with rollout.reshard=hybridflow (the naive all-gather over the "
            "model-parallel group does not reach other ranks' experts): set rollout.reshard=hybridflow"
        )
    stage = world // actor.pp  # tp x dp ranks per pipeline stage
    if stage % (etp * actor.ep):
        raise ValueError(
            f"actor.etp x actor.ep ({etp} x {actor.ep}) must divide the {stage} ranks of each pipeline stage "
            f"({world} ranks / actor.pp={actor.pp}), which megatron-core splits into expert-tensor, expert and "
            "expert-data-parallel ranks: change actor.ep (or actor.etp), or the ranks (placement.nodes x "
            "tasks_per_node)"
        )


def _check_engine_blocks(cfg: HybridFlowConfig, world: int) -> None:
    """A tensor-parallel rollout engine (`engine_tp`) needs whole blocks of ranks.

    Raises:
        ValueError: naming the keys."""
    tp = engine_tp(cfg)
    if world % tp:
        raise ValueError(
            f"the actor pool's {world} ranks (nodes x tasks_per_node) are not a multiple of rollout.gen_tp = {tp}"
        )


DDP = HFBackend("ddp", sharded=False)
FSDP = HFBackend("fsdp", sharded=True)
MEGATRON = MegatronBackend()
