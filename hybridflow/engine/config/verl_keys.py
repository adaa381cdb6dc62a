"""Every verl config key ``hf verl`` takes, and what it is here (`VERL_KEYS`; docs/verl-keys.md is `key_table`).

Every verl key is one of:
- mapped (`VerlKey.ours` names our key or keys; `to_ours` / `to_verl` convert values where the two differ, e.g.
  verl's ``top_k=-1`` is our ``top_k=0``);
- accepted with no effect here (`VerlKey.ours` empty), for what only changes speed or memory in verl (FSDP offload,
  padding removal, vLLM's engine knobs): each is said when the run starts, and a value that would change the
  computation is refused (`VerlKey.accepts`);
- set together with others by `hybridflow.engine.config.verl.translate` (`VerlKey.via`);
- refused: any key not in `VERL_KEYS` (`find_key` names the nearest supported key). Nothing is ignored silently.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hybridflow.engine.config.loading import ConfigError

ARR = "actor_rollout_ref"

UNSAID = object()
"""What a `VerlKey.to_verl` returns for one of our values verl cannot say (``ddp``, ``trainer.device: auto``):
`to_verl` leaves the key out."""


@dataclass(frozen=True)
class VerlKey:
    """One verl key (a dotted name, or an `fnmatch` pattern for a family of no-effect keys such as
    ``*.fsdp_config.*``) and what it is here.

    Attributes:
        verl: verl's key, as in its Hydra overrides.
        ours: the HybridFlow keys it sets (one value each, from `to_ours`); empty: accepted with no effect here.
        to_ours: verl's value -> the values of `ours` (a tuple, one per key); None: the same value.
        to_verl: our values (a tuple, one per key of `ours`) -> verl's value; None: the first one as it is.
        accepts: the verl values taken (others are refused); None: any.
        note: what differs, or why the key has no effect here (shown in the table and when the run starts).
        via: our key this one sets together with others (`translate` does it: ``trainer.total_epochs`` ->
            ``trainer.total_iterations``); such a key is not "no effect".
        schema: which of verl's config schemas has the key: ``both``; ``legacy``: verl's 2025 one only (its
            ``reward_model.*`` and top-level ``custom_reward_function.*``, keys its scripts added with ``+``);
            ``current``: verl main's only (``model_engine``, ``reward.*``, ``distillation.*``, ``*.veomni.*``, ...),
            as its ``verl/trainer/config/_generated_ppo_*.yaml`` list them.
    """

    verl: str
    ours: tuple[str, ...] = ()
    to_ours: Callable[[Any], tuple] | None = None
    to_verl: Callable[[tuple], Any] | None = None
    accepts: Callable[[Any], bool] | None = None
    note: str = ""
    via: str = ""
    schema: str = "both"

    def convert(self, value: Any, key: str | None = None) -> dict[str, Any]:
        """Our overrides for verl's `value` of `key` (one this entry matches; default `verl`), empty for a no-effect
        key.

        Raises:
            ConfigError: `value` is one this key does not take here (the key, the value and why named)."""
        if self.accepts is not None and not self.accepts(value):
            raise ConfigError(f"verl key {key or self.verl}={value!r} is not supported here: {self.note}")
        if not self.ours:
            return {}
        values = self.to_ours(value) if self.to_ours else (value,) * len(self.ours)
        return dict(zip(self.ours, values, strict=True))


def _same(verl: str, ours: str | None = None, note: str = "", schema: str = "both") -> VerlKey:
    """A key whose value carries over unchanged (to ``ours``, or to verl's name without ``actor_rollout_ref.``)."""
    return VerlKey(verl, (ours or verl.removeprefix(f"{ARR}."),), note=note, schema=schema)


def _no_effect(verl: str, note: str, accepts: Callable[[Any], bool] | None = None, schema: str = "both") -> VerlKey:
    return VerlKey(verl, (), accepts=accepts, note=note, schema=schema)


def _judge_engine(prefix: str) -> list[VerlKey]:
    """verl's serving engine of the reward model (``reward_model.rollout`` / ``reward.reward_model.rollout``): our
    generative judge's vLLM engine (``reward_model.judge.*``); a discriminative reward model scores with its own
    forward pass, which these keys do not change."""
    return [
        _same(f"{prefix}.tensor_model_parallel_size", "reward_model.judge.tensor_parallel_size", _JUDGE_ENGINE),
        _same(f"{prefix}.gpu_memory_utilization", "reward_model.judge.gpu_memory_utilization", _JUDGE_ENGINE),
        _same(f"{prefix}.response_length", "reward_model.judge.max_tokens", "the longest verdict, in tokens"),
        _same(f"{prefix}.prompt_length", "reward_model.max_length", "the longest reward-model input, in tokens"),
        _same(f"{prefix}.temperature", "reward_model.judge.temperature", _JUDGE_ENGINE),
        _same(f"{prefix}.top_p", "reward_model.judge.top_p", _JUDGE_ENGINE),
        VerlKey(
            f"{prefix}.dtype",
            ("reward_model.judge.vllm_dtype",),
            to_ours=_none_is("native"),
            accepts=lambda v: _unset(v) or v in ("bfloat16", "float32"),
            to_verl=lambda values: UNSAID if values[0] == "native" else values[0],
            note="the judge engine's dtype",
        ),
        _no_effect(
            f"{prefix}.name",
            "the judge generates on vLLM (reward_model.judge.engine)",
            lambda v: _unset(v) or v == "vllm",
        ),
        _no_effect(f"{prefix}.*", _REWARD_LOOP),
    ]


def _current(entries: list[VerlKey]) -> list[VerlKey]:
    """`entries` tagged as keys of verl main's schema only."""
    return [replace(entry, schema="current") for entry in entries]


def _strategy(verl: str, ours: str) -> VerlKey:
    """A training strategy: verl's fsdp and fsdp2 are our fsdp; our ddp (no verl counterpart) shows as fsdp."""
    return VerlKey(
        verl,
        (ours,),
        to_ours=lambda v: ("fsdp" if v in ("fsdp", "fsdp2") else v,),
        to_verl=lambda values: UNSAID if values[0] == "ddp" else values[0],
        accepts=_only("fsdp", "fsdp2", "megatron"),
        note="fsdp and fsdp2 are our fsdp (FSDP2); our ddp has no verl name (verl's fsdp is the same update, sharded)",
    )


def _top_k(verl: str, ours: str) -> VerlKey:
    """A top-k: verl's -1 (off) is our 0."""
    return VerlKey(
        verl,
        (ours,),
        to_ours=_minus_one_is_zero,
        to_verl=lambda values: -1 if values[0] == 0 else values[0],
        note="verl's -1 (off) is our 0",
    )


def _only(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


def _unset(value: Any) -> bool:
    return value in (None, "null", "", -1)


_MEGATRON_LORA_NAMES = {
    "linear_qkv": ["q_proj", "k_proj", "v_proj"],
    "linear_q": ["q_proj"],
    "linear_k": ["k_proj"],
    "linear_v": ["v_proj"],
    "linear_proj": ["o_proj"],
    "linear_fc1": ["gate_proj", "up_proj"],
    "linear_fc1_gate": ["gate_proj"],
    "linear_fc1_up": ["up_proj"],
    "linear_fc2": ["down_proj"],
}


def _hf_module_names(value: Any) -> Any:
    """megatron-core's LoRA target names (verl's ``model.lora.target_modules``) as Hugging Face module names; other
    names (already Hugging Face's, or ``all-linear``) as they are."""
    if isinstance(value, str):
        return _MEGATRON_LORA_NAMES.get(value, value)
    return list(dict.fromkeys(n for name in value for n in _MEGATRON_LORA_NAMES.get(name, [name])))


def _unset_or_zero(value: Any) -> bool:
    return _unset(value) or value in (0, "0")


def _unset_or_one(value: Any) -> bool:
    return value in (None, "null", 1)


def _minus_one_is_zero(value: Any) -> tuple:
    return (0 if value is None or int(value) < 0 else int(value),)


_SCHEDULES = ("constant", "cosine")
_COSINE = (
    "after the warm-up: constant, or cosine by iteration as verl's get_cosine_schedule_with_warmup (its "
    "zero-indexed steps, one per update)"
)


def _none_is(default: Any) -> Callable[[Any], tuple]:
    return lambda v: (default if _unset(v) else v,)


def _lr_schedule(section: str, role: str) -> list[VerlKey]:
    """The lr schedule of a role's optimizer (``actor_rollout_ref.actor.optim`` or ``critic.optim``) in verl's three
    spellings, all onto our ``{role}.optim`` cosine: FSDP's (``lr_scheduler_type``, its older ``warmup_style``,
    ``min_lr_ratio``, ``num_cycles``), megatron-core's (``lr_decay_style``, ``lr_decay_steps``; ``min_lr`` is
    absolute: `translate` divides it by the lr) and VeOmni's (``lr_min``, ``lr_decay_ratio``, ``lr_start``)."""
    optim, ours = f"{section}.optim", f"{role}.optim"
    schedule, minimum = f"{ours}.lr_scheduler_type", f"{ours}.min_lr_ratio"
    return [
        VerlKey(f"{optim}.lr_scheduler_type", (schedule,), accepts=_only(*_SCHEDULES), note=_COSINE),
        VerlKey(
            f"{optim}.warmup_style",
            accepts=lambda v: _unset(v) or v in _SCHEDULES,
            note="verl's older name of lr_scheduler_type: when set, it wins, as in verl",
            via=schedule,
        ),
        VerlKey(
            f"{optim}.lr_decay_style",
            (schedule,),
            accepts=_only(*_SCHEDULES),
            note="megatron-core's name of lr_scheduler_type (linear, inverse-square-root and WSD decays are not "
            "implemented)",
        ),
        VerlKey(f"{optim}.min_lr_ratio", (minimum,), to_ours=_none_is(0.0), note="cosine: lr x it"),
        _same(f"{optim}.num_cycles", f"{ours}.num_cycles"),
        VerlKey(
            f"{optim}.lr_decay_steps",
            (f"{ours}.decay_iterations",),
            to_ours=_minus_one_is_zero,
            to_verl=lambda values: values[0] or UNSAID,
            note="the iteration the cosine reaches its minimum (megatron-core's; null: trainer.total_iterations)",
        ),
        VerlKey(f"{optim}.min_lr", note="megatron-core's minimum lr: min_lr_ratio = min_lr / lr", via=minimum),
        _no_effect(f"{optim}.lr_warmup_init", "the warm-up starts at lr 0", lambda v: _unset(v) or float(v) == 0),
        _no_effect(f"{optim}.weight_decay_incr_style", "a constant weight decay", _only("constant")),
        _no_effect(f"{optim}.lr_wsd_decay_style", "only with lr_decay_style=WSD, which is not implemented"),
        _no_effect(f"{optim}.lr_wsd_decay_steps", "only with lr_decay_style=WSD, which is not implemented", _unset),
        _no_effect(f"{optim}.use_checkpoint_opt_param_scheduler", "the schedule is a function of the iteration"),
        *_current(
            [
                VerlKey(
                    f"{optim}.lr_min",
                    note="VeOmni's minimum lr: min_lr_ratio = lr_min / lr",
                    via=minimum,
                ),
                VerlKey(
                    f"{optim}.lr_decay_ratio",
                    note="VeOmni's: the cosine reaches its minimum at iteration int(ratio x trainer.total_iterations)",
                    via=f"{ours}.decay_iterations",
                ),
                _no_effect(f"{optim}.lr_start", "the warm-up starts at lr 0", lambda v: _unset(v) or float(v) == 0),
                _no_effect(
                    f"{optim}.zero_indexed_step", "the schedule counts iterations from 0, as verl's", _only(True)
                ),
            ]
        ),
    ]


def _off(verl: str, note: str, *values: Any) -> VerlKey:
    """A key accepted only at `values` (verl's default: the feature off) or unset; any other value is refused with
    `note` (what is not implemented, or what to do)."""
    return _no_effect(verl, note, lambda v: _unset(v) or v in values or v in ({}, [], "{}", "[]"))


_CURRENT_REST = {
    "*.torchtitan.*",
    "*.megatron.dist_ckpt_optim_fully_reshardable",
    "*.megatron.distrib_optim_fully_reshardable_mem_efficient",
    "*.megatron.pad_*",
    "*.pad_to_length",
    "*.megatron.entropy_from_logits_*",
    "*.entropy_from_logits_chunk_size",
    "*.megatron.max_seqlen_per_dp_cp_rank",
    "*.megatron.dynamic_context_parallel",
    "critic.megatron.use_megatron_fsdp",
    "*.qat.enable",
    "*.qat.*",
    f"{ARR}.rollout.qat",
    f"{ARR}.rollout.moe_load_balance_metrics_interval",
    "*.optim.exp_avg_dtype",
    "*.optim.exp_avg_sq_dtype",
    "*.optim.main_grads_dtype",
    "*.optim.use_precision_aware_optimizer",
    "*.optim.use_layer_wise_distributed_optimizer",
    "*.optim.muon_*",
    f"{ARR}.ref.optim.*",
    "*.optim.eps",
    "*.optim.name",
    "*.optim.decay_type",
    "*.optim.min_lr_factor",
    f"{ARR}.actor.policy_loss.dro_beta",
    "critic.model.custom_chat_template",
    "critic.model.fused_kernel_options.*",
    "critic.model.use_fused_kernels",
    "critic.model.use_liger",
    f"{ARR}.rollout.multi_turn.function_tool_path",
    f"{ARR}.rollout.disaggregation.*",
    f"{ARR}.rollout.full_determinism",
    f"{ARR}.rollout.n_gpus_per_node",
    f"{ARR}.rollout.nnodes",
    f"{ARR}.rollout.seed",
    "algorithm.filter_groups.max_inflight_gen_batches",
    "data.function_tool_path",
    "data.mm_processor_kwargs",
    "*sandbox_fusion.url",
    "*sandbox_fusion.*",
}
"""The keys of `_schema_rest` that only verl main's schema has (checked against the leaf keys of its
``_generated_ppo_*.yaml`` at ``1dda039`` and ``b178a3c``); the others are in both."""


def _schema_rest() -> list[VerlKey]:
    """The keys of verl main's ``_generated_ppo_*.yaml`` (``1dda039``) beyond its example scripts': engine tuning
    accepted as such; features off by default taken only off (quantisation-aware training, multi-token prediction,
    router replay, prefill/decode disaggregation, quantised rollout, the sandbox, custom dataset classes), each
    refused otherwise naming what is not here."""
    roles = (f"{ARR}.actor", f"{ARR}.ref", "critic")
    mtp = "multi-token prediction (MTP heads, speculative decoding) is not implemented: leave it off"
    entries = [
        _no_effect(
            "*.torchtitan.*", "the torchtitan engine's knobs: verl reads them only with model_engine=torchtitan"
        ),
        *[_no_effect(f"{role}.megatron.{k}", _SPEED) for role in roles for k in ("dist_checkpointing_prefix",)],
        _no_effect("*.megatron.dist_ckpt_optim_fully_reshardable", "checkpoints are saved whole per role here"),
        _no_effect("*.megatron.distrib_optim_fully_reshardable_mem_efficient", "checkpoints are saved whole here"),
        _no_effect("*.megatron.override_ddp_config*", _SPEED),
        _no_effect("*.megatron.pad_*", _PADDING),
        _no_effect("*.pad_to_length", _PADDING),
        _no_effect("*.megatron.entropy_from_logits_*", _SPEED),
        _no_effect("*.entropy_from_logits_chunk_size", _SPEED),
        _no_effect("*.megatron.max_seqlen_per_dp_cp_rank", _SEQUENCE, _unset),
        _off("*.megatron.dynamic_context_parallel", _SEQUENCE, False),
        _no_effect("*.megatron.dtype", "the compute dtype is model.dtype (auto: bf16 on CUDA, fp32 on CPU)"),
        _off("*.megatron.forward_only", "a trained role here is trained", False),
        _off("*.megatron.override_mcore_model_config", "the model's config.json is used as it is"),
        _no_effect("critic.megatron.seed", "megatron's RNG seeds dropout only, which these models have none of"),
        _no_effect("critic.megatron.vanilla_mbridge", "megatron-core models are built by our bridge"),
        _no_effect("critic.megatron.use_megatron_fsdp", _OFFLOAD),
        _no_effect("critic.megatron.use_distributed_optimizer", _OFFLOAD),
        _no_effect("critic.megatron.use_remove_padding", _PADDING),
        _no_effect("critic.megatron.sequence_parallel", _SPEED),
        _no_effect("critic.megatron.override_transformer_config.attention_backend", _SPEED),
        _off("critic.megatron.virtual_pipeline_model_parallel_size", _STAGES + ": leave it unset here"),
        _off("*.qat.enable", "quantisation-aware training is not implemented: leave qat.enable off", False),
        _no_effect("*.qat.*", "read only with qat.enable (quantisation-aware training, not implemented)"),
        _off(f"{ARR}.rollout.qat", "quantisation-aware training is not implemented"),
        _off("*.router_replay.*", "only the actor replays routes (actor.router_replay.mode)", "disabled"),
        _no_effect(
            f"{ARR}.rollout.enable_rollout_routing_replay",
            "the hf rollout records each token's experts whenever actor.router_replay.mode=R3",
        ),
        _no_effect(f"{ARR}.rollout.moe_load_balance_metrics_interval", _MOE, lambda v: int(v or 0) == 0),
        _off("*.model.mtp.enable*", mtp, False),
        _off("*.model.mtp.detach_encoder", mtp, False),
        _no_effect("*.model.mtp.*", mtp + " (read only with mtp.enable)"),
        _off(f"{ARR}.rollout.mtp", mtp),
        _no_effect("*.model.tiled_mlp.*", _SPEED),
        _no_effect("*.optim.exp_avg_dtype", "AdamW's moments are kept in fp32", _only("fp32")),
        _no_effect("*.optim.exp_avg_sq_dtype", "AdamW's moments are kept in fp32", _only("fp32")),
        _no_effect("*.optim.main_grads_dtype", "gradients are accumulated in fp32", _only("fp32")),
        _off("*.optim.use_precision_aware_optimizer", "the optimizer steps fp32 master weights", False),
        _no_effect("*.optim.use_layer_wise_distributed_optimizer", _OFFLOAD),
        _off("*.optim.override_optimizer_config", "AdamW with lr, betas and weight_decay: give those keys"),
        _no_effect("*.optim.optimizer", "AdamW (torch's)", _only("AdamW", "adamw", "adam")),
        _no_effect("*.optim.optimizer_impl", "AdamW (torch's)", _only("torch.optim")),
        _no_effect("*.optim.muon_*", "only with optimizer=muon, which is not implemented (AdamW here)"),
        _no_effect(f"{ARR}.ref.optim.*", "the reference policy is frozen: it has no optimizer"),
        _no_effect("*.optim.eps", "AdamW's eps is torch's 1e-8", lambda v: float(v) == 1e-8),
        _no_effect("*.optim.name", "AdamW (torch's)", _only("AdamW", "adamw")),
        _no_effect("*.optim.decay_type", "torchtitan's lr decay: read only with model_engine=torchtitan (refused)"),
        _no_effect("*.optim.min_lr_factor", "torchtitan's lr floor: read only with model_engine=torchtitan (refused)"),
        _no_effect("critic.optim.total_training_steps", "set by the trainer (trainer.total_training_steps)"),
        _no_effect(f"{ARR}.actor.calculate_entropy", "actor/entropy is reported every update"),
        _no_effect("*.data_loader_seed", "mini-batches are shuffled from trainer.seed and the iteration"),
        _no_effect(f"{ARR}.actor.freeze_vision_tower", _TEXT_ONLY),
        _off("*.loss_scale_factor", "the loss is aggregated by loss_agg_mode alone here"),
        _no_effect("*.rollout_n", "rollout.n (verl fills this from it)"),
        _no_effect(f"{ARR}.actor.use_remove_padding", _PADDING),
        _off(f"{ARR}.actor.policy_loss.dro_beta", "the DRO loss is not implemented (actor.policy_loss.loss_mode)"),
        _off("*.model.exclude_modules", "LoRA targets model.target_modules; nothing is excluded"),
        _off("*.model.hf_config_path", "the model's config.json (model.path) is used"),
        _off(f"{ARR}.model.tokenizer_path", "the tokenizer is the model's (model.path)"),
        _no_effect(f"{ARR}.model.lora.a2a_experimental", _SPEED),
        _off(f"{ARR}.model.lora.adapter_path", "give actor_rollout_ref.model.lora_adapter_path"),
        _off(f"{ARR}.model.lora.dtype", "the adapter is in the model's dtype"),
        _off(f"{ARR}.model.lora.exclude_modules", "nothing is excluded from model.lora.target_modules"),
        _no_effect(f"{ARR}.model.lora.freeze_*", _TEXT_ONLY + "; everything but the adapter is frozen", _only(True)),
        _no_effect(f"{ARR}.model.lora.lora_B_init_method", "B starts at zero (PEFT's)", _only("zero")),
        _no_effect(
            "critic.model.lora_rank", "a LoRA critic is not implemented: the critic trains whole", _unset_or_zero
        ),
        _no_effect(
            "critic.model.lora.rank", "a LoRA critic is not implemented: the critic trains whole", _unset_or_zero
        ),
        _no_effect("critic.model.lora*", "a LoRA critic is not implemented: read only with critic.model.lora_rank > 0"),
        _no_effect("critic.model.target_modules", "read only with critic.model.lora_rank > 0 (not implemented)"),
        _off("critic.model.custom_chat_template", "the tokenizer's own chat template is used"),
        _off("critic.model.external_lib", "models load through transformers' Auto classes"),
        _off("critic.model.override_config", "the model's config.json is used as it is"),
        _no_effect("critic.model.enable_activation_offload", _SPEED),
        _no_effect("critic.model.fused_kernel_options.*", _SPEED),
        _no_effect("critic.model.use_fused_kernels", _SPEED),
        _no_effect("critic.model.use_liger", _SPEED),
        _no_effect("critic.model.use_shm", _SPEED),
        _no_effect("critic.nccl_timeout", "placement.call_timeout_s limits a stage call here"),
        _no_effect("critic.enable", "the critic runs exactly when the estimator needs one (gae)", _unset),
        _no_effect("critic.forward_micro_batch_size", _MICRO_GLOBAL),
        _off(f"{ARR}.rollout.agent.agent_loop_config_path", "agent loops are rollout.multi_turn here"),
        _off(f"{ARR}.rollout.agent.custom_async_server.*", "the rollout engine is vLLM in process here"),
        _no_effect(f"{ARR}.rollout.agent.default_agent_loop", "one response per prompt", _only("single_turn_agent")),
        _no_effect(f"{ARR}.rollout.agent.num_workers", _SPEED),
        _off(f"{ARR}.rollout.multi_turn.function_tool_path", "tools are given by rollout.multi_turn.tool_config_path"),
        _no_effect(f"{ARR}.rollout.multi_turn.max_parallel_calls", _SPEED),
        _off(f"{ARR}.rollout.multi_turn.num_repeat_rollouts", "rollout.n responses per prompt"),
        _no_effect(f"{ARR}.rollout.multi_turn.tokenization_sanity_check_mode", "a check of verl's tokenization"),
        _off(f"{ARR}.rollout.multi_turn.use_inference_chat_template", "the chat template is the tokenizer's", False),
        _no_effect(f"{ARR}.rollout.disaggregation.*", "prefill/decode disaggregation of the serving engine: " + _SPEED),
        _no_effect(f"{ARR}.rollout.full_determinism", _SPEED),
        _no_effect(
            f"{ARR}.rollout.logprobs_mode",
            "the log-probs of the distribution sampled from",
            _only("processed_logprobs"),
        ),
        _no_effect(f"{ARR}.rollout.n_gpus_per_node", "the rollout's pool: placement.pools here"),
        _no_effect(f"{ARR}.rollout.nnodes", "the rollout's pool: placement.pools here"),
        _off(f"{ARR}.rollout.over_sample_rate", "every sampled response is trained on", 0),
        _no_effect(f"{ARR}.rollout.pipeline_model_parallel_size", "vLLM's pipeline parallelism is not used", _only(1)),
        _off(f"{ARR}.rollout.quantization", "the rollout generates with the actor's weights, unquantised"),
        _off(f"{ARR}.rollout.quantization_config_file", "the rollout generates with the actor's weights, unquantised"),
        _no_effect(f"{ARR}.rollout.scheduling_policy", _SPEED),
        _no_effect(f"{ARR}.rollout.seed", "sampling is seeded from trainer.seed, the iteration and the row"),
        _no_effect(f"{ARR}.rollout.skip_tokenizer_init", _SPEED),
        _no_effect("algorithm.filter_groups.max_inflight_gen_batches", _SPEED),
        _off("data.apply_chat_template_kwargs", "the tokenizer's chat template with its defaults"),
        _off("data.custom_cls.*", "prompt files in verl's layout (data.train_files)"),
        _off("data.function_tool_path", "tools are given by rollout.multi_turn.tool_config_path"),
        _off("data.tool_config_path", "tools are given by rollout.multi_turn.tool_config_path"),
        _no_effect("data.mm_processor_kwargs", _TEXT_ONLY),
        _no_effect("data.return_multi_modal_inputs", _TEXT_ONLY),
        _off("data.train_max_samples", "every row of data.train_files is used: give a smaller file"),
        _off("data.val_max_samples", "every row of data.val_files is used: give a smaller file"),
        _off("*sandbox_fusion.url", "the sandbox-fusion reward is not implemented: a score function is run here"),
        _no_effect("*sandbox_fusion.*", "read only with sandbox_fusion.url (not implemented)"),
        _no_effect("reward_model.enable_resource_pool", "the reward model's pool: placement.pools here"),
        _no_effect("reward_model.n_gpus_per_node", "the reward model's pool: placement.pools here"),
        _no_effect("reward_model.nnodes", "the reward model's pool: placement.pools here"),
        _off("reward_model.model.external_lib", "models load through transformers' Auto classes"),
        _off("reward_model.reward_loop_*", "verl's reward loop: a score function or reward model scores here"),
    ]
    return [replace(entry, schema="current") if entry.verl in _CURRENT_REST else entry for entry in entries]


_SPEED = "speed and memory only (verl's FSDP/vLLM tuning); the computation here is the same without it"
_PADDING = "HybridFlow's trainers never compute on padding tokens; the values are the same either way"
_CHECKPOINTING = (
    "activation checkpointing: each decoder layer recomputed in the backward pass (less memory, the same values)"
)
_RECOMPUTE = (
    "full or selective: every layer recomputed whole, as model.gradient_checkpointing (megatron's full, uniform, "
    "one layer per unit; the same values) unless model.enable_gradient_checkpointing is given"
)
_DYNAMIC_BSZ = (
    "micro-batches here hold a fixed number of sequences (*.ppo_micro_batch_size); the update is the same "
    "weighted sum either way (loss_agg_mode), up to float rounding"
)
_OFFLOAD = (
    "memory only: verl moves parameters, gradients or optimizer state to host memory between stages; the update is "
    "the same"
)
_BRIDGE = "weights convert between Hugging Face and megatron-core layouts with HybridFlow's own bridge"
_DIST_CKPT = (
    "the initial weights are model.path's (Hugging Face); a megatron dist checkpoint is not read: convert it to a "
    "Hugging Face folder and leave use_dist_checkpointing false"
)
_SCHEDULE = "megatron's interleaved pipeline schedule is speed only; the update is the same"
_STAGES = "how layers are split over pipeline stages is speed and memory only; the update is the same"
_ACTOR_TC = f"{ARR}.actor.megatron.override_transformer_config"
_ROUTES_IN_BATCH = "routes travel in the batch (routed_experts), not in files: leave it unset"
_MOE = (
    "expert parallelism is the megatron actor's here (actor_rollout_ref.actor.megatron.expert_model_parallel_size; "
    "fsdp shards experts as any weight; docs/moe.md); this one is not implemented: leave it at 1"
)
_CONTEXT = (
    "context parallelism is not implemented: split the model with actor_rollout_ref.actor.megatron."
    "tensor_model_parallel_size or shorten data.max_response_length"
)
_SEQUENCE = (
    "Ulysses sequence parallelism is not implemented: split the model with tensor parallelism instead "
    "(actor_rollout_ref.actor.strategy=megatron with megatron.tensor_model_parallel_size) or shorten "
    "data.max_response_length"
)
_REMOTE_CODE = (
    "no remote code is run: models load with transformers' own classes, and one whose config names code of its own "
    "is refused when it is read"
)
_REWARD_LOOP = (
    "verl's reward loop serves the reward model (reward_model.model.path) on an inference engine of its own; here "
    "it scores with its own forward pass in the rm_score stage: the same scores"
)
_JUDGE_ENGINE = (
    "the reward model's serving engine: a generative judge's vLLM engine (-o reward_model.judge.enable=true with its "
    "prompt_function and verdict_function); a discriminative reward model scores with its own forward pass (the "
    "same scores)"
)
_DAPO_KWARGS = "DAPO's overlong buffer in verl's reward-manager spelling (reward_model.reward_kwargs)"
_MICRO_GLOBAL = (
    "verl's deprecated global micro-batch size only splits the same update into micro-batches (up to float "
    "rounding); to set ours give the per-GPU one (ppo_micro_batch_size_per_gpu / log_prob_micro_batch_size_per_gpu)"
)

_ENGINE = (
    "verl's training engine, the Hydra defaults group of the actor, ref and critic (*.strategy): dp (FSDP) and veomni "
    "(VeOmni's FSDP2 engine, with its default cosine lr decay to optim.lr_min over optim.lr_decay_ratio of the run) "
    "train as our fsdp, megatron as ours; a *.strategy given with it wins, as in verl; torchtitan (its lr decays "
    "linearly after warm-up) is not supported: use dp"
)
MODEL_ENGINES = {"dp": "fsdp", "veomni": "fsdp", "megatron": "megatron"}
"""verl's ``model_engine`` choices (``verl/trainer/config/model_engine/*.yaml``) taken here -> our strategy."""
_DISTILL = (
    "on-policy distillation from one teacher (our teacher role): loss_mode and use_policy_gradient choose "
    "teacher.use_as; a policy-gradient distillation term is taken with one mini-batch of one epoch "
    "(ppo_mini_batch_size = train_batch_size, ppo_epochs 1), where verl's current log-probs are the old ones"
)
_DISTILL_CLIP = (
    "the distillation term's PPO clip range: with one mini-batch of one epoch (required) its ratio is 1 and nothing "
    "is clipped"
)
_TEACHER_ENGINE = (
    "verl serves the teacher on an inference engine; here it scores with its own forward pass (the same log-probs, "
    "at temperature 1: the rollout's must be 1, as verl's teacher ignores its own)"
)
_LORA_MERGE = "the rollout generates with the base weights plus the adapter either way (merged or as an adapter)"
_TEXT_ONLY = "text prompts only: a file's image, video and audio columns are not read (a text model is trained)"

VERL_KEYS: tuple[VerlKey, ...] = (
    # ------------------------------------------------------------------ data
    _same("data.train_files"),
    _same("data.val_files"),
    _same("data.max_prompt_length", note="longer prompts are dropped (verl's filter_overlong_prompts=True)"),
    _same("data.max_response_length", "rollout.response_length"),
    _same("data.train_batch_size"),
    _same("data.gen_batch_size"),
    VerlKey(
        "data.val_batch_size",
        ("data.val_batch_size",),
        accepts=lambda v: v is None or int(v) > 0,
        note="null (verl: the whole set in one batch) keeps ours (64 prompts per generate call)",
    ),
    _same("data.shuffle"),
    _same("data.seed"),
    _no_effect(
        "data.filter_overlong_prompts",
        "prompts longer than data.max_prompt_length are always dropped here (verl's true), never truncated",
    ),
    _no_effect("data.filter_overlong_prompts_workers", _SPEED),
    _no_effect(
        "data.truncation",
        "prompts longer than data.max_prompt_length are dropped here before any batch, so none is truncated",
    ),
    _no_effect("data.prompt_key", "the prompt column is 'prompt' (verl's default)", _only("prompt")),
    _no_effect("data.reward_fn_key", "the score function is chosen by 'data_source'", _only("data_source")),
    _no_effect("data.return_raw_chat", "the chat messages always travel with the row (raw_prompt)"),
    _no_effect("data.return_raw_input_ids", "no effect here"),
    _no_effect("data.return_full_prompt", "no effect here"),
    _no_effect("data.dataloader_num_workers", _SPEED),
    _no_effect("data.validation_shuffle", "validation prompts are read in file order", _only(False)),
    _no_effect("data.trust_remote_code", _REMOTE_CODE),
    _no_effect("data.use_shm", _SPEED),
    _no_effect("data.tokenizer", "the tokenizer is the model's (model.path)", _unset),
    # ------------------------------------------------------------------ model
    _same(f"{ARR}.model.path", "model.path"),
    _same(f"{ARR}.model.lora_rank", "model.lora_rank"),
    _same(f"{ARR}.model.lora_alpha", "model.lora_alpha"),
    _same(f"{ARR}.model.target_modules", "model.target_modules"),
    _same(f"{ARR}.model.lora_adapter_path", "model.lora_adapter_path"),
    _same(f"{ARR}.model.lora.rank", "model.lora_rank", "verl's megatron spelling of lora_rank"),
    _same(f"{ARR}.model.lora.alpha", "model.lora_alpha", "verl's megatron spelling of lora_alpha"),
    VerlKey(
        f"{ARR}.model.lora.target_modules",
        ("model.target_modules",),
        to_ours=lambda v: (_hf_module_names(v),),
        note="verl's megatron spelling: megatron-core's layer names (linear_qkv, linear_proj, linear_fc1, "
        "linear_fc2, ...) become the Hugging Face ones (q_proj/k_proj/v_proj, o_proj, gate_proj/up_proj, down_proj)",
    ),
    _no_effect(f"{ARR}.model.lora.type", "adapters are PEFT's LoRA (verl's lora)", _only("lora")),
    _no_effect(f"{ARR}.model.lora.dropout", "no adapter dropout here", lambda v: v in (0, 0.0, None)),
    _no_effect(f"{ARR}.model.lora.dropout_position", "no adapter dropout here"),
    _no_effect(
        f"{ARR}.model.lora.lora_A_init_method", "A starts Kaiming-uniform (PEFT's), B at zero", _only("kaiming")
    ),
    _no_effect(f"{ARR}.model.use_remove_padding", _PADDING),
    _same(f"{ARR}.model.enable_gradient_checkpointing", "model.gradient_checkpointing", _CHECKPOINTING),
    _no_effect(f"{ARR}.model.enable_activation_offload", _SPEED),
    _no_effect(f"{ARR}.model.use_fused_kernels", _SPEED),
    _no_effect(f"{ARR}.model.fused_kernel_options.*", _SPEED),
    _no_effect(f"{ARR}.model.use_liger", _SPEED),
    _no_effect(f"{ARR}.model.use_shm", _SPEED),
    _no_effect(f"{ARR}.model.trust_remote_code", _REMOTE_CODE),
    _no_effect(f"{ARR}.model.external_lib", "models load through transformers' Auto classes", _unset),
    _no_effect(f"{ARR}.model.custom_chat_template", "the tokenizer's own chat template is used", _unset),
    _no_effect(f"{ARR}.model.override_config", "the model's config.json is used as it is", lambda v: not v),
    _no_effect(
        f"{ARR}.model.override_config.*",
        "only dropout 0 (ReMax's examples): the embedded models have none; a model's config.json is used as it is",
        lambda v: v in (0, 0.0),
    ),
    _no_effect(f"{ARR}.hybrid_engine", "the actor and rollout share weights (3D-HybridEngine)", _only(True)),
    _no_effect(f"{ARR}.nccl_timeout", "placement.call_timeout_s limits a stage call here"),
    # ------------------------------------------------------------------ actor
    _strategy(f"{ARR}.actor.strategy", "actor.strategy"),
    _same(f"{ARR}.actor.optim.lr"),
    _same(f"{ARR}.actor.optim.weight_decay"),
    _same(f"{ARR}.actor.optim.betas"),
    _same(f"{ARR}.actor.optim.clip_grad", "actor.optim.grad_clip"),
    _same(f"{ARR}.actor.grad_clip", "actor.optim.grad_clip"),
    VerlKey(
        f"{ARR}.actor.optim.lr_warmup_steps",
        ("actor.optim.warmup_iterations",),
        to_ours=_minus_one_is_zero,
        note="iterations of warm-up from lr 0, as verl counts them (one scheduler step per update); -1: from "
        "lr_warmup_steps_ratio",
    ),
    VerlKey(
        f"{ARR}.actor.optim.lr_warmup_steps_ratio",
        note="with lr_warmup_steps -1 or unset: warmup_iterations = int(ratio x trainer.total_iterations), as verl",
        via="actor.optim.warmup_iterations",
    ),
    *_lr_schedule(f"{ARR}.actor", "actor"),
    _no_effect(f"{ARR}.actor.optim.total_training_steps", "set by the trainer (trainer.total_training_steps)"),
    _same(f"{ARR}.actor.ppo_mini_batch_size", note="prompts per optimizer step, as in verl"),
    _same(f"{ARR}.actor.ppo_micro_batch_size_per_gpu", "actor.ppo_micro_batch_size", "sequences per rank"),
    _no_effect(f"{ARR}.actor.ppo_micro_batch_size", _MICRO_GLOBAL),
    _no_effect(f"{ARR}.actor.use_dynamic_bsz", _DYNAMIC_BSZ),
    _no_effect(f"{ARR}.actor.ppo_max_token_len_per_gpu", _DYNAMIC_BSZ),
    _same(f"{ARR}.actor.ppo_epochs"),
    _same(f"{ARR}.actor.shuffle"),
    _same(f"{ARR}.actor.clip_ratio_low"),
    _same(f"{ARR}.actor.clip_ratio_high"),
    VerlKey(
        f"{ARR}.actor.clip_ratio",
        ("actor.clip_ratio_low", "actor.clip_ratio_high"),
        to_ours=lambda v: (v, v),
        note="both ends of the clip range (clip_ratio_low / clip_ratio_high set one each)",
    ),
    _same(f"{ARR}.actor.clip_ratio_c"),
    _same(f"{ARR}.actor.loss_agg_mode"),
    VerlKey(
        f"{ARR}.actor.use_token_level_loss",
        ("actor.loss_agg_mode",),
        to_ours=lambda v: ("token-mean" if v else "seq-mean-token-mean",),
        note="verl's older spelling: true is loss_agg_mode=token-mean, false seq-mean-token-mean",
    ),
    _same(f"{ARR}.actor.entropy_coeff"),
    _same(f"{ARR}.actor.use_kl_loss"),
    _same(f"{ARR}.actor.kl_loss_coef"),
    _same(f"{ARR}.actor.kl_loss_type"),
    _same(f"{ARR}.actor.policy_loss.loss_mode"),
    _same(f"{ARR}.actor.policy_loss.clip_cov_ratio"),
    _same(f"{ARR}.actor.policy_loss.clip_cov_lb"),
    _same(f"{ARR}.actor.policy_loss.clip_cov_ub"),
    _same(f"{ARR}.actor.policy_loss.kl_cov_ratio"),
    _same(f"{ARR}.actor.policy_loss.ppo_kl_coef"),
    _same(f"{ARR}.actor.tau_pos", "actor.policy_loss.tau_pos", "SAPO's gate temperature (loss_mode=sapo)"),
    _same(f"{ARR}.actor.tau_neg", "actor.policy_loss.tau_neg", "SAPO's gate temperature (loss_mode=sapo)"),
    _no_effect(
        f"{ARR}.actor.policy_loss.tau_*",
        "verl's SAPO reads actor.tau_pos / tau_neg, not this key (its SAPO examples add it at verl's defaults)",
    ),
    _same(f"{ARR}.actor.megatron.tensor_model_parallel_size", "actor.tp"),
    _same(f"{ARR}.actor.megatron.pipeline_model_parallel_size", "actor.pp"),
    _no_effect(f"{ARR}.actor.megatron.virtual_pipeline_model_parallel_size", _SCHEDULE, _unset_or_one),
    _same(f"{ARR}.actor.megatron.expert_model_parallel_size", "actor.ep"),
    VerlKey(
        f"{ARR}.actor.megatron.expert_tensor_parallel_size",
        ("actor.etp",),
        to_ours=lambda v: (None if _unset(v) or v == "None" else int(v),),
        to_verl=lambda ours: "null" if ours[0] is None else ours[0],
        note="null: actor.tp, as megatron-core's default",
    ),
    _no_effect(f"{ARR}.actor.megatron.context_parallel_size", _CONTEXT, _unset_or_one),
    _no_effect(f"{ARR}.actor.megatron.param_offload", _OFFLOAD),
    _no_effect(f"{ARR}.actor.megatron.grad_offload", _OFFLOAD),
    _no_effect(f"{ARR}.actor.megatron.optimizer_offload", _OFFLOAD),
    _no_effect(f"{ARR}.actor.megatron.use_mbridge", _BRIDGE),
    _no_effect(f"{ARR}.actor.megatron.vanilla_mbridge", _BRIDGE),
    _no_effect(f"{ARR}.actor.megatron.use_dist_checkpointing", _DIST_CKPT, _only(False)),
    _no_effect(f"{ARR}.actor.megatron.dist_checkpointing_path", _DIST_CKPT),
    _no_effect(f"{ARR}.actor.megatron.seed", "the megatron actor is seeded from trainer.seed"),
    VerlKey(
        f"{ARR}.actor.megatron.override_transformer_config.recompute_granularity",
        note=_RECOMPUTE,
        accepts=_only(None, "null", "full", "selective"),
        via="model.gradient_checkpointing",
    ),
    _no_effect(f"{ARR}.actor.megatron.override_transformer_config.recompute_*", _RECOMPUTE),
    _no_effect(f"{ARR}.actor.megatron.override_transformer_config.*_fusion", _SPEED),
    _same(
        f"{_ACTOR_TC}.moe_aux_loss_coeff",
        "actor.moe.aux_loss_coeff",
        note="megatron-core's definition",
    ),
    _same(
        f"{_ACTOR_TC}.moe_z_loss_coeff",
        "actor.moe.z_loss_coeff",
        note="megatron-core's definition",
    ),
    _off(
        f"{_ACTOR_TC}.moe_router_load_balancing_type",
        "the load-balancing loss is megatron-core's aux_loss (Switch Transformer's); others are not implemented",
        "aux_loss",
    ),
    _no_effect(
        f"{_ACTOR_TC}.moe_router_dtype",
        "transformers' routers take their softmax in fp32 (their logits in model.dtype)",
        _only("fp32"),
    ),
    VerlKey(
        f"{_ACTOR_TC}.moe_token_dispatcher_type",
        ("actor.moe.token_dispatcher_type",),
        to_ours=lambda v: ("alltoall" if v == "flex" else v,),
        accepts=_only("allgather", "alltoall", "flex"),
        note="flex (DeepEP's fused all-to-all, GPUs only) runs as alltoall: the same tokens reach the same experts",
    ),
    _no_effect(f"{_ACTOR_TC}.moe_grouped_gemm", _SPEED),
    _no_effect(f"{_ACTOR_TC}.moe_enable_deepep", _SPEED),
    _no_effect(f"{_ACTOR_TC}.moe_shared_expert_overlap", _SPEED),
    _no_effect(
        f"{_ACTOR_TC}.moe_*",
        "this megatron-core MoE setting is not implemented here (the MoE settings taken: moe_aux_loss_coeff, "
        "moe_z_loss_coeff, moe_router_dtype=fp32 and the dispatch and fusion tuning; docs/moe.md)",
        lambda v: False,
    ),
    _no_effect(f"{ARR}.actor.megatron.override_transformer_config.deallocate_pipeline_outputs", _SPEED),
    _no_effect(f"{ARR}.actor.megatron.override_transformer_config.persist_layer_norm", _SPEED),
    _no_effect(f"{ARR}.actor.megatron.override_transformer_config.attention_backend", _SPEED),
    _no_effect(f"{ARR}.actor.megatron.override_transformer_config.account_for_*_in_pipeline_split", _STAGES),
    _no_effect(f"{ARR}.actor.megatron.override_transformer_config.num_layers_in_*_pipeline_stage", _STAGES),
    _no_effect(f"{ARR}.actor.optim.override_optimizer_config.*", _OFFLOAD),
    _no_effect(f"{ARR}.actor.ulysses_sequence_parallel_size", _SEQUENCE, _only(1)),
    _no_effect(f"{ARR}.actor.use_torch_compile", _SPEED),
    _no_effect(f"{ARR}.actor.entropy_from_logits_with_chunking", _SPEED),
    _no_effect(f"{ARR}.actor.entropy_checkpointing", _CHECKPOINTING),
    _same(
        f"{ARR}.actor.calculate_sum_pi_squared",
        note="sum_pi_squared for algorithm.adv_estimator=optimal_token_baseline",
    ),
    _no_effect(f"{ARR}.actor.sum_pi_squared_checkpointing", _CHECKPOINTING),
    _no_effect(f"{ARR}.actor.use_fused_kernels", _SPEED),
    _no_effect(
        f"{ARR}.actor.use_prefix_grouper",
        "a prompt is computed once for its group's responses here already (actor.share_prompts)",
    ),
    _same(f"{ARR}.actor.router_replay.mode", note="R3's routes are recorded by the hf rollout"),
    _same(
        f"{ARR}.actor.megatron.router_replay.mode",
        "actor.router_replay.mode",
        note="the actor's router replay, whatever its engine (fsdp, ddp, or megatron at actor.pp=1)",
        schema="current",
    ),
    _same(
        f"{ARR}.actor.veomni.router_replay.mode",
        "actor.router_replay.mode",
        note="the actor's router replay, whatever its engine (fsdp, ddp, or megatron at actor.pp=1)",
        schema="current",
    ),
    _off(f"{ARR}.actor.*router_replay.record_file", _ROUTES_IN_BATCH, None),
    _off(f"{ARR}.actor.*router_replay.replay_file", _ROUTES_IN_BATCH, None),
    _no_effect(
        f"{ARR}.ref.*router_replay.*",
        "the reference policy never replays routes, as verl's compute_ref_log_prob does not",
        schema="current",
    ),
    _no_effect(f"{ARR}.actor.checkpoint.*", "checkpoints always hold the model, the optimizer and the trainer state"),
    # ------------------------------------------------------------------ rollout
    VerlKey(
        f"{ARR}.rollout.name",
        ("rollout.name",),
        accepts=_only("vllm", "hf"),
        note="vllm (an in-process engine) or hf (transformers generate); sglang is not available here: use vllm",
    ),
    _no_effect(f"{ARR}.rollout.mode", "generation is one call per batch here; agent loops: rollout.multi_turn"),
    _same(f"{ARR}.rollout.n"),
    _same(f"{ARR}.rollout.temperature"),
    _same(f"{ARR}.rollout.top_p"),
    _top_k(f"{ARR}.rollout.top_k", "rollout.top_k"),
    _same(f"{ARR}.rollout.response_length", "rollout.response_length"),
    _no_effect(f"{ARR}.rollout.prompt_length", "data.max_prompt_length bounds the prompts"),
    _same(f"{ARR}.rollout.gpu_memory_utilization"),
    _same(f"{ARR}.rollout.tensor_model_parallel_size", "rollout.gen_tp"),
    _same(f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu", "actor.log_prob_micro_batch_size", "sequences per rank"),
    _no_effect(f"{ARR}.rollout.log_prob_micro_batch_size", _MICRO_GLOBAL),
    _no_effect(f"{ARR}.rollout.log_prob_use_dynamic_bsz", _DYNAMIC_BSZ),
    _no_effect(f"{ARR}.rollout.log_prob_max_token_len_per_gpu", _DYNAMIC_BSZ),
    VerlKey(
        f"{ARR}.rollout.dtype",
        ("rollout.vllm_dtype",),
        accepts=_only("bfloat16", "float32"),
        note="the vLLM engine's dtype (our rollout.vllm_dtype; unset: native, bf16 where the hardware computes it)",
        to_verl=lambda values: UNSAID if values[0] == "native" else values[0],
    ),
    _no_effect(f"{ARR}.rollout.do_sample", "sampling; greedy is temperature=0", _only(True)),
    _no_effect(f"{ARR}.rollout.ignore_eos", "generation stops at the end-of-sequence token", _only(False)),
    _no_effect(f"{ARR}.rollout.enforce_eager", _SPEED),
    _no_effect(f"{ARR}.rollout.free_cache_engine", _SPEED),
    _no_effect(f"{ARR}.rollout.enable_chunked_prefill", _SPEED),
    _no_effect(f"{ARR}.rollout.enable_prefix_caching", _SPEED),
    _no_effect(f"{ARR}.rollout.max_num_batched_tokens", _SPEED),
    _no_effect(f"{ARR}.rollout.max_num_seqs", _SPEED),
    _no_effect(f"{ARR}.rollout.max_model_len", _SPEED),
    _no_effect(f"{ARR}.rollout.load_format", _SPEED),
    _no_effect(f"{ARR}.rollout.layered_summon", _SPEED),
    _no_effect(f"{ARR}.rollout.disable_log_stats", _SPEED),
    _no_effect(f"{ARR}.rollout.cudagraph_capture_sizes", _SPEED),
    _no_effect(f"{ARR}.rollout.multi_stage_wake_up", _SPEED),
    _no_effect(f"{ARR}.rollout.engine_kwargs.*", _SPEED),
    _no_effect(f"{ARR}.rollout.data_parallel_size", "vLLM's data parallelism (MoE serving); " + _MOE, _unset_or_one),
    _same(f"{ARR}.rollout.expert_parallel_size", "rollout.expert_parallel_size"),
    _no_effect(f"{ARR}.rollout.trace.*", "samples are in the run store: hf runs samples RUN"),
    _no_effect(f"{ARR}.rollout.prometheus.*", "vLLM's metrics server: hf runs timeline RUN shows each stage's seconds"),
    _no_effect(f"{ARR}.rollout.calculate_log_probs", "the engine's log-probs are kept when a correction needs them"),
    _same(
        f"{ARR}.rollout.update_weights_bucket_megabytes", "rollout.checkpoint_engine.update_weights_bucket_megabytes"
    ),
    _same(f"{ARR}.rollout.val_kwargs.temperature", "rollout.val_temperature"),
    _no_effect(f"{ARR}.rollout.val_kwargs.n", "one response per validation prompt", _only(1)),
    _same(f"{ARR}.rollout.val_kwargs.top_p", "rollout.val_top_p"),
    _top_k(f"{ARR}.rollout.val_kwargs.top_k", "rollout.val_top_k"),
    _no_effect(
        f"{ARR}.rollout.val_kwargs.do_sample",
        "validation samples when rollout.val_kwargs.temperature (our rollout.val_temperature) is above 0, and is "
        "greedy at 0; do_sample=false with a temperature above 0 is refused (set the temperature to 0)",
    ),
    _same(f"{ARR}.rollout.multi_turn.enable"),
    _same(f"{ARR}.rollout.multi_turn.max_assistant_turns"),
    _same(f"{ARR}.rollout.multi_turn.max_user_turns"),
    _same(f"{ARR}.rollout.multi_turn.max_tool_response_length"),
    _same(f"{ARR}.rollout.multi_turn.tool_response_truncate_side"),
    _same(f"{ARR}.rollout.multi_turn.tool_config_path"),
    _same(f"{ARR}.rollout.multi_turn.format"),
    # ------------------------------------------------------------------ ref
    _same(f"{ARR}.ref.log_prob_micro_batch_size_per_gpu", "ref.log_prob_micro_batch_size", "sequences per rank"),
    _no_effect(f"{ARR}.ref.log_prob_micro_batch_size", _MICRO_GLOBAL),
    _no_effect(f"{ARR}.ref.log_prob_use_dynamic_bsz", _DYNAMIC_BSZ),
    _no_effect(f"{ARR}.ref.log_prob_max_token_len_per_gpu", _DYNAMIC_BSZ),
    _no_effect(f"{ARR}.ref.ulysses_sequence_parallel_size", _SEQUENCE, _only(1)),
    _no_effect(f"{ARR}.ref.strategy", "the ref model lives with the actor, in its layout"),
    _no_effect(f"{ARR}.ref.use_torch_compile", _SPEED),
    _no_effect(f"{ARR}.ref.entropy_from_logits_with_chunking", _SPEED),
    _no_effect(f"{ARR}.ref.megatron.*", "the ref model lives with the actor, in its layout"),
    # ------------------------------------------------------------------ critic
    _strategy("critic.strategy", "critic.strategy"),
    _same("critic.model.path", "critic.model_path"),
    _same("critic.optim.lr"),
    _same("critic.optim.weight_decay"),
    _same("critic.optim.betas"),
    _same("critic.optim.clip_grad", "critic.optim.grad_clip"),
    _same("critic.grad_clip", "critic.optim.grad_clip"),
    VerlKey(
        "critic.optim.lr_warmup_steps",
        ("critic.optim.warmup_iterations",),
        to_ours=_minus_one_is_zero,
        note="iterations of warm-up from lr 0, as verl counts them (one scheduler step per update); -1: from "
        "lr_warmup_steps_ratio",
    ),
    VerlKey(
        "critic.optim.lr_warmup_steps_ratio",
        note="with lr_warmup_steps -1 or unset: warmup_iterations = int(ratio x trainer.total_iterations), as verl",
        via="critic.optim.warmup_iterations",
    ),
    *_lr_schedule("critic", "critic"),
    _same("critic.ppo_mini_batch_size"),
    _same("critic.ppo_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size", "sequences per rank"),
    _same("critic.forward_micro_batch_size_per_gpu", "critic.forward_micro_batch_size", "sequences per rank"),
    _no_effect("critic.ppo_micro_batch_size", _MICRO_GLOBAL),
    _no_effect("critic.use_dynamic_bsz", _DYNAMIC_BSZ),
    _no_effect("critic.ppo_max_token_len_per_gpu", _DYNAMIC_BSZ),
    _no_effect("critic.forward_max_token_len_per_gpu", _DYNAMIC_BSZ),
    _same("critic.ppo_epochs"),
    _same("critic.shuffle"),
    _same("critic.cliprange_value"),
    _same("critic.loss_agg_mode"),
    _no_effect("critic.model.use_remove_padding", _PADDING),
    _same("critic.model.enable_gradient_checkpointing", "critic.gradient_checkpointing", _CHECKPOINTING),
    _no_effect("critic.model.tokenizer_path", "the critic reads the actor's tokens"),
    _no_effect("critic.model.trust_remote_code", _REMOTE_CODE),
    _no_effect("critic.ulysses_sequence_parallel_size", _SEQUENCE, _only(1)),
    _no_effect("critic.rollout_n", "follows actor_rollout_ref.rollout.n, as in verl"),
    _no_effect("critic.checkpoint.*", "checkpoints always hold the model, the optimizer and the trainer state"),
    _no_effect(
        "critic.megatron.tensor_model_parallel_size",
        "a megatron critic lives in the actor's processes and layout (actor_rollout_ref.actor.megatron.*); the "
        "values are the same in any layout",
    ),
    _no_effect(
        "critic.megatron.pipeline_model_parallel_size",
        "a megatron critic lives in the actor's processes and layout (actor_rollout_ref.actor.megatron.*); the "
        "values are the same in any layout",
    ),
    _no_effect("critic.megatron.expert_model_parallel_size", _MOE, _unset_or_one),
    _no_effect("critic.megatron.expert_tensor_parallel_size", _MOE, _unset_or_one),
    _no_effect("critic.megatron.context_parallel_size", _CONTEXT, _unset_or_one),
    _no_effect("critic.megatron.param_offload", _OFFLOAD),
    _no_effect("critic.megatron.grad_offload", _OFFLOAD),
    _no_effect("critic.megatron.optimizer_offload", _OFFLOAD),
    _no_effect("critic.megatron.use_mbridge", _BRIDGE),
    _no_effect("critic.megatron.use_dist_checkpointing", _DIST_CKPT, _only(False)),
    _no_effect("critic.megatron.dist_checkpointing_path", _DIST_CKPT),
    VerlKey(
        "critic.megatron.override_transformer_config.recompute_granularity",
        note=_RECOMPUTE,
        accepts=_only(None, "null", "full", "selective"),
        via="critic.gradient_checkpointing",
    ),
    _no_effect("critic.megatron.override_transformer_config.recompute_*", _RECOMPUTE),
    _no_effect("critic.megatron.override_transformer_config.*_fusion", _SPEED),
    _no_effect("critic.optim.override_optimizer_config.*", _OFFLOAD),
    # ------------------------------------------------------------------ reward
    _same("reward_model.enable"),
    _same("reward_model.model.path", "reward_model.path"),
    _same("reward_model.micro_batch_size_per_gpu", "reward_model.micro_batch_size", "sequences per rank"),
    _no_effect("reward_model.micro_batch_size", _MICRO_GLOBAL),
    VerlKey(
        "reward_model.max_length",
        ("reward_model.max_length",),
        accepts=lambda v: v is None or int(v) > 0,
        note="null keeps ours (1024 tokens)",
    ),
    VerlKey(
        "reward_model.strategy",
        ("reward_model.strategy",),
        to_ours=lambda v: ("fsdp",),
        to_verl=lambda values: UNSAID if values[0] == "ddp" else values[0],
        accepts=_only("fsdp", "fsdp2"),
        note="fsdp and fsdp2 are our fsdp; our ddp has no verl name",
    ),
    _no_effect("reward_model.model.input_tokenizer", "the reward model reads the text with its own tokenizer"),
    _no_effect("reward_model.model.use_remove_padding", _PADDING),
    _no_effect("reward_model.model.trust_remote_code", _REMOTE_CODE),
    _no_effect("reward_model.use_dynamic_bsz", _DYNAMIC_BSZ),
    _no_effect("reward_model.forward_max_token_len_per_gpu", _DYNAMIC_BSZ),
    _no_effect("reward_model.launch_reward_fn_async", _SPEED),
    _no_effect("reward_model.use_reward_loop", _REWARD_LOOP),
    _no_effect("reward_model.num_workers", _REWARD_LOOP),
    *_judge_engine("reward_model.rollout"),
    _no_effect(
        "reward_model.reward_manager",
        "scores come from the score function (custom_reward_function or the data_source's); DAPO's overlong "
        "penalty is reward_model.overlong_buffer",
        lambda v: _unset(v) or v in ("naive", "dapo"),
    ),
    _same("reward_model.overlong_buffer.enable", "reward.overlong_buffer.enable"),
    _same("reward_model.overlong_buffer.len", "reward.overlong_buffer.len"),
    _same("reward_model.overlong_buffer.penalty_factor", "reward.overlong_buffer.penalty"),
    _no_effect("reward_model.overlong_buffer.log", "the penalty is always logged (reward/overlong_penalty)"),
    _same("reward_model.reward_kwargs.overlong_buffer_cfg.enable", "reward.overlong_buffer.enable", _DAPO_KWARGS),
    _same("reward_model.reward_kwargs.overlong_buffer_cfg.len", "reward.overlong_buffer.len", _DAPO_KWARGS),
    _same(
        "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", "reward.overlong_buffer.penalty", _DAPO_KWARGS
    ),
    _no_effect("reward_model.reward_kwargs.overlong_buffer_cfg.log", "the penalty is always logged"),
    VerlKey(
        "reward_model.reward_kwargs.max_resp_len",
        note="the length the overlong buffer ends at: taken when it is data.max_response_length (the buffer ends "
        "at rollout.response_length here)",
        via="reward.overlong_buffer",
    ),
    _same("custom_reward_function.overlong_buffer.enable", "reward.overlong_buffer.enable", "DAPO's older spelling"),
    _same("custom_reward_function.overlong_buffer.len", "reward.overlong_buffer.len", "DAPO's older spelling"),
    _same(
        "custom_reward_function.overlong_buffer.penalty_factor",
        "reward.overlong_buffer.penalty",
        "DAPO's older spelling",
    ),
    _no_effect("custom_reward_function.overlong_buffer.log", "the penalty is always logged"),
    _same("custom_reward_function.path", "reward.custom_function", "with .name: reward.custom_function=path:name"),
    VerlKey(
        "custom_reward_function.name",
        note="the function in custom_reward_function.path (default compute_score)",
        via="reward.custom_function",
    ),
    # ------------------------------------------------------------------ algorithm
    _same("algorithm.adv_estimator"),
    _same("algorithm.gamma"),
    _same("algorithm.lam"),
    _same("algorithm.norm_adv_by_std_in_grpo"),
    _same(
        "algorithm.gdpo_reward_keys",
        note="GDPO's reward components: keys of the score function's returned dict",
        schema="current",
    ),
    _same(
        "algorithm.gdpo_reward_weights", note="one weight per gdpo_reward_keys entry (null: all 1)", schema="current"
    ),
    _same("algorithm.use_kl_in_reward"),
    _same("algorithm.kl_penalty"),
    _same("algorithm.kl_ctrl.type"),
    _same("algorithm.kl_ctrl.kl_coef"),
    _same("algorithm.kl_ctrl.target_kl"),
    _same("algorithm.kl_ctrl.horizon"),
    _same("algorithm.filter_groups.enable"),
    _same("algorithm.filter_groups.metric"),
    _same("algorithm.filter_groups.max_num_gen_batches"),
    _same("algorithm.use_pf_ppo", note="PF-PPO: only with adv_estimator=gae (verl ignores it otherwise; refused here)"),
    _same("algorithm.pf_ppo.reweight_method"),
    _same("algorithm.pf_ppo.weight_pow"),
    VerlKey(
        "algorithm.rollout_correction.rollout_is",
        ("algorithm.rollout_correction.rollout_is",),
        to_ours=lambda v: (None if _unset(v) else v,),
        accepts=lambda v: _unset(v) or v in ("token", "sequence"),
        note="truncated importance sampling per token or per sequence; null: off",
    ),
    _same("algorithm.rollout_correction.rollout_is_threshold"),
    _same(
        "algorithm.rollout_correction.rollout_is_batch_normalize",
        note="the truncated weights divided by their batch mean",
    ),
    VerlKey(
        "algorithm.rollout_correction.rollout_rs",
        ("algorithm.rollout_correction.rollout_rs",),
        to_ours=lambda v: (None if _unset(v) else v,),
        note="rejection sampling: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2..3, comma-separated",
    ),
    VerlKey(
        "algorithm.rollout_correction.rollout_rs_threshold",
        ("algorithm.rollout_correction.rollout_rs_threshold",),
        to_ours=lambda v: (None if _unset(v) else v,),
        note="one bound per rollout_rs option (k1: lower_upper in ratio space)",
    ),
    _same(
        "algorithm.rollout_correction.bypass_mode",
        note="skip the old_log_prob stage: the rollout's log-probs are the old ones",
    ),
    _same("algorithm.rollout_correction.loss_type", note="bypass mode's loss: ppo_clip or reinforce"),
    # ------------------------------------------------------------------ trainer
    _same("trainer.total_training_steps", "trainer.total_iterations"),
    VerlKey(
        "trainer.total_epochs",
        note="trainer.total_iterations = epochs x (training rows // data.train_batch_size), rows counted in "
        "data.train_files (verl counts them after dropping over-long prompts); total_training_steps wins",
        via="trainer.total_iterations",
    ),
    _same("trainer.n_gpus_per_node", "placement.tasks_per_node", "ranks per node"),
    _same("trainer.nnodes", "placement.nodes"),
    VerlKey("trainer.save_freq", ("trainer.save_freq",), to_ours=_minus_one_is_zero, note="-1 is 0 (at the end)"),
    VerlKey(
        "trainer.test_freq",
        ("trainer.test_freq",),
        to_ours=_minus_one_is_zero,
        note="-1 is 0 (before and after training)",
    ),
    _same("trainer.val_before_train"),
    _same("trainer.project_name"),
    _same("trainer.experiment_name"),
    VerlKey(
        "trainer.logger",
        ("trainer.logger",),
        to_ours=lambda v: ([{"file": "jsonl"}.get(name, name) for name in ([v] if isinstance(v, str) else v)],),
        to_verl=lambda ours: [{"jsonl": "file"}.get(name, name) for name in ours[0]],
        note="verl's file is our jsonl",
    ),
    _same("trainer.log_val_generations"),
    _same("trainer.default_local_dir", "trainer.checkpoint_dir"),
    VerlKey(
        "trainer.device",
        ("trainer.device",),
        to_verl=lambda values: UNSAID if values[0] == "auto" else values[0],
        accepts=_only("cuda", "cpu"),
        note="cuda or cpu (npu is not supported); our auto (cuda where there is one) has no verl name",
    ),
    _no_effect("trainer.critic_warmup", "the actor updates from the first iteration", _only(0)),
    _no_effect("trainer.balance_batch", "rows are dealt to ranks in order; sequence balancing is speed only"),
    VerlKey(
        "trainer.resume_mode",
        accepts=_only("auto", "disable", "resume_path"),
        note="resume_path: a new run starting from trainer.resume_from_path (our trainer.resume_from); auto and "
        "disable start anew (a run of ours continues with hf resume RUN, exactly, from its newest usable checkpoint)",
        via="trainer.resume_from",
    ),
    VerlKey(
        "trainer.resume_from_path",
        note="with trainer.resume_mode=resume_path (verl ignores it otherwise): a HybridFlow checkpoint folder "
        "global_step_N to start a new run from, its weights, optimizer and data position (trainer.resume_from)",
        via="trainer.resume_from",
    ),
    _no_effect("trainer.default_hdfs_dir", "checkpoints are local files (trainer.checkpoint_dir)", _unset),
    _no_effect("trainer.del_local_ckpt_after_load", "checkpoints are kept"),
    _no_effect("trainer.max_actor_ckpt_to_keep", "checkpoints are kept (hf runs delete removes a run's)"),
    _no_effect("trainer.max_critic_ckpt_to_keep", "checkpoints are kept (hf runs delete removes a run's)"),
    _no_effect("trainer.rollout_data_dir", "samples are in the run store: hf runs samples RUN"),
    _no_effect("trainer.validation_data_dir", "samples are in the run store: hf runs samples RUN"),
    _no_effect("trainer.val_only", "validation without training is not a run here", _only(False)),
    _no_effect("trainer.esi_redundant_time", "Slurm's --signal warning: placement.slurm.signal_delay_s"),
    _no_effect("trainer.ray_wait_register_center_timeout", "no Ray here"),
    _no_effect("trainer.use_legacy_worker_impl", "one worker implementation here"),
    # ------------------------------------------------------------------ verl main's current schema
    *_current(
        [
            VerlKey(
                "model_engine",
                accepts=_only(*MODEL_ENGINES),
                note=_ENGINE,
                via="actor.strategy",
            ),
            VerlKey(
                f"{ARR}.actor.model_engine",
                accepts=_only(*MODEL_ENGINES),
                note=_ENGINE,
                via="actor.strategy",
            ),
            *[
                VerlKey(
                    f"{group}@{package}",
                    accepts=lambda v, group=group: str(v) in {f"{e}_{group}" for e in MODEL_ENGINES},
                    note=f"one role's engine in verl's defaults list (E_{group}, E one of model_engine's): as "
                    "model_engine; a config group of another package (hydra.searchpath=[pkg://...]) is not known "
                    "here: use model_engine=megatron or dp",
                    via=f"{group}.strategy",
                )
                for group, package in (("actor", f"{ARR}.actor"), ("ref", f"{ARR}.ref"), ("critic", "critic"))
            ],
            _no_effect(
                "hydra.searchpath",
                "Hydra's config search path: hf verl reads --config-path/--config-name's file or verl's own config "
                "names; a config group of another package is refused by its group's key",
            ),
            _no_effect("hydra.*", "Hydra's own output folders and logging: the run's folder is trainer.output_dir"),
            _same(
                f"{ARR}.rollout.checkpoint_engine.update_weights_bucket_megabytes",
                "rollout.checkpoint_engine.update_weights_bucket_megabytes",
                "the most MiB one weight broadcast to a rollout pool of its own carries (checkpoint_engine.backend "
                "gloo); colocated, the rollout reads the actor's weights in place",
            ),
            _no_effect(f"{ARR}.rollout.checkpoint_engine.*", _SPEED),
            _same("reward.reward_model.enable", "reward_model.enable"),
            _same("reward.reward_model.model_path", "reward_model.path"),
            *_judge_engine("reward.reward_model.rollout"),
            _no_effect(
                "reward.reward_model.enable_resource_pool",
                "the reward model's placement: its own pool with placement.pools (hf plan places it)",
            ),
            _no_effect("reward.reward_model.n_gpus_per_node", "the reward model's pool: placement.pools"),
            _no_effect("reward.reward_model.nnodes", "the reward model's pool: placement.pools"),
            _no_effect("reward.num_workers", _SPEED),
            _no_effect(
                "reward.reward_manager.name",
                "scores come from the score function (reward.custom_reward_function or the data_source's); DAPO's "
                "overlong penalty is reward.reward_kwargs.overlong_buffer_cfg; GDPO's components are the keys of "
                "the dict the function returns (algorithm.gdpo_reward_keys)",
                _only("naive", "dapo", "gdpo"),
            ),
            _no_effect("reward.reward_manager.source", "verl's registered reward managers", _only("register")),
            _no_effect(
                "reward.reward_manager.module.path",
                "a reward manager class of your own is not run here: write a score function "
                "(reward.custom_reward_function.path and .name)",
                _unset,
            ),
            _no_effect("reward.reward_manager.module.name", "the class in reward.reward_manager.module.path"),
            _same("reward.reward_kwargs.overlong_buffer_cfg.enable", "reward.overlong_buffer.enable", _DAPO_KWARGS),
            _same("reward.reward_kwargs.overlong_buffer_cfg.len", "reward.overlong_buffer.len", _DAPO_KWARGS),
            _same(
                "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor",
                "reward.overlong_buffer.penalty",
                _DAPO_KWARGS,
            ),
            _no_effect("reward.reward_kwargs.overlong_buffer_cfg.log", "the penalty is always logged"),
            VerlKey(
                "reward.reward_kwargs.max_resp_len",
                note="the length the overlong buffer ends at: taken when it is data.max_response_length (the buffer "
                "ends at rollout.response_length here)",
                via="reward.overlong_buffer",
            ),
            _same(
                "reward.custom_reward_function.path",
                "reward.custom_function",
                "with .name: reward.custom_function=path:name",
            ),
            VerlKey(
                "reward.custom_reward_function.name",
                note="the function in reward.custom_reward_function.path (default compute_score)",
                via="reward.custom_function",
            ),
            VerlKey("distillation.enabled", note=_DISTILL, via="teacher.model_path"),
            VerlKey(
                "distillation.teacher_models.*.model_path",
                note="the teacher's folder; one teacher per run here (verl's lone teacher_model, or one named entry)",
                via="teacher.model_path",
            ),
            VerlKey(
                "distillation.teacher_models.*.key",
                note="with several teachers, the teacher_key value whose rows this one scores (teacher.routes); one "
                "teacher scores every row",
                via="teacher.routes",
            ),
            _no_effect("distillation.teacher_models.*.num_replicas", "the teacher's pool: placement only"),
            _no_effect("distillation.teacher_models.*.inference.*", _TEACHER_ENGINE),
            VerlKey(
                "distillation.teacher_key",
                ("teacher.route_key",),
                accepts=_only("data_source", "ability"),
                note="the prompt column whose value picks a row's teacher (data_source or ability)",
            ),
            _no_effect("distillation.n_gpus_per_node", "the teacher's pool: placement only (the same log-probs)"),
            _no_effect("distillation.nnodes", "the teacher's pool: placement only (the same log-probs)"),
            VerlKey(
                "distillation.distillation_loss.loss_mode",
                note="with use_policy_gradient=True: k1 (kl), the sampled token's log-ratio as its reward "
                "(teacher.use_as=reward); with False: k2 (mse), k3 (low_var_kl) or abs as a loss (teacher.use_as=loss, "
                "teacher.kl_loss_type), or forward_kl_topk (teacher.top_k_kl=forward over teacher.top_k tokens)",
                via="teacher.use_as",
            ),
            VerlKey("distillation.distillation_loss.use_policy_gradient", note=_DISTILL, via="teacher.use_as"),
            VerlKey(
                "distillation.distillation_loss.use_task_rewards",
                note="True: teacher.task_coef=1 and teacher.kl_coef=distillation_loss_coef; False: the teacher alone "
                "(task_coef 0, kl_coef 1, and no entropy bonus or KL loss, as verl drops the PPO loss with them)",
                via="teacher.task_coef",
            ),
            VerlKey(
                "distillation.distillation_loss.distillation_loss_coef",
                note="teacher.kl_coef with use_task_rewards=True",
                via="teacher.kl_coef",
            ),
            VerlKey(
                "distillation.distillation_loss.loss_max_clamp",
                ("teacher.kl_clamp",),
                to_ours=lambda v: (None if _unset(v) else float(v),),
                note="each token's KL clamped to [-c, c] before it is a reward or a loss",
            ),
            VerlKey(
                "distillation.distillation_loss.topk",
                note="loss_mode=forward_kl_topk: the teacher's support size (teacher.top_k); unused otherwise",
                via="teacher.top_k",
            ),
            VerlKey(
                "distillation.distillation_loss.log_prob_min_clamp",
                note="loss_mode=forward_kl_topk: the floor of both log-probs (teacher.log_prob_floor), else unused",
                via="teacher.log_prob_floor",
            ),
            _no_effect(
                "distillation.distillation_loss.policy_loss_mode", "the distillation term's PPO loss", _only("vanilla")
            ),
            _no_effect("distillation.distillation_loss.clip_ratio*", _DISTILL_CLIP),
            _no_effect(f"{ARR}.model.lora.merge", _LORA_MERGE),
            _no_effect(f"{ARR}.ref.entropy_checkpointing", _CHECKPOINTING),
            _no_effect(f"{ARR}.actor.megatron.use_remove_padding", _PADDING),
            _no_effect(f"{ARR}.actor.megatron.use_megatron_fsdp", _OFFLOAD),
            _no_effect(f"{ARR}.actor.megatron.use_distributed_optimizer", _OFFLOAD),
            _no_effect(f"{ARR}.actor.megatron.sequence_parallel", _SPEED),
            _no_effect("*.veomni.expert_parallel_size", _MOE, _unset_or_one),
            _no_effect("*.veomni.ulysses_parallel_size", _SEQUENCE, _unset_or_one),
            _no_effect("*.veomni.*", "VeOmni's engine tuning (kernels, offload, sharding): " + _SPEED),
            _no_effect("*.fsdp.ulysses_sequence_parallel_size", _SEQUENCE, _unset_or_one),
            _no_effect("*.fsdp.*", _SPEED),
            _no_effect("data.image_key", _TEXT_ONLY),
            _no_effect("data.video_key", _TEXT_ONLY),
            _no_effect("data.audio_key", _TEXT_ONLY),
            _no_effect("data.image_patch_size", _TEXT_ONLY),
            _no_effect("trainer.use_v1", "one trainer here"),
            _no_effect(
                "trainer.v1.trainer_mode",
                "sync: generate, then train, every iteration; asynchronous modes are -o trainer.mode=one_step_off "
                "or -o trainer.mode=streaming",
                _only("sync"),
            ),
            _no_effect("trainer.v1.*", "settings of verl's asynchronous v1 trainer modes (trainer.v1.trainer_mode)"),
            _no_effect(
                "transfer_queue.*",
                "no transfer queue: the flow passes handles and bulk tensors move between worker groups directly",
            ),
            _off("skip.*.enable", "verl's rollout dump and replay (skip.*.enable) is not here", False),
            _no_effect("skip.*", "read only with skip.*.enable (verl's rollout dump and replay, not here)"),
        ]
    ),
    # ------------------------------------------------------------------ families with no effect
    _no_effect("*.fsdp_config.ulysses_sequence_parallel_size", _SEQUENCE, _unset_or_one),
    # ------------------------------------------------------------------ the rest of verl main's generated schema
    *_schema_rest(),
    _no_effect("*.fsdp_config.*", _SPEED),
    _no_effect("*.profiler.*", "profiling: hf runs timeline RUN shows each stage's seconds"),
    _no_effect("global_profiler.*", "profiling: hf runs timeline RUN shows each stage's seconds"),
    _no_effect("ray_init.*", "no Ray here: worker groups are Slurm jobs or local processes"),
    _no_effect("ray_kwargs.*", "no Ray here: worker groups are Slurm jobs or local processes"),
)
"""Every verl key ``hf verl`` takes (see the module docstring); generated into docs/verl-keys.md."""

_LEGACY_ONLY = {
    *(f"reward_model.{k}" for k in ("micro_batch_size_per_gpu", "micro_batch_size", "max_length", "strategy")),
    *(f"reward_model.{k}" for k in ("use_dynamic_bsz", "forward_max_token_len_per_gpu", "launch_reward_fn_async")),
    *(f"reward_model.{k}" for k in ("use_reward_loop", "model.input_tokenizer", "model.use_remove_padding")),
    *(f"reward_model.overlong_buffer.{k}" for k in ("enable", "len", "penalty_factor", "log")),
    *(f"custom_reward_function.overlong_buffer.{k}" for k in ("enable", "len", "penalty_factor", "log")),
    *(f"reward_model.reward_kwargs.overlong_buffer_cfg.{k}" for k in ("enable", "len", "penalty_factor", "log")),
    "reward_model.reward_kwargs.max_resp_len",
    f"{ARR}.actor.use_token_level_loss",
    f"{ARR}.actor.sum_pi_squared_checkpointing",
    f"{ARR}.rollout.update_weights_bucket_megabytes",
    "trainer.use_legacy_worker_impl",
}
"""Keys of verl's 2025 schema that verl main's ``_generated_ppo_*.yaml`` no longer have (checked against verl
``1dda039``, 2026-08-22, and ``b178a3c``, 2026-01-29)."""
VERL_KEYS = tuple(replace(e, schema="legacy") if e.verl in _LEGACY_ONLY else e for e in VERL_KEYS)


def find_key(verl_key: str) -> VerlKey:
    """The `VerlKey` for `verl_key` (an exact entry first, then a pattern such as ``*.fsdp_config.*``).

    Raises:
        ConfigError: the key is not supported; the message names the nearest supported key, or says that the key
            is one of HybridFlow's own (to pass with ``-o``)."""
    for entry in VERL_KEYS:
        if entry.verl == verl_key:
            return entry
    for entry in VERL_KEYS:
        if "*" in entry.verl and fnmatch.fnmatchcase(verl_key, entry.verl):
            return entry
    exact = [e.verl for e in VERL_KEYS if "*" not in e.verl]
    near = difflib.get_close_matches(verl_key, exact, n=1, cutoff=0.6)
    if not near:  # a key under a known section: the closest by its last parts
        tail = verl_key.rsplit(".", 1)[-1]
        near = [k for k in exact if k.rsplit(".", 1)[-1] == tail][:1]
    hint = f"the nearest supported key is {near[0]}" if near else "see docs/verl-keys.md for the keys taken"
    ours = {o for e in VERL_KEYS for o in e.ours}
    if verl_key in ours:
        hint = f"{verl_key} is HybridFlow's own key: give it with -o {verl_key}=..."
    raise ConfigError(f"verl key {verl_key} is not supported by hf verl: {hint}")


def key_table() -> str:
    """The Markdown table of every verl key and what it is here (docs/verl-keys.md)."""
    lines = [
        "| verl key | schema | HybridFlow key | notes |",
        "| --- | --- | --- | --- |",
    ]
    for entry in VERL_KEYS:
        ours = ", ".join(f"`{k}`" for k in entry.ours) or (f"`{entry.via}`" if entry.via else "no effect")
        lines.append(f"| `{entry.verl}` | {entry.schema} | {ours} | {entry.note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
