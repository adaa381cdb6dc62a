"""Typed run configuration (pydantic), loaded from YAML with ``-o key=value`` overrides.

Sections follow verl's vocabulary, flattened one level: ``model``, ``data``, ``rollout``, ``actor``, ``ref``,
``critic``, ``algorithm``, ``reward``, ``reward_model``, ``trainer`` (verl's ``actor_rollout_ref.actor.ppo_epochs``
is our ``actor.ppo_epochs``). Unknown or ill-typed keys are errors that name the key and the allowed values.
Batch sizes: ``data.train_batch_size`` and ``*.ppo_mini_batch_size`` count prompts (as in verl);
micro-batch sizes count sequences (prompt + one response).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hybridflow.engine.parallel_layout import HybridLayout

logger = logging.getLogger(__name__)


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
    val_batch_size: int = Field(64, gt=0, description="prompts per validation generate call")
    shuffle: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if not self.train_files and self.reasoning_gym is None:
            raise ValueError("set data.train_files (parquet/jsonl) or data.reasoning_gym.name")
        return self


class RolloutConfig(_Section):
    """Sampling: responses per prompt, temperature, top-p/top-k, response length (tokens)."""

    name: Literal["hf", "vllm", "auto"] = Field(
        "hf",
        description="hf: transformers generate; vllm: an in-process vLLM engine; auto: vllm where it is installed and "
        "the layout allows it, else hf (resolved when the config is loaded, and recorded resolved)",
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


class OptimConfig(_Section):
    """AdamW with linear warm-up to a constant LR, and global grad-norm clipping."""

    lr: float = Field(1e-6, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up, then constant")
    grad_clip: float = Field(1.0, gt=0.0, description="max global grad norm")


LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


class ActorConfig(_Section):
    """The PPO policy update: training backend, mini/micro-batches, clipping (clip-higher, dual-clip), loss
    aggregation, KL loss."""

    strategy: Literal["ddp", "fsdp", "megatron"] = Field(
        "ddp",
        description="ddp: a Hugging Face model replicated on every rank, gradients all-reduced; fsdp: the same model "
        "sharded over the ranks with FSDP2 (weights, gradients and optimizer states 1/ranks each); megatron: "
        "megatron-core GPTModel with tensor (actor.tp) and pipeline (actor.pp) parallelism, generating through the "
        "3D-HybridEngine",
    )
    tp: int = Field(1, ge=1, description="actor.strategy=megatron or fsdp: tensor-parallel size")
    pp: int = Field(1, ge=1, description="actor.strategy=megatron: pipeline-parallel size (stages)")
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


class RefConfig(_Section):
    """The frozen reference policy (log-probs for the KL term)."""

    log_prob_micro_batch_size: int = Field(16, gt=0)


class CriticConfig(_Section):
    """The value model and its clipped value-loss update (PPO with GAE only)."""

    model_path: str | None = Field(None, description="None: initialise from model.path")
    strategy: Literal["ddp", "fsdp", "megatron"] = Field(
        "ddp",
        description="as actor.strategy; megatron needs actor.strategy=megatron and placement.colocate (the critic "
        "shares the actor's processes and layout)",
    )
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = Field(8, gt=0)
    ppo_micro_batch_size: int = Field(8, gt=0)
    forward_micro_batch_size: int = Field(16, gt=0)
    ppo_epochs: int = Field(1, gt=0)
    shuffle: bool = True
    cliprange_value: float = Field(0.5, gt=0.0)
    loss_agg_mode: LossAggMode = "token-mean"


class KLControlConfig(_Section):
    """The in-reward KL coefficient: fixed, or adaptive toward target_kl (Ziegler et al. 2019)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0.0)
    target_kl: float = Field(0.1, gt=0.0)
    horizon: int = Field(10000, gt=0)


class AlgorithmConfig(_Section):
    """Advantage estimator and the KL-in-reward penalty."""

    adv_estimator: Literal["grpo", "gae", "rloo"] = "grpo"
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(1.0, ge=0.0, le=1.0)
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLType = "kl"
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)


class RewardConfig(_Section):
    """The score function; by default chosen by each prompt's data_source. Validation always scores with it."""

    custom_function: str | None = Field(None, description="'module:function' or 'path.py:function'")
    function_coef: float = Field(
        1.0,
        ge=0.0,
        description="weight of the function score in the training reward (0 with reward_model.enable: the RM alone)",
    )


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


class PlacementConfig(_Section):
    """Where the roles run. Colocated (the HybridFlow default): actor, rollout, ref, reward, critic and reward model
    share one worker group's processes. Split: the critic and the reward model each get a worker group of their own
    (actor, rollout, ref and reward stay together: the rollout generates with the actor's weights).

    Each group has ``nodes`` x ``tasks_per_node`` ranks (the critic's own group: ``critic_nodes`` x
    ``critic_tasks_per_node`` when set); every rank is one data-parallel replica.
    """

    colocate: bool = True
    executor: Literal["local", "slurm"] = Field("local", description="local processes, or one Slurm job per group")
    nodes: int = Field(1, ge=1, description="nodes per worker group (local executor: 1)")
    tasks_per_node: int = Field(1, ge=1, description="ranks per node: data-parallel replicas, one per device")
    critic_nodes: int | None = Field(None, ge=1, description="the split critic group's nodes; None: nodes")
    critic_tasks_per_node: int | None = Field(None, ge=1, description="its ranks per node; None: tasks_per_node")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed; auto: nccl on GPUs")
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    heartbeat_timeout_s: float = Field(10.0, gt=0, description="a rank silent this long is reported dead")
    call_timeout_s: float | None = Field(None, gt=0, description="limit for one stage call (a stuck rank); None: none")

    @model_validator(mode="before")
    @classmethod
    def _earlier_world_size(cls, values: Any) -> Any:
        """Configs recorded before nodes x tasks_per_node (``world_size: 1``, ``slurm: {}``) still load."""
        if isinstance(values, dict) and "world_size" in values:
            values = dict(values)
            values.setdefault("tasks_per_node", values.pop("world_size"))
        return values

    @model_validator(mode="after")
    def _local_is_one_node(self) -> PlacementConfig:
        if self.executor == "local" and max(self.nodes, self.critic_nodes or 1) > 1:
            raise ValueError("placement.nodes > 1 needs placement.executor: slurm (local groups run on this machine)")
        return self

    @property
    def world_size(self) -> int:
        """Ranks of the actor/rollout/ref group (and of the colocated critic)."""
        return self.nodes * self.tasks_per_node

    @property
    def critic_world_size(self) -> int:
        """Ranks of the critic's group."""
        if self.colocate:
            return self.world_size
        return (self.critic_nodes or self.nodes) * (self.critic_tasks_per_node or self.tasks_per_node)


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
        self._parallel_layout()
        self._divisible_by_ranks()
        if self.actor.tis_cap is not None and self.rollout.name != "vllm":
            raise ValueError(
                "actor.tis_cap corrects the drift between the rollout engine's and the actor's log-probs, and the hf "
                "rollout samples from the actor itself: set rollout.name=vllm or remove actor.tis_cap"
            )
        if self.reward.function_coef == 0 and not self.reward_model.enable:
            raise ValueError(
                "reward.function_coef=0 leaves no training reward: set it > 0, or reward_model.enable=true with "
                "reward_model.path"
            )
        if self.algorithm.adv_estimator in ("grpo", "rloo") and self.rollout.n < 2:
            raise ValueError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator} compares responses within a "
                "group: set rollout.n >= 2"
            )
        return self

    def _resolve_rollout(self) -> None:
        """``rollout.name: auto``: vllm where it is installed, unless the megatron actor generates tensor-parallel
        (vLLM is fed from the generation shards only at rollout.gen_tp=1), else hf."""
        if self.rollout.name != "auto":
            return
        vllm = importlib.util.find_spec("vllm") is not None
        megatron_tp = self.actor.strategy == "megatron" and (self.rollout.gen_tp or self.actor.tp) > 1
        self.rollout.name = "vllm" if vllm and not megatron_tp else "hf"

    def _parallel_layout(self) -> None:
        actor, rollout, world = self.actor, self.rollout, self.placement.world_size
        if self.critic.strategy == "megatron" and (actor.strategy != "megatron" or not self.placement.colocate):
            raise ValueError(
                "critic.strategy=megatron runs in the megatron actor's processes and layout: set "
                "actor.strategy=megatron and placement.colocate=true, or critic.strategy=ddp|fsdp"
            )
        if actor.strategy == "fsdp":
            if (actor.pp, rollout.gen_pp) != (1, 1) or rollout.gen_tp not in (None, actor.tp):
                raise ValueError(
                    "actor.strategy=fsdp trains with tensor parallelism (actor.tp) only and generates in the same "
                    "layout: leave actor.pp, rollout.gen_pp at 1 and rollout.gen_tp unset, or use "
                    "actor.strategy=megatron for pipelines and resharding"
                )
            if world % actor.tp:
                raise ValueError(
                    f"the actor group's {world} ranks (placement.nodes x tasks_per_node) are not a multiple of "
                    f"actor.tp = {actor.tp}"
                )
            return
        if actor.strategy != "megatron":
            if (actor.tp, actor.pp, rollout.gen_tp or 1, rollout.gen_pp) != (1, 1, 1, 1):
                raise ValueError(
                    "actor.tp, actor.pp, rollout.gen_tp and rollout.gen_pp split the model for the 3D-HybridEngine and "
                    f"need actor.strategy=megatron (or fsdp for actor.tp); got strategy {actor.strategy!r}"
                )
            return
        if importlib.util.find_spec("megatron.core") is None:
            raise ValueError(
                "actor.strategy=megatron needs megatron-core: pip install megatron-core (bash .ci/setup installs it), "
                "or set actor.strategy=ddp"
            )
        if world % (actor.tp * actor.pp):
            raise ValueError(
                f"the actor group's {world} ranks (placement.nodes x tasks_per_node) are not a multiple of "
                f"actor.tp x actor.pp = {actor.tp * actor.pp}"
            )
        if actor.entropy_coeff != 0 or actor.tis_cap is not None:
            raise ValueError(
                "actor.strategy=megatron does not compute the vocabulary-parallel entropy bonus or truncated "
                "importance sampling yet: set actor.entropy_coeff=0 and leave actor.tis_cap unset"
            )
        if rollout.gen_pp != 1:
            raise ValueError("rollout.gen_pp > 1 (pipelined generation) is not implemented: set rollout.gen_pp=1")
        if rollout.name == "vllm" and (rollout.gen_tp or actor.tp) != 1:
            raise ValueError(
                "actor.strategy=megatron feeds vLLM from the 3D-HybridEngine's generation shards only without tensor "
                "parallelism (vLLM's own TP over the generation TP group is not built): set rollout.gen_tp=1, or "
                "rollout.name=hf to generate tensor-parallel with transformers"
            )
        self.actor_layout()  # gen_tp must divide tp

    def actor_layout(self) -> HybridLayout:
        """The actor group's training layout p-t-d and generation layout p_g-t_g (``actor.strategy=megatron``;
        with ``ddp`` every rank is a data-parallel replica: p = t = 1, d = ranks).

        Raises:
            ValueError: rollout.gen_tp does not divide actor.tp."""
        actor = self.actor
        d = self.placement.world_size // (actor.tp * actor.pp)
        return HybridLayout(p=actor.pp, t=actor.tp, d=d, p_g=self.rollout.gen_pp, t_g=self.rollout.gen_tp or actor.tp)

    def _divisible_by_ranks(self) -> None:
        """Every data-parallel rank must get the same number of sequences of every mini-batch (each optimizer step
        all-reduces gradients once per rank)."""
        n = self.rollout.n
        placement = self.placement
        actor_dp = placement.world_size // (self.actor.tp * self.actor.pp)
        actor_keys = "nodes x tasks_per_node" + (" / (actor.tp x actor.pp)" if actor_dp != placement.world_size else "")
        checks = [("actor", actor_dp, self.actor.ppo_mini_batch_size, actor_keys)]
        if self.algorithm.adv_estimator == "gae":
            keys = "nodes x tasks_per_node" if placement.colocate else "critic_nodes x critic_tasks_per_node"
            checks.append(("critic", placement.critic_world_size, self.critic.ppo_mini_batch_size, keys))
        for role, ranks, mini, keys in checks:
            if ranks > 1 and (mini * n) % ranks:
                raise ValueError(
                    f"{role}.ppo_mini_batch_size x rollout.n = {mini * n} sequences cannot be split evenly over the "
                    f"{ranks} data-parallel ranks of the {role}'s group (placement.{keys}); "
                    "make it a multiple of the ranks"
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

    Raises:
        ConfigError: naming every unknown, missing or ill-typed key and, for choices, the allowed values.
        FileNotFoundError: if `path` does not exist.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(e)}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, ...)")
    return validate_config(apply_overrides(tree, overrides or [], source=str(path or "the config")), schema)


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
    "placement.heartbeat_timeout_s",
    "placement.call_timeout_s",
)
"""Keys (or prefixes, ending in '.') that ``hf resume RUN_ID -o ...`` may change: how long the run goes, how often
it validates and saves, where its metrics and samples are logged, and where and under which limits its workers run.
None of them changes what an iteration computes, so the resumed run's iterations equal those of a run started with
the new values."""


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
    refused = [k for k in changed if not k.startswith(RESUMABLE_KEYS)]
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

    Raises:
        ConfigError: for a malformed override or one that descends into a value."""
    tree = copy.deepcopy(tree)
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
