"""The config's sections (pydantic models): ``model``, ``data``, ``rollout``, ``actor``, ``ref``, ``critic``,
``teacher``, ``algorithm``, ``reward``, ``reward_model``, ``trainer``, ``placement``; each checks its own keys and
names the registered choices (`hybridflow.engine.extensions`, the estimator and loss registries)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hybridflow.engine.extensions import backend_names, rollout_names, training_backend


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


def _registered_name(value: str, registered: list[str], key: str) -> str:
    """`value` if its registry holds it. Raises ValueError naming `key` and the registered names."""
    if value not in registered:
        raise ValueError(f"unknown {key} {value!r}; registered: {registered}")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """The policy model: a local Hugging Face folder or an embedded model, and the compute dtype."""

    path: str = Field(
        "tiny",
        description="local Hugging Face folder, or an embedded model: 'smollm2', 'tiny', 'smollm2-moe', 'smollm2-wide'",
    )
    dtype: Literal["auto", "native", "float32", "bfloat16"] = Field(
        "auto",
        description="auto: fp32 on CPU, bf16 on CUDA; native: bf16 where the device computes it (CUDA, a CPU "
        "with AVX512-BF16 or AMX), else fp32",
    )
    lora_rank: int = Field(0, ge=0, description="LoRA rank r of the actor's adapter (PEFT); 0: train every weight")
    lora_alpha: float = Field(16, gt=0, description="LoRA scaling numerator: the update is (alpha / r) B A")
    target_modules: str | list[str] = Field(
        "all-linear", description="modules given an adapter: all-linear (every linear but the output head) or names"
    )
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    lora_adapter_path: str | None = Field(None, description="a saved adapter folder to start from (PEFT layout)")
    lora_merge: bool = Field(
        False, description="sync merged full weights to a vLLM rollout instead of the adapter alone"
    )
    gradient_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer's activations in the backward pass instead of keeping them "
        "(activation checkpointing: less memory, about one more forward of compute; the same values)",
    )

    @model_validator(mode="after")
    def _lora_keys_need_a_rank(self) -> ModelConfig:
        if self.lora_rank == 0 and self.lora_adapter_path:  # verl's way: the adapter's own rank and alpha
            self.lora_rank, self.lora_alpha = _adapter_rank(Path(self.lora_adapter_path))
        if self.lora_rank == 0 and self.lora_merge:
            raise ValueError(
                "model.lora_merge is a LoRA setting: set model.lora_rank > 0 (the adapter's rank, e.g. 16) or "
                "model.lora_adapter_path"
            )
        return self

    @property
    def lora(self) -> bool:
        """Whether the actor trains a LoRA adapter instead of every weight."""
        return self.lora_rank > 0


def _adapter_rank(folder: Path) -> tuple[int, float]:
    """``(r, lora_alpha)`` of the PEFT adapter saved in `folder` (its ``adapter_config.json``).

    Raises:
        ValueError: `folder` holds no readable adapter config (names the file and what to give instead)."""
    import json

    path = folder / "adapter_config.json"
    try:
        adapter = json.loads(path.read_text())
        return int(adapter["r"]), float(adapter.get("lora_alpha", 8))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"model.lora_adapter_path={folder}: no LoRA rank in {path} ({type(e).__name__}: {e}); give a folder "
            "written by PeftModel.save_pretrained (or a LoRA run's checkpoint actor/), or set model.lora_rank"
        ) from None


class PolicyModelConfig(ModelConfig):
    """The policy that ``hf sft train`` and ``hf dpo train`` train: `ModelConfig` and how the group's ranks hold it
    (verl's SFT trainer's ``model.strategy``)."""

    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: a whole replica on every rank; fsdp: weights, gradients and Adam states sharded over the "
        "ranks (FSDP2, ZeRO-3: 1/N of ddp's memory each), gathered one decoder layer at a time",
    )


class ReasoningGymConfig(_Section):
    """Prompts from a reasoning-gym generator: train and held-out validation items from one seeded set."""

    name: str = Field(description="reasoning-gym generator, e.g. basic_arithmetic")
    config: dict[str, Any] = Field(default_factory=dict, description="generator keyword arguments")
    train_size: int = Field(1000, gt=0)
    val_size: int = Field(100, ge=0)
    seed: int = 0
    instruction: str | None = Field(None, description="appended to each question; None uses the default")


class VerifiersDataConfig(_Section):
    """Prompts from a verifiers environment's own datasets (`hybridflow.engine.agent.verifiers_env`), run by its
    agent loop ``verifiers/<env_id>``."""

    env_id: str = Field(description="the environment: the module with load_environment() (verifiers' env id)")
    env_args: dict[str, Any] = Field(default_factory=dict, description="load_environment()'s keyword arguments")
    train_size: int | None = Field(None, gt=0, description="rows of its dataset (None: all)")
    val_size: int | None = Field(None, ge=0, description="rows of its eval dataset for validation (None: all)")
    seed: int | None = Field(None, description="shuffle both datasets with this seed first (None: their order)")


class _Files(_Section):
    """A data section with ``train_files`` and ``val_files``."""

    @field_validator("train_files", "val_files", mode="before", check_fields=False)
    @classmethod
    def _one_path_is_a_list(cls, value: Any) -> Any:
        """``data.train_files: train.parquet`` means ``[train.parquet]`` (as verl accepts); ``~`` is the home
        folder (verl's default paths, ``~/data/rlhf/gsm8k/train.parquet``)."""
        value = [value] if isinstance(value, str | Path) else value
        if isinstance(value, list):
            return [str(Path(v).expanduser()) if str(v).startswith("~") else v for v in value]
        return value


class DataConfig(_Files):
    """Prompt sources, prompt length limit (tokens) and batch sizes (prompts)."""

    train_files: list[str] = Field(
        default_factory=list, description="parquet/jsonl files in verl's layout (one path or a list)"
    )
    val_files: list[str] = Field(default_factory=list, description="held-out prompts for validation (path or list)")
    reasoning_gym: ReasoningGymConfig | None = None
    verifiers: VerifiersDataConfig | None = None
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
        if not self.train_files and self.reasoning_gym is None and self.verifiers is None:
            raise ValueError("set data.train_files (parquet/jsonl), data.reasoning_gym.name or data.verifiers.env_id")
        return self


class MultiTurnConfig(_Section):
    """Agent loops: multi-turn rollouts with tools (verl's ``rollout.multi_turn`` keys; `hybridflow.engine.agent`)."""

    enable: bool = Field(False, description="run every row through an agent loop (token-in-token-out)")
    default_agent_loop: str = Field(
        "tool_agent",
        description="the loop of rows without an agent_name column: single_turn, tool_agent, one registered with "
        "register_agent_loop or register_environment, a 'path.py:Class' loop or environment, skyrl_gym/<id> or "
        "verifiers/<id>",
    )
    max_assistant_turns: int | None = Field(None, ge=1, description="assistant turns per trajectory (None: no limit)")
    max_user_turns: int | None = Field(None, ge=0, description="tool turns per trajectory (None: no limit)")
    max_tool_response_length: int = Field(256, ge=1, description="characters of a tool answer the model reads")
    tool_response_truncate_side: Literal["left", "middle", "right"] = Field(
        "middle", description="which part of a longer tool answer is cut"
    )
    tool_config_path: str | None = Field(
        None, description="YAML file listing the tools (`tools: [{function: module:name, timeout_s: 5}]`)"
    )
    tool_timeout_s: float = Field(10.0, gt=0, description="seconds a tool call may take (a tool's timeout_s wins)")
    format: str = Field(
        "hermes", description="tool-call format of the model's text (hermes: <tool_call>{json}</tool_call>)"
    )
    env_config: dict[str, Any] = Field(
        default_factory=dict, description="the env_config of skyrl_gym/<id> environments (skyrl-gym's make())"
    )
    env_imports: list[str] = Field(
        default_factory=list,
        description="modules ('package.module') or files ('path.py') imported before the agent loops are looked "
        "up, in every rollout process: where environments are registered (skyrl_gym.register, register_environment)",
    )

    @model_validator(mode="after")
    def _tools_for_tool_agent(self) -> MultiTurnConfig:
        if self.enable and self.default_agent_loop == "tool_agent" and self.tool_config_path is None:
            raise ValueError(
                "rollout.multi_turn.default_agent_loop=tool_agent needs tools: set rollout.multi_turn.tool_config_path "
                "to a YAML file listing them (see hybridflow.engine.agent.tools)"
            )
        return self


class CheckpointEngineConfig(_Section):
    """How the actor's weights reach a rollout pool of its own after an update (verl's
    ``rollout.checkpoint_engine``): ``file``: the actor's rank 0 writes one safetensors file (shared memory on one
    node, the run's data folder across nodes) that every rollout rank reads; ``gloo``: the actor's rank 0
    broadcasts them by torch.distributed (gloo) over a process group of itself and the rollout's ranks, in buckets,
    from a thread (training goes on while a queued load waits), no file anywhere."""

    backend: Literal["file", "gloo"] = Field(
        "file",
        description="file: a safetensors file the rollout's ranks read (shared memory on one node); gloo: a "
        "torch.distributed broadcast from the actor's rank 0 to every rollout rank (across nodes with no shared "
        "folder)",
    )
    update_weights_bucket_megabytes: int = Field(
        512, gt=0, description="gloo: the most bytes (MiB) one broadcast carries; a larger tensor goes alone"
    )


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
    val_top_p: float = Field(1.0, gt=0.0, le=1.0, description="validation sampling top-p (verl's val_kwargs.top_p)")
    val_top_k: int = Field(0, ge=0, description="validation sampling top-k, 0 = disabled (verl's val_kwargs.top_k)")
    vllm_dtype: Literal["native", "bfloat16", "float32"] = Field(
        "native",
        description="vllm: the engine's weights and compute; native: bf16 where the device computes it (CUDA, a CPU "
        "with AVX512-BF16 or AMX: 1.8x faster than fp32; drift is reported), else fp32 (bf16 emulated: 5x slower)",
    )
    vllm_kv_cache_gb: float = Field(1.0, gt=0, description="vllm on CPU: KV cache space (GiB)")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vllm on GPU: share of GPU memory it may use")
    gen_tp: int | None = Field(
        None,
        ge=1,
        description="tensor-parallel size of generation (verl's rollout.tensor_model_parallel_size). "
        "rollout.name=vllm: one vLLM engine over each block of gen_tp consecutive ranks of the actor's pool (or of "
        "the rollout's pool of its own), fed the actor's whole weights; actor.strategy=megatron with "
        "rollout.name=hf: the 3D-HybridEngine's t_g (must divide actor.tp); None: actor.tp (1 in a rollout pool)",
    )
    gen_pp: int = Field(1, ge=1, description="pipeline stages of generation (p_g); only 1 is implemented")
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="rollout.name=vllm, an MoE actor: each vLLM engine splits the experts of every MoE layer over "
        "its ranks (vLLM's enable_expert_parallel; verl's rollout.expert_parallel_size, which verl requires to equal "
        "tensor x data parallel: engines here are data parallel 1, so 1 or the engine's rollout.gen_tp); 1: the "
        "experts are tensor-parallel as dense weights",
    )

    def filters(self, stream: str) -> tuple[int, float]:
        """(top-k, top-p) of a generation `stream`: ``val_top_k`` / ``val_top_p`` for validation (a stream named
        ``val`` or ``val-<batch>``), else ``top_k`` / ``top_p``."""
        if stream == "val" or stream.startswith("val-"):
            return self.val_top_k, self.val_top_p
        return self.top_k, self.top_p

    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    max_staleness: int = Field(
        1,
        ge=0,
        description="trainer.mode=async: the most actor updates a trained batch's generating weights may lag behind "
        "(0 = the synchronous loop's samples); the controller admits a generation only while the bound can hold, "
        "nothing is dropped. sync is 0, one_step_off 1",
    )
    streaming: bool = Field(
        False,
        description="trainer.mode=async: the rollout's engine generates every admitted prompt at once, continuously, "
        "and hands over finished groups of rollout.n (hybridflow.engine.rollout.admission): a batch is the first "
        "data.train_batch_size finished groups whose older ones can still meet rollout.max_staleness; false: one "
        "generation call per batch",
    )
    partial_rollout: bool = Field(
        True,
        description="rollout.streaming: a weight push interrupts the generations in flight and each continues from "
        "its tokens under the new weights, every token recording the version that sampled it (AReaL, verl's "
        "fully-async partial_rollout); false: they finish under the old weights before the engine loads",
    )
    checkpoint_engine: CheckpointEngineConfig = Field(default_factory=CheckpointEngineConfig)
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
    """AdamW with linear warm-up to a constant LR or a cosine decay by iteration
    (`hybridflow.engine.backends.training.LRSchedule`), and global grad-norm clipping."""

    lr: float = Field(1e-6, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up, then constant")
    warmup_iterations: int = Field(
        0,
        ge=0,
        description="training iterations of linear warm-up from lr 0, then constant: iteration i (from 0) trains at "
        "lr x min(1, i / warmup_iterations), as verl's lr_warmup_steps (one scheduler step per update)",
    )
    lr_scheduler_type: Literal["constant", "cosine"] = Field(
        "constant",
        description="after the warm-up: constant, or cosine (verl's): iteration i trains at lr x (r + (1 - r) x (1 + "
        "cos(2 pi num_cycles p)) / 2), p = min(1, (i - warmup_iterations) / (decay_iterations - warmup_iterations)), "
        "r = min_lr_ratio",
    )
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="cosine: the lr it decays to, as a fraction of lr")
    num_cycles: float = Field(0.5, gt=0.0, description="cosine: waves over the decay; 0.5 falls from lr to the minimum")
    decay_iterations: int = Field(
        0,
        ge=0,
        description="cosine: the iteration (from 0, warm-up included) at which the lr reaches its minimum, and stays; "
        "0: the run's trainer.total_iterations as first started (a resume that extends the run keeps the curve)",
    )
    grad_clip: float = Field(1.0, gt=0.0, description="max global grad norm")

    @model_validator(mode="after")
    def _one_warmup(self) -> OptimConfig:
        if self.warmup_steps and self.warmup_iterations:
            raise ValueError(
                "optim.warmup_steps (per optimizer step) and optim.warmup_iterations (per iteration, verl's) are two "
                "warm-ups: set one of them to 0"
            )
        if self.lr_scheduler_type == "cosine" and self.warmup_steps:
            raise ValueError(
                "optim.lr_scheduler_type=cosine decays by training iteration, and optim.warmup_steps warms up by "
                "optimizer step: give the warm-up in iterations (optim.warmup_iterations) and set warmup_steps to 0"
            )
        if self.decay_iterations and self.decay_iterations <= self.warmup_iterations:
            raise ValueError(
                f"optim.decay_iterations ({self.decay_iterations}) must come after the warm-up's "
                f"optim.warmup_iterations ({self.warmup_iterations}): raise decay_iterations, or 0 for the whole run"
            )
        return self


LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+"]


class PolicyLossConfig(_Section):
    """Which policy loss the actor minimises (verl's ``actor.policy_loss``)."""

    loss_mode: str = Field(
        "vanilla",
        description="a registered policy loss (algorithms.losses.register_policy_loss): vanilla (PPO clip "
        "with clip-higher and dual-clip), gspo (sequence-level ratio; its paper uses loss_agg_mode "
        "seq-mean-token-mean and clip ranges ~3e-4/4e-4), cispo (clipped importance weight, held constant), "
        "clip_cov, kl_cov (Cui et al. 2025: high-covariance tokens lose their gradient / get a KL penalty), sapo "
        "(a smooth gate of the ratio in place of the clip, tau_pos / tau_neg)",
    )
    clip_cov_ratio: float = Field(0.0002, gt=0.0, le=1.0, description="clip_cov: share of tokens detached")
    clip_cov_lb: float = Field(1.0, description="clip_cov: lower bound of the covariance of a detachable token")
    clip_cov_ub: float = Field(5.0, description="clip_cov: upper bound of the covariance of a detachable token")
    kl_cov_ratio: float = Field(0.0002, gt=0.0, le=1.0, description="kl_cov: share of tokens KL-penalised")
    ppo_kl_coef: float = Field(1.0, ge=0.0, description="kl_cov: coefficient of the |log ratio| penalty")
    tau_pos: float = Field(1.0, gt=0.0, description="sapo: the gate's temperature on tokens of positive advantage")
    tau_neg: float = Field(1.05, gt=0.0, description="sapo: the gate's temperature on the others")

    @field_validator("loss_mode")
    @classmethod
    def _registered(cls, value: str) -> str:
        from hybridflow.engine.algorithms.losses import policy_loss_modes

        return _registered_name(value, policy_loss_modes(), "actor.policy_loss.loss_mode")


def _registered_backend(value: str, key: str) -> str:
    return _registered_name(value, backend_names(), key)


class MoeLossConfig(_Section):
    """The router's auxiliary losses of a mixture-of-experts actor (`hybridflow.engine.moe`; megatron-core's keys and
    definitions); a dense actor ignores them."""

    aux_loss_coeff: float = Field(
        0.0,
        ge=0.0,
        description="load-balancing loss coefficient (megatron-core moe_aux_loss_coeff; Switch Transformer eqs. 4-6, "
        "1.0 per layer when balanced), times the loss summed over the MoE layers",
    )
    z_loss_coeff: float = Field(
        0.0, ge=0.0, description="router z-loss coefficient (megatron-core moe_z_loss_coeff; ST-MoE eq. 5)"
    )
    token_dispatcher_type: Literal["allgather", "alltoall"] = Field(
        "allgather",
        description="actor.strategy=megatron with actor.ep > 1: how tokens reach their experts' ranks "
        "(megatron-core moe_token_dispatcher_type; the same numbers either way, docs/moe.md)",
    )


class RouterReplayConfig(_Section):
    """Router replay of a mixture-of-experts actor (verl's ``actor.router_replay``; `hybridflow.engine.moe`): which
    forward's expert choices the policy update's forwards reuse, so that a token's PPO ratio compares the same
    experts; a dense actor ignores it."""

    mode: Literal["disabled", "R2", "R3"] = Field(
        "disabled",
        description="disabled: every forward routes as its router chooses; R2: the old_log_prob stage records its "
        "choices and the update replays them; R3: the rollout records the experts each token went to and both the "
        "old_log_prob stage and the update replay them (needs rollout.name=hf); the reference policy never replays",
    )


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
    ep: int = Field(
        1,
        ge=1,
        description="actor.strategy=megatron, an MoE model: expert-parallel size (megatron-core "
        "expert_model_parallel_size): the data-parallel ranks are split into groups of ep, each rank holding "
        "1/ep of every layer's experts; divides the data-parallel size and the expert count",
    )
    etp: int | None = Field(
        None,
        ge=1,
        description="actor.strategy=megatron, an MoE model: expert tensor-parallel size (megatron-core "
        "expert_tensor_parallel_size); null: actor.tp",
    )

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
    moe: MoeLossConfig = Field(default_factory=MoeLossConfig)
    router_replay: RouterReplayConfig = Field(default_factory=RouterReplayConfig)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0.0)
    kl_loss_type: KLType = "low_var_kl"
    share_prompts: bool = Field(
        True,
        description="compute a prompt once for its n samples in the old_log_prob, ref and update passes (rows "
        "packed without padding, each prompt followed by its samples' responses; equal to full rows up to float32 "
        "rounding); false: every row packed with its own prompt. Megatron keeps padded full rows",
    )
    calculate_sum_pi_squared: bool = Field(
        False,
        description="the old_log_prob stage also returns sum_pi_squared [B, T] (sum over the vocabulary of pi^2 at "
        "each response token, from the same logits), which algorithm.adv_estimator=optimal_token_baseline needs",
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


class TeacherConfig(_Section):
    """On-policy distillation's teacher (the ``teacher`` role): a frozen model scoring every token the actor
    samples, and how its per-token reverse KL, KL(actor || teacher) estimated on the sampled tokens, trains the
    actor (Agarwal et al. 2024, GKD, eq. 2 at lambda = 1, beta = 1; Thinking Machines' on-policy distillation):

    - ``use_as: reward``: a dense reward. Each response token's advantage becomes ``task_coef`` x the estimator's
      advantage + ``kl_coef`` x (log pi_teacher - log pi_actor) of that token, the actor's log-probs the old
      policy's (the old_log_prob stage's), as Tinker's cookbook and slime's ``--use-opd`` add it;
    - ``use_as: loss``: a loss. The actor's loss adds ``kl_coef`` x the ``kl_loss_type`` estimate of the per-token
      KL to the teacher (the actor's ``loss_agg_mode`` aggregate), with the gradient of the actor's log-probs, as
      ``actor.use_kl_loss`` does against ref; the advantages are ``task_coef`` x the estimator's. The default k2's
      gradient on the actor's own samples is the reverse KL's; k3's is the forward KL's (Tang and Munos 2025).
      With ``top_k`` > 0 the term is the exact reverse KL over the teacher's ``top_k`` likeliest tokens of each
      position and one bucket for the rest (`hybridflow.engine.algorithms.distillation.top_k_reverse_kl`).

    ``task_coef: 0`` trains on the teacher alone (pure distillation); the task reward is still computed (the
    ``val/`` scores and the metrics). The teacher's tokenizer must be the actor's (checked before any work).

    Several teachers (``routes``, verl's ``distillation.teacher_models`` with ``teacher_key``): each row is scored by
    the teacher of its ``route_key`` column's value (its ``data_source``: a math teacher for the math prompts, a code
    teacher for the code ones); every rank of the teacher's pool holds them all and scores its rows, each with its
    own teacher (`hybridflow.engine.backends.teachers.RoutedTeachers`). Every value in the prompt files must have a
    teacher (checked before any work)."""

    model_path: str | None = Field(
        None, description="the teacher's folder or hub name (resolved as model.path); None: no teacher (or routes)"
    )
    routes: dict[str, str] = Field(
        default_factory=dict,
        description="several teachers: a value of the rows' route_key column -> the folder of the teacher scoring "
        "those rows (verl's distillation.teacher_models.<name>.key and .model_path); instead of model_path",
    )
    route_key: Literal["data_source", "ability"] = Field(
        "data_source", description="routes: the prompt column whose value picks a row's teacher (verl's teacher_key)"
    )
    log_prob_micro_batch_size: int = Field(16, gt=0, description="sequences per teacher forward")
    use_as: Literal["reward", "loss"] = Field("reward", description="the KL as a dense per-token reward, or a loss")
    kl_coef: float = Field(1.0, gt=0.0, description="the weight of the per-token reverse KL")
    kl_loss_type: KLType = Field(
        "k2",
        description="use_as: loss: the per-token estimator (actor.kl_loss_type's names); k2's gradient on the actor's "
        "samples is the reverse KL's, k3's (low_var_kl) the forward KL(teacher || actor)'s",
    )
    task_coef: float = Field(1.0, ge=0.0, description="the weight of the task reward's advantages; 0: the teacher's")
    top_k: int = Field(
        0,
        ge=0,
        description="use_as: loss: > 0 replaces the kl_loss_type estimate of the sampled token by a KL over the "
        "teacher's top_k tokens of each position (top_k_kl); 0: the estimate",
    )
    top_k_kl: Literal["reverse", "forward"] = Field(
        "reverse",
        description="top_k > 0: reverse: the exact KL(actor || teacher) over the top_k tokens and a bucket for the "
        "rest (distillation.top_k_reverse_kl); forward: verl's forward_kl_topk, sum over the top_k of q (log q - log "
        "p), floored at 0 (distillation.top_k_forward_kl)",
    )
    log_prob_floor: float | None = Field(
        None,
        lt=0.0,
        description="top_k_kl: forward: both models' log-probs at the top_k tokens floored here first (verl's "
        "distillation_loss.log_prob_min_clamp); None: not floored",
    )
    kl_clamp: float | None = Field(
        None,
        gt=0.0,
        description="each token's KL estimate clamped to [-kl_clamp, kl_clamp] before it is a reward or a loss (verl's "
        "distillation_loss.loss_max_clamp; with top_k only the forward KL's); None: unclamped",
    )

    @property
    def enabled(self) -> bool:
        """Whether the run distils from a teacher (``model_path`` or ``routes`` set)."""
        return self.model_path is not None or bool(self.routes)

    def model_paths(self) -> dict[str, str]:
        """The teachers' folders by route (``{"": model_path}`` for one teacher scoring every row)."""
        return dict(self.routes) if self.routes else {"": self.model_path} if self.model_path else {}

    @model_validator(mode="after")
    def _path_for_settings(self) -> TeacherConfig:
        """Settings of a teacher (other than their defaults, as a recorded config holds them) without its folder
        would silently train without one: refused."""
        if self.model_path is not None and self.routes:
            raise ValueError(
                "teacher.model_path (one teacher for every row) and teacher.routes (a teacher per data source) are "
                "two ways to name the teachers: give one of them"
            )
        fields = type(self).model_fields
        default = {k: fields[k].get_default(call_default_factory=True) for k in fields}
        settings = [k for k in fields if k not in ("model_path", "routes") and getattr(self, k) != default[k]]
        if not self.enabled and settings:
            raise ValueError(
                f"teacher.{', teacher.'.join(settings)} set without teacher.model_path: give the teacher's folder "
                "(-o teacher.model_path=DIR, e.g. a checkpoint's actor/ folder), or remove the teacher's settings"
            )
        if self.top_k and self.kl_clamp is not None and self.top_k_kl == "reverse":
            raise ValueError(
                "teacher.kl_clamp clamps the estimate of the sampled token's KL; with teacher.top_k the reverse KL is "
                "exact over the teacher's top-k tokens: unset teacher.kl_clamp, or set teacher.top_k=0 (or "
                "teacher.top_k_kl=forward, verl's forward_kl_topk, which its loss_max_clamp clamps)"
            )
        if self.top_k and self.use_as != "loss":
            raise ValueError(
                f"teacher.top_k={self.top_k} needs teacher.use_as=loss: the KL over the teacher's top-k tokens belongs "
                "to a position, not to the token sampled there, so it is no token's reward; set teacher.use_as=loss, "
                "or teacher.top_k=0"
            )
        return self


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
    gradient_checkpointing: bool = Field(False, description="as model.gradient_checkpointing, for the value model")

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


class RolloutCorrectionConfig(_Section):
    """The gap between the policy that sampled a batch (the rollout engine: its kernels and dtype, and in the
    overlapped modes weights up to ``rollout.max_staleness`` updates old) and the policy trained, verl's
    ``algorithm.rollout_correction`` keys (`hybridflow.engine.algorithms.rollout_correction`): truncated importance
    sampling (TIS), each token's policy-gradient term weighted by ``min(w, rollout_is_threshold)``, w = pi_old /
    pi_rollout per token (``token``) or their product over the response (``sequence``); rejection sampling of
    tokens or responses (``rollout_rs``); decoupled (pi_old: the actor's proximal policy) or bypass mode (the
    rollout's own log-probs). Decoupled PPO (Hilton et al. 2022, eq. 3; AReaL, Fu et al. 2025, eq. 5) with TIS (Yao,
    Liu et al. 2025). Needs a rollout that reports its log-probs (vllm, agent loops)."""

    rollout_is: Literal["token", "sequence"] | None = Field(
        None,
        description="token: a weight per token (biased, low variance); sequence: one weight per response, the "
        "product of its tokens' ratios (unbiased, high variance); None: off (the default in trainer.mode=sync; the "
        "overlapped modes default to token, and None there warns)",
    )
    rollout_is_threshold: float = Field(
        2.0, gt=0.0, description="the truncation cap C of the weights (2.0 as verl and the TIS paper)"
    )
    rollout_is_batch_normalize: bool = Field(
        False, description="divide the truncated weights by their mean over the batch (mean 1; needs rollout_is)"
    )
    rollout_rs: str | None = Field(
        None,
        description="rejection sampling: drop the tokens or responses whose divergence from the rollout policy "
        "leaves rollout_rs_threshold; comma-separated options, all must pass: token_k1|k2|k3, seq_sum_k1|k2|k3, "
        "seq_mean_k1|k2|k3, seq_max_k2|k3 (k1: -log ratio, k2: log ratio^2 / 2, k3: ratio - 1 - log ratio)",
    )
    rollout_rs_threshold: str | float | None = Field(
        None,
        description="one bound for every rollout_rs option or one per option, comma-separated; a k1 option takes "
        "lower_upper in ratio space (0.5_2.0) or upper alone (lower = 1 / upper), k2 and k3 an upper bound",
    )
    bypass_mode: bool = Field(
        False,
        description="two policies: skip the old_log_prob stage and use the rollout's log-probs as the old ones; the "
        "weights and rejection then come from the current policy in every micro-batch",
    )
    loss_type: Literal["ppo_clip", "reinforce"] = Field(
        "ppo_clip",
        description="bypass mode's loss: ppo_clip (PPO's clip around the rollout policy; the weights are only "
        "reported) or reinforce (-w * A * log pi with the truncated weights w, no clip)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> RolloutCorrectionConfig:
        from hybridflow.engine.algorithms.rollout_correction import rejection_bounds

        key = "algorithm.rollout_correction"
        if self.rollout_rs is not None:
            rejection_bounds(self.rollout_rs, self.rollout_rs_threshold)
        if self.rollout_is_batch_normalize and self.rollout_is is None:
            raise ValueError(f"{key}.rollout_is_batch_normalize normalises the weights of rollout_is: set rollout_is")
        if self.loss_type != "ppo_clip" and not self.bypass_mode:
            raise ValueError(
                f"{key}.loss_type={self.loss_type} is bypass mode's loss: set {key}.bypass_mode=true, or leave "
                "loss_type at ppo_clip (decoupled mode weights actor.policy_loss's loss)"
            )
        return self

    def enabled(self) -> bool:
        """Whether anything corrects the gap (weights, rejection or bypass mode); else the section is inert."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


class PFPPOConfig(_Section):
    """PF-PPO's policy filtration (Shen et al. 2024, arXiv 2409.06957; verl's ``algorithm.pf_ppo``): how responses
    are weighted when the batch is redrawn from itself (`hybridflow.engine.algorithms.policy_filtration`)."""

    reweight_method: Literal["pow", "max_min", "max_random"] = Field(
        "pow",
        description="pow: |score|^weight_pow; max_min: only the batch's highest and lowest scores; max_random: the "
        "highest 4x as likely as the others",
    )
    weight_pow: float = Field(2.0, ge=0.0, description="the exponent of reweight_method=pow")


class AlgorithmConfig(_Section):
    """Advantage estimator, the KL-in-reward penalty, dynamic sampling, the off-policy correction."""

    adv_estimator: str = Field(
        "grpo",
        description="a registered advantage estimator (algorithms.estimators.register_adv_est): gae (needs the "
        "critic), grpo (norm_adv_by_std_in_grpo false: Dr. GRPO), rloo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, opo, remax (baseline: the greedy response's score), optimal_token_baseline "
        "(needs actor.calculate_sum_pi_squared), gdpo (needs algorithm.gdpo_reward_keys)",
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(1.0, ge=0.0, le=1.0)
    norm_adv_by_std_in_grpo: bool = True
    gdpo_reward_keys: list[str] = Field(
        default_factory=list,
        description="adv_estimator=gdpo: the score function's reward components, keys of the dict it returns "
        "(reward_extra/<key>), each normalised within its group on its own",
    )
    gdpo_reward_weights: list[float] | None = Field(
        None, description="adv_estimator=gdpo: one weight per gdpo_reward_keys entry (None: all 1)"
    )
    use_kl_in_reward: bool = False
    kl_penalty: KLType = "kl"
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    use_pf_ppo: bool = Field(
        False,
        description="PF-PPO (adv_estimator=gae): after the advantages, train on B responses redrawn with replacement "
        "in proportion to algorithm.pf_ppo's weights of their scores",
    )
    pf_ppo: PFPPOConfig = Field(default_factory=PFPPOConfig)
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

    @model_validator(mode="after")
    def _gdpo_components(self) -> AlgorithmConfig:
        if (self.adv_estimator == "gdpo") != bool(self.gdpo_reward_keys):
            raise ValueError(
                "algorithm.adv_estimator=gdpo normalises the score function's reward components one by one: name them "
                "with algorithm.gdpo_reward_keys (keys of the dict it returns), and give those keys only with gdpo"
            )
        weights = self.gdpo_reward_weights
        if weights is not None and len(weights) != len(self.gdpo_reward_keys):
            raise ValueError(
                f"algorithm.gdpo_reward_weights has {len(weights)} entries for {len(self.gdpo_reward_keys)} "
                "algorithm.gdpo_reward_keys: give one weight per key"
            )
        return self

    @model_validator(mode="after")
    def _pf_ppo_with_gae(self) -> AlgorithmConfig:
        if self.use_pf_ppo and self.adv_estimator != "gae":
            raise ValueError(
                f"algorithm.use_pf_ppo filters PPO's batch after GAE (as verl, which ignores it otherwise), but "
                f"algorithm.adv_estimator={self.adv_estimator}: set adv_estimator=gae or use_pf_ppo=false"
            )
        return self


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
    timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="seconds one sample's score (or cost) may take; a call past it is stopped (its scoring process "
        "killed) and the sample scores 0.0 with the error 'timeout after N s'. 30: far above a rule check's "
        "milliseconds and a verifier's few seconds, so a correct answer is not lost to a slow call",
    )
    num_workers: int = Field(
        2,
        ge=1,
        description="scoring processes per rank: samples scored at once (each data-parallel rank scores its share "
        "with its own); raise it for a slow score function on a machine with cores to spare",
    )
    max_failed_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="the share of a batch whose score function may raise or time out (those samples score 0.0, "
        "their errors kept with the samples: hf runs samples) before the run stops with the cause; 0: any failure "
        "stops it",
    )


class JudgeConfig(_Section):
    """A generative reward model (an LLM as a judge, verl's GenRM): ``reward_model.path`` is a causal LM that reads a
    prompt built from each sample and writes a verdict, which a user function turns into the score
    (`hybridflow.engine.reward.judge`)."""

    enable: bool = False
    prompt_function: str | None = Field(
        None,
        description="'path.py:name' or 'module:name': fn(data_source, solution_str, ground_truth, extra_info) -> the "
        "judge's prompt, a string or chat messages (rendered with the judge's chat template)",
    )
    verdict_function: str | None = Field(
        None,
        description="'path.py:name' or 'module:name': fn(judge_text, data_source, solution_str, ground_truth, "
        "extra_info) -> the score (a float)",
    )
    engine: Literal["vllm", "hf"] = Field(
        "vllm", description="vllm: a vLLM engine in each rank of the reward model's pool; hf: transformers' generate"
    )
    temperature: float = Field(0.0, ge=0.0, description="the judge's sampling temperature (0: greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(256, gt=0, description="the longest verdict, in tokens")
    vllm_dtype: Literal["native", "bfloat16", "float32"] = Field(
        "native", description="engine=vllm: weights and compute (native: as rollout.vllm_dtype's)"
    )
    vllm_kv_cache_gb: float = Field(1.0, gt=0, description="CPU: the vLLM engine's KV cache, GiB")
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="GPU: the vLLM engine's share of memory")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="engine=vllm: consecutive ranks of the reward model's pool one judge engine spans (vLLM tensor "
        "parallel, verl's reward.reward_model.rollout.tensor_model_parallel_size); the pool's ranks a multiple of it",
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
    dtype: Literal["auto", "native", "float32", "bfloat16"] = Field(
        "auto", description="auto: fp32 on CPU, bf16 on CUDA; native: as model.dtype's"
    )
    coef: float = Field(1.0, description="weight of the RM score in the training reward")
    cost_path: str | None = Field(
        None,
        description="Safe-RLHF's cost model: a one-label sequence classifier whose score is the response's cost, "
        "scored in the rm_score stage with this section's settings (needs algorithm.cost_limit; enable not needed)",
    )
    judge: JudgeConfig = Field(
        default_factory=JudgeConfig,
        description="judge.enable: reward_model.path is a generative reward model (a causal LM judging each sample)",
    )

    @model_validator(mode="after")
    def _path_when_enabled(self) -> RewardModelConfig:
        if self.enable and not self.path:
            raise ValueError(
                "reward_model.enable is true but reward_model.path is not set: give the RM's folder "
                "(-o reward_model.path=DIR, e.g. one written by hf rm train)"
            )
        judge = self.judge
        if judge.enable and not (self.enable and judge.prompt_function and judge.verdict_function):
            raise ValueError(
                "reward_model.judge.enable needs reward_model.enable=true with reward_model.path (the judge model), "
                "reward_model.judge.prompt_function and reward_model.judge.verdict_function ('path.py:name' each)"
            )
        return self


TrackerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]
"""The values of ``trainer.logger`` (verl's names; ``jsonl`` is verl's ``file``)."""


class _RunTrainer(_Section):
    """What every kind of run's ``trainer`` section has: seed, device, threads, output folders, recovery, trackers."""

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
    max_recoveries: int = Field(
        2,
        ge=0,
        description="times a run recovers by itself when a worker group loses ranks (killed, silent, their node or "
        "job gone): the flow relaunches its groups and goes on from the newest usable checkpoint, no hf resume; "
        "0: the run fails at once. A rank that raises (its code, its data, a NaN guard) is never retried",
    )
    recovery_backoff_s: float = Field(
        5.0, ge=0, description="seconds before the first relaunch; each next one waits twice as long"
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
    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync",
        description="sync: each iteration generates, then trains; one_step_off (verl's one-step-off-policy): the "
        "rollout pool generates the next iteration's batch while the actor trains on this one (staleness 1, "
        "corrected by algorithm.rollout_correction, token-level unless set); async: the rollout pool generates as "
        "far ahead as "
        "rollout.max_staleness allows, taking new weights every trainer.weight_sync_every updates; the overlapped "
        "modes need the rollout in a pool of its own (placement.pools)",
    )
    weight_sync_every: int = Field(
        1,
        ge=1,
        description="trainer.mode=async: actor updates per weight push to the rollout pool (at most "
        "rollout.max_staleness + 1; the last update always pushes)",
    )
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
    log_routed_experts: bool = Field(
        False,
        description="keep, with each kept rollout sample (trainer.log_train_generations), the experts each of its "
        "response tokens went to in each MoE layer (the batch's routed_experts; hf runs samples --routes); needs "
        "an MoE actor with actor.router_replay.mode R2 (the old_log_prob forward's routes) or R3 (the rollout's)",
    )
    resubmit_on_preemption: bool = Field(
        True,
        description="on Slurm's warning (SIGUSR2 placement.slurm.signal_delay_s before the time limit, SIGTERM on "
        "preemption) the run checkpoints at the next stage boundary, resubmits its worker groups (new allocations) "
        "and goes on, so a run longer than the partition's limit finishes by itself; it stops (resumable, hf "
        "resume) when two allocations in a row reach their time limit before an iteration (a preemption does not "
        "count). false: it stops at the first warning",
    )

    @model_validator(mode="after")
    def _routes_with_samples(self) -> TrainerConfig:
        if self.log_routed_experts and not self.log_train_generations:
            raise ValueError(
                "trainer.log_routed_experts keeps the routes of the kept rollout samples, and "
                "trainer.log_train_generations is 0 (none kept): set trainer.log_train_generations=N"
            )
        return self


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
        120,
        ge=0,
        description="SIGUSR2 this long before the time limit: the run checkpoints and resubmits its groups "
        "(trainer.resubmit_on_preemption)",
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


ROLES = ("actor", "rollout", "ref", "critic", "reward", "reward_model", "teacher")
"""The roles of an RLHF run: the models (actor, its rollout, the frozen ref, critic, reward model, the distillation
teacher) and ``reward``, the
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
    num_threads: int = Field(
        0,
        ge=0,
        description="torch intra-op threads of this pool's ranks (a vLLM engine on CPU computes with them too); "
        "0: trainer.num_threads. Pools that run at the same time on one CPU share its cores: split them",
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
    num_threads: int = 0  # torch threads of its ranks; 0: trainer.num_threads

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
    rendezvous_timeout_s: float = Field(
        120.0,
        gt=0,
        description="how long a group's start waits for each step of its rendezvous: a Slurm job's node agents "
        "reaching the controller once the job runs, and the ranks joining torch.distributed's store. Nodes that "
        "cannot reach the controller or rank 0's store (firewall, wrong placement.slurm.interface), or a rank that "
        "never joins, end the start with an error naming the nodes, the address and the fix (torch's default: 30 "
        "minutes of silence)",
    )

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
            name: replace(
                self.pool(name, pool.roles, pool.nodes, pool.tasks_per_node, pool.slurm), num_threads=pool.num_threads
            )
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
