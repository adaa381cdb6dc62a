"""``actor.strategy: megatron``: the actor trained on megatron-core (tensor, pipeline and data parallel) and the
rollout generating from the same weights through the 3D-HybridEngine, in one worker group's processes.

`HybridActorRollout` owns, on one rank: megatron's parallel state, this rank's ``GPTModel`` shard and its
`MegatronActor`, and a `HybridEngine` over the shard. Each ``generate_sequences`` moves the weights to the
generation layout (``rollout.gen_tp``, ``rollout.reshard``), builds a tensor-parallel Hugging Face model over the
generation shards (`hybridflow.engine.backends.tp_generation`, no copy), lends it to the rollout, and moves the weights
back; between calls the rank holds only its training shard. It is the rollout's `hybridflow.engine.extensions.
WeightSource` (`generation_model`): the ``hf`` rollout samples with the lent model, a ``vllm`` engine (only at
``rollout.gen_tp: 1``, one per rank) loads the generation shards (the whole model, in Hugging Face names) from it
after every update.

Transfer protocol (`hybridflow.engine.transfer`, meshes from `HybridLayout.mesh_coords`): the actor's stages split a
batch over megatron's data-parallel replicas (the ranks of one model-parallel group get the same rows) and collect
from the last pipeline stage's first TP rank; generation splits over the generation replicas (the generation TP
groups) and collects from each one's first rank.

With ``critic.strategy: megatron`` the same processes host a megatron critic (`add_critic`) in the same layout.

Checkpoints (`save` / `load`): `hybridflow.engine.backends.megatron_checkpoint` (Hugging Face layout plus per-shard
optimizer states).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.engine.backends.hybrid_engine import HybridEngine, megatron_shard_specs
from hybridflow.engine.backends.megatron_bridge import generation_hf_weights, generation_order
from hybridflow.engine.backends.megatron_checkpoint import global_names, load_sharded_role, save_sharded_role
from hybridflow.engine.backends.megatron_replay import MegatronRouterReplay
from hybridflow.engine.backends.megatron_router_stats import MegatronRouterStats
from hybridflow.engine.checkpoint import CheckpointError
from hybridflow.engine.config import HybridFlowConfig
from hybridflow.engine.models import load_model
from hybridflow.engine.moe import moe_spec
from hybridflow.engine.protocol import DataProto


class HybridActorRollout:
    """The megatron actor and its 3D-HybridEngine rollout on this rank (see the module docstring).

    Must be built on every rank of the group at once (it creates process groups). On CPU it installs
    `hybridflow.engine.backends.megatron_cpu` first.

    Args:
        cfg: the run config (``actor.strategy: megatron``).
        model_path: the resolved Hugging Face model folder (weights are loaded from it and converted).
        tokenizer: its tokenizer.
        device: where the model lives.

    Raises:
        ValueError: the model does not split as configured (heads, query groups or vocabulary not divisible by
            ``actor.tp``, layers by ``actor.pp``); the message names the key.
        RuntimeError: megatron's rank order differs from `HybridLayout`'s (the engine would gather wrong shards).
    """

    def __init__(self, cfg: HybridFlowConfig, model_path: str | Path, tokenizer, device: torch.device):
        if device.type == "cpu":
            from hybridflow.engine.backends.megatron_cpu import install

            install()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from hybridflow.engine.backends.megatron_actor import MegatronActor
        from hybridflow.engine.backends.megatron_model import build_gpt_model, load_hf_weights

        self.cfg = cfg
        self.layout = layout = cfg.actor_layout()
        self.rank = dist.get_rank()
        self.coords = layout.coords(self.rank)
        parallel_state.initialize_model_parallel(
            layout.t, layout.p, expert_model_parallel_size=cfg.actor.ep, expert_tensor_parallel_size=cfg.actor.etp
        )
        model_parallel_cuda_manual_seed(cfg.trainer.seed)
        mine = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
        if mine != (self.coords.pp, self.coords.tp):
            raise RuntimeError(
                f"rank {self.rank}: megatron placed it at (pp, tp) = {mine}, the hybrid layout at "
                f"{(self.coords.pp, self.coords.tp)}; the 3D-HybridEngine needs megatron's default rank order"
            )
        hf_model = load_model(model_path, torch.float32, device, trainable=False)
        self.hf_config = hf_model.config
        self.generation_config = hf_model.generation_config
        self.device = device
        self.whole_experts = cfg.actor.etp == 1 and layout.t > 1  # each expert whole on its rank, as trained
        specs = megatron_shard_specs(self.hf_config, layout.p, cfg.actor.ep, self.whole_experts)
        for key, value in (
            ("query groups (num_key_value_heads)", self.hf_config.num_key_value_heads),
            ("attention heads", self.hf_config.num_attention_heads),
            ("vocabulary", self.hf_config.vocab_size),
        ):
            if value % layout.t:
                raise ValueError(f"the model's {key} ({value}) do not split into actor.tp={layout.t} parts")
        self.model = build_gpt_model(self.hf_config, recompute=cfg.model.gradient_checkpointing, moe=cfg.actor.moe).to(
            device
        )
        load_hf_weights(self.model, {n: p.detach() for n, p in hf_model.named_parameters()}, self.hf_config)
        del hf_model
        spec = moe_spec(self.hf_config)
        if spec is not None:  # the update's router metrics, read by MegatronActor.update_policy
            self.model.router_stats = MegatronRouterStats(self.model, spec.top_k)
        if cfg.actor.router_replay.mode != "disabled" and spec is not None:
            self.model.router_replay = MegatronRouterReplay(self.model)  # read by megatron_actor.forward
        correction = cfg.algorithm.rollout_correction
        teacher = cfg.teacher if cfg.distills_in_loss() else None
        self.actor = MegatronActor(self.model, cfg.actor, cfg.rollout.n, cfg.trainer.seed, correction, teacher)
        names = global_names(self.model, self.hf_config, self.coords.pp, layout.p)
        params = {names[local]: p for local, p in self.model.named_parameters() if names.get(local) in specs}
        regroup = functools.partial(generation_order, config=self.hf_config)
        experts = (parallel_state.get_expert_model_parallel_group(), parallel_state.get_expert_model_parallel_rank())
        self.engine = HybridEngine(params, specs, layout, cfg.rollout.reshard, regroup=regroup, expert_group=experts)
        self.tokenizer = tokenizer
        self.last_transition: dict[str, float] = {}
        self.critic = self.critic_config = None

    def add_critic(self, critic_path: str | Path, device: torch.device) -> None:
        """Host a megatron critic in the same parallel layout (``critic.strategy: megatron``): a value-head
        ``GPTModel`` loaded from the Hugging Face critic of `hybridflow.engine.models.load_critic` (zero head)."""
        from hybridflow.engine.backends.megatron_critic import MegatronCritic
        from hybridflow.engine.backends.megatron_model import build_gpt_model, load_hf_weights
        from hybridflow.engine.models import load_critic

        hf_critic = load_critic(critic_path, torch.float32, device, trainable=False)
        self.critic_config = hf_critic.config
        model = build_gpt_model(
            self.critic_config, value_head=True, recompute=self.cfg.critic.gradient_checkpointing
        ).to(device)
        load_hf_weights(model, {n: p.detach() for n, p in hf_critic.named_parameters()}, self.critic_config)
        del hf_critic
        self.critic = MegatronCritic(model, self.cfg.critic, self.cfg.rollout.n, self.cfg.trainer.seed)

    # ------------------------------------------------------------------ weight source
    @contextlib.contextmanager
    def generation_model(self) -> Iterator[torch.nn.Module]:
        """The weights in the generation layout, as a (tensor-parallel) Hugging Face model over the generation
        shards, for the duration of the context; back in the training layout after it (`hybridflow.engine.extensions.
        WeightSource`). ``last_transition`` gets ``hybrid_engine/to_generation_s``, ``/to_training_s``,
        ``/received_mib``, ``/gen_param_mib`` and ``/training_copy_mib`` (this rank's; the last: training weights
        held besides the generation ones, 0 when resharding holds no weight twice), reported with the next update."""
        from hybridflow.engine.backends.tp_generation import build_tp_generation_model

        stats = self.engine.to_generation()
        try:
            weights = generation_hf_weights(self.engine.gen_weights, self.hf_config)
            model = build_tp_generation_model(
                self.hf_config,
                weights,
                self.engine.gen_tp_group,
                self.coords.gen_tp,
                split_experts=not self.whole_experts,
            )
            model.generation_config = self.generation_config
            del weights
            yield model
            del model
        finally:
            back = self.engine.to_training()
        mib = 2.0**20
        self.last_transition = {
            "hybrid_engine/to_generation_s": stats.seconds,
            "hybrid_engine/to_training_s": back,
            "hybrid_engine/received_mib": stats.received_bytes / mib,
            "hybrid_engine/gen_param_mib": stats.gen_param_bytes / mib,
            "hybrid_engine/training_copy_mib": stats.training_copy_bytes / mib,
        }

    def compute_log_prob(self, data: DataProto, calculate_entropy: bool = False) -> DataProto | None:
        """``old_log_probs`` [B, T] float32 on the last pipeline stage (None elsewhere: not collected). No
        ``entropys``: the vocabulary-parallel entropy is not computed (`calculate_entropy` is ignored), so runs on
        this strategy record no ``actor/entropy``."""
        return self.actor.compute_log_prob(data)

    @property
    def optimizer(self):
        return self.actor.optimizer

    @property
    def lr_scheduler(self):
        return self.actor.lr_scheduler

    def update_policy(self, data: DataProto) -> dict[str, float]:
        """The PPO update (`MegatronActor.update_policy`) plus the last transition's figures."""
        start = time.perf_counter()
        metrics = self.actor.update_policy(data)
        metrics["perf/update_actor_s"] = time.perf_counter() - start
        return {**metrics, **self.last_transition}

    def parameter_count(self) -> int:
        """Parameters of the whole model (every stage and TP shard counted once), from the HF config's shapes."""
        specs = megatron_shard_specs(self.hf_config, 1)
        return sum(torch.Size(s.shape).numel() for s in specs.values())

    # ------------------------------------------------------------------ checkpoints
    def save(self, staging: str | Path) -> None:
        """Write ``actor/`` (and ``critic/`` with a megatron critic) into a checkpoint's staging folder
        (`hybridflow.engine.backends.megatron_checkpoint`). Every rank must call it (the weights are gathered to rank
        0)."""
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        actor = self.actor
        save_sharded_role(
            Path(staging) / "actor",
            self.model,
            actor.optimizer,
            actor.lr_scheduler,
            self.hf_config,
            self.layout,
            AutoModelForCausalLM,
            self.tokenizer,
            self.generation_config,
        )
        if self.critic is not None:
            critic = self.critic
            save_sharded_role(
                Path(staging) / "critic",
                critic.model,
                critic.optimizer,
                critic.lr_scheduler,
                self.critic_config,
                self.layout,
                AutoModelForTokenClassification,
            )

    def load(self, path: str | Path) -> None:
        """Restore the actor (and a megatron critic) from a checkpoint (`load_sharded_role`).

        Raises:
            CheckpointError: see `load_sharded_role`; or no ``critic/`` while a megatron critic is hosted."""
        actor = self.actor
        folder = Path(path)
        load_sharded_role(
            folder / "actor", self.model, actor.optimizer, actor.lr_scheduler, self.hf_config, self.layout
        )
        if self.critic is not None:
            if not (folder / "critic").is_dir():
                raise CheckpointError(f"checkpoint {path} has no critic/ folder, but a megatron critic is hosted")
            critic = self.critic
            load_sharded_role(
                folder / "critic", critic.model, critic.optimizer, critic.lr_scheduler, self.critic_config, self.layout
            )
