"""The advantage stage on a rollout batch: KL-in-reward (optional), then the configured estimator.

Small and controller-side in the HybridFlow design: it reads [B, T] tensors the other stages produced and adds
``token_level_rewards``, ``advantages`` and ``returns``. The estimators themselves live in `estimators`. The score
trained on combines the function's and the reward model's (`training_scores`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow.engine.algorithms.estimators import (
    compute_gae_advantage_return,
    estimator_inputs,
    get_adv_estimator_fn,
    uses_greedy_baseline,
)
from hybridflow.engine.algorithms.kl import KLController, apply_kl_penalty, get_kl_controller
from hybridflow.engine.algorithms.lagrangian import LagrangeMultiplier, lagrangian_advantages
from hybridflow.engine.config import AlgorithmConfig, HybridFlowConfig, OverlongBufferConfig, TeacherConfig
from hybridflow.engine.guards import check_finite
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.torch_ops import last_positions, masked_mean, masked_whiten


def overlong_reward(response_lengths: torch.Tensor, max_length: int, buffer_len: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment per response (Yu et al. 2025, "DAPO", §3.4, eq. 13)::

        R(y) = min(0, ((max_length - buffer_len) - |y|) / buffer_len) * penalty

    0 up to ``max_length - buffer_len`` tokens, then falling linearly to ``-penalty`` at ``max_length``.

    Args:
        response_lengths: int or float [B], tokens in each response (``response_mask`` sums).
        max_length: L_max, ``rollout.response_length``.
        buffer_len: L_cache, ``reward.overlong_buffer.len`` (0 < L_cache < L_max).
        penalty: ``reward.overlong_buffer.penalty`` (>= 0).

    Returns:
        float32 [B], <= 0.

    Raises:
        ValueError: ``buffer_len`` not in (0, max_length) or a negative ``penalty``.
    """
    if not 0 < buffer_len < max_length or penalty < 0:
        raise ValueError(
            f"reward.overlong_buffer: need 0 < len ({buffer_len}) < rollout.response_length ({max_length}) and "
            f"penalty ({penalty}) >= 0"
        )
    exceed = response_lengths.float() - (max_length - buffer_len)
    return (-exceed / buffer_len * penalty).clamp(max=0.0)


def build_kl_controller(algorithm: AlgorithmConfig) -> KLController:
    """The in-reward KL coefficient controller from ``algorithm.kl_ctrl`` (fixed or adaptive)."""
    ctrl = algorithm.kl_ctrl
    return get_kl_controller(ctrl.type, ctrl.kl_coef, target_kl=ctrl.target_kl, horizon=ctrl.horizon)


def _lagrangian_advantages(
    batch, rewards: torch.Tensor, kl_cost: torch.Tensor | None, algorithm: AlgorithmConfig, lagrangian
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Safe-RLHF's advantage stage (Dai et al. 2023, §3.3): step lambda with the batch's episode costs (the sum of
    each row's ``token_level_costs``), estimate the reward's and the cost's GAE (the critic's ``values``, the cost
    critic's ``cost_values``) unwhitened, and whiten their Lagrangian combination `lagrangian_advantages`. The
    in-reward KL penalty `kl_cost` (when ``algorithm.use_kl_in_reward``), subtracted from the reward, is added to
    the cost too, so the policy's KL weight stays beta whatever lambda: ((-beta KL) - lambda (beta KL)) / (1 +
    lambda) = -beta KL. Returns the columns (``token_level_rewards``, ``advantages``, ``returns``,
    ``cost_returns``, float32 [B, T]) and ``critic/cost/mean``, ``actor/lagrange_multiplier``."""
    mask = batch["response_mask"]
    episode_costs = batch["token_level_costs"].sum(-1)
    multiplier = lagrangian.update(episode_costs.tolist())
    costs = batch["token_level_costs"] if kl_cost is None else batch["token_level_costs"] + kl_cost
    gae = {"gamma": algorithm.gamma, "lam": algorithm.lam, "whiten": False}
    reward_advantages, returns = compute_gae_advantage_return(rewards, batch["values"], mask, **gae)
    cost_advantages, cost_returns = compute_gae_advantage_return(costs, batch["cost_values"], mask, **gae)
    combined = lagrangian_advantages(reward_advantages, cost_advantages, multiplier)
    advantages = torch.where(mask != 0, masked_whiten(combined, mask), 0.0)
    out = {"token_level_rewards": rewards, "advantages": advantages, "returns": returns, "cost_returns": cost_returns}
    return out, {"critic/cost/mean": float(episode_costs.mean()), "actor/lagrange_multiplier": multiplier}


def _estimator_advantages(
    data: DataProto, rewards: torch.Tensor, algorithm: AlgorithmConfig, greedy: DataProto | None, shaping: dict
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The configured estimator's ``advantages`` and ``returns`` [B, T] on `rewards` (with ReMax's greedy baselines
    from `greedy`, reported as ``critic/reward_baseline/mean``), and ``token_level_rewards``.

    Raises:
        ValueError: an estimator with a greedy baseline and no `greedy`."""
    uids = data.non_tensor_batch.get("uid")
    baselines, metrics = None, {}
    if uses_greedy_baseline(algorithm.adv_estimator):
        if greedy is None:
            raise ValueError(f"algorithm.adv_estimator={algorithm.adv_estimator} needs the greedy responses' scores")
        baselines = greedy_baselines(uids, greedy, **shaping)
        metrics["critic/reward_baseline/mean"] = float(baselines.mean())
    batch, inputs = data.batch, estimator_inputs(algorithm.adv_estimator)
    weights = None
    if "rollout_is_weights" in inputs and "rollout_log_probs" in batch:  # the optimal token baseline's W
        from hybridflow.engine.algorithms.rollout_correction import decoupled_is_weights

        correction = algorithm.rollout_correction
        weights = decoupled_is_weights(
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], correction
        )
    components = {}
    if "reward_components" in inputs:  # GDPO: the score function's components, one column each
        components = {
            "reward_components": reward_components(data, algorithm.gdpo_reward_keys),
            "reward_weights": algorithm.gdpo_reward_weights,
        }
    advantages, returns = get_adv_estimator_fn(algorithm.adv_estimator)(
        rewards,
        batch["response_mask"],
        **components,
        index=uids,
        values=batch.get("values", None),
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
        reward_baselines=baselines,
        old_log_probs=batch.get("old_log_probs", None),
        sum_pi_squared=batch.get("sum_pi_squared", None),
        rollout_is_weights=weights,
    )
    return {"token_level_rewards": rewards, "advantages": advantages, "returns": returns}, metrics


def reward_components(data: DataProto, keys: list[str]) -> torch.Tensor:
    """The score function's components `keys` (its returned dict's keys, the ``reward_extra/<key>`` columns) as
    float32 [B, K].

    Raises:
        ValueError: a key the score function did not return (the keys it did are listed)."""
    missing = [key for key in keys if f"reward_extra/{key}" not in data.keys]
    if missing:
        returned = sorted(k.removeprefix("reward_extra/") for k in data.keys if k.startswith("reward_extra/"))
        raise ValueError(
            f"algorithm.gdpo_reward_keys names {missing}, which the score function did not return: it returned "
            f"{returned}; return a dict with those keys (and 'score'), or name its keys"
        )
    return torch.stack([data.batch[f"reward_extra/{key}"].float() for key in keys], dim=-1)


def build_lagrangian(algorithm: AlgorithmConfig) -> LagrangeMultiplier | None:
    """Safe-RLHF's Lagrange multiplier from ``algorithm.cost_limit``, ``lambda_init``, ``lambda_lr``,
    ``lambda_max`` and ``episode_cost_window``; None without a cost limit."""
    if algorithm.cost_limit is None:
        return None
    a = algorithm
    return LagrangeMultiplier(a.cost_limit, a.lambda_init, a.lambda_lr, a.lambda_max, a.episode_cost_window)


def training_scores(data: DataProto, function_coef: float = 1.0, rm_coef: float = 1.0) -> torch.Tensor:
    """The score the algorithm trains on, float32 [B, T]: ``function_coef`` x ``token_level_scores`` (the rule or
    custom function) + ``rm_coef`` x ``rm_scores`` (the reward model, when the batch has it). With the defaults and
    no reward model it is ``token_level_scores`` itself.

    The coefficients are ``reward.function_coef`` and ``reward_model.coef``."""
    batch = data.batch
    scores = batch["token_level_scores"]
    if function_coef != 1.0:
        scores = function_coef * scores
    if "rm_scores" in batch:
        scores = scores + rm_coef * batch["rm_scores"]
    return scores


def overlong_shaped(
    rewards: torch.Tensor, response_mask: torch.Tensor, overlong: OverlongBufferConfig, max_length: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """`rewards` float [B, T] with DAPO's overlong penalty (`overlong_reward`) added on each response's
    last token, where its score sits; and ``reward_extra/overlong_reward/mean`` (the mean penalty) and
    ``reward_extra/overlong/mean`` (the share of responses penalised), verl's DAPO names."""
    lengths = (response_mask != 0).sum(-1)
    penalty = overlong_reward(lengths, max_length, overlong.len, overlong.penalty).to(rewards.dtype)
    shaped = rewards.clone()  # on the last response token, where the score sits (position 0 for an empty response)
    shaped[torch.arange(len(rewards), device=rewards.device), last_positions(response_mask)] += penalty
    metrics = {
        "reward_extra/overlong_reward/mean": float(penalty.mean()),
        "reward_extra/overlong/mean": float((penalty < 0).float().mean()),
    }
    return shaped, metrics


def shaped_scores(
    data: DataProto,
    function_coef: float = 1.0,
    rm_coef: float = 1.0,
    overlong: OverlongBufferConfig | None = None,
    max_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The training reward before any KL term, float32 [B, T]: `training_scores`, plus DAPO's overlong penalty
    (`overlong_shaped`) when `overlong` is enabled; and the penalty's metrics (empty without it).

    Raises:
        ValueError: `overlong` is enabled without `max_length` (``rollout.response_length``).
    """
    rewards = training_scores(data, function_coef, rm_coef)
    if overlong is None or not overlong.enable:
        return rewards, {}
    if max_length is None:
        raise ValueError("reward.overlong_buffer needs the response limit (rollout.response_length)")
    return overlong_shaped(rewards, data.batch["response_mask"], overlong, max_length)


def reward_shaping(cfg: HybridFlowConfig) -> dict[str, Any]:
    """`shaped_scores`' keywords from a run's config: ``reward.function_coef``, ``reward_model.coef``,
    ``reward.overlong_buffer`` and ``rollout.response_length``."""
    return {
        "function_coef": cfg.reward.function_coef,
        "rm_coef": cfg.reward_model.coef,
        "overlong": cfg.reward.overlong_buffer,
        "max_length": cfg.rollout.response_length,
    }


def greedy_baselines(uids: np.ndarray, greedy: DataProto, **shaping: Any) -> torch.Tensor:
    """ReMax's baseline of each sampled row: the training score (`shaped_scores` with the same `shaping` keywords
    as the samples) of the greedy response to the row's prompt, float32 [B].

    Args:
        uids: the sampled rows' prompt uids, length B (n rows per prompt).
        greedy: one scored greedy response per prompt: ``uid`` (non-tensor), ``token_level_scores`` and
            ``response_mask`` [P, T'] (``rm_scores`` with a reward model).

    Raises:
        ValueError: a sampled row's prompt has no greedy response in `greedy` (names the uid).
    """
    rewards, _ = shaped_scores(greedy, **shaping)
    score = {uid: float(s) for uid, s in zip(greedy.non_tensor_batch["uid"], rewards.sum(-1).tolist(), strict=True)}
    missing = [u for u in uids if u not in score]
    if missing:
        raise ValueError(f"no greedy response for prompt uid {missing[0]!r}: the greedy stage must see every prompt")
    return torch.tensor([score[u] for u in uids], dtype=torch.float32)


def compute_advantage(
    data: DataProto,
    algorithm: AlgorithmConfig,
    kl_ctrl: KLController | None = None,
    function_coef: float = 1.0,
    rm_coef: float = 1.0,
    overlong: OverlongBufferConfig | None = None,
    max_length: int | None = None,
    greedy: DataProto | None = None,
    lagrangian: LagrangeMultiplier | None = None,
) -> tuple[DataProto, dict[str, float]]:
    """Rewards, advantages and returns for a scored rollout batch.

    Args:
        data: needs ``token_level_scores`` float32 [B, T] and ``response_mask`` [B, T]; ``rm_scores`` [B, T] when a
            reward model scored the batch; ``uid`` (non-tensor) for group estimators (grpo, rloo) and remax;
            ``values`` [B, T] for gae; ``old_log_probs`` and ``ref_log_prob`` [B, T] when
            ``algorithm.use_kl_in_reward``.
        algorithm: the ``algorithm`` config section.
        kl_ctrl: the controller for ``use_kl_in_reward`` (updated in place with this batch's KL).
        function_coef, rm_coef: weights of the function and reward-model scores (`training_scores`).
        overlong: ``reward.overlong_buffer``; when enabled, DAPO's overlong penalty is added to the training
            reward (`overlong_shaped`) with `max_length` = ``rollout.response_length``.
        greedy: for an estimator with a greedy baseline (remax): the scored greedy responses, one per prompt
            (`greedy_baselines`); reported as ``critic/reward_baseline/mean``.
        lagrangian: Safe-RLHF (the batch has ``token_level_costs`` and the cost critic's ``cost_values`` [B, T]):
            the multiplier, stepped first with this batch's episode costs (`LagrangeMultiplier.update`); the
            advantages are then the whitened `lagrangian_advantages` of the reward's and the cost's GAE
            (`_lagrangian_advantages`), and ``cost_returns`` is added. Reported: ``critic/cost/mean`` (this batch's
            mean episode cost), ``actor/lagrange_multiplier``.

    Returns:
        (DataProto with ``token_level_rewards``, ``advantages``, ``returns`` float32 [B, T] (and ``cost_returns``);
        metrics).

    Raises:
        ValueError: ``use_kl_in_reward`` is set without a controller, remax without `greedy`, or costs without
            `lagrangian` (or the reverse).
        NonFiniteError: a reward, advantage or return on a response token is NaN or ±inf (names the first sample).
    """
    batch = data.batch
    mask = batch["response_mask"]
    shaping = {"function_coef": function_coef, "rm_coef": rm_coef, "overlong": overlong, "max_length": max_length}
    rewards, metrics = shaped_scores(data, **shaping)
    kl_cost = None  # the in-reward KL penalty, beta x KL_t [B, T], which Safe-RLHF also charges as a cost
    if algorithm.use_kl_in_reward:
        if kl_ctrl is None:
            raise ValueError("algorithm.use_kl_in_reward needs a KL controller (build_kl_controller)")
        shaped = rewards
        rewards, kl_metrics = apply_kl_penalty(
            rewards, batch["old_log_probs"], batch["ref_log_prob"], mask, kl_ctrl, algorithm.kl_penalty
        )
        kl_cost = shaped - rewards
        metrics.update(kl_metrics)
    uids = data.non_tensor_batch.get("uid")
    if (lagrangian is None) != ("token_level_costs" not in batch):
        raise ValueError(
            "Safe-RLHF needs both the batch's token_level_costs (reward.cost_function or reward_model.cost_path) and "
            "the Lagrange multiplier (build_lagrangian with algorithm.cost_limit); got only one"
        )
    if lagrangian is not None:
        out, more = _lagrangian_advantages(batch, rewards, kl_cost, algorithm, lagrangian)
    else:
        out, more = _estimator_advantages(data, rewards, algorithm, greedy, shaping)
    metrics.update(more)
    for name, tensor in out.items():
        check_finite(
            tensor, stage="adv", metric=name, mask=mask, describe=None if uids is None else lambda i: f"uid {uids[i]}"
        )
    return DataProto.from_dict(out), metrics


def policy_filtration(
    scores: DataProto, algorithm: AlgorithmConfig, seed: int, step: int
) -> tuple[list[int], dict[str, float]]:
    """PF-PPO's rows (`hybridflow.engine.algorithms.policy_filtration.resampled_rows`): the batch to train on, B rows
    of the scored batch redrawn with replacement by ``algorithm.pf_ppo``'s weights of each response's score.

    Args:
        scores: ``token_level_scores`` float32 [B, T] (a response's score is its sum, as verl).
        algorithm: the ``algorithm`` section (``pf_ppo.reweight_method``, ``pf_ppo.weight_pow``).
        seed, step: ``trainer.seed`` and the iteration; the draw's generator is seeded from both (and the stream
            ``pf_ppo``), so a resumed run redraws the same rows.

    Returns:
        (the B row indices, ascending, repeats allowed; ``pf_ppo/distinct_fraction``: distinct rows drawn / B,
        ``pf_ppo/score_mean``: the mean score of the rows drawn).
    """
    from hybridflow.engine.algorithms.policy_filtration import resampled_rows
    from hybridflow.engine.rollout.hf import sampling_seed

    score = scores.batch["token_level_scores"].sum(-1)
    generator = torch.Generator().manual_seed(sampling_seed(seed, step, "pf_ppo", 0))
    rows = resampled_rows(score, algorithm.pf_ppo.reweight_method, algorithm.pf_ppo.weight_pow, generator)
    metrics = {
        "pf_ppo/distinct_fraction": len(set(rows)) / len(rows),
        "pf_ppo/score_mean": float(score[rows].mean()),
    }
    return rows, metrics


ADVANTAGE_INPUTS = (
    "token_level_scores",
    "response_mask",
    "uid",
    "rm_scores",
    "values",
    "old_log_probs",
    "ref_log_prob",
    "token_level_costs",
    "cost_values",
    "rollout_log_probs",
    "entropys",
    "sum_pi_squared",
    "teacher_log_prob",
)
"""The columns `advantage_stage` reads, those present (the controller loads only these)."""


def advantage_stage(
    data: DataProto,
    greedy: DataProto | None,
    algorithm: AlgorithmConfig,
    kl_ctrl: KLController | None,
    shaping: dict[str, Any],
    lagrangian: LagrangeMultiplier | None = None,
    teacher: TeacherConfig | None = None,
) -> tuple[DataProto, dict[str, float]]:
    """The iteration's ``adv`` stage, run by the controller: `compute_advantage` (`shaping`: `reward_shaping`'s
    keywords; `greedy`: ReMax's scored greedy batch) plus ``rollout/*`` (`hybridflow.engine.metrics.
    rollout_mismatch`, when the batch has the engine's and the actor's log-probs) and ``actor/entropy`` (the mean
    ``entropys`` over response tokens, when the old_log_prob stage ran). With decoupled rejection sampling
    (``algorithm.rollout_correction.rollout_rs``, not ``bypass_mode``) the rejected tokens leave ``response_mask``
    first (`rollout_correction.decoupled_mask`, ``rollout_corr/rollout_rs_*``), as verl's driver does: the
    advantages, the critic and the actor see the new mask. In bypass mode the rollout's log-probs stand for
    ``old_log_probs`` (the in-reward KL penalty's). With a distillation `teacher` (``teacher.model_path``) the
    advantages are weighed by ``teacher.task_coef`` and, with ``teacher.use_as: reward``, each token's gets the
    teacher's dense reward (`hybridflow.engine.algorithms.distillation.distilled_advantages`); ``distill/*``
    (`distillation_metrics`) whenever the student's log-probs of the batch are at hand.

    Returns:
        (DataProto of ``token_level_rewards``, ``advantages``, ``returns`` [B, T] float32 (and ``cost_returns``;
        with rejection sampling the new ``response_mask``), metrics). Raises as `compute_advantage`.
    """
    from hybridflow.engine.algorithms.rollout_correction import decoupled_mask
    from hybridflow.engine.metrics import rollout_mismatch

    correction, metrics = algorithm.rollout_correction, {}
    if "rollout_log_probs" in data.keys and "old_log_probs" in data.keys:  # else the on-policy update reports it
        metrics.update(rollout_mismatch(data))  # over every response token, before any rejection
    if correction.bypass_mode and algorithm.use_kl_in_reward:  # the rollout's log-probs are the old ones
        data.batch["old_log_probs"] = data.batch["rollout_log_probs"]
    rejected = None
    if correction.rollout_rs is not None and not correction.bypass_mode:  # once per batch, before the advantages
        rejected, rejection = decoupled_mask(
            data.batch["old_log_probs"],
            data.batch["rollout_log_probs"],
            data.batch["response_mask"],
            correction.rollout_rs,
            correction.rollout_rs_threshold,
        )
        data.batch["response_mask"] = rejected
        metrics.update(rejection)
    out, more = compute_advantage(data, algorithm, kl_ctrl, **shaping, greedy=greedy, lagrangian=lagrangian)
    metrics.update(more)
    if teacher is not None:
        out, more = _distilled(data, out, teacher, correction.bypass_mode)
        metrics.update(more)
    if rejected is not None:
        out = out.union(DataProto.from_dict({"response_mask": rejected}))
    if "entropys" in data.keys:
        metrics["actor/entropy"] = float(masked_mean(data.batch["entropys"], data.batch["response_mask"]))
    return out, metrics


def _distilled(
    data: DataProto, out: DataProto, teacher: TeacherConfig, bypass: bool
) -> tuple[DataProto, dict[str, float]]:
    """`advantage_stage`'s distillation step: `out`'s ``advantages`` weighed by ``teacher.task_coef`` plus, with
    ``teacher.use_as: reward``, the teacher's dense reward of each token against the student's log-probs that
    sampled it (``old_log_probs``; the rollout engine's in bypass mode, where no old_log_prob stage runs)."""
    from hybridflow.engine.algorithms.distillation import distillation_metrics, distilled_advantages

    batch = data.batch
    student = "rollout_log_probs" if bypass else "old_log_probs"
    mask = out.batch["response_mask"] if "response_mask" in out.keys else batch["response_mask"]
    advantages = out.batch["advantages"]
    metrics = {}
    if student in data.keys:  # (loss mode on-policy skips the old_log_prob stage: the update reports its KL)
        metrics = distillation_metrics(batch[student], batch["teacher_log_prob"], mask)
    if teacher.use_as == "reward":
        log_probs = batch[student]
        coefs = {"kl_coef": teacher.kl_coef, "task_coef": teacher.task_coef, "kl_clamp": teacher.kl_clamp}
        advantages = distilled_advantages(advantages, log_probs, batch["teacher_log_prob"], mask, **coefs)
    else:
        advantages = teacher.task_coef * advantages
    return out.drop(["advantages"]).union(DataProto.from_dict({"advantages": advantages})), metrics
