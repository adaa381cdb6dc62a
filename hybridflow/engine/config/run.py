"""The whole configs: `HybridFlowConfig` (an RL run: its sections and the rules that span them) and
`RMTrainingConfig` (``hf rm train``)."""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import replace
from typing import Any, ClassVar

from pydantic import Field, model_validator

from hybridflow.engine.config.sections import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    PlacementConfig,
    PolicyModelConfig,
    Pool,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    TeacherConfig,
    TrainerConfig,
    _Files,
    _RunTrainer,
    _Section,
)
from hybridflow.engine.extensions import engine_tp, rollout_spec, training_backend
from hybridflow.engine.parallel_layout import HybridLayout


class OffPolicyWarning(UserWarning):
    """A run trains stale batches (``trainer.mode: one_step_off | async``) with the off-policy correction off."""


class GroupOfOneWarning(UserWarning):
    """A group estimator (grpo, rloo, ...) with ``rollout.n: 1``: every group is one response, whose advantage is
    then its score (verl's rule for a group of one: mean 0, std 1), a policy gradient without a baseline."""


class HybridFlowConfig(_Section):
    """The whole run configuration (every key: docs/reference/config.md, generated from these models)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
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
            raise ValueError(
                "no data section: set data.train_files (parquet/jsonl), data.reasoning_gym.name or "
                "data.verifiers.env_id"
            )
        return values

    @model_validator(mode="before")
    @classmethod
    def _earlier_tis_cap(cls, values: Any) -> Any:
        """Configs recorded before ``algorithm.rollout_correction`` still load (``hf resume``, ``hf runs``): their
        ``actor.tis_cap: C`` is ``rollout_is: token`` with ``rollout_is_threshold: C``, a null one ``rollout_is:
        null`` (as recorded: no correction)."""
        if not (isinstance(values, dict) and isinstance(values.get("actor"), dict) and "tis_cap" in values["actor"]):
            return values
        actor = dict(values["actor"])
        cap = actor.pop("tis_cap")
        algorithm = dict(values.get("algorithm") or {})
        correction = dict(algorithm.get("rollout_correction") or {})
        correction.setdefault("rollout_is", None if cap is None else "token")
        if cap is not None:
            correction.setdefault("rollout_is_threshold", cap)
        return {**values, "actor": actor, "algorithm": {**algorithm, "rollout_correction": correction}}

    @model_validator(mode="after")
    def _batch_sizes(self) -> HybridFlowConfig:
        self._resolve_rollout()
        self._resolve_decay()
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
        self._check_judge_engine()
        if self.rollout.checkpoint_engine.backend != "file" and not self.rollout_apart():
            raise ValueError(
                f"rollout.checkpoint_engine.backend={self.rollout.checkpoint_engine.backend} carries weights to a "
                "rollout in a pool of its own, and this rollout shares the actor's (it syncs in process): put rollout "
                "in a pool of its own (placement.pools) or remove rollout.checkpoint_engine.backend"
            )
        self._check_mode()
        self._parallel_layout()
        self._check_rollout_expert_parallel()
        self._divisible_by_ranks()
        self._even_pipeline_micro_batches()
        reports_log_probs = rollout_spec(self.rollout.name).reports_log_probs or self.rollout.multi_turn.enable
        correction = self.algorithm.rollout_correction
        if correction.enabled() and not reports_log_probs:
            keys = {"rollout_is": correction.rollout_is, "rollout_rs": correction.rollout_rs, "bypass_mode": True}
            used = next(key for key, value in keys.items() if value)
            raise ValueError(
                f"algorithm.rollout_correction.{used} corrects the gap between the rollout engine's and the "
                f"actor's log-probs, and the {self.rollout.name} rollout reports none (it samples from the actor "
                "itself): set rollout.name=vllm or rollout.multi_turn.enable, or remove "
                f"algorithm.rollout_correction.{used}"
            )
        self._check_sum_pi_squared()
        self._verifiers_loop()
        if correction.bypass_mode and self.actor.policy_loss.loss_mode != "vanilla":
            raise ValueError(
                "algorithm.rollout_correction.bypass_mode trains with its own loss (loss_type: ppo_clip or reinforce), "
                f"not actor.policy_loss.loss_mode={self.actor.policy_loss.loss_mode}: set loss_mode=vanilla or "
                "bypass_mode=false"
            )
        if correction.bypass_mode and correction.rollout_is_batch_normalize and self.actor.strategy == "megatron":
            raise ValueError(
                "algorithm.rollout_correction.rollout_is_batch_normalize in bypass mode renormalises each "
                "micro-batch's weights across ranks inside the update, which the megatron actor's pipeline schedule "
                "does not do: set actor.strategy=fsdp, or bypass_mode=false (decoupled mode normalises once per batch)"
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
            warnings.warn(
                f"algorithm.adv_estimator={estimator} compares responses within a group, and with rollout.n=1 each "
                "group is one response: its advantage is its score (verl's rule for a group of one), with no "
                "baseline; set rollout.n >= 2 for one",
                GroupOfOneWarning,
                stacklevel=2,
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
        self._check_lora()
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

    def _check_lora(self) -> None:
        """``model.lora_rank`` > 0: a Hugging Face actor (ddp, fsdp), with the reference policy in the actor's
        processes (it is the actor's model with the adapter disabled)."""
        if not self.model.lora:
            return
        if not training_backend(self.actor.strategy).hf_model:
            raise ValueError(
                f"model.lora_rank > 0 trains a PEFT adapter on a Hugging Face model, and actor.strategy="
                f"{self.actor.strategy} trains a model of its own: set actor.strategy=ddp or fsdp, or model.lora_rank=0"
            )
        if self.actor.tp > 1:
            raise ValueError(
                "actor.tp > 1 splits the actor's linear layers, and the PEFT adapter on them is not split: set "
                "actor.tp=1 with model.lora_rank > 0"
            )
        if "ref" in self.roles() and self.pool_of("ref").name != self.pool_of("actor").name:
            raise ValueError(
                f"with model.lora_rank > 0 the reference policy is the actor's model with its adapter disabled: put "
                f"ref in the actor's pool (placement.pools.{self.pool_of('actor').name}.roles)"
            )

    def _check_judge_engine(self) -> None:
        """A judge engine over several ranks (``reward_model.judge.tensor_parallel_size``) is vLLM's, in blocks of
        consecutive ranks of the reward model's pool."""
        judge = self.reward_model.judge
        tp = judge.tensor_parallel_size
        if tp == 1 or not (self.reward_model.enable and judge.enable):
            return
        if judge.engine != "vllm":
            raise ValueError(
                f"reward_model.judge.tensor_parallel_size={tp} splits a vLLM engine over ranks, and "
                f"reward_model.judge.engine={judge.engine}: set engine=vllm or tensor_parallel_size=1"
            )
        pool = self.pool_of("reward_model")
        ranks = pool.nodes * pool.tasks_per_node
        if ranks % tp:
            raise ValueError(
                f"reward_model.judge.tensor_parallel_size={tp} does not divide the {ranks} ranks of pool {pool.name!r} "
                f"(the reward model's): give that pool a multiple of {tp} ranks (placement.pools.{pool.name}."
                "tasks_per_node) or a tensor_parallel_size that divides it"
            )

    def _check_sum_pi_squared(self) -> None:
        """``optimal_token_baseline`` reads the old_log_prob stage's ``sum_pi_squared``: the actor computes it
        (``actor.calculate_sum_pi_squared``, Hugging Face actors: ddp, fsdp) and the stage runs (not in bypass
        mode)."""
        from hybridflow.engine.algorithms.estimators import estimator_inputs

        estimator = self.algorithm.adv_estimator
        if "sum_pi_squared" in estimator_inputs(estimator) and not self.actor.calculate_sum_pi_squared:
            raise ValueError(
                f"algorithm.adv_estimator={estimator} weighs each token by its path variance from sum_pi_squared: "
                "set actor.calculate_sum_pi_squared=true"
            )
        if self.actor.calculate_sum_pi_squared and not training_backend(self.actor.strategy).hf_model:
            raise ValueError(
                f"actor.calculate_sum_pi_squared is computed by the Hugging Face actors, not actor.strategy="
                f"{self.actor.strategy}: set actor.strategy=fsdp (or ddp)"
            )
        if "old_log_probs" in estimator_inputs(estimator) and self.algorithm.rollout_correction.bypass_mode:
            raise ValueError(
                f"algorithm.adv_estimator={estimator} reads the old_log_prob stage's log-probs and sum_pi_squared, "
                "which bypass mode skips: set algorithm.rollout_correction.bypass_mode=false"
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
        (``algorithm.use_kl_in_reward`` and the teacher's dense reward do); ``actor.recompute_log_prob`` is false;
        and the batch was generated by the weights being trained (`max_staleness` 0). Always in
        ``algorithm.rollout_correction.bypass_mode`` (the rollout's log-probs are the old ones); never with
        decoupled rejection sampling or batch-normalised weights (they need the proximal policy's log-probs before
        the update)."""
        a = self.actor
        one_step = a.ppo_epochs == 1 and a.ppo_mini_batch_size == self.data.train_batch_size
        on_policy = self.max_staleness() == 0  # else the proximal policy's log-probs: the actor's before its update
        correction = self.algorithm.rollout_correction
        if correction.bypass_mode:  # the rollout's log-probs are the old ones
            return True
        # decoupled rejection sampling and batch-normalised weights need the proximal policy before the update
        from hybridflow.engine.algorithms.estimators import estimator_inputs

        batch_wide = correction.rollout_rs is not None or correction.rollout_is_batch_normalize
        batch_wide |= "old_log_probs" in estimator_inputs(self.algorithm.adv_estimator)  # the estimator reads them
        return (
            one_step
            and on_policy
            and not self.algorithm.use_kl_in_reward
            and not self.distills_in_reward()
            and not a.recompute_log_prob
            and not batch_wide
        )

    def roles(self) -> list[str]:
        """The roles this run uses: actor, rollout and reward (the score function: validation uses it) always; ref
        for a KL term (``actor.use_kl_loss`` or ``algorithm.use_kl_in_reward``); critic for an advantage estimator
        that needs one (GAE); reward_model when ``reward_model.enable`` or a cost model (``reward_model.cost_path``);
        teacher with ``teacher.model_path`` or ``teacher.routes`` (on-policy distillation)."""
        from hybridflow.engine.algorithms.estimators import uses_critic

        roles = ["actor", "rollout", "reward"]
        if self.actor.use_kl_loss or self.algorithm.use_kl_in_reward:
            roles.append("ref")
        if uses_critic(self.algorithm.adv_estimator):
            roles.append("critic")
        if self.reward_model.enable or self.reward_model.cost_path:
            roles.append("reward_model")
        if self.teacher.enabled:
            roles.append("teacher")
        return roles

    def distills_in_reward(self) -> bool:
        """Whether the teacher's per-token reverse KL is a dense reward (``teacher.use_as: reward``)."""
        return self.teacher.enabled and self.teacher.use_as == "reward"

    def distills_in_loss(self) -> bool:
        """Whether the teacher's per-token reverse KL is a term of the actor's loss (``teacher.use_as: loss``)."""
        return self.teacher.enabled and self.teacher.use_as == "loss"

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
            "teacher": "teacher.model_path or teacher.routes",
        }
        pools = self.placement.pools
        owner = {role: name for name, pool in pools.items() for role in pool.roles}
        for role in used:
            if role not in owner and role != "reward":
                raise ValueError(f"placement.pools: role {role!r} is in no pool; add it to the roles of one pool")
        if owner["actor"] != owner["rollout"]:
            self._check_rollout_apart(owner["actor"], owner["rollout"])
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

    def rollout_apart(self) -> bool:
        """Whether the rollout has a pool of its own (``placement.pools``): its engines get the actor's weights
        published by the actor's pool after each update (`hybridflow.engine.rollout.published`), not in-process."""
        return self.pool_of("rollout").name != self.pool_of("actor").name

    def max_staleness(self) -> int:
        """The most actor updates a trained batch's generating weights may lag behind (versions): 0 for
        ``trainer.mode: sync``, 1 for one_step_off, ``rollout.max_staleness`` for async."""
        return {"sync": 0, "one_step_off": 1}.get(self.trainer.mode, self.rollout.max_staleness)

    def _verifiers_loop(self) -> None:
        """``data.verifiers`` prompts are run by their environment's loop."""
        source = self.data.verifiers
        multi_turn = self.rollout.multi_turn
        loop = f"verifiers/{source.env_id}" if source is not None else None
        if loop is not None and (not multi_turn.enable or multi_turn.default_agent_loop != loop):
            raise ValueError(
                f"data.verifiers prompts run in their environment's agent loop: set rollout.multi_turn.enable=true and "
                f"rollout.multi_turn.default_agent_loop={loop}"
            )

    def _check_mode(self) -> None:
        """``trainer.mode: one_step_off | async`` need the rollout in a pool of its own (it generates while the actor
        trains), a weight push at least every ``rollout.max_staleness + 1`` updates (else no batch could be admitted
        within the bound), and correct a lag with truncated importance sampling
        (``algorithm.rollout_correction.rollout_is``: token unless set; null turns it off, with an
        `OffPolicyWarning`). DAPO's further draws and ReMax's greedy baseline queue behind the admitted ones."""
        mode, trainer = self.trainer.mode, self.trainer
        self._check_streaming()
        for key, value, default in (
            ("rollout.max_staleness", self.rollout.max_staleness, 1),
            ("trainer.weight_sync_every", trainer.weight_sync_every, 1),
        ):
            if mode != "async" and value != default:
                raise ValueError(f"{key}={value} applies to trainer.mode=async (got {mode}): set trainer.mode=async")
        if mode == "sync":
            return
        if trainer.weight_sync_every > self.max_staleness() + 1:
            raise ValueError(
                f"trainer.weight_sync_every={trainer.weight_sync_every} leaves the rollout's weights more than "
                f"rollout.max_staleness={self.max_staleness()} updates behind: set trainer.weight_sync_every <= "
                f"{self.max_staleness() + 1} or raise rollout.max_staleness"
            )
        if not self.rollout_apart():
            raise ValueError(
                f"trainer.mode={mode} generates the next batch while the actor trains on this one, on other devices: "
                "put rollout in a pool of its own (placement.pools, rollout.name=vllm), or set trainer.mode=sync"
            )
        shared = [r for r in self.pool_of("rollout").roles if r != "rollout"]
        if shared:  # a worker group serves one call at a time, and the rollout's is busy generating
            raise ValueError(
                f"trainer.mode={mode} keeps the rollout's pool generating while this iteration's other stages run: "
                f"move {', '.join(shared)} out of placement.pools.{self.pool_of('rollout').name} (e.g. reward into "
                f"placement.pools.{self.pool_of('actor').name}.roles)"
            )
        correction = self.algorithm.rollout_correction
        if "rollout_is" not in correction.model_fields_set and self.max_staleness() > 0:
            correction.rollout_is = "token"  # the off-policy correction is on by default
        elif correction.rollout_is is None and self.max_staleness() > 0 and not correction.bypass_mode:
            warnings.warn(
                f"trainer.mode={mode} trains batches up to {self.max_staleness()} updates stale with the off-policy "
                "correction off (algorithm.rollout_correction.rollout_is=null): its gradient is biased toward the "
                "weights that generated them; set algorithm.rollout_correction.rollout_is=token (or remove the "
                "override) to correct it",
                OffPolicyWarning,
                stacklevel=2,
            )

    def _check_streaming(self) -> None:
        """``rollout.streaming`` streams on the vLLM engines of the async mode's rollout pool (one per block of
        ``rollout.gen_tp`` ranks), each an equal share of every batch (agent loops too, on engines of one rank:
        `hybridflow.engine.agent.streaming`); what it does not carry yet (DAPO's further draws, ReMax's greedy
        baseline, agent loops on an engine over several ranks) is refused by its key."""
        from hybridflow.engine.algorithms.estimators import uses_greedy_baseline

        rollout = self.rollout
        if not rollout.streaming:
            if not rollout.partial_rollout:
                raise ValueError("rollout.partial_rollout=false applies to rollout.streaming=true: set both")
            return
        pool = self.pool_of("rollout")
        engines = max(1, pool.world_size // engine_tp(self))
        refused = [
            (self.trainer.mode != "async", f"trainer.mode=async (got {self.trainer.mode})"),
            (rollout.name != "vllm", f"rollout.name=vllm (got {rollout.name})"),
            (
                self.data.train_batch_size % engines != 0,
                f"data.train_batch_size={self.data.train_batch_size} divisible by the {engines} engines of "
                f"placement.pools.{pool.name} (its ranks / rollout.gen_tp: each engine streams an equal share of "
                "every batch)",
            ),
            (
                rollout.multi_turn.enable and engine_tp(self) > 1,
                "rollout.gen_tp=1 with rollout.multi_turn.enable (the tools of a stream's trajectories run on one "
                "rank; an engine over several ranks steps them in lockstep)",
            ),
            (self.algorithm.filter_groups.enable, "algorithm.filter_groups.enable=false: DAPO draws batches"),
            (uses_greedy_baseline(self.algorithm.adv_estimator), "an estimator without ReMax's greedy baseline"),
        ]
        needs = [fix for refuse, fix in refused if refuse]
        if needs:
            raise ValueError(f"rollout.streaming=true needs {'; '.join(needs)}; or set rollout.streaming=false")

    def _check_rollout_apart(self, actor_pool: str, rollout_pool: str) -> None:
        """A rollout pool apart from the actor's needs an engine that loads published weights (vLLM), an actor
        that can publish whole weights (ddp, fsdp; megatron generating at ``rollout.gen_tp: 1``, its
        3D-HybridEngine resharding to whole replicas) and no LoRA adapter."""
        keep = f"or put rollout in placement.pools.{actor_pool}.roles"
        if not rollout_spec(self.rollout.name).syncs_weights:
            raise ValueError(
                f"placement.pools: rollout (pool {rollout_pool}) apart from actor (pool {actor_pool}) needs an engine "
                f"with weights of its own, fed by the actor's pool: set rollout.name=vllm (got "
                f"{self.rollout.name!r}), {keep}"
            )
        gen_tp = self.rollout.gen_tp or self.actor.tp
        if not training_backend(self.actor.strategy).hf_model and gen_tp > 1 and self.actor_layout().t_g > 1:
            raise ValueError(
                f"placement.pools: actor.strategy={self.actor.strategy} publishes its weights for a rollout pool of "
                f"its own from the 3D-HybridEngine's generation layout, where each rank must hold the whole model "
                f"(generation tp 1; got {gen_tp}): set rollout.gen_tp=1 (or the rollout pool's engines' tensor "
                f"parallelism, rollout.gen_tp=N), {keep}"
            )
        ranks = self.pool_of("rollout").world_size
        if ranks % engine_tp(self):
            raise ValueError(
                f"placement.pools: the rollout pool {rollout_pool}'s {ranks} ranks are not a multiple of "
                f"rollout.gen_tp = {engine_tp(self)} (one vLLM engine per block of gen_tp ranks)"
            )
        if self.model.lora:
            raise ValueError(
                f"placement.pools: a LoRA actor (model.lora_rank) syncs its rollout in process: remove "
                f"model.lora_rank for a rollout pool of its own, {keep}"
            )

    def _check_rollout_expert_parallel(self) -> None:
        """``rollout.expert_parallel_size`` splits the experts over the ranks of one vLLM engine, data parallel 1
        here: so it is 1 or the engine's tensor-parallel size (verl: tensor x data parallel). Whether the model has
        experts is checked against its config before work (`hybridflow.engine.preflight`)."""
        ep = self.rollout.expert_parallel_size
        if ep == 1:
            return
        if not rollout_spec(self.rollout.name).engine_tp:
            raise ValueError(
                f"rollout.expert_parallel_size={ep} splits experts over the ranks of a vLLM engine, and the "
                f"{self.rollout.name} rollout generates on the actor's own layers: set rollout.name=vllm with "
                f"rollout.gen_tp={ep}, or remove rollout.expert_parallel_size"
            )
        tp = engine_tp(self)
        if ep != tp:
            raise ValueError(
                f"rollout.expert_parallel_size={ep} must equal the vLLM engine's ranks, rollout.gen_tp = {tp} "
                "(each engine is data parallel 1, and vLLM splits experts over tensor x data parallel ranks): set "
                f"rollout.gen_tp={ep} or rollout.expert_parallel_size={tp}"
            )

    def _resolve_rollout(self) -> None:
        """``rollout.name: auto``: vllm where it is installed, unless the megatron actor generates tensor-parallel
        (there hf generates on the 3D-HybridEngine's generation shards, with no whole replica gathered per rank as a
        tensor-parallel vLLM engine is fed), else hf."""
        if self.rollout.name != "auto":
            return
        vllm = importlib.util.find_spec("vllm") is not None
        megatron_tp = self.actor.strategy == "megatron" and (self.rollout.gen_tp or self.actor.tp) > 1
        self.rollout.name = "vllm" if vllm and not megatron_tp else "hf"

    def _resolve_decay(self) -> None:
        """A cosine lr schedule with ``decay_iterations: 0`` decays over the run's ``trainer.total_iterations`` (as
        verl's ``optim.total_training_steps``, which its trainer sets); recorded so, a resumed run keeps its curve."""
        for optim in (self.actor.optim, self.critic.optim):
            if optim.lr_scheduler_type == "cosine" and optim.decay_iterations == 0:
                optim.decay_iterations = max(self.trainer.total_iterations, optim.warmup_iterations + 1)

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
        # a rollout engine tensor-parallel itself is fed whole replicas (t_g = 1) and splits them its own way
        t_g = 1 if engine_tp(self) > 1 else self.rollout.gen_tp or actor.tp
        return HybridLayout(p=actor.pp, t=actor.tp, d=d, p_g=self.rollout.gen_pp, t_g=t_g)

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

    def _even_pipeline_micro_batches(self) -> None:
        """With megatron pipeline parallelism (``actor.pp > 1``), every micro-batch of an update must hold the same
        number of sequences: megatron's schedule passes activations between stages in buffers of one shape
        ([seq, micro_batch_size, hidden]), and a smaller last micro-batch crashes the run. Elsewhere (ddp, fsdp,
        megatron at ``pp: 1``) a last micro-batch smaller than the others is exact (each micro-batch's loss weighted
        by its share of the global mini-batch: `hybridflow.engine.backends.training.micro_batch_weights`)."""
        if self.actor.strategy != "megatron" or self.actor.pp == 1:
            return
        n, dp = self.rollout.n, self.pool_of("actor").world_size // (self.actor.tp * self.actor.pp)
        batch = self.data.train_batch_size * n // dp  # each rank's rows of the log-prob / value pass
        checks = [
            ("actor.ppo_micro_batch_size", "actor.ppo_mini_batch_size", self.actor.ppo_micro_batch_size),
            ("actor.log_prob_micro_batch_size", "data.train_batch_size", self.actor.log_prob_micro_batch_size),
        ]
        if "critic" in self.roles() and self.critic.strategy == "megatron":  # the actor's processes and layout
            checks += [
                ("critic.ppo_micro_batch_size", "critic.ppo_mini_batch_size", self.critic.ppo_micro_batch_size),
                ("critic.forward_micro_batch_size", "data.train_batch_size", self.critic.forward_micro_batch_size),
            ]
        for key, rows_key, micro in checks:
            rows = self.critic if rows_key.startswith("critic") else self.actor
            size = rows.ppo_mini_batch_size if rows_key.endswith("ppo_mini_batch_size") else self.data.train_batch_size
            per_rank = size * n // dp if rows_key != "data.train_batch_size" else batch
            if micro < per_rank and per_rank % micro:
                divisor = max(d for d in range(1, micro + 1) if per_rank % d == 0)
                raise ValueError(
                    f"{key}={micro} does not divide the {per_rank} sequences of each data-parallel rank's "
                    f"{'mini-batch' if 'mini' in rows_key else 'batch'} ({rows_key} x rollout.n / data-parallel size "
                    f"= {size} x {n} / {dp}), and megatron's pipeline schedule (actor.pp={self.actor.pp}) needs "
                    f"micro-batches of one size: set {key}={divisor} (the largest divisor of {per_rank} up to "
                    f"{micro}), or another divisor of {per_rank}"
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


class EpochTrainerConfig(_RunTrainer):
    """Epochs, evaluation, checkpoints and outputs of a run over a fixed set of rows (``hf rm train``, ``hf sft
    train``, ``hf dpo train``)."""

    total_epochs: int = Field(1, ge=0, description="passes over the training rows")
    val_before_train: bool = Field(True, description="evaluate the initial model (step 0)")
    save_freq: int = Field(0, ge=0, description="also checkpoint every K steps (always: at each epoch's end)")


class RMTrainerConfig(EpochTrainerConfig):
    """The ``trainer`` section of a reward-model training run (``hf rm train``)."""

    experiment_name: str = "reward_model"


class _OneGroupRun(_Section):
    """A run of one data-parallel worker group (``hf rm train``, ``hf sft train``): no pools, and each step's batch
    split evenly over the group's ranks. `COMMAND` names the command in the errors, `ROWS` what a batch counts."""

    COMMAND: ClassVar[str] = ""
    ROWS: ClassVar[str] = ""

    @model_validator(mode="after")
    def _one_pool(self) -> _OneGroupRun:
        if self.placement.pools is not None:
            raise ValueError(
                f"{self.COMMAND} runs one data-parallel worker group: remove placement.pools and give its ranks with "
                "placement.nodes x tasks_per_node"
            )
        return self

    @model_validator(mode="after")
    def _schedule_by_step(self) -> _OneGroupRun:
        optim = getattr(self, "optim", None)
        if optim is not None and optim.lr_scheduler_type == "cosine":
            raise ValueError(
                f"optim.lr_scheduler_type=cosine decays by RL iteration (hf run); {self.COMMAND} schedules by "
                "optimizer step: set optim.lr_scheduler_type=constant (with optim.warmup_steps)"
            )
        return self

    @model_validator(mode="after")
    def _batch_splits_over_ranks(self) -> _OneGroupRun:
        ranks, batch = self.placement.world_size, self.data.train_batch_size
        if batch % ranks:
            raise ValueError(
                f"data.train_batch_size ({batch} {self.ROWS}) must be a multiple of the group's {ranks} data-parallel "
                "ranks (placement.nodes x tasks_per_node): every rank takes the same share of each step"
            )
        return self


class RMTrainingConfig(_OneGroupRun):
    """A reward-model training run (``hf rm train``): a sequence classifier with one label, initialised from
    ``model.path`` (a causal LM gets a new score head), trained with the Bradley-Terry loss on preference pairs."""

    COMMAND: ClassVar[str] = "hf rm train"
    ROWS: ClassVar[str] = "pairs"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: PreferenceDataConfig
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    trainer: RMTrainerConfig = Field(default_factory=RMTrainerConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)


class DemonstrationsConfig(_Section):
    """Tool-use demonstrations made from an RL config's training prompts and tools
    (`hybridflow.engine.agent.demonstrations`): the SFT warm-up sees the prompts, the tools offered in them and the
    token layout its RL run will use; the RL run's validation prompts stay unseen."""

    rl_config: str = Field(description="the RL run's YAML config (its data section and rollout.multi_turn tools)")
    builder: str = Field("calculator", description="calculator or letter_counting: what call each row demonstrates")
    size: int | None = Field(None, gt=0, description="demonstrations from the first N training prompts (None: all)")


class SFTDataConfig(_Files):
    """Conversations for supervised fine-tuning: files with one conversation per row (verl's multi-turn SFT layout:
    ``messages``, a list of {role, content}, and optionally ``tools``, OpenAI function schemas), and/or generated
    tool-use demonstrations. The loss is on the assistant turns only."""

    train_files: list[str] = Field(default_factory=list, description="parquet/jsonl conversations (path or list)")
    val_files: list[str] = Field(default_factory=list, description="held-out conversations (path or list)")
    demonstrations: DemonstrationsConfig | None = None
    val_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="held out of the training conversations without val_files"
    )
    max_length: int = Field(512, gt=0, description="tokens per conversation; longer ones are dropped")
    train_batch_size: int = Field(16, gt=0, description="conversations per optimizer step")
    micro_batch_size: int = Field(4, gt=0, description="conversations per forward/backward")
    val_batch_size: int = Field(32, gt=0, description="conversations per evaluation call")
    shuffle: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _a_source(self) -> SFTDataConfig:
        if not self.train_files and self.demonstrations is None:
            raise ValueError("set data.train_files (conversations) or data.demonstrations (tool-use demonstrations)")
        return self


class SFTTrainerConfig(EpochTrainerConfig):
    """The ``trainer`` section of a supervised fine-tuning run (``hf sft train``)."""

    experiment_name: str = "sft"


class SFTTrainingConfig(_OneGroupRun):
    """A supervised fine-tuning run (``hf sft train``, the SFT of SFT -> RM -> RL): the causal LM ``model.path``
    trained with the token-mean cross-entropy of its assistant turns."""

    COMMAND: ClassVar[str] = "hf sft train"
    ROWS: ClassVar[str] = "conversations"
    model: PolicyModelConfig = Field(default_factory=PolicyModelConfig)
    data: SFTDataConfig
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    trainer: SFTTrainerConfig = Field(default_factory=SFTTrainerConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
