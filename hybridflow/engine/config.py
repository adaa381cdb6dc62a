"""Typed run configuration (pydantic), loaded from YAML with ``-o key=value`` overrides.

Sections follow verl's vocabulary, flattened one level: ``model``, ``data``, ``rollout``, ``actor``, ``ref``,
``critic``, ``algorithm``, ``reward``, ``reward_model``, ``trainer`` (verl's ``actor_rollout_ref.actor.ppo_epochs``
is our ``actor.ppo_epochs``). Unknown or ill-typed keys are errors that name the key and the allowed values.
Batch sizes: ``data.train_batch_size`` and ``*.ppo_mini_batch_size`` count prompts (as in verl);
micro-batch sizes count sequences (prompt + one response).
"""

from __future__ import annotations

import copy
import fnmatch
import importlib.util
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hybridflow.engine.extensions import backend_names, rollout_names, rollout_spec, training_backend
from hybridflow.engine.parallel_layout import HybridLayout

logger = logging.getLogger(__name__)


def _registered_name(value: str, registered: list[str], key: str) -> str:
    """`value` if its registry holds it. Raises ValueError naming `key` and the registered names."""
    if value not in registered:
        raise ValueError(f"unknown {key} {value!r}; registered: {registered}")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """The policy model: a local Hugging Face folder or an embedded model, and the compute dtype."""

    path: str = Field("tiny", description="local Hugging Face folder, or an embedded model: 'smollm2', 'tiny'")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="auto: fp32 on CPU, bf16 on CUDA")


class ReasoningGymConfig(_Section):
    """Prompts from a reasoning-gym generator: train and held-out validation items from one seeded set."""

    name: str = Field(description="reasoning-gym generator, e.g. basic_arithmetic")
    config: dict[str, Any] = Field(default_factory=dict, description="generator keyword arguments")
    train_size: int = Field(1000, gt=0)
    val_size: int = Field(100, ge=0)
    seed: int = 0
    instruction: str | None = Field(None, description="appended to each question; None uses the default")


class _Files(_Section):
    """A data section with ``train_files`` and ``val_files``."""

    @field_validator("train_files", "val_files", mode="before", check_fields=False)
    @classmethod
    def _one_path_is_a_list(cls, value: Any) -> Any:
        """``data.train_files: train.parquet`` means ``[train.parquet]`` (as verl accepts)."""
        return [value] if isinstance(value, str | Path) else value


class DataConfig(_Files):
    """Prompt sources, prompt length limit (tokens) and batch sizes (prompts)."""

    train_files: list[str] = Field(
        default_factory=list, description="parquet/jsonl files in verl's layout (one path or a list)"
    )
    val_files: list[str] = Field(default_factory=list, description="held-out prompts for validation (path or list)")
    reasoning_gym: ReasoningGymConfig | None = None
    max_prompt_length: int = Field(256, gt=0, description="tokens; longer prompts are dropped")
    train_batch_size: int = Field(8, gt=0, description="prompts per iteration")
    gen_batch_size: int | None = Field(
        None,
        gt=0,
        description="with algorithm.filter_groups: prompts per generation draw (default train_batch_size)",
    )
    val_batch_size: int = Field(64, gt=0, description="prompts per validation generate call")
    shuffle: bool = True
    seed: int = 0
    audit_labels: bool = Field(
        True,
        description="refuse a run whose labels fail their exact audit (hybridflow.engine.audit: arithmetic sources); "
        "hf data check CONFIG lists them",
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if not self.train_files and self.reasoning_gym is None:
            raise ValueError("set data.train_files (parquet/jsonl) or data.reasoning_gym.name")
        return self


class RolloutConfig(_Section):
    """Sampling: responses per prompt, temperature, top-p/top-k, response length (tokens)."""

    name: str = Field(
        "hf",
        description="a registered rollout (hybridflow.engine.extensions.register_rollout): hf: transformers generate; "
        "vllm: an in-process vLLM engine; auto: vllm where it is installed and the layout allows it, else hf "
        "(resolved when the config is loaded, and recorded resolved)",
    )
    n: int = Field(4, gt=0, description="responses sampled per prompt")
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = disabled")
    response_length: int = Field(64, gt=0, description="max new tokens")
    micro_batch_size: int = Field(32, gt=0, description="sequences per generate call")
    val_temperature: float = Field(0.0, ge=0.0, description="validation sampling temperature (0 = greedy)")
    vllm_dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="vllm: the engine's weights and compute (bf16: 1.8x faster here; drift is reported)"
    )
    vllm_kv_cache_gb: float = Field(1.0, gt=0, description="vllm on CPU: KV cache space (GiB)")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vllm on GPU: share of GPU memory it may use")
    gen_tp: int | None = Field(
        None,
        ge=1,
        description="actor.strategy=megatron: tensor-parallel size of generation (the 3D-HybridEngine's t_g; must "
        "divide actor.tp); None: actor.tp",
    )
    gen_pp: int = Field(1, ge=1, description="pipeline stages of generation (p_g); only 1 is implemented")
    reshard: Literal["hybridflow", "naive"] = Field(
        "hybridflow",
        description="actor.strategy=megatron: how training shards become generation shards: hybridflow (all-gather "
        "inside micro-DP groups, no redundant copy) or naive (gather the whole model, keep the training shard)",
    )

    @field_validator("name")
    @classmethod
    def _registered(cls, value: str) -> str:
        return value if value == "auto" else _registered_name(value, rollout_names(), "rollout.name")


class OptimConfig(_Section):
    """AdamW with linear warm-up to a constant LR, and global grad-norm clipping."""

    lr: float = Field(1e-6, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up, then constant")
    grad_clip: float = Field(1.0, gt=0.0, description="max global grad norm")


LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+"]


class PolicyLossConfig(_Section):
    """Which policy loss the actor minimises (verl's ``actor.policy_loss``)."""

    loss_mode: str = Field(
        "vanilla",
        description="a registered policy loss (algorithms.losses.register_policy_loss): vanilla (PPO clip "
        "with clip-higher and dual-clip), gspo (sequence-level ratio; its paper uses loss_agg_mode "
        "seq-mean-token-mean and clip ranges ~3e-4/4e-4), cispo (clipped importance weight, held constant), "
        "clip_cov, kl_cov (Cui et al. 2025: high-covariance tokens lose their gradient / get a KL penalty)",
    )
    clip_cov_ratio: float = Field(0.0002, gt=0.0, le=1.0, description="clip_cov: share of tokens detached")
    clip_cov_lb: float = Field(1.0, description="clip_cov: lower bound of the covariance of a detachable token")
    clip_cov_ub: float = Field(5.0, description="clip_cov: upper bound of the covariance of a detachable token")
    kl_cov_ratio: float = Field(0.0002, gt=0.0, le=1.0, description="kl_cov: share of tokens KL-penalised")
    ppo_kl_coef: float = Field(1.0, ge=0.0, description="kl_cov: coefficient of the |log ratio| penalty")

    @field_validator("loss_mode")
    @classmethod
    def _registered(cls, value: str) -> str:
        from hybridflow.engine.algorithms.losses import policy_loss_modes

        return _registered_name(value, policy_loss_modes(), "actor.policy_loss.loss_mode")


def _registered_backend(value: str, key: str) -> str:
    return _registered_name(value, backend_names(), key)


class ActorConfig(_Section):
    """The PPO policy update: training backend, mini/micro-batches, clipping (clip-higher, dual-clip), loss
    aggregation, KL loss."""

    strategy: str = Field(
        "ddp",
        description="a registered training backend (engine.extensions.register_backend): ddp: a Hugging Face "
        "model replicated on every rank, gradients all-reduced; fsdp: the same model "
        "sharded over the ranks with FSDP2 (weights, gradients and optimizer states 1/ranks each); megatron: "
        "megatron-core GPTModel with tensor (actor.tp) and pipeline (actor.pp) parallelism, generating through the "
        "3D-HybridEngine",
    )
    tp: int = Field(1, ge=1, description="actor.strategy=megatron or fsdp: tensor-parallel size")
    pp: int = Field(1, ge=1, description="actor.strategy=megatron: pipeline-parallel size (stages)")

    @field_validator("strategy")
    @classmethod
    def _registered_strategy(cls, value: str) -> str:
        return _registered_backend(value, "actor.strategy")

    optim: OptimConfig = Field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = Field(8, gt=0, description="prompts per optimizer step (times rollout.n sequences)")
    ppo_micro_batch_size: int = Field(8, gt=0, description="sequences per forward/backward")
    log_prob_micro_batch_size: int = Field(16, gt=0, description="sequences per forward when computing log-probs")
    ppo_epochs: int = Field(1, gt=0)
    shuffle: bool = True
    clip_ratio_low: float = Field(0.2, ge=0.0)
    clip_ratio_high: float = Field(0.2, ge=0.0)
    clip_ratio_c: float = Field(3.0, gt=1.0, description="dual-clip lower bound for negative advantages")
    loss_agg_mode: LossAggMode = "token-mean"
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0.0)
    kl_loss_type: KLType = "low_var_kl"
    tis_cap: float | None = Field(
        None,
        gt=0.0,
        description="truncated importance sampling of the rollout engine's drift: weight each token's policy loss by "
        "min(pi_actor / pi_rollout, tis_cap) (2.0 is usual); None: off. Needs rollout.name=vllm",
    )
    share_prompts: bool = Field(
        True,
        description="compute a prompt once for its n samples in the old_log_prob, ref and update passes (rows "
        "packed without padding, each prompt followed by its samples' responses; equal to full rows up to float32 "
        "rounding); false: every row packed with its own prompt. Megatron keeps padded full rows",
    )
    recompute_log_prob: bool = Field(
        False,
        description="run the old_log_prob stage even when the update is on-policy (one optimizer step per iteration: "
        "actor.ppo_epochs 1 and actor.ppo_mini_batch_size = data.train_batch_size, and no "
        "algorithm.use_kl_in_reward), where the old log-probs equal the update's own forward, detached, and the "
        "stage is skipped",
    )

    @property
    def shares_prompts(self) -> bool:
        """Whether the log-prob passes and the update compute a repeated prompt once: ``share_prompts`` with ddp
        or fsdp (megatron keeps full rows)."""
        return self.share_prompts and training_backend(self.strategy).packs_rows


class RefConfig(_Section):
    """The frozen reference policy (log-probs for the KL term)."""

    log_prob_micro_batch_size: int = Field(16, gt=0)


class CriticConfig(_Section):
    """The value model and its clipped value-loss update (PPO with GAE only)."""

    model_path: str | None = Field(None, description="None: initialise from model.path")
    strategy: str = Field(
        "ddp",
        description="a registered training backend, as actor.strategy; megatron needs actor.strategy=megatron and "
        "placement.colocate (the critic shares the actor's processes and layout)",
    )
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = Field(8, gt=0)
    ppo_micro_batch_size: int = Field(8, gt=0)
    forward_micro_batch_size: int = Field(16, gt=0)
    ppo_epochs: int = Field(1, gt=0)
    shuffle: bool = True
    cliprange_value: float = Field(0.5, gt=0.0)
    loss_agg_mode: LossAggMode = "token-mean"
    share_prompts: bool = Field(True, description="as actor.share_prompts, for the values and the critic update")

    @property
    def shares_prompts(self) -> bool:
        """Whether the value passes compute a repeated prompt once (``share_prompts``, not megatron)."""
        return self.share_prompts and training_backend(self.strategy).packs_rows

    @field_validator("strategy")
    @classmethod
    def _registered_strategy(cls, value: str) -> str:
        return _registered_backend(value, "critic.strategy")


class KLControlConfig(_Section):
    """The in-reward KL coefficient: fixed, or adaptive toward target_kl (Ziegler et al. 2019)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0.0)
    target_kl: float = Field(0.1, gt=0.0)
    horizon: int = Field(10000, gt=0)


class FilterGroupsConfig(_Section):
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2, verl's ``algorithm.filter_groups``): groups whose responses all
    score the same give GRPO no gradient, so they are dropped and more prompts are drawn (``data.gen_batch_size`` at
    a time) until ``data.train_batch_size`` prompts remain."""

    enable: bool = False
    metric: str = Field(
        "acc",
        description="what must differ within a group: seq_reward (the function's score), seq_final_reward (the "
        "training reward: function, reward model, overlong penalty) or a key the score function reports (acc)",
    )
    max_num_gen_batches: int = Field(
        0, ge=0, description="draws per iteration before the run stops as too easy or too hard (0: no limit)"
    )


class AlgorithmConfig(_Section):
    """Advantage estimator, the KL-in-reward penalty, dynamic sampling."""

    adv_estimator: str = Field(
        "grpo",
        description="a registered advantage estimator (algorithms.estimators.register_adv_est): gae (needs the "
        "critic), grpo (norm_adv_by_std_in_grpo false: Dr. GRPO), rloo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, opo, remax (baseline: the greedy response's score)",
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(1.0, ge=0.0, le=1.0)
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLType = "kl"
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    cost_limit: float | None = Field(
        None,
        description="Safe-RLHF (Dai et al. 2023): the episode cost d the policy must stay under; with a cost source "
        "(reward.cost_function or reward_model.cost_path) it adds a cost critic and the PPO-Lagrangian objective "
        "(None: off)",
    )
    lambda_init: float = Field(1.0, gt=0.0, description="Safe-RLHF: the Lagrange multiplier's first value")
    lambda_lr: float = Field(
        0.1, gt=0.0, description="Safe-RLHF: log(lambda) += lambda_lr x (mean episode cost - cost_limit) x lambda"
    )
    lambda_max: float | None = Field(None, gt=0.0, description="Safe-RLHF: the multiplier's ceiling (None: none)")
    episode_cost_window: int = Field(
        128, gt=0, description="Safe-RLHF: the last responses whose mean cost steps lambda (128 as Safe-RLHF's code)"
    )

    @field_validator("adv_estimator")
    @classmethod
    def _registered(cls, value: str) -> str:
        from hybridflow.engine.algorithms.estimators import adv_estimators

        return _registered_name(value, adv_estimators(), "algorithm.adv_estimator")


class OverlongBufferConfig(_Section):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): a training-reward penalty growing linearly over the
    last ``len`` tokens before ``rollout.response_length``, to ``-penalty`` at the limit (verl's
    ``overlong_buffer``)."""

    enable: bool = False
    len: int = Field(16, gt=0, description="tokens of the buffer before rollout.response_length")
    penalty: float = Field(1.0, ge=0.0, description="the penalty at rollout.response_length (verl's penalty_factor)")


class RewardConfig(_Section):
    """The score function; by default chosen by each prompt's data_source. Validation always scores with it."""

    custom_function: str | None = Field(None, description="'module:function' or 'path.py:function'")
    cost_function: str | None = Field(
        None,
        description="Safe-RLHF's cost signal, with the custom function's signature and forms ('module:function' or "
        "'path.py:function'); needs algorithm.cost_limit",
    )
    function_coef: float = Field(
        1.0,
        ge=0.0,
        description="weight of the function score in the training reward (0 with reward_model.enable: the RM alone)",
    )
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)


class RewardModelConfig(_Section):
    """A model-based reward (verl's ``reward_model`` section): a one-label sequence classifier scores each
    (prompt, response) after generation (stage ``rm_score``). The training reward is ``reward_model.coef`` x RM
    score + ``reward.function_coef`` x function score; validation keeps the function's exact-answer score."""

    enable: bool = False
    path: str | None = Field(None, description="local Hugging Face folder (AutoModelForSequenceClassification)")
    micro_batch_size: int = Field(8, gt=0, description="sequences per forward")
    max_length: int = Field(1024, gt=0, description="tokens the RM reads; longer texts lose the prompt's start")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: a whole copy per rank; fsdp: sharded at rest, gathered while it scores"
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="auto: fp32 on CPU, bf16 on CUDA")
    coef: float = Field(1.0, description="weight of the RM score in the training reward")
    cost_path: str | None = Field(
        None,
        description="Safe-RLHF's cost model: a one-label sequence classifier whose score is the response's cost, "
        "scored in the rm_score stage with this section's settings (needs algorithm.cost_limit; enable not needed)",
    )

    @model_validator(mode="after")
    def _path_when_enabled(self) -> RewardModelConfig:
        if self.enable and not self.path:
            raise ValueError(
                "reward_model.enable is true but reward_model.path is not set: give the RM's folder "
                "(-o reward_model.path=DIR, e.g. one written by hf rm train)"
            )
        return self


TrackerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]
"""The values of ``trainer.logger`` (verl's names; ``jsonl`` is verl's ``file``)."""


class _RunTrainer(_Section):
    """What every kind of run's ``trainer`` section has: seed, device, threads, output folders, trackers."""

    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    experiment_name: str = "hybridflow"
    output_dir: str = "outputs"
    num_threads: int = Field(0, ge=0, description="torch intra-op threads; 0 = torch's default")
    checkpoint_dir: str | None = Field(
        None,
        description="where checkpoints go; hf run / hf rm train: <checkpoint_dir>/<run_id> (None: <run "
        "folder>/checkpoints); the single-process trainer: <checkpoint_dir> (None: "
        "<output_dir>/<experiment_name>/checkpoints)",
    )
    logger: list[TrackerName] = Field(
        default_factory=lambda: ["console", "jsonl"],
        description="where metrics go besides the run store: console (one line per iteration), jsonl "
        "(<run folder>/metrics.jsonl), tensorboard (<run folder>/tensorboard), wandb (offline without a login), "
        "mlflow (trainer.mlflow_tracking_uri)",
    )
    project_name: str = Field("hybridflow", description="the wandb project and the MLflow experiment")
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI (sqlite:///..., file:..., http://host:5000); None: $MLFLOW_TRACKING_URI, "
        "else sqlite:///<output_dir>/mlflow.db",
    )

    @field_validator("logger", mode="before")
    @classmethod
    def _one_logger_is_a_list(cls, value: Any) -> Any:
        """``trainer.logger: wandb`` means ``[wandb]``; repeated names count once."""
        value = [value] if isinstance(value, str) else value
        return list(dict.fromkeys(value)) if isinstance(value, list) else value


class TrainerConfig(_RunTrainer):
    """Iterations, seed, device, validation and checkpoint frequency, output folders, trackers."""

    total_iterations: int = Field(1, ge=0)
    test_freq: int = Field(0, ge=0, description="validate every K iterations (0 = only before and after)")
    val_before_train: bool = True
    save_freq: int = Field(0, ge=0, description="save a checkpoint every K iterations (0 = only at the end of fit)")
    resume_from: str | None = Field(
        None,
        description="a global_step_<N> checkpoint folder to start from (hf run: a new run continuing it), or 'auto' "
        "(hf run: the run's own newest usable checkpoint, as hf resume always does; the single-process trainer: the "
        "latest in checkpoint_dir, if any)",
    )
    log_val_generations: int = Field(
        0, ge=0, description="keep N (prompt, response, score, ground truth) samples of every validation"
    )
    log_train_generations: int = Field(0, ge=0, description="keep N samples of every iteration's rollout")


class SlurmConfig(_Section):
    """Slurm resources of every worker group's job (``placement.executor: slurm``), passed to sbatch by submitit.

    Ranks are Slurm tasks: ``placement.nodes`` x ``placement.tasks_per_node`` of them, one per device.
    """

    partition: str | None = Field(None, description="sbatch --partition; None: the cluster's default")
    account: str | None = Field(None, description="sbatch --account")
    qos: str | None = Field(None, description="sbatch --qos")
    time_min: int = Field(24 * 60, ge=1, description="the job's time limit (minutes)")
    cpus_per_task: int = Field(1, ge=1, description="CPU cores per rank")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (one per rank on GPU clusters); 0 on CPU")
    mem_gb: float | None = Field(None, gt=0, description="memory per node (GiB); None: the cluster's default")
    signal_delay_s: int = Field(
        120, ge=0, description="SIGUSR2 this long before the time limit: the run checkpoints and stops"
    )
    sbatch: dict[str, Any] = Field(
        default_factory=dict,
        description="extra #SBATCH options, e.g. {constraint: a100, exclusive: true}",
    )
    setup: list[str] = Field(default_factory=list, description="shell lines run before the workers (module load ...)")
    interface: str | None = Field(
        None,
        description="network interface the controller's channel and the ranks' gloo/NCCL traffic use (e.g. ib0); "
        "None: the address of the host name (controller) and the route to the controller (ranks)",
    )


ROLES = ("actor", "rollout", "ref", "critic", "reward", "reward_model")
"""The roles of an RLHF run: the models (actor, its rollout, the frozen ref, critic, reward model) and ``reward``, the
score function (a CPU function; it lives with the rollout unless a pool names it)."""


class PoolConfig(_Section):
    """One resource pool (HybridFlow paper, section 4: a set of devices the roles placed on it share): one worker
    group of ``nodes`` x ``tasks_per_node`` ranks, one per device, hosting `roles`. Roles in one pool are colocated:
    they share the group's processes and run one after another. Roles in different pools run at the same time
    where the iteration allows (``placement.concurrent``)."""

    roles: list[str] = Field(min_length=1, description="roles whose models live in this pool (see ROLES)")
    nodes: int | None = Field(None, ge=1, description="nodes of this pool's group; None: placement.nodes")
    tasks_per_node: int | None = Field(None, ge=1, description="ranks per node; None: placement.tasks_per_node")
    slurm: dict[str, Any] = Field(
        default_factory=dict,
        description="placement.slurm keys this pool's job sets differently, e.g. {gpus_per_node: 4, partition: big}",
    )


@dataclass(frozen=True)
class Pool:
    """A resolved resource pool: the worker group `name` of ``nodes`` x ``tasks_per_node`` ranks, the roles of the
    run it hosts, and the Slurm resources of its job."""

    name: str
    roles: tuple[str, ...]
    nodes: int
    tasks_per_node: int
    slurm: SlurmConfig

    @property
    def world_size(self) -> int:
        """Ranks: nodes x tasks_per_node."""
        return self.nodes * self.tasks_per_node


class PlacementConfig(_Section):
    """Where the roles run: on resource pools, each one worker group (one Slurm job, or local processes).

    ``pools`` names the pools and partitions the roles into them, any way that keeps actor and rollout together
    (the rollout generates with the actor's weights). Without ``pools``, ``colocate`` picks one of two layouts:
    true (the HybridFlow default): every role in one pool ``actor_rollout_ref`` of ``nodes`` x ``tasks_per_node``
    ranks; false: the critic (``critic_nodes`` x ``critic_tasks_per_node`` ranks) and the reward model each in a
    pool of its own (named after the role). Every rank of a pool is one data-parallel replica of its models (or a
    shard, for fsdp and megatron).
    """

    colocate: bool = True
    pools: dict[str, PoolConfig] | None = Field(
        None,
        description="named resource pools: {name: {roles: [...], nodes, tasks_per_node, slurm: {...}}}; every role "
        "of the run in exactly one pool; None: the layout placement.colocate picks",
    )
    concurrent: bool = Field(
        True, description="stages of roles in different pools run at the same time; false: one after another"
    )
    executor: Literal["local", "slurm"] = Field("local", description="local processes, or one Slurm job per pool")
    nodes: int = Field(1, ge=1, description="nodes per pool (local executor: 1)")
    tasks_per_node: int = Field(1, ge=1, description="ranks per node: data-parallel replicas, one per device")
    critic_nodes: int | None = Field(None, ge=1, description="colocate=false: the critic pool's nodes; None: nodes")
    critic_tasks_per_node: int | None = Field(None, ge=1, description="its ranks per node; None: tasks_per_node")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed; auto: nccl on GPUs")
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    auto: bool = Field(
        False,
        description="plan the pools and strategies at hf run (hf plan's search) over placement.nodes x "
        "placement.tasks_per_node devices of placement.hardware; `placement: auto` is short for {auto: true}",
    )
    hardware: str | None = Field(
        None, description="placement.auto: the hardware profile (a100-80gb, h100-80gb, h200, or hf plan --calibrate's)"
    )
    plan: str | None = Field(None, description="the placement plan (hf plans list) this placement came from")
    heartbeat_timeout_s: float = Field(10.0, gt=0, description="a rank silent this long is reported dead")
    call_timeout_s: float | None = Field(None, gt=0, description="limit for one stage call (a stuck rank); None: none")

    @model_validator(mode="before")
    @classmethod
    def _earlier_world_size(cls, values: Any) -> Any:
        """Configs recorded before nodes x tasks_per_node (``world_size: 1``, ``slurm: {}``) still load;
        ``placement: auto`` is ``{auto: true}``."""
        if values == "auto":
            return {"auto": True}
        if isinstance(values, dict) and "world_size" in values:
            values = dict(values)
            values.setdefault("tasks_per_node", values.pop("world_size"))
        return values

    @model_validator(mode="after")
    def _pools_or_shorthand(self) -> PlacementConfig:
        if self.pools is not None:
            shorthand = [k for k in ("critic_nodes", "critic_tasks_per_node") if getattr(self, k) is not None]
            shorthand += ["colocate"] if not self.colocate else []
            if shorthand:
                raise ValueError(
                    f"placement.pools replaces placement.{', placement.'.join(shorthand)}: give the critic's ranks "
                    "in its pool (placement.pools.<name>.nodes / tasks_per_node) and remove those keys"
                )
            for name, pool in self.pools.items():
                unknown = sorted(set(pool.roles) - set(ROLES))
                if unknown:
                    raise ValueError(
                        f"placement.pools.{name}.roles: unknown role(s) {', '.join(map(repr, unknown))}; "
                        f"roles are {', '.join(ROLES)}"
                    )
                for key in pool.slurm:
                    if key not in SlurmConfig.model_fields:
                        raise ValueError(
                            f"placement.pools.{name}.slurm.{key}: unknown key; "
                            f"allowed: {', '.join(SlurmConfig.model_fields)}"
                        )
                try:
                    SlurmConfig.model_validate({**self.slurm.model_dump(), **pool.slurm})
                except ValidationError as e:
                    raise ValueError(f"placement.pools.{name}.slurm: {_format_errors(e)}") from None
            owners: dict[str, list[str]] = {}
            for name, pool in self.pools.items():
                for role in pool.roles:
                    owners.setdefault(role, []).append(name)
            doubled = {role: names for role, names in owners.items() if len(names) > 1}
            if doubled:
                role, names = next(iter(doubled.items()))
                raise ValueError(
                    f"placement.pools: role {role!r} is in pools {' and '.join(names)}; put each role in one pool"
                )
        for name, pool in self.pool_configs().items():
            if self.executor == "local" and pool.nodes > 1:
                key = "critic_nodes" if name == "critic" and self.critic_nodes else "nodes"
                key = f"pools.{name}.nodes" if self.pools is not None and self.pools[name].nodes else key
                raise ValueError(
                    f"placement.{key} > 1 needs placement.executor: slurm (local groups run on this machine)"
                )
        return self

    def pool_configs(self) -> dict[str, Pool]:
        """Every configured pool with its ranks and Slurm resources resolved, hosting all the roles it names
        (`HybridFlowConfig.pools` keeps only the roles a run uses). Without ``pools``: the ``colocate`` layout
        over every role."""
        if self.pools is None:
            if self.colocate:
                return {"actor_rollout_ref": self.pool("actor_rollout_ref", ROLES)}
            split = ("critic", "reward_model")
            layout = {"actor_rollout_ref": self.pool("actor_rollout_ref", [r for r in ROLES if r not in split])}
            layout["critic"] = self.pool("critic", ["critic"], self.critic_nodes, self.critic_tasks_per_node)
            layout["reward_model"] = self.pool("reward_model", ["reward_model"])
            return layout
        return {
            name: self.pool(name, pool.roles, pool.nodes, pool.tasks_per_node, pool.slurm)
            for name, pool in self.pools.items()
        }

    def pool(
        self,
        name: str,
        roles: Any,
        nodes: int | None = None,
        tasks_per_node: int | None = None,
        slurm: dict[str, Any] | None = None,
    ) -> Pool:
        merged = SlurmConfig.model_validate({**self.slurm.model_dump(), **(slurm or {})})
        return Pool(name, tuple(roles), nodes or self.nodes, tasks_per_node or self.tasks_per_node, merged)

    @property
    def world_size(self) -> int:
        """Ranks of a pool that does not set its own: nodes x tasks_per_node."""
        return self.nodes * self.tasks_per_node


class HybridFlowConfig(_Section):
    """The whole run configuration. See the README's configuration reference."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)

    @model_validator(mode="before")
    @classmethod
    def _data_section(cls, values: Any) -> Any:
        if isinstance(values, dict) and "data" not in values:
            raise ValueError("no data section: set data.train_files (parquet/jsonl) or data.reasoning_gym.name")
        return values

    @model_validator(mode="after")
    def _batch_sizes(self) -> HybridFlowConfig:
        self._resolve_rollout()
        if self.data.train_batch_size % self.actor.ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size ({self.data.train_batch_size}) must be a multiple of "
                f"actor.ppo_mini_batch_size ({self.actor.ppo_mini_batch_size})"
            )
        if self.algorithm.adv_estimator == "gae" and self.data.train_batch_size % self.critic.ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size ({self.data.train_batch_size}) must be a multiple of "
                f"critic.ppo_mini_batch_size ({self.critic.ppo_mini_batch_size})"
            )
        self._check_pools()
        self._parallel_layout()
        self._divisible_by_ranks()
        if self.actor.tis_cap is not None and not rollout_spec(self.rollout.name).reports_log_probs:
            raise ValueError(
                f"actor.tis_cap corrects the drift between the rollout engine's and the actor's log-probs, and the "
                f"{self.rollout.name} rollout reports none (it samples from the actor itself): set rollout.name=vllm "
                "or remove actor.tis_cap"
            )
        overlong = self.reward.overlong_buffer
        if overlong.enable and overlong.len >= self.rollout.response_length:
            raise ValueError(
                f"reward.overlong_buffer.len={overlong.len} must be below rollout.response_length="
                f"{self.rollout.response_length}: the buffer is the last tokens before the limit"
            )
        if self.reward.function_coef == 0 and not self.reward_model.enable:
            raise ValueError(
                "reward.function_coef=0 leaves no training reward: set it > 0, or reward_model.enable=true with "
                "reward_model.path"
            )
        from hybridflow.engine.algorithms.estimators import uses_greedy_baseline, uses_groups

        estimator = self.algorithm.adv_estimator
        if uses_groups(estimator) and self.rollout.n < 2:
            raise ValueError(
                f"algorithm.adv_estimator={estimator} compares responses within a group: set rollout.n >= 2"
            )
        if self.algorithm.filter_groups.enable:
            if self.rollout.n < 2:
                raise ValueError(
                    "algorithm.filter_groups drops the groups whose responses all score the same, and with "
                    "rollout.n=1 every group is one response: set rollout.n >= 2"
                )
            if uses_greedy_baseline(estimator):
                raise ValueError(
                    f"algorithm.filter_groups is for group estimators (grpo, rloo, ...), not {estimator}: set "
                    "algorithm.filter_groups.enable=false or another algorithm.adv_estimator"
                )
        elif self.data.gen_batch_size is not None:
            raise ValueError(
                "data.gen_batch_size sets the prompts of each draw of dynamic sampling: enable "
                "algorithm.filter_groups.enable or remove data.gen_batch_size"
            )
        self._check_safe_rlhf()
        if uses_greedy_baseline(estimator) and self.rollout.temperature == 0:
            raise ValueError(
                f"algorithm.adv_estimator={estimator} subtracts the greedy response's score, and rollout.temperature=0 "
                "samples the greedy response itself (every advantage 0): set rollout.temperature > 0"
            )
        return self

    def _check_safe_rlhf(self) -> None:
        """Safe-RLHF needs its limit and one cost source (a cost function or a cost model), a critic (GAE) for the
        cost critic to sit beside, and a ddp or fsdp critic (the cost critic is a second value model in the critic's
        group)."""
        limit = self.algorithm.cost_limit
        sources = {"reward.cost_function": self.reward.cost_function}
        sources["reward_model.cost_path"] = self.reward_model.cost_path
        given = {key: value for key, value in sources.items() if value is not None}
        if limit is not None and not given:
            raise ValueError(
                f"algorithm.cost_limit={limit} needs a cost source: set reward.cost_function ('module:function' or "
                "'path.py:function', the custom reward's signature) or reward_model.cost_path (a cost model's "
                "folder), or remove algorithm.cost_limit"
            )
        if len(given) > 1:
            raise ValueError(
                "reward.cost_function and reward_model.cost_path are both set: Safe-RLHF takes one cost; remove one"
            )
        for key, value in given.items():
            if limit is None:
                raise ValueError(
                    f"{key}={value} is read only by Safe-RLHF: set algorithm.cost_limit (the episode cost to stay "
                    f"under), or remove {key}"
                )
        if limit is None:
            return
        if self.algorithm.adv_estimator != "gae":
            raise ValueError(
                f"algorithm.cost_limit (Safe-RLHF) estimates cost advantages with a cost critic beside the critic: "
                f"set algorithm.adv_estimator=gae, not {self.algorithm.adv_estimator}"
            )
        if training_backend(self.critic.strategy, "critic.strategy").hosted_by_actor:
            raise ValueError(
                "algorithm.cost_limit (Safe-RLHF): the cost critic is built for ddp and fsdp critics: set "
                "critic.strategy to ddp or fsdp"
            )

    def safe_rlhf(self) -> bool:
        """Whether the run is Safe-RLHF's PPO-Lagrangian: ``algorithm.cost_limit`` with ``reward.cost_function`` or
        ``reward_model.cost_path``."""
        return self.algorithm.cost_limit is not None

    def prompts_per_draw(self) -> int:
        """Prompts drawn per generation: ``data.gen_batch_size`` with dynamic sampling, else
        ``data.train_batch_size``."""
        return self.data.gen_batch_size or self.data.train_batch_size

    def skips_old_log_prob(self) -> bool:
        """Whether the old_log_prob stage is skipped: the update is on-policy, one optimizer step per iteration
        (``actor.ppo_epochs`` 1, ``actor.ppo_mini_batch_size`` = ``data.train_batch_size``), so the log-probs it
        would compute are the update's own before its step; nothing reads them before the update
        (``algorithm.use_kl_in_reward`` does); and ``actor.recompute_log_prob`` is false."""
        a = self.actor
        one_step = a.ppo_epochs == 1 and a.ppo_mini_batch_size == self.data.train_batch_size
        return one_step and not self.algorithm.use_kl_in_reward and not a.recompute_log_prob

    def roles(self) -> list[str]:
        """The roles this run uses: actor, rollout and reward (the score function: validation uses it) always; ref
        for a KL term (``actor.use_kl_loss`` or ``algorithm.use_kl_in_reward``); critic for an advantage estimator
        that needs one (GAE); reward_model when ``reward_model.enable`` or a cost model (``reward_model.cost_path``)."""
        from hybridflow.engine.algorithms.estimators import uses_critic

        roles = ["actor", "rollout", "reward"]
        if self.actor.use_kl_loss or self.algorithm.use_kl_in_reward:
            roles.append("ref")
        if uses_critic(self.algorithm.adv_estimator):
            roles.append("critic")
        if self.reward_model.enable or self.reward_model.cost_path:
            roles.append("reward_model")
        return roles

    def pools(self) -> dict[str, Pool]:
        """The run's resource pools (`PlacementConfig.pool_configs`), each hosting the roles of `roles` it names
        (the score function ``reward``, when no pool names it, in the rollout's pool); pools hosting none of them
        are left out (``colocate: false`` without a critic or reward model: one pool)."""
        used = self.roles()
        configured = self.placement.pool_configs()
        named = {r for pool in configured.values() for r in pool.roles}
        out = {}
        for name, pool in configured.items():
            roles = [
                r
                for r in used
                if r in pool.roles or (r == "reward" and "reward" not in named and "rollout" in pool.roles)
            ]
            if roles:
                out[name] = replace(pool, roles=tuple(roles))
        return out

    def pool_of(self, role: str) -> Pool:
        """The pool hosting `role` (one of `roles`).

        Raises:
            KeyError: the run does not use `role`."""
        for pool in self.pools().values():
            if role in pool.roles:
                return pool
        raise KeyError(f"this run has no {role!r} role (its roles: {', '.join(self.roles())})")

    def _check_pools(self) -> None:
        """``placement.pools`` must place every role the run uses, keep actor and rollout together (the
        3D-HybridEngine and the hf rollout generate with the actor's weights, in its processes), and use every
        pool it names."""
        if self.placement.pools is None:
            return
        used = self.roles()
        enable = {
            "ref": "actor.use_kl_loss or algorithm.use_kl_in_reward",
            "critic": "algorithm.adv_estimator=gae",
            "reward_model": "reward_model.enable or reward_model.cost_path",
        }
        pools = self.placement.pools
        owner = {role: name for name, pool in pools.items() for role in pool.roles}
        for role in used:
            if role not in owner and role != "reward":
                raise ValueError(f"placement.pools: role {role!r} is in no pool; add it to the roles of one pool")
        if owner["actor"] != owner["rollout"]:
            raise ValueError(
                f"placement.pools: actor (pool {owner['actor']}) and rollout (pool {owner['rollout']}) must share a "
                "pool: the rollout generates with the actor's weights in the actor's processes (3D-HybridEngine); "
                f"put both in placement.pools.{owner['actor']}.roles"
            )
        for name, pool in pools.items():
            if not set(pool.roles) & set(used):
                how = "; ".join(f"{r}: {enable[r]}" for r in pool.roles if r in enable)
                raise ValueError(
                    f"placement.pools.{name}: this run uses none of its roles ({', '.join(pool.roles)}); remove the "
                    f"pool, or enable them ({how})"
                )
        critic = training_backend(self.critic.strategy, "critic.strategy")
        if critic.hosted_by_actor and "critic" in owner and owner["critic"] != owner["actor"]:
            raise ValueError(
                f"critic.strategy={critic.name} runs in the {critic.name} actor's processes and layout: put critic in "
                f"the actor's pool (placement.pools.{owner['actor']}.roles), or set critic.strategy=ddp|fsdp"
            )

    def _resolve_rollout(self) -> None:
        """``rollout.name: auto``: vllm where it is installed, unless the megatron actor generates tensor-parallel
        (vLLM is fed from the generation shards only at rollout.gen_tp=1), else hf."""
        if self.rollout.name != "auto":
            return
        vllm = importlib.util.find_spec("vllm") is not None
        megatron_tp = self.actor.strategy == "megatron" and (self.rollout.gen_tp or self.actor.tp) > 1
        self.rollout.name = "vllm" if vllm and not megatron_tp else "hf"

    def _parallel_layout(self) -> None:
        """The actor's layout as its backend allows (`TrainingBackend.check_layout`), and a critic hosted by the actor
        (megatron) only with a megatron actor in the actor's pool."""
        world = self.pool_of("actor").world_size
        separate = self.placement.pools is None and not self.placement.colocate
        critic = training_backend(self.critic.strategy, "critic.strategy")
        if critic.hosted_by_actor and (self.actor.strategy != critic.name or separate):
            raise ValueError(
                f"critic.strategy={critic.name} runs in the {critic.name} actor's processes and layout: set "
                f"actor.strategy={critic.name} and place the critic in the actor's pool (placement.colocate=true), or "
                "critic.strategy=ddp|fsdp"
            )
        training_backend(self.actor.strategy).check_layout(self, world)

    def actor_layout(self, world: int | None = None) -> HybridLayout:
        """The actor group's training layout p-t-d and generation layout p_g-t_g (``actor.strategy=megatron``;
        with ``ddp`` every rank is a data-parallel replica: p = t = 1, d = ranks) over `world` ranks (default: the
        actor pool's).

        Raises:
            ValueError: rollout.gen_tp does not divide actor.tp."""
        actor = self.actor
        d = (world or self.pool_of("actor").world_size) // (actor.tp * actor.pp)
        return HybridLayout(p=actor.pp, t=actor.tp, d=d, p_g=self.rollout.gen_pp, t_g=self.rollout.gen_tp or actor.tp)

    def _divisible_by_ranks(self) -> None:
        """Every data-parallel rank must get the same number of sequences of every mini-batch (each optimizer step
        all-reduces gradients once per rank)."""
        n = self.rollout.n
        actor_pool = self.pool_of("actor")
        actor_dp = actor_pool.world_size // (self.actor.tp * self.actor.pp)
        checks = [("actor", actor_pool, actor_dp, self.actor.ppo_mini_batch_size)]
        if "critic" in self.roles():
            critic_pool = self.pool_of("critic")
            checks.append(("critic", critic_pool, critic_pool.world_size, self.critic.ppo_mini_batch_size))
        for role, pool, ranks, mini in checks:
            if ranks > 1 and (mini * n) % ranks:
                split = " / (actor.tp x actor.pp)" if role == "actor" and ranks != pool.world_size else ""
                raise ValueError(
                    f"{role}.ppo_mini_batch_size x rollout.n = {mini * n} sequences cannot be split evenly over the "
                    f"{ranks} data-parallel ranks of the {role}'s pool {pool.name} (its nodes x "
                    f"tasks_per_node{split}); make it a multiple of the ranks"
                )


class PreferenceDataConfig(_Files):
    """Preference pairs for reward-model training, in the field's layout (TRL's preference datasets): parquet or
    jsonl files with columns ``chosen`` and ``rejected`` (strings, or chat lists of the response's messages) and
    optionally ``prompt`` (a string, or a chat list). Without ``val_files``, ``val_fraction`` of the training pairs
    is held out (chosen by ``seed``)."""

    train_files: list[str] = Field(description="parquet/jsonl preference files (path or list)")
    val_files: list[str] = Field(default_factory=list, description="held-out pairs (path or list)")
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="held out of train_files when val_files is empty")
    max_length: int = Field(512, gt=0, description="tokens per (prompt + response); longer: the prompt's start goes")
    train_batch_size: int = Field(16, gt=0, description="pairs per optimizer step")
    micro_batch_size: int = Field(4, gt=0, description="pairs per forward/backward (2 sequences each)")
    val_batch_size: int = Field(64, gt=0, description="pairs per evaluation call")
    shuffle: bool = True
    seed: int = 0


class RMTrainerConfig(_RunTrainer):
    """Epochs, evaluation, checkpoints and outputs of a reward-model training run (``hf rm train``)."""

    experiment_name: str = "reward_model"
    total_epochs: int = Field(1, ge=0, description="passes over the training pairs")
    val_before_train: bool = Field(True, description="evaluate the initial model (step 0)")
    save_freq: int = Field(0, ge=0, description="also checkpoint every K steps (always: at each epoch's end)")


class RMTrainingConfig(_Section):
    """A reward-model training run (``hf rm train``): a sequence classifier with one label, initialised from
    ``model.path`` (a causal LM gets a new score head), trained with the Bradley-Terry loss on preference pairs."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: PreferenceDataConfig
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    trainer: RMTrainerConfig = Field(default_factory=RMTrainerConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)

    @model_validator(mode="after")
    def _one_pool(self) -> RMTrainingConfig:
        if self.placement.pools is not None:
            raise ValueError(
                "hf rm train runs one data-parallel worker group: remove placement.pools and give its ranks with "
                "placement.nodes x tasks_per_node"
            )
        return self

    @model_validator(mode="after")
    def _pairs_split_over_ranks(self) -> RMTrainingConfig:
        ranks, batch = self.placement.world_size, self.data.train_batch_size
        if batch % ranks:
            raise ValueError(
                f"data.train_batch_size ({batch} pairs) must be a multiple of the group's {ranks} data-parallel "
                "ranks (placement.nodes x tasks_per_node): every rank takes the same share of each step"
            )
        return self


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names each offending key."""


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[leaf] = value


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        elif e["type"] == "literal_error":
            lines.append(f"  {key}: {e['msg']} (got {e['input']!r})")
        else:
            lines.append(f"  {key}: {e['msg']}")
    return "invalid configuration:\n" + "\n".join(lines)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """``line L, column C: <problem>`` from a YAML parse error (1-based, as editors count)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, schema: type[_Section] | None = None
) -> HybridFlowConfig:
    """Read a YAML config, apply ``key.sub=value`` overrides (values parsed as YAML), and validate against
    `schema` (default `HybridFlowConfig`; `RMTrainingConfig` for ``hf rm train``).

    A config may extend others, as Hydra's defaults list does: ``defaults: [grpo_smollm2.yaml]`` (paths relative to
    the file) reads those first, in order, and merges this file's keys over them, section by section.

    Raises:
        ConfigError: naming every unknown, missing or ill-typed key and, for choices, the allowed values; a
            ``defaults`` entry that is missing or loops back.
        FileNotFoundError: if `path` does not exist.
    """
    tree = {} if path is None else _read_tree(Path(path))
    return validate_config(apply_overrides(tree, overrides or [], source=str(path or "the config")), schema)


def _read_tree(path: Path, extending: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The YAML tree of `path` merged over its ``defaults`` (read recursively; `extending`: the files on the way)."""
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, ...)")
    bases = tree.pop("defaults", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: defaults must be a list of YAML files to extend, e.g. [grpo_smollm2.yaml]")
    merged: dict[str, Any] = {}
    for base in bases:
        base_path = (path.parent / base).resolve()
        if base_path in extending or base_path == path.resolve():
            raise ConfigError(f"{path}: defaults entry {base} extends itself (through {[str(p) for p in extending]})")
        if not base_path.is_file():
            raise ConfigError(f"{path}: defaults entry {base} is not a file ({base_path})")
        merged = _merged(merged, _read_tree(base_path, (*extending, path.resolve())))
    return _merged(merged, tree)


def _merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`: mappings merge key by key, anything else in `top` replaces `base`'s."""
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def validate_config(tree: dict[str, Any], schema: type[_Section] | None = None) -> HybridFlowConfig:
    """Validate a config tree (plain data, e.g. a stored run's config) against `schema` (default
    `HybridFlowConfig`).

    Raises:
        ConfigError: naming every unknown, missing or ill-typed key and, for choices, the allowed values."""
    try:
        return (schema or HybridFlowConfig).model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=[x, y]"]`` -> ``{"a.b": 1, "c": ["x", "y"]}`` (values parsed as YAML).

    Raises:
        ConfigError: for an item that is not ``key=value``."""
    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        parsed[key.strip()] = yaml.safe_load(raw)
    return parsed


RESUMABLE_KEYS = (
    "trainer.total_iterations",
    "trainer.total_epochs",
    "trainer.test_freq",
    "trainer.save_freq",
    "trainer.logger",
    "trainer.project_name",
    "trainer.mlflow_tracking_uri",
    "trainer.log_val_generations",
    "trainer.log_train_generations",
    "placement.executor",
    "placement.slurm.",
    "placement.pools.*.slurm.",
    "placement.concurrent",
    "placement.heartbeat_timeout_s",
    "placement.call_timeout_s",
)
"""Keys (or prefixes, ending in '.'; ``*`` stands for a pool's name) that ``hf resume RUN_ID -o ...`` may change:
how long the run goes, how often it validates and saves, where its metrics and samples are logged, and where, under
which limits and whether at the same time its workers run. None of them changes what an iteration computes, so the
resumed run's iterations equal those of a run started with the new values."""


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{prefix}{key}.").items()}
    return {prefix.removesuffix("."): tree}


def resume_config(
    stored: dict[str, Any], overrides: list[str], schema: type[_Section] | None = None
) -> HybridFlowConfig:
    """A recorded run's config with ``hf resume`` overrides applied, refused where they would change the
    computation (anything outside `RESUMABLE_KEYS`: the model, data, batch sizes, algorithm, ...).

    Raises:
        ConfigError: for an invalid override or value, or one that changes a key outside `RESUMABLE_KEYS` (the
            keys are named, with the way out: a new run with ``hf run``)."""
    old = validate_config(stored, schema).model_dump(mode="json")
    new = validate_config(apply_overrides(stored, overrides, source="the run's recorded config"), schema)
    before, after = _leaves(old), _leaves(new.model_dump(mode="json"))
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    refused = [
        k for k in changed if not any(fnmatch.fnmatchcase(k, f"{r}*" if r.endswith(".") else r) for r in RESUMABLE_KEYS)
    ]
    if refused:
        raise ConfigError(
            f"hf resume cannot change {', '.join(refused)}: that would change what the run's iterations compute, "
            "so the resumed run would no longer be one run. Start a new run with hf run instead. Resume may change: "
            + ", ".join(k + ("*" if k.endswith(".") else "") for k in RESUMABLE_KEYS)
        )
    return new


_PROMPT_SOURCES = {"files": ("data.train_files", "data.val_files"), "reasoning_gym": ("data.reasoning_gym",)}


def apply_overrides(tree: dict[str, Any], overrides: list[str], source: str = "the config") -> dict[str, Any]:
    """A copy of `tree` with ``key.sub=value`` overrides applied.

    Prompt sources: an override that names one kind of source (``data.train_files`` / ``data.val_files``, or
    ``data.reasoning_gym.*``) replaces the other kind given by `tree` rather than mixing both into one training set
    (a warning says so); to mix them, name both kinds in the overrides or write both in the file.

    ``placement: auto`` becomes ``{auto: true}`` first, so ``-o placement.hardware=...`` can complete it.

    Raises:
        ConfigError: for a malformed override or one that descends into a value."""
    tree = copy.deepcopy(tree)
    if tree.get("placement") == "auto":
        tree["placement"] = {"auto": True}
    parsed = parse_overrides(overrides)
    named = {kind for kind, keys in _PROMPT_SOURCES.items() for key in parsed if key.startswith(keys)}
    data = tree.get("data")
    if len(named) == 1 and isinstance(data, dict):
        (kind,) = named
        other = "reasoning_gym" if kind == "files" else "files"
        dropped = [k for k in _PROMPT_SOURCES[other] if data.get(k.removeprefix("data."))]
        for key in dropped:
            del data[key.removeprefix("data.")]
        if dropped:
            logger.warning(
                "%s given with -o replaces %s of %s (name both with -o to train on a mix)",
                " / ".join(_PROMPT_SOURCES[kind]),
                " / ".join(dropped),
                source,
            )
    for key, value in parsed.items():
        _set_dotted(tree, key, value)
    return tree
