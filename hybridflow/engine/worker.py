"""The RLHF worker: what each rank of a worker group runs.

`RLHFWorker` hosts any subset of the roles ``actor``, ``rollout``, ``ref``, ``critic``, ``reward`` (the score
function), ``reward_model``. HybridFlow's
default puts them all in one group's processes (colocated: the rollout generates with the actor's own weights,
no copy); a split placement gives each group a subset. The methods are the stages of an iteration, each with its
transfer protocol (`hybridflow.engine.transfer`): batch-in, batch-out stages are ``DP_COMPUTE_PROTO`` (each
data-parallel rank computes on its share of the rows), set-up and updates run on every rank.

This module never imports Prefect or submitit; the worker group (``hybridflow.slurm.worker_group``) serves it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from hybridflow.engine.backends.actor import Actor, RefPolicy
from hybridflow.engine.backends.critic import Critic
from hybridflow.engine.backends.engines import TrainingBackend
from hybridflow.engine.backends.teachers import RoutedTeachers
from hybridflow.engine.checkpoint import load_checkpoint, read_trainer_state
from hybridflow.engine.config import ROLES, HybridFlowConfig
from hybridflow.engine.embedded_models import resolve_model_path
from hybridflow.engine.extensions import (
    Rollout,
    WeightSource,
    awake,
    build_rollout,
    engine_tp,
    rollout_spec,
    training_backend,
)
from hybridflow.engine.flops import update_mfu
from hybridflow.engine.models import load_model, load_tokenizer, pick_device, pick_dtype
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.reward.reward_model import RewardModel
from hybridflow.engine.reward.rewards import RewardManager, load_reward_function
from hybridflow.engine.reward.scoring import BUILTIN_SPEC
from hybridflow.engine.rollout.broadcast import WeightReceiver, WeightSender
from hybridflow.engine.rollout.hf import eos_token_ids
from hybridflow.engine.rollout.published import (
    actor_probe_log_probs,
    full_weights,
    probe_prompt,
    publish,
    published_tensors,
    remove_published,
    weights_folder,
)
from hybridflow.engine.stream_worker import StreamingRollout
from hybridflow.engine.transfer import Dispatch, register

if TYPE_CHECKING:
    from hybridflow.engine.backends.hybrid_actor import HybridActorRollout
    from hybridflow.engine.backends.lora import LoraReference
    from hybridflow.engine.backends.megatron_critic import MegatronCritic
    from hybridflow.engine.reward.judge import JudgeRewardModel


def judge_tp(cfg: HybridFlowConfig) -> int:
    """The ranks one generative judge engine spans (``reward_model.judge.tensor_parallel_size`` of a vLLM judge);
    1 without one."""
    rm = cfg.reward_model
    return rm.judge.tensor_parallel_size if rm.enable and rm.judge.enable and rm.judge.engine == "vllm" else 1


@dataclass
class Roles:
    """The role objects of one process (None where the role is not hosted)."""

    tokenizer: Any
    actor: Actor | HybridActorRollout | None = None
    weights: WeightSource | None = None  # where the actor's current full weights are read (its rollout's source)
    rollout: Rollout | None = None
    ref: RefPolicy | LoraReference | None = None
    teacher: RefPolicy | RoutedTeachers | None = None  # distillation's teacher(s) (teacher.model_path / routes)
    critic: Critic | MegatronCritic | None = None
    cost_critic: Critic | None = None  # Safe-RLHF: a second value model in the critic's processes
    reward_fn: RewardManager | None = None
    cost_fn: RewardManager | None = None  # Safe-RLHF: reward.cost_function, with the score function
    reward_model: RewardModel | JudgeRewardModel | None = None
    cost_model: RewardModel | None = None  # Safe-RLHF: reward_model.cost_path, scored with the reward model

    def critics(self) -> list[Critic | MegatronCritic]:
        """The value models of the values and update_critic stages: the critic, Safe-RLHF's cost critic."""
        return [c for c in (self.critic, self.cost_critic) if c is not None]

    def scorers(self) -> list[RewardModel]:
        """The sequence classifiers of the rm_score stage: the reward model, the cost model (either may be absent)."""
        return [m for m in (self.reward_model, self.cost_model) if m is not None]


def build_roles(cfg: HybridFlowConfig, roles: set[str] | list[str]) -> Roles:
    """Load the models for `roles` (subset of `ROLES`) as the config says.

    Trained models (actor, critic) keep fp32 weights; ``model.dtype`` (auto: bf16 on CUDA, fp32 on CPU) is the
    compute dtype, applied with autocast; the frozen ref is stored in it. The ``hf`` rollout shares the actor's
    model (colocated: generation sees the weights being trained, no copy); the ``vllm`` rollout runs an engine in
    the same process, updated from the actor's weights after each update (`RLHFWorker.sync_rollout_weights`). Both
    seed their sampling from ``trainer.seed``.

    Raises:
        FileNotFoundError, ValueError: from model resolution and reward loading (messages name the config key).
    """
    threads = process_threads(cfg, roles)
    if threads:  # before any engine starts: vLLM-CPU computes with the threads it finds, then fixes them
        torch.set_num_threads(threads)
    device = pick_device(cfg.trainer.device)
    compute_dtype = pick_dtype(cfg.model.dtype, device)
    model_path = resolve_model_path(cfg.model.path)
    out = Roles(tokenizer=load_tokenizer(model_path))
    if "actor" in roles:  # the rollout generates with the actor's weights (gathered, resharded: its backend's)
        backend = training_backend(cfg.actor.strategy)
        out.actor, out.weights = backend.build_actor(cfg, model_path, out.tokenizer, device, compute_dtype)
        if "rollout" in roles:  # (megatron's generation model computes in its shards' dtype: no autocast)
            dtype = compute_dtype if backend.hf_model else None
            out.rollout = build_rollout(cfg, out.weights, out.tokenizer, model_path, dtype)
    elif "rollout" in roles:  # a pool of its own (vllm): its weights arrive published by the actor's pool
        out.rollout = build_rollout(cfg, None, out.tokenizer, model_path, None)
    if "ref" in roles and cfg.model.lora:  # the actor's model with its adapter off is the base model: no copy
        from hybridflow.engine.backends.lora import LoraReference

        out.ref = LoraReference(out.actor, cfg.ref.log_prob_micro_batch_size)
    elif "ref" in roles:
        ref_model = load_model(model_path, compute_dtype, device, trainable=False)
        out.ref = RefPolicy(
            ref_model,
            cfg.ref.log_prob_micro_batch_size,
            compute_dtype=compute_dtype,
            share_prompts=cfg.actor.shares_prompts,
        )
    if "teacher" in roles:  # on-policy distillation: scores the actor's tokens in the actor's numerics
        teacher, share = cfg.teacher, cfg.actor.shares_prompts
        scorers = {
            route: RefPolicy(
                load_model(resolve_model_path(path), compute_dtype, device, trainable=False),
                teacher.log_prob_micro_batch_size,
                compute_dtype,
                share,
                "teacher_log_prob",
                teacher.top_k,
            )
            for route, path in teacher.model_paths().items()
        }
        out.teacher = RoutedTeachers(scorers, teacher.route_key) if teacher.routes else scorers[""]
    if "critic" in roles:
        backend = training_backend(cfg.critic.strategy, "critic.strategy")
        critic_path = resolve_model_path(cfg.critic.model_path or cfg.model.path)
        out.critic = backend.build_critic(cfg, out.actor, critic_path, device, compute_dtype)
        if cfg.safe_rlhf():  # the cost critic: its own value model, initialised as the critic's
            columns = ("cost_values", "cost_returns")
            out.cost_critic = backend.build_critic(
                cfg, out.actor, critic_path, device, compute_dtype, "cost_critic", columns
            )
    if "reward" in roles:  # scored in processes of their own, each call with a time limit (reward.timeout_s)
        reward = cfg.reward
        limits = {"timeout_s": reward.timeout_s, "num_workers": reward.num_workers}
        limits["max_failed_fraction"] = reward.max_failed_fraction
        if reward.custom_function:
            load_reward_function(reward.custom_function)  # loads here first: a bad spec fails the start, named
        spec = reward.custom_function or BUILTIN_SPEC
        out.reward_fn = RewardManager(out.tokenizer, name=reward.custom_function, spec=spec, **limits)
        if reward.cost_function:
            load_reward_function(reward.cost_function, "reward.cost_function")
            key = "reward.cost_function"
            out.cost_fn = RewardManager(out.tokenizer, spec=reward.cost_function, key=key, **limits)
    if "reward_model" in roles:
        rm = cfg.reward_model
        dtype = pick_dtype(rm.dtype, device)
        if rm.enable and rm.judge.enable:  # a generative reward model
            from hybridflow.engine.reward.judge import JudgeRewardModel

            path = resolve_model_path(rm.path)
            fraction = cfg.reward.max_failed_fraction
            out.reward_model = JudgeRewardModel(rm, path, out.tokenizer, device, dtype, cfg.trainer.seed, fraction)
        elif rm.enable:
            out.reward_model = RewardModel(rm, resolve_model_path(rm.path), out.tokenizer, device, dtype)
        if rm.cost_path:
            cost_path = resolve_model_path(rm.cost_path)
            out.cost_model = RewardModel(rm, cost_path, out.tokenizer, device, dtype, column="token_level_costs")
    return out


def process_threads(cfg: HybridFlowConfig, roles: set[str] | list[str]) -> int:
    """The torch threads for a process hosting `roles`: its pool's ``num_threads`` when they are one pool's and it
    sets them, else ``trainer.num_threads`` (0: torch's default)."""
    names = {cfg.pool_of(role).name for role in roles if role in cfg.roles()}
    own = cfg.pools()[names.pop()].num_threads if len(names) == 1 else 0
    return own or cfg.trainer.num_threads


def _joined(parts: list[DataProto]) -> DataProto:
    """The columns of every part (same rows) in one `DataProto`."""
    out = parts[0]
    for part in parts[1:]:
        out = out.union(part)
    return out


class RLHFWorker(StreamingRollout):
    """One rank hosting the given roles (a streaming rollout's methods: `StreamingRollout`).

    Args:
        rank, world_size, data_dir: set by the worker group.
        config: the run's configuration as a dict (validated again here).
        roles: the roles this group hosts (subset of `ROLES`); ``rollout`` without ``actor`` only for a rollout
            that loads published weights (``rollout.name: vllm``; the config checks it, `HybridFlowConfig`).

    Raises:
        ValueError: unknown role.
    """

    def __init__(self, rank: int, world_size: int, data_dir: str, config: dict[str, Any], roles: list[str]):
        unknown = sorted(set(roles) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown roles {unknown}; roles are {list(ROLES)}")
        self.rank, self.world_size, self.data_dir = rank, world_size, data_dir
        self.config = HybridFlowConfig.model_validate(config)
        self.roles = set(roles)
        self.actor: Actor | None = None
        self.weights: WeightSource | None = None
        self.rollout: Rollout | None = None
        self.version = 0  # the actor's weight version: the updates applied (= the global step)
        self.rollout_version = 0  # the version the rollout's engine serves (stamped on each generated row)
        self.weight_link: WeightSender | WeightReceiver | None = None  # rollout.checkpoint_engine.backend=gloo
        self._init_stream()  # rollout.streaming (`StreamingRollout`)
        self.ref: RefPolicy | LoraReference | None = None
        self.teacher: RefPolicy | None = None
        self.critic: Critic | MegatronCritic | None = None
        self.cost_critic: Critic | None = None
        self.reward_fn: RewardManager | None = None
        self.cost_fn: RewardManager | None = None
        self.reward_model: RewardModel | None = None
        self.critics: list[Critic | MegatronCritic] = []  # the critic and Safe-RLHF's cost critic, those configured
        self.scorers: list[RewardModel] = []  # the reward model and Safe-RLHF's cost model, those configured

    def _backend(self, role: str) -> TrainingBackend:
        """The training backend of trained `role` (``<section>.strategy``; the cost critic trains as the critic)."""
        section = "critic" if role == "cost_critic" else role
        return training_backend(getattr(self.config, section).strategy, f"{section}.strategy")

    def mesh_coords(self, mesh: str) -> tuple[int, int, bool] | None:
        """This rank's ``(data-parallel index, size, collect)`` on `mesh` (`hybridflow.engine.transfer.MESHES`): the
        actor's training or generation layout (`HybridLayout.mesh_coords`, whatever its backend), the critic's when
        the critic lives in the actor's layout (megatron); None (every rank its own replica) for a critic of its
        own processes."""
        if mesh == "critic":
            if not self._backend("critic").hosted_by_actor:
                return None
            mesh = "train"
        if mesh == "generate" and "actor" not in self.roles:  # a rollout pool of its own: engines side by side
            return self._blocks(engine_tp(self.config))  # each engine over a block of ranks
        if mesh == "judge":  # the reward model's scoring: a judge engine over a block, or each rank its own
            return self._blocks(judge_tp(self.config))
        return self._backend("actor").mesh_coords(self.config, self.world_size, self.rank, mesh)

    def _blocks(self, tp: int) -> tuple[int, int, bool] | None:
        """This rank's coordinates among blocks of `tp` consecutive ranks, one replica each (None for tp 1)."""
        return (self.rank // tp, self.world_size // tp, self.rank % tp == 0) if tp > 1 else None

    def _trained(self) -> list[tuple[str, Any]]:
        """The trained roles this rank hosts, in checkpoint order: (role, object)."""
        roles = [("actor", self.actor), ("critic", self.critic), ("cost_critic", self.cost_critic)]
        return [(role, trained) for role, trained in roles if trained is not None]

    def _need(self, role: str) -> None:
        if getattr(self, "reward_fn" if role == "reward" else role) is None:
            raise RuntimeError(
                f"this group does not host role {role!r} (it hosts {sorted(self.roles)}), or init_model was not called"
            )

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Load the models of this rank's roles. Returns their parameter counts (for the run record):
        ``<role>_params`` and ``<role>_trainable_params`` (a LoRA actor's adapter; elements)."""
        roles = build_roles(self.config, self.roles)
        self.tokenizer, self.actor, self.rollout = roles.tokenizer, roles.actor, roles.rollout
        self.weights = roles.weights
        self.ref, self.critic, self.reward_fn = roles.ref, roles.critic, roles.reward_fn
        self.cost_critic, self.cost_fn = roles.cost_critic, roles.cost_fn
        self.reward_model, self.teacher = roles.reward_model, roles.teacher
        self.critics, self.scorers = roles.critics(), roles.scorers()
        info = {}
        for role, trained in self._trained():
            if role == "cost_critic":
                continue
            backend = self._backend(role)
            counts = {"params": backend.parameter_count(role, trained)}
            counts["trainable_params"] = backend.trainable_count(role, trained)
            info.update({f"{role}_{key}": n for key, n in counts.items() if n is not None})
        rm_model = getattr(self.reward_model, "model", None)  # a judge on vLLM: the engine's own
        if rm_model is not None:
            info["reward_model_params"] = sum(p.numel() for p in rm_model.parameters())
        return info

    @register(Dispatch.DP_COMPUTE_PROTO, mesh="generate")
    def generate_sequences(
        self, prompts: DataProto, n: int | None = None, temperature: float | None = None, stream: str = "train"
    ) -> DataProto:
        """Rollout: sample responses (see `HFRollout.generate_sequences`; `stream` separates random streams), each
        row stamped with ``rollout_version`` int64 [B*n]: the actor weight version (its updates) that generated it.
        A streaming rollout's stream (a validation's generation) pauses meanwhile, as at a push, and continues after
        it under the same weights: the engine serves this call's requests alone."""
        self._need("rollout")
        if self.stream is not None:
            self.stream.pause()
        # vLLM on GPU: its KV cache exists only while generating (a stream's engine stays awake)
        with awake(self.rollout) if self.stream is None else contextlib.nullcontext():
            out = self.rollout.generate_sequences(prompts, n=n, temperature=temperature, stream=stream)
        self._resume_stream(self.rollout_version)
        # a rollout that generates from the actor's own weights serves the actor's version
        version = self.rollout_version if rollout_spec(self.config.rollout.name).syncs_weights else self.version
        return out.union(DataProto.from_dict({"rollout_version": torch.full((len(out),), version, dtype=torch.int64)}))

    @register(Dispatch.RANK_ZERO)
    def publish_weights(self, version: int) -> dict[str, Any]:
        """For a rollout pool of its own: send the actor's current weights, in the engine's dtype, by
        ``rollout.checkpoint_engine.backend``: ``file``: a safetensors file where the rollout pool reads it
        (`hybridflow.engine.rollout.published.publish`; shared memory on one node); ``gloo``: a broadcast from this
        pool's rank 0 to the rollout's ranks, queued on a thread (`hybridflow.engine.rollout.broadcast.WeightSender`).
        Every rank takes part (an FSDP actor is gathered); rank 0 sends. Returns the handle the rollout loads with:
        ``{"path", "version", "bytes"}`` or ``{"host", "port", "world", "version", "bytes"}``."""
        self._need("actor")
        cfg = self.config
        prompt = probe_prompt(self.tokenizer, eos_token_ids(self.tokenizer, self.weights.generation_config))
        dtype = pick_dtype(cfg.rollout.vllm_dtype, self.weights.device)
        engine = cfg.rollout.checkpoint_engine
        with self.weights.generation_model() as model:
            if self.rank != 0:
                return {}
            if engine.backend == "file":
                folder = weights_folder(self.data_dir, local=cfg.placement.executor == "local")
                return publish(model, prompt, folder, version, dtype)
            if self.weight_link is None:
                receivers = cfg.pool_of("rollout").world_size
                self.weight_link = WeightSender(receivers, engine.update_weights_bucket_megabytes * 2**20)
            return self.weight_link.send(full_weights(model), actor_probe_log_probs(model, prompt), version, dtype)

    @register(Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self, published: dict[str, Any] | None = None, version: int = 0) -> dict[str, float]:
        """Load the actor's updated weights into a rollout that keeps its own (``rollout.name: vllm``; the ``hf``
        rollout generates from the actor's and needs nothing): in the actor's processes from its model
        (`Rollout.update_weights`), in a rollout pool of its own as the actor's pool `published` them: from the file
        (removed once every rank has loaded it) or the broadcast (`publish_weights`). Returns the rollout's check;
        the caller times the stage (``timing_s/weight_sync``). `version`: the weights' (the actor updates they
        hold), stamped on the rows the rollout generates from now on."""
        self._need("rollout")
        streamed = self._pause_stream()  # partial rollouts: interrupted; else the requests in flight finish first
        if published is None:
            metrics = self.rollout.update_weights()
        elif "path" in published:
            metrics = self.rollout.load_weights(*published_tensors(published["path"]))
            if dist.is_initialized():
                dist.barrier()
            if self.rank == 0:
                remove_published(published["path"])
        else:
            if self.weight_link is None:
                self.weight_link = WeightReceiver(published, self.rank)
            metrics = self.rollout.load_weights(*self.weight_link.receive(published["version"]))
        self.rollout_version = version
        self._resume_stream(version)  # every unfinished sample continues, its new tokens recording `version`
        return {**metrics, **streamed}

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_reward(self, data: DataProto, costs: bool = True) -> DataProto:
        """``token_level_scores`` float32 [B, T] plus one float64 column per extra the score function reports
        (``reward_extra/<key>``, e.g. ``reward_extra/acc``); with ``reward.cost_function`` (Safe-RLHF) and `costs`,
        its ``token_level_costs`` float32 [B, T] (each response's cost on its last token).

        A sample whose score (or cost) function raised or ran past ``reward.timeout_s`` scores (costs) 0.0; it is
        marked in ``reward_extra/failed`` and ``reward_extra/timed_out`` float64 [B] (1.0 or 0.0: their means are
        the metrics ``reward_extra/failed/mean``, ``reward_extra/timed_out/mean``) and its error is the non-tensor
        ``reward_error`` (str [B]: ``""`` for a sample scored, else e.g. ``"timeout after 30 s"`` or ``"ValueError:
        ..."``, a cost function's prefixed ``"cost: "``), which the run store keeps with the sample.

        Raises:
            ScoreFunctionError: more than ``reward.max_failed_fraction`` of the rows failed (`RewardManager`).
            ValueError: the score function reports an extra key ``failed`` or ``timed_out`` (those names are the
                failure columns').
        """
        self._need("reward")
        scored = self.reward_fn.scored(data)
        tensors = {"token_level_scores": scored.scores}
        errors, failed, timed_out = list(scored.errors), scored.failed, scored.timed_out
        if self.cost_fn is not None and costs:
            cost = self.cost_fn.scored(data)
            tensors["token_level_costs"] = cost.scores
            errors = [
                ("; ".join(filter(None, (e, f"cost: {c}" if c else ""))))
                for e, c in zip(errors, cost.errors, strict=True)
            ]
            failed, timed_out = failed | cost.failed, timed_out | cost.timed_out
        for key, values in scored.extra.items():
            if key in ("failed", "timed_out"):
                raise ValueError(
                    f"the score function {self.reward_fn.name} reports an extra key {key!r}: that name is the reward "
                    "stage's own (reward_extra/failed, reward_extra/timed_out); rename the key"
                )
            tensors[f"reward_extra/{key}"] = torch.from_numpy(np.asarray(values, dtype=np.float64))
        tensors["reward_extra/failed"] = torch.from_numpy(failed.astype(np.float64))
        tensors["reward_extra/timed_out"] = torch.from_numpy(timed_out.astype(np.float64))
        return DataProto.from_dict(tensors, {"reward_error": np.array(errors, dtype=object)})

    @register(Dispatch.DP_COMPUTE_PROTO, mesh="judge")
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` float32 [B, T]: the reward model's score on each row's last response token
        (`RewardModel.compute_rm_score`); Safe-RLHF's cost model's as ``token_level_costs``.

        Raises:
            RuntimeError: this group hosts neither a reward model nor a cost model."""
        if not self.scorers:
            raise RuntimeError(f"this group does not host role 'reward_model' (it hosts {sorted(self.roles)})")
        return _joined([scorer.compute_rm_score(data) for scorer in self.scorers])

    @register(Dispatch.DP_COMPUTE_PROTO, mesh="train")
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` and ``entropys`` float32 [B, T] under the current actor."""
        self._need("actor")
        return self.actor.compute_log_prob(data, calculate_entropy=True)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` float32 [B, T] under the frozen reference policy."""
        self._need("ref")
        return self.ref.compute_ref_log_prob(data)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """``teacher_log_prob`` float32 [B, T]: each response token's log-prob under the distillation teacher; with
        ``teacher.top_k`` = k also ``teacher_top_k_ids`` int64 and ``teacher_top_k_log_probs`` float32 [B, T, k]."""
        self._need("teacher")
        return self.teacher.compute_ref_log_prob(data)

    @register(Dispatch.DP_COMPUTE_PROTO, mesh="critic")
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` float32 [B, T] from the critic (and Safe-RLHF's ``cost_values`` from the cost critic)."""
        self._need("critic")
        return _joined([critic.compute_values(data) for critic in self.critics])

    @register(Dispatch.DP_COMPUTE_PROTO, mesh="train")
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO policy update on this rank's rows; returns the actor metrics and ``perf/mfu/actor``
        (`hybridflow.engine.flops.update_mfu`: the FLOPs the update needs over its seconds and this device's peak)."""
        self._need("actor")
        started = time.perf_counter()
        metrics = self.actor.update_policy(data)
        seconds = time.perf_counter() - started
        self.version += 1
        cfg = self.config
        device = pick_device(cfg.trainer.device)
        dtype = pick_dtype(cfg.model.dtype, device)
        metrics["perf/mfu/actor"] = update_mfu(cfg.model.path, data, cfg.actor.ppo_epochs, seconds, device.type, dtype)
        return metrics

    @register(Dispatch.DP_COMPUTE_PROTO, mesh="critic")
    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Value update on this rank's rows (and the cost critic's, Safe-RLHF); returns the critic metrics
        (``critic/*``, ``cost_critic/*``)."""
        self._need("critic")
        return {k: v for critic in self.critics for k, v in critic.update_critic(data).items()}

    @register(Dispatch.RANK_ZERO)
    def save_checkpoint_part(self, staging: str) -> list[str]:
        """Write the trained roles this group hosts (actor, critic, Safe-RLHF's cost critic) into a checkpoint's
        staging folder (see `checkpoint.begin_checkpoint`); the controller finishes the checkpoint. Returns the
        roles written (``stream`` for a streaming rollout's groups not handed over, with their samples' tokens so
        far and the admission's bookkeeping: ``<AHEAD_DIR>/stream-<rank>.json``, `StreamingGenerator.state_dict`;
        every rank of a rollout pool its own).

        Data-parallel replicas hold identical weights and optimizer states: rank 0 writes, the others return. A
        sharded model (``fsdp``, ``megatron``) is gathered from its shards first, so every rank takes part."""
        written: list[str] = []
        for role, trained in self._trained():  # a sharded model is gathered: every rank takes part
            tokenizer = self.tokenizer if role == "actor" else None
            written += self._backend(role).save(staging, role, trained, tokenizer, self.rank)
        return written + self._save_stream(staging)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore the weights, optimizer and scheduler states of the roles this group hosts on every rank (the
        controller has verified the checkpoint's hashes already)."""
        states: dict[str, Any] = {}  # the roles loaded from Hugging Face folders, in one call
        for role, trained in self._trained():
            states.update(self._backend(role).load(path, role, trained))
        load_checkpoint(path, verify=False, restore_rng=False, **states)
        self.version = int(read_trainer_state(path)["global_steps"])
        if "rollout" in self.roles:  # a stream continues once the engine has the restored weights
            self._load_stream(path)
        if self.rollout is not None and self.actor is not None:  # a rollout with weights of its own serves the
            self.rollout.update_weights()  # restored actor (a pool of its own gets them published: the flow)
            self.rollout_version = self.version
