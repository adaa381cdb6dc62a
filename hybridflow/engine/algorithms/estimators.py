"""Advantage estimators, in a registry keyed by the config value ``algorithm.adv_estimator``: ``"gae"``
(`compute_gae_advantage_return`), ``"grpo"`` (`compute_grpo_outcome_advantage`; Dr. GRPO with
``norm_adv_by_std_in_grpo`` false), ``"rloo"``, ``"reinforce_plus_plus"``, ``"reinforce_plus_plus_baseline"``,
``"opo"`` and ``"remax"`` (baseline: the greedy response's score). Each is a pure torch function of token-level
rewards and masks.

Conventions. B is the number of sequences in the batch and T the padded response length in tokens. A mask is a
[B, T] tensor (bool, int or float) with 1 for real response tokens and 0 for padding; responses are right-padded,
so a row of the mask is ones followed by zeros. Positions where the mask is 0 never influence a result: they are
replaced by 0 before any arithmetic, so even NaN or inf there is harmless. Names follow verl, so that the config
keys (``actor.loss_agg_mode``, ``algorithm.kl_penalty``, ...) mean what verl users expect.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.engine.torch_ops import check_same_shape, masked_sum, masked_whiten

# --------------------------------------------------------------------------------------------------------------------
# Advantage estimators and their registry
# --------------------------------------------------------------------------------------------------------------------

_ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}

ADV_ESTIMATORS_NEEDING_CRITIC: set[str] = set()
"""Names of registered advantage estimators that need a critic's ``values`` (filled by `register_adv_est`)."""

# The keyword arguments that every estimator returned by `get_adv_estimator_fn` accepts, with their defaults.
_UNIFORM_ADV_KWARGS: dict[str, Any] = {
    "index": None,
    "values": None,
    "gamma": 1.0,
    "lam": 1.0,
    "epsilon": 1e-6,
    "norm_adv_by_std_in_grpo": True,
    "reward_baselines": None,
    "old_log_probs": None,
    "sum_pi_squared": None,
    "rollout_is_weights": None,
}


def register_adv_est(name: str, *, needs_critic: bool = False) -> Callable[[Callable], Callable]:
    """Decorator that registers an advantage estimator under ``name`` (the value of ``algorithm.adv_estimator``).

    The function must accept ``token_level_rewards`` and ``response_mask`` and any subset of the uniform keyword
    arguments listed in `get_adv_estimator_fn`, and return ``(advantages, returns)``, both [B, T]. It is returned
    unchanged. With ``needs_critic=True`` the name is added to `ADV_ESTIMATORS_NEEDING_CRITIC`.

    Raises:
        ValueError: ``name`` is already registered to a different function.
    """

    def decorator(fn: Callable) -> Callable:
        existing = _ADV_ESTIMATORS.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"Advantage estimator {name!r} is already registered (to {existing.__qualname__}); pick another name."
            )
        _ADV_ESTIMATORS[name] = fn
        if needs_critic:
            ADV_ESTIMATORS_NEEDING_CRITIC.add(name)
        return fn

    return decorator


def _unknown_adv_estimator(name: str) -> ValueError:
    return ValueError(
        f"Unknown advantage estimator {name!r} (config key `algorithm.adv_estimator`); "
        f"registered: {sorted(_ADV_ESTIMATORS)}."
    )


def get_adv_estimator_fn(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Look up a registered advantage estimator and wrap it in the uniform calling convention.

    The returned callable is called as::

        advantages, returns = fn(token_level_rewards, response_mask, *, index=None, values=None, gamma=1.0,
                                 lam=1.0, epsilon=1e-6, norm_adv_by_std_in_grpo=True)

    and forwards to the estimator only the keywords its signature takes, so callers can always pass everything
    they have (``"gae"`` uses values/gamma/lam; ``"grpo"`` index/epsilon/norm_adv_by_std_in_grpo; ``"rloo"``
    index/epsilon). Extra keywords that the estimator itself declares are passed through as well.

    Raises:
        ValueError: ``name`` is not registered (the message lists the registered names); when the returned
            callable is called, an argument the estimator requires is None or missing (e.g. ``values`` for GAE),
            or a keyword is neither uniform nor accepted by the estimator.
    """
    if name not in _ADV_ESTIMATORS:
        raise _unknown_adv_estimator(name)
    fn = _ADV_ESTIMATORS[name]
    params = inspect.signature(fn).parameters
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty]

    @functools.wraps(fn)
    def call(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **kwargs: Any):
        unknown = sorted(k for k in kwargs if k not in _UNIFORM_ADV_KWARGS and k not in params)
        if unknown:
            raise ValueError(
                f"Advantage estimator {name!r} got unexpected keyword(s) {unknown}; "
                f"allowed: {sorted(_UNIFORM_ADV_KWARGS)} plus the estimator's own parameters."
            )
        merged = {**_UNIFORM_ADV_KWARGS, **kwargs}
        given = {k: v for k, v in merged.items() if k in params}
        missing = [n for n in required if n not in ("token_level_rewards", "response_mask") and given.get(n) is None]
        if missing:
            hint = ""
            if "index" in missing:
                hint = (
                    " `index` is the batch's non-tensor `uid` column: one prompt id per sequence, equal for the "
                    "responses to one prompt (set by the data sampler, PromptSampler.next_batch, or by the rollout)."
                )
            raise ValueError(
                f"Advantage estimator {name!r} needs {missing}, but they were not given (or are None).{hint}"
            )
        return fn(token_level_rewards=token_level_rewards, response_mask=response_mask, **given)

    return call


def uses_groups(name: str) -> bool:
    """True when the advantage estimator ``name`` compares the responses to one prompt (it takes ``index``, the
    prompt uids), so it needs ``rollout.n`` >= 2.

    Raises:
        ValueError: ``name`` is not a registered estimator.
    """
    return "index" in estimator_inputs(name)


def estimator_inputs(name: str) -> set[str]:
    """The keyword arguments the advantage estimator ``name`` takes (e.g. ``old_log_probs`` and ``sum_pi_squared``
    for ``optimal_token_baseline``). Raises ValueError: ``name`` is not registered."""
    if name not in _ADV_ESTIMATORS:
        raise _unknown_adv_estimator(name)
    return set(inspect.signature(_ADV_ESTIMATORS[name]).parameters)


def uses_greedy_baseline(name: str) -> bool:
    """True when the advantage estimator ``name`` subtracts the score of each prompt's greedy response (it takes
    ``reward_baselines``, as ReMax does), so the iteration needs the greedy generation stage.

    Raises:
        ValueError: ``name`` is not a registered estimator.
    """
    return "reward_baselines" in estimator_inputs(name)


def adv_estimators() -> list[str]:
    """The registered advantage-estimator names (``algorithm.adv_estimator``), sorted."""
    return sorted(_ADV_ESTIMATORS)


def uses_critic(name: str) -> bool:
    """True when the advantage estimator ``name`` needs a critic (value model), i.e. it is in
    `ADV_ESTIMATORS_NEEDING_CRITIC`.

    Raises:
        ValueError: ``name`` is not a registered estimator.
    """
    if name not in _ADV_ESTIMATORS:
        raise _unknown_adv_estimator(name)
    return name in ADV_ESTIMATORS_NEEDING_CRITIC


@register_adv_est("gae", needs_critic=True)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over the response tokens.

    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
    eq. 16: ``A_t = sum_l (gamma * lam)^l * delta_{t+l}`` with ``delta_t = r_t + gamma * V_{t+1} - V_t``, computed
    by the right-to-left recursion ``A_t = delta_t + gamma * lam * A_{t+1}``.

    Padding: at positions where the mask is 0 the recursion does not step; the "next" value and advantage are
    carried through unchanged. For right-padded responses this means the last real token bootstraps with
    ``V = 0`` and ``A = 0`` after it (the episode ends there); a hole inside a response is skipped over.

    Args:
        token_level_rewards: float [B, T], the reward of each token (after any KL penalty).
        values: float [B, T], the critic's value of each token's state.
        response_mask: bool/int/float [B, T], 1 on real response tokens.
        gamma: discount factor in [0, 1] (``algorithm.gamma``).
        lam: GAE lambda in [0, 1] (``algorithm.lam``).
        whiten: False: the advantages as estimated (Safe-RLHF combines two before whitening).

    Returns:
        ``(advantages, returns)``, both [B, T] in ``values``' dtype, no grad. ``returns = advantages + values``
        computed before whitening (the critic's regression target); ``advantages`` are then whitened with
        `masked_whiten` over all response tokens of the batch (unless `whiten` is false). Both are exactly 0 at
        masked positions.

    Raises:
        ValueError: shapes differ, gamma or lam outside [0, 1], or fewer than two response tokens in the batch
            (whitening needs a variance).
    """
    check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    for key, x in (("algorithm.gamma", gamma), ("algorithm.lam", lam)):
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"`{key}` must be in [0, 1], got {x}.")
    is_real = response_mask != 0
    rewards = torch.where(is_real, token_level_rewards.to(values.dtype), 0.0)
    vals = torch.where(is_real, values, 0.0)

    next_value = torch.zeros_like(vals[:, 0])
    next_adv = torch.zeros_like(vals[:, 0])
    advantages = torch.zeros_like(vals)
    for t in reversed(range(vals.shape[1])):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_adv = torch.where(is_real[:, t], adv_t, next_adv)
        next_value = torch.where(is_real[:, t], vals[:, t], next_value)
        advantages[:, t] = next_adv

    returns = torch.where(is_real, advantages + vals, 0.0)
    if whiten:
        advantages = torch.where(is_real, masked_whiten(advantages, response_mask), 0.0)
    return advantages, returns


def group_ids(index: Sequence[Any] | np.ndarray | torch.Tensor, batch_size: int) -> tuple[torch.Tensor, int]:
    """Map each sequence's prompt uid to a dense group id 0..G-1; return (ids int64 [B], G)."""
    # .tolist() turns numpy/torch elements into python scalars and strings, which hash by value.
    uids = index.tolist() if isinstance(index, torch.Tensor | np.ndarray) else list(index)
    if len(uids) != batch_size:
        raise ValueError(
            f"`index` has {len(uids)} entries but the batch has {batch_size} sequences; "
            "pass one prompt uid per sequence (the non-tensor column `uid`)."
        )
    dense: dict[Any, int] = {}
    ids = [dense.setdefault(uid, len(dense)) for uid in uids]
    return torch.tensor(ids, dtype=torch.long), len(dense)


def _outcome_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """One score per sequence, float [B]: the sum of its rewards over the response tokens."""
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be [B, T], got shape {list(token_level_rewards.shape)}.")
    return masked_sum(token_level_rewards, response_mask, dim=-1)


@register_adv_est("grpo")
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: each response's score relative to the other responses to the same prompt.

    Source: Shao et al. 2024, "DeepSeekMath", §4.1.2 (outcome supervision):
    ``A_i = (r_i - mean(r_group)) / std(r_group)``, given to every token of response i. Without std
    normalisation (``norm_adv_by_std_in_grpo=False``) this is the Dr. GRPO variant, Liu et al. 2025.

    The score of a sequence is the sum of its token-level rewards over the response mask. The std is the unbiased
    sample std (as ``torch.std``). A group of size 1 uses mean 0 and std 1, so its advantage is its own score
    (divided by 1 + epsilon when normalising).

    Args:
        token_level_rewards: float [B, T].
        response_mask: bool/int/float [B, T].
        index: length-B numpy array (object, str or int) or sequence of prompt uids; equal uids form a group.
        epsilon: added to the group std before dividing.
        norm_adv_by_std_in_grpo: divide by (std + epsilon) (``algorithm.norm_adv_by_std_in_grpo``).

    Returns:
        ``(advantages, returns)``, identical [B, T] tensors in the rewards' dtype, 0 at masked positions, no grad.

    Raises:
        ValueError: shapes differ or ``index`` does not have B entries.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    adv = _group_normalised(scores, index, epsilon, norm_adv_by_std_in_grpo)
    advantages = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return advantages, advantages


def _group_normalised(scores: torch.Tensor, index: Sequence[Any] | np.ndarray, epsilon: float, by_std: bool):
    """GRPO's per-group normalisation of one score per sequence, float [B]: ``(r - mean_g) / (std_g + epsilon)``
    (``by_std``; else ``r - mean_g``), the unbiased std; a group of one keeps its score (mean 0, std 1)."""
    ids, n_groups = group_ids(index, scores.shape[0])
    ids = ids.to(scores.device)
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add_(0, ids, scores)
    singleton = counts == 1
    mean = torch.where(singleton, 0.0, sums / counts)
    sq_dev = torch.zeros_like(counts).index_add_(0, ids, (scores - mean[ids]) ** 2)
    std = torch.where(singleton, 1.0, torch.sqrt(sq_dev / (counts - 1).clamp(min=1)))
    adv = scores - mean[ids]
    return adv / (std[ids] + epsilon) if by_std else adv


@register_adv_est("gdpo")
@torch.no_grad()
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | np.ndarray,
    reward_components: torch.Tensor,
    reward_weights: Sequence[float] | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (group reward-decoupled normalisation): each reward component normalised within its group on its own,
    then summed with weights and whitened over the batch, so a component of small spread is not drowned by one of
    large spread (verl's ``gdpo`` estimator, ``verl/trainer/ppo/core_algos.py``):

    ``A_k = (r_k - mean_g(r_k)) / (std_g(r_k) + epsilon)`` per component k (GRPO's, `_group_normalised`),
    ``A = sum_k w_k A_k`` given to every token of the response, then ``A`` whitened over all response tokens of the
    batch (`masked_whiten`: the token-weighted mean and unbiased variance, + 1e-8). `token_level_rewards` (the summed
    score) is not used.

    Args:
        token_level_rewards: float [B, T] (unused: the components stand in for it).
        response_mask: [B, T].
        index: B prompt uids; equal uids form a group.
        reward_components: float [B, K], the score function's components (``algorithm.gdpo_reward_keys``: the
            ``reward_extra/<key>`` columns of its returned dict).
        reward_weights: K weights (``algorithm.gdpo_reward_weights``); None: all 1.
        epsilon, norm_adv_by_std_in_grpo: as GRPO's.

    Returns:
        ``(advantages, returns)``, identical float [B, T], 0 at masked positions.

    Raises:
        ValueError: `reward_components` is not [B, K], or `reward_weights` has other than K entries."""
    batch = response_mask.shape[0]
    if reward_components.dim() != 2 or reward_components.shape[0] != batch:
        raise ValueError(f"reward_components must be [B={batch}, K], got {list(reward_components.shape)}")
    k = reward_components.shape[1]
    weights = [1.0] * k if reward_weights is None else list(reward_weights)
    if len(weights) != k:
        raise ValueError(f"algorithm.gdpo_reward_weights has {len(weights)} entries for {k} reward components")
    components = reward_components.to(torch.float32)
    combined = sum(
        w * _group_normalised(components[:, i], index, epsilon, norm_adv_by_std_in_grpo) for i, w in enumerate(weights)
    )
    mask = response_mask.to(torch.float32)
    advantages = masked_whiten(combined.unsqueeze(-1) * mask, mask) * mask
    return advantages, advantages


@register_adv_est("rloo")
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (REINFORCE Leave-One-Out) outcome advantage.

    Source: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs", §3: ``A_i = r_i - (1 / (k - 1)) * sum_{j != i} r_j`` over the k responses to the
    same prompt, given to every token of response i. A group of size 1 has no other responses, so its baseline
    is 0 and ``A_i = r_i``.

    Args:
        token_level_rewards: float [B, T]; the score of a sequence is its sum over the response mask.
        response_mask: bool/int/float [B, T].
        index: length-B numpy array (object, str or int) or sequence of prompt uids; equal uids form a group.
        epsilon: unused; accepted so that every outcome estimator takes the same arguments.

    Returns:
        ``(advantages, returns)``, identical [B, T] tensors in the rewards' dtype, 0 at masked positions, no grad.

    Raises:
        ValueError: shapes differ or ``index`` does not have B entries.
    """
    del epsilon
    scores = _outcome_scores(token_level_rewards, response_mask)
    ids, n_groups = group_ids(index, scores.shape[0])
    ids = ids.to(scores.device)
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add_(0, ids, scores)
    others = counts[ids] - 1
    baseline = torch.where(others > 0, (sums[ids] - scores) / others.clamp(min=1), 0.0)
    advantages = (scores - baseline).unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages


def _group_means(scores: torch.Tensor, index, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Each sequence's group mean of `scores` (float [B]; weighted by `weights` [B] when given), 0 for a group of
    one. Returns float [B]."""
    ids, n_groups = group_ids(index, scores.shape[0])
    ids = ids.to(scores.device)
    weights = torch.ones_like(scores) if weights is None else weights.to(scores.dtype)
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, torch.ones_like(scores))
    totals = torch.zeros_like(counts).index_add_(0, ids, weights)
    sums = torch.zeros_like(counts).index_add_(0, ids, weights * scores)
    return torch.where(counts[ids] > 1, sums[ids] / totals[ids].clamp(min=torch.finfo(scores.dtype).tiny), 0.0)


@register_adv_est("gpg")
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Group Policy Gradient) outcome advantage: the score minus its group's mean, scaled by the batch's share
    of non-zero scores.

    Source: Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning"
    (arXiv 2504.02546), eq. 5-6 (``F_norm`` = 1), as verl computes it (``compute_gpg_outcome_advantage``)::

        A_i = alpha * (r_i - mean_{j in group(i)} r_j),   alpha = B / max(1, #{i : r_i != 0})

    over the B responses of the whole batch; a group of one has mean 0. No division by the group's std.

    Args:
        token_level_rewards: float [B, T]; the score of a sequence is its sum over the response mask.
        response_mask: bool/int/float [B, T].
        index: length-B prompt uids; equal uids form a group.
        epsilon: unused; accepted so that every outcome estimator takes the same arguments.

    Returns:
        ``(advantages, returns)``, identical [B, T] tensors in the rewards' dtype, 0 at masked positions, no grad.

    Raises:
        ValueError: shapes differ or ``index`` does not have B entries.
    """
    del epsilon
    scores = _outcome_scores(token_level_rewards, response_mask)
    alpha = scores.shape[0] / max(1, int(torch.count_nonzero(scores)))
    advantages = (alpha * (scores - _group_means(scores, index))).unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantage: the discounted return of each token, whitened over every response token of the batch.

    Source: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models", §3
    (token-level return ``G_t = sum_{s >= t} gamma^(s-t) r_s``, the KL penalty folded into the rewards, global
    advantage normalisation). No critic and no group: works with ``rollout.n`` = 1. s counts response tokens only:
    masked positions inside a response (tool turns) are skipped, as GAE skips them.

    Args:
        token_level_rewards: float [B, T] (with ``algorithm.use_kl_in_reward`` the KL penalty is already in them).
        response_mask: bool/int/float [B, T].
        gamma: discount (``algorithm.gamma``).

    Returns:
        ``(advantages, returns)`` float [B, T], 0 at masked positions, no grad: ``returns`` the discounted returns,
        ``advantages`` those whitened (`masked_whiten`) over the batch's response tokens.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    is_real = response_mask != 0
    rewards = torch.where(is_real, token_level_rewards, 0.0)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        # a masked position (padding, or a tool turn inside an agent trajectory) is not a step: the return carries
        # across it undiscounted, so G_t of the model's token before a tool turn includes what follows the turn
        running = torch.where(is_real[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    returns = torch.where(is_real, returns, 0.0)
    advantages = masked_whiten(returns, response_mask) * is_real.to(returns.dtype)
    return advantages, returns


@register_adv_est("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[Any] | np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with the group-mean baseline: each response's score minus its prompt group's mean score, given
    to every token, then whitened over every response token of the batch.

    Source: Hu 2025, "REINFORCE++", §4 (REINFORCE++-baseline: the group mean replaces GRPO's per-group std
    normalisation by a global one). A group of one has baseline 0.

    Args:
        token_level_rewards: float [B, T]; a sequence's score is its sum over the response mask.
        response_mask: bool/int/float [B, T].
        index: length-B prompt uids; equal uids form a group.

    Returns:
        ``(advantages, returns)``, identical float [B, T] tensors, 0 at masked positions, no grad.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    centred = scores - _group_means(scores, index)
    is_real = (response_mask != 0).to(scores.dtype)
    advantages = masked_whiten(centred.unsqueeze(-1) * is_real, response_mask) * is_real
    return advantages, advantages


@register_adv_est("opo")
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[Any] | np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (on-policy RL with the optimal baseline) outcome advantage: each response's score minus its group's
    length-weighted mean score, ``b = sum_j |o_j| r_j / sum_j |o_j|``.

    Source: Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline" (arXiv 2505.23585), §3: the optimal
    baseline under the approximation that a sequence's gradient norm grows with its length. A group of one has
    baseline 0.

    Args:
        token_level_rewards: float [B, T]; a sequence's score is its sum over the response mask.
        response_mask: bool/int/float [B, T]; a sequence's length |o| is its sum.
        index: length-B prompt uids; equal uids form a group.

    Returns:
        ``(advantages, returns)``, identical float [B, T] tensors, 0 at masked positions, no grad.
    """
    scores = _outcome_scores(token_level_rewards, response_mask)
    lengths = (response_mask != 0).sum(-1).to(scores.dtype)
    advantages = (scores - _group_means(scores, index, lengths)).unsqueeze(-1) * (response_mask != 0).to(scores.dtype)
    return advantages, advantages


@register_adv_est("remax")
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax advantage: the reward-to-go of each token minus the score of its prompt's greedy response.

    Source: Li et al. 2023, "ReMax" (arXiv 2310.10505), Algorithm 1: the greedy response's reward is the baseline
    of REINFORCE, ``A_t = sum_{t' >= t} r_t' - r(x, y_greedy)``. With an outcome reward (on the last token) every
    token's advantage is ``r(x, y) - r(x, y_greedy)``. No whitening, no critic.

    Args:
        token_level_rewards: float [B, T].
        response_mask: bool/int/float [B, T].
        reward_baselines: float [B], the training score of each row's prompt's greedy response (the batch's
            ``reward_baselines`` column, written by `hybridflow.engine.advantage.greedy_baselines`).

    Returns:
        ``(advantages, returns)`` float [B, T] (returns: the reward-to-go), 0 at masked positions, no grad.

    Raises:
        ValueError: ``reward_baselines`` does not have one entry per row.
    """
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"reward_baselines has shape {tuple(reward_baselines.shape)}; need one per row: "
            f"({token_level_rewards.shape[0]},)"
        )
    is_real = (response_mask != 0).to(token_level_rewards.dtype)
    rewards = torch.where(response_mask != 0, token_level_rewards, 0.0)
    returns = rewards.flip(-1).cumsum(-1).flip(-1) * is_real
    advantages = (returns - reward_baselines.to(returns.dtype).unsqueeze(-1)) * is_real
    return advantages, returns


@register_adv_est("optimal_token_baseline")
@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline (OTB, verl's ``optimal_token_baseline``): a baseline per prompt group and per
    token position that weighs each response's return by its accumulated path variance.

    Source: verl's ``compute_optimal_token_baseline_advantage`` (the variance-minimising baseline of a score-function
    estimator, b* = E[G ||grad log pi||^2] / E[||grad log pi||^2], with the squared norm of the logits' score
    ||s_j||^2 = 1 - 2 pi(y_j) + sum_v pi(v)^2 accumulated over the response). For each group of a prompt's
    responses and each position t::

        G_t = sum_{t' >= t} r_t'                 (the reward-to-go)
        W_t = sum_{j <= t} (1 - 2 pi_j + sum pi^2_j) * rho_j^2     (rho: truncated IS weights, 1 without)
        B_t = sum_i G_i,t W_i,t m_i,t / (sum_i W_i,t m_i,t + 1e-8)
        A_t = (G_t - B_t) m_t

    over the group's responses i that reach position t (m: the response mask). A group of one response gets no
    baseline (A = G).

    Args:
        token_level_rewards: float [B, T].
        response_mask: [B, T].
        index: the B prompt uids; equal uids form a group.
        old_log_probs: float [B, T], log pi of the sampled tokens (the old_log_prob stage).
        sum_pi_squared: float [B, T], sum_v pi(v)^2 at each response token (``actor.calculate_sum_pi_squared``).
        rollout_is_weights: optional float [B, T], the rollout correction's truncated weights (their squares scale W).

    Returns:
        ``(advantages, returns)`` float [B, T]: returns the reward-to-go; both 0 at masked positions.

    Raises:
        ValueError: shapes differ or ``index`` does not have B entries.
    """
    check_same_shape(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
    )
    mask = (response_mask != 0).to(token_level_rewards.dtype)
    returns = (torch.where(response_mask != 0, token_level_rewards, 0.0)).flip(-1).cumsum(-1).flip(-1) * mask
    w = 1.0 - 2.0 * torch.exp(torch.where(response_mask != 0, old_log_probs, 0.0)) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.square()
    cumulative = torch.where(response_mask != 0, w, 0.0).cumsum(-1) * mask
    ids, n_groups = group_ids(index, returns.shape[0])
    ids = ids.to(returns.device)
    width = returns.shape[1]
    numerator = returns.new_zeros(n_groups, width).index_add_(0, ids, returns * cumulative)
    denominator = returns.new_zeros(n_groups, width).index_add_(0, ids, cumulative)
    counts = returns.new_zeros(n_groups).index_add_(0, ids, returns.new_ones(returns.shape[0]))
    baseline = torch.where((counts > 1).unsqueeze(-1), numerator / (denominator + 1e-8), 0.0)
    advantages = (returns - baseline[ids]) * mask
    return advantages, returns
