"""The RL algorithms of HybridFlow as small, pure torch functions.

Nothing here knows about workers, models or configs: every function takes tensors and numbers and returns tensors
(or floats for metrics), so each one can be tested on its own. The module holds

- masked statistics: `masked_sum`, `masked_mean`, `masked_var`, `masked_whiten`;
- advantage estimators, in a registry keyed by the config value ``algorithm.adv_estimator``:
  ``"gae"`` (`compute_gae_advantage_return`), ``"grpo"`` (`compute_grpo_outcome_advantage`; Dr. GRPO with
  ``norm_adv_by_std_in_grpo`` false), ``"rloo"``, ``"reinforce_plus_plus"``, ``"reinforce_plus_plus_baseline"``
  ``"opo"`` and ``"remax"`` (baseline: the greedy response's score);
- the KL machinery: per-token estimators (`kl_penalty`), fixed and adaptive coefficient controllers, and
  `apply_kl_penalty`, which folds the KL into the token-level rewards;
- losses: `agg_loss` (how a [B, T] loss matrix becomes a scalar), policy losses in a registry keyed by
  ``actor.policy_loss.loss_mode`` (``"vanilla"``: `compute_policy_loss`, PPO clip with clip-higher and dual-clip;
  ``"gspo"``, ``"cispo"``, ``"clip_cov"``, ``"kl_cov"``) and `compute_value_loss` (clipped critic loss);
- `entropy_from_logits`, `logprobs_from_logits` and `logprobs_and_entropy` (both from one log-softmax);
- DAPO's pieces: `overlong_reward` and `varied_groups` (dynamic sampling).

Conventions. B is the number of sequences in the batch and T the padded response length in tokens. A mask is a
[B, T] tensor (bool, int or float) with 1 for real response tokens and 0 for padding; responses are right-padded,
so a row of the mask is ones followed by zeros. Positions where the mask is 0 never influence a result: they are
replaced by 0 before any arithmetic, so even NaN or inf there is harmless. Names follow verl, so that the config
keys (``actor.loss_agg_mode``, ``algorithm.kl_penalty``, ...) mean what verl users expect.
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "ADV_ESTIMATORS_NEEDING_CRITIC",
    "AGG_LOSS_MODES",
    "KL_PENALTY_TYPES",
    "AdaptiveKLController",
    "FixedKLController",
    "adv_estimators",
    "agg_loss",
    "apply_kl_penalty",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_gspo",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_reward",
    "policy_loss_modes",
    "register_adv_est",
    "register_policy_loss",
    "uses_critic",
    "uses_greedy_baseline",
    "uses_groups",
    "varied_groups",
]

WHITEN_EPS = 1e-8
"""Added to the variance in `masked_whiten` before the square root."""

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-20, 20] before `exp` (exp(20) is about 4.9e8), so the ratio never overflows."""


# --------------------------------------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------------------------------------


def _check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming every shape when the given tensors do not all have the same shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"Shape mismatch: {listed}. These tensors must all have the same shape (usually [B, T]).")


def _masked(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (values * mask with masked-out entries set to exactly 0, mask as values' dtype expanded to its shape).

    The mask may broadcast to ``values`` (e.g. [B, 1] for [B, T]) but must not enlarge it.
    """
    try:
        shape = torch.broadcast_shapes(values.shape, mask.shape)
    except RuntimeError:
        shape = None
    if shape != values.shape:
        raise ValueError(
            f"Mask of shape {list(mask.shape)} does not fit values of shape {list(values.shape)}: "
            "the mask must have the same shape as the values (or broadcast to it)."
        )
    mask = mask.expand(values.shape)
    dtype = values.dtype if values.is_floating_point() else torch.get_default_dtype()
    weights = mask.to(dtype)
    kept = torch.where(mask != 0, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))
    return kept * weights, weights


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values * mask`` over ``dim`` (over every entry when ``dim`` is None).

    Args:
        values: float tensor, e.g. [B, T].
        mask: bool/int/float tensor of the same shape (or broadcastable to it); 1 marks entries to keep.
        dim: dimension to reduce, or None for all.

    Returns:
        A tensor of ``values``' dtype: 0-dim when ``dim`` is None, else ``values`` with ``dim`` removed.

    Raises:
        ValueError: the mask does not fit the values' shape.
    """
    kept, _ = _masked(values, mask)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the entries where ``mask`` is non-zero (mask-weighted mean for fractional masks).

    Args:
        values: float tensor, e.g. [B, T].
        mask: bool/int/float tensor of the same shape (or broadcastable to it).
        dim: dimension to reduce, or None for all.

    Returns:
        ``sum(values * mask) / sum(mask)`` over ``dim``; 0-dim when ``dim`` is None. Where the mask selects
        nothing the result is 0 (not NaN), so an empty micro-batch or an all-padding row gives a 0 loss.

    Raises:
        ValueError: the mask does not fit the values' shape.
    """
    kept, weights = _masked(values, mask)
    if dim is None:
        total, count = kept.sum(), weights.sum()
    else:
        total, count = kept.sum(dim=dim), weights.sum(dim=dim)
    # With 0/1 masks `total` is exactly 0 wherever `count` is 0, so the clamp only turns 0/0 into 0.
    return total / count.clamp(min=torch.finfo(count.dtype).tiny)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all entries where ``mask`` is non-zero.

    Args:
        values: float tensor, e.g. [B, T].
        mask: bool/int/float tensor of the same shape (or broadcastable to it).
        unbiased: apply Bessel's correction n / (n - 1), as ``torch.var`` does by default.

    Returns:
        0-dim tensor of ``values``' dtype.

    Raises:
        ValueError: the mask selects nothing, or (with ``unbiased``) fewer than two entries; or the shapes differ.
    """
    _, weights = _masked(values, mask)
    count = float(weights.sum())
    if count == 0:
        raise ValueError("masked_var: the mask selects no entries, so the variance is undefined.")
    if unbiased and count <= 1:
        raise ValueError(
            f"masked_var: the mask selects {count:g} entries; the unbiased variance needs at least 2 "
            "(pass unbiased=False, or give more response tokens)."
        )
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        var = var * (count / (count - 1))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` to zero mean and unit variance using statistics of the masked entries only.

    ``(values - mean) / sqrt(var + 1e-8)`` with mean and unbiased variance from `masked_mean` / `masked_var` over
    every masked entry of the batch. With ``shift_mean=False`` the mean is added back (only the scale changes).

    Args:
        values: float tensor, e.g. [B, T].
        mask: bool/int/float tensor of the same shape.
        shift_mean: subtract the mean (True) or keep it (False).

    Returns:
        Tensor of ``values``' shape and dtype. Entries outside the mask go through the same affine map but did not
        influence it; callers multiply by the mask when they need zeros there.

    Raises:
        ValueError: fewer than two masked entries (see `masked_var`), or the shapes differ.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


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
    if name not in _ADV_ESTIMATORS:
        raise _unknown_adv_estimator(name)
    return "index" in inspect.signature(_ADV_ESTIMATORS[name]).parameters


def uses_greedy_baseline(name: str) -> bool:
    """True when the advantage estimator ``name`` subtracts the score of each prompt's greedy response (it takes
    ``reward_baselines``, as ReMax does), so the iteration needs the greedy generation stage.

    Raises:
        ValueError: ``name`` is not a registered estimator.
    """
    if name not in _ADV_ESTIMATORS:
        raise _unknown_adv_estimator(name)
    return "reward_baselines" in inspect.signature(_ADV_ESTIMATORS[name]).parameters


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
    _check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
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


def _group_ids(index: Sequence[Any] | np.ndarray | torch.Tensor, batch_size: int) -> tuple[torch.Tensor, int]:
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
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
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
    ids, n_groups = _group_ids(index, scores.shape[0])
    ids = ids.to(scores.device)
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add_(0, ids, scores)
    singleton = counts == 1
    mean = torch.where(singleton, 0.0, sums / counts)
    sq_dev = torch.zeros_like(counts).index_add_(0, ids, (scores - mean[ids]) ** 2)
    std = torch.where(singleton, 1.0, torch.sqrt(sq_dev / (counts - 1).clamp(min=1)))

    adv = scores - mean[ids]
    if norm_adv_by_std_in_grpo:
        adv = adv / (std[ids] + epsilon)
    advantages = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
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
    ids, n_groups = _group_ids(index, scores.shape[0])
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
    ids, n_groups = _group_ids(index, scores.shape[0])
    ids = ids.to(scores.device)
    weights = torch.ones_like(scores) if weights is None else weights.to(scores.dtype)
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, torch.ones_like(scores))
    totals = torch.zeros_like(counts).index_add_(0, ids, weights)
    sums = torch.zeros_like(counts).index_add_(0, ids, weights * scores)
    return torch.where(counts[ids] > 1, sums[ids] / totals[ids].clamp(min=torch.finfo(scores.dtype).tiny), 0.0)


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantage: the discounted return of each token, whitened over every response token of the batch.

    Source: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models", §3
    (token-level return ``G_t = sum_{s >= t} gamma^(s-t) r_s``, the KL penalty folded into the rewards, global
    advantage normalisation). No critic and no group: works with ``rollout.n`` = 1.

    Args:
        token_level_rewards: float [B, T] (with ``algorithm.use_kl_in_reward`` the KL penalty is already in them).
        response_mask: bool/int/float [B, T].
        gamma: discount (``algorithm.gamma``).

    Returns:
        ``(advantages, returns)`` float [B, T], 0 at masked positions, no grad: ``returns`` the discounted returns,
        ``advantages`` those whitened (`masked_whiten`) over the batch's response tokens.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    is_real = response_mask != 0
    rewards = torch.where(is_real, token_level_rewards, 0.0)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = torch.where(is_real[:, t], running, 0.0)  # nothing flows back across padding
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
            ``reward_baselines`` column, written by `hybridflow.algorithms.advantage.greedy_baselines`).

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


def varied_groups(values: torch.Tensor, index: Sequence[Any] | np.ndarray) -> torch.Tensor:
    """Which sequences belong to a group whose `values` are not all equal (a group of one counts as varied): the
    groups DAPO's dynamic sampling keeps, since a group of equal rewards has zero group-relative advantage.

    Source: Yu et al. 2025, "DAPO" (arXiv 2503.14476), §3.2, eq. 11: keep a prompt when
    ``0 < |{o_i : is_equivalent(a, o_i)}| < G``, generalised (as verl does) to "the group's metric has std > 0".

    Args:
        values: float [B], one metric value per sequence (e.g. its accuracy or score).
        index: length-B prompt uids; equal uids form a group.

    Returns:
        bool [B].
    """
    ids, n_groups = _group_ids(index, values.shape[0])
    values = values.to(torch.float64)
    low = torch.full((n_groups,), float("inf"), dtype=values.dtype).scatter_reduce(0, ids, values, "amin")
    high = torch.full((n_groups,), float("-inf"), dtype=values.dtype).scatter_reduce(0, ids, values, "amax")
    counts = torch.bincount(ids, minlength=n_groups)
    return ((high > low) | (counts == 1))[ids]


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


# --------------------------------------------------------------------------------------------------------------------
# KL: per-token estimators, coefficient controllers, reward penalty
# --------------------------------------------------------------------------------------------------------------------

KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+")
"""Names accepted by `kl_penalty` (aliases: k1 = kl, k2 = mse, k3 = low_var_kl; a trailing ``+``: the same value
with k2's gradient, straight through)."""

K3_CLAMP = 10.0
"""`kl_penalty` clamps the k3 estimate to [-10, 10] (in practice [0, 10], since k3 >= 0)."""


def _kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    _check_same_shape(log_prob=log_prob, ref_log_prob=ref_log_prob)
    log_ratio = log_prob - ref_log_prob  # k1: log pi(x) - log pi_ref(x), x sampled from pi
    if kind.endswith("+") and kind in KL_PENALTY_TYPES:  # the value of kind, the gradient of k2
        value = _kl_estimate(log_prob, ref_log_prob, kind[:-1])
        k2 = 0.5 * log_ratio.square()
        return k2 - k2.detach() + value.detach()
    if kind in ("kl", "k1"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("mse", "k2"):
        return 0.5 * log_ratio.square()
    if kind in ("low_var_kl", "k3"):
        ref_minus_logp = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = torch.exp(ref_minus_logp) - ref_minus_logp - 1
        return k3.clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(
        f"Unknown KL penalty type {kind!r} (config key `algorithm.kl_penalty`, or `actor.kl_loss_type` for the "
        f"KL loss); allowed: {list(KL_PENALTY_TYPES)}."
    )


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

    Source: John Schulman, "Approximating KL Divergence" (blog, 2020). With ``k1 = log_prob - ref_log_prob``:

    - ``"kl"`` / ``"k1"``: k1 (unbiased, high variance, can be negative);
    - ``"abs"``: |k1|;
    - ``"mse"`` / ``"k2"``: 0.5 * k1^2 (biased, low variance);
    - ``"low_var_kl"`` / ``"k3"``: exp(ref - logp) - (ref - logp) - 1 (unbiased, low variance, always >= 0).
      For numerical safety ``ref - logp`` is clamped to [-20, 20] before the exp and the result to [-10, 10];
      both clamps only bite on tokens whose probabilities differ by a factor above about e^12;
    - ``"k1+"``, ``"kl+"``, ``"abs+"``, ``"k3+"``, ``"low_var_kl+"``: the value of the estimator named without the
      ``+`` and the gradient of k2 (straight through: ``k2 - sg(k2) + sg(value)``). As a loss, k1's and k3's
      expected gradients are not the gradient of KL(pi || pi_ref), k2's is (its gradient is
      ``(log pi - log pi_ref) * grad log pi``, the score-function form of the KL's gradient); the ``+`` forms
      keep the reported value of the chosen estimator and take that gradient (as verl's ``k3+``).

    Args:
        log_prob: float [B, T] (or any shape), log-probs under the current policy.
        ref_log_prob: float, same shape, log-probs under the reference policy.
        kl_penalty: one of `KL_PENALTY_TYPES`.

    Returns:
        Float tensor of the input shape (not masked; multiply by the response mask as needed).

    Raises:
        ValueError: unknown ``kl_penalty`` (lists the allowed names) or shapes differ.
    """
    return _kl_estimate(log_prob, ref_log_prob, kl_penalty)


class FixedKLController:
    """A constant KL coefficient (``algorithm.kl_ctrl.type: fixed``); `update` does nothing.

    Attributes:
        value: the coefficient beta, a float.
    """

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"`algorithm.kl_ctrl.kl_coef` must be >= 0, got {kl_coef}.")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient unchanged (same signature as `AdaptiveKLController.update`)."""


class AdaptiveKLController:
    """KL coefficient steered towards a target KL (``algorithm.kl_ctrl.type: adaptive``).

    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", §2.2: after each batch,
    ``e = clip(KL / KL_target - 1, -0.2, 0.2)`` and ``beta <- beta * (1 + K_beta * e)`` with
    ``K_beta = n_steps / horizon``.

    Attributes:
        value: the current coefficient beta, a float.
        target: the target KL.
        horizon: number of steps (samples) over which the proportional controller acts.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int | float):
        if init_kl_coef < 0:
            raise ValueError(f"`algorithm.kl_ctrl.kl_coef` must be >= 0, got {init_kl_coef}.")
        if not target_kl > 0:
            raise ValueError(f"`algorithm.kl_ctrl.target_kl` must be > 0, got {target_kl}.")
        if not horizon > 0:
            raise ValueError(f"`algorithm.kl_ctrl.horizon` must be > 0, got {horizon}.")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale ``value`` by ``1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


class LagrangeMultiplier:
    """Safe-RLHF's multiplier lambda >= 0 of the cost constraint ``J_C <= d`` (``algorithm.cost_limit``).

    Source: Dai et al. 2023, "Safe RLHF: Safe Reinforcement Learning from Human Feedback", §3.3: the policy
    maximises ``min_lambda -J_R + lambda (J_C - d)`` by alternating a policy step and a step of lambda along
    ``J_C - d``. As in their PPO-Lagrangian implementation, lambda is kept as ``exp(log_lambda)`` (so it stays
    positive), J_C is the mean cost of the last ``window`` episodes (responses), and each iteration takes one
    gradient-descent step of ``lambda_lr`` on the loss ``-(J_C - d) x lambda`` over ``log_lambda``:
    ``log_lambda += lambda_lr x (J_C - d) x lambda``. Lambda rises while the cost is over the limit and falls while
    it is under; ``log_lambda`` is kept in [`LOG_LAMBDA_MIN`, log(``lambda_max``)] so that lambda neither underflows
    to 0 nor overflows.

    Attributes:
        log_value: log lambda (checkpointed, with the window, by `state_dict`).
        value: lambda, a float > 0.

    Raises:
        ValueError: ``lambda_init`` or ``lambda_max`` is not > 0, or ``window`` < 1 (each names its config key).
    """

    LOG_LAMBDA_MIN = -50.0

    def __init__(
        self,
        cost_limit: float,
        lambda_init: float,
        lambda_lr: float,
        lambda_max: float | None = None,
        window: int = 128,
    ):
        if not lambda_init > 0:
            raise ValueError(f"`algorithm.lambda_init` must be > 0, got {lambda_init}.")
        if lambda_max is not None and not lambda_max > 0:
            raise ValueError(f"`algorithm.lambda_max` must be > 0 or unset, got {lambda_max}.")
        if window < 1:
            raise ValueError(f"`algorithm.episode_cost_window` must be >= 1, got {window}.")
        self.cost_limit, self.lambda_lr = float(cost_limit), float(lambda_lr)
        self.log_max = math.log(lambda_max) if lambda_max is not None else 50.0
        self.log_value = self._clamped(math.log(lambda_init))
        self.costs: collections.deque[float] = collections.deque(maxlen=window)

    def _clamped(self, log_value: float) -> float:
        return min(max(log_value, self.LOG_LAMBDA_MIN), self.log_max)

    @property
    def value(self) -> float:
        return math.exp(self.log_value)

    def update(self, episode_costs: Sequence[float]) -> float:
        """Add this batch's episode costs (one per response, in ``reward.cost_function``'s units) to the window and
        step lambda with the window's mean; returns the new lambda."""
        self.costs.extend(float(c) for c in episode_costs)
        mean_cost = sum(self.costs) / len(self.costs)
        self.log_value = self._clamped(self.log_value + self.lambda_lr * (mean_cost - self.cost_limit) * self.value)
        return self.value

    def state_dict(self) -> dict[str, Any]:
        """``{"log_lambda", "episode_costs"}``: what a checkpoint keeps (JSON-serialisable)."""
        return {"log_lambda": self.log_value, "episode_costs": list(self.costs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s output exactly."""
        self.log_value = float(state["log_lambda"])
        self.costs.clear()
        self.costs.extend(float(c) for c in state["episode_costs"])


def lagrangian_advantages(
    reward_advantages: torch.Tensor, cost_advantages: torch.Tensor, multiplier: float
) -> torch.Tensor:
    """The PPO-Lagrangian advantage ``(A_R - lambda A_C) / (1 + lambda)`` (Dai et al. 2023, §3.3, as their
    implementation combines them): the surrogate of ``J_R - lambda J_C``, rescaled by ``1 / (1 + lambda)`` so that
    its size does not grow with lambda.

    Args:
        reward_advantages, cost_advantages: float [B, T] (GAE of the reward and of the cost; 0 off the mask).
        multiplier: lambda >= 0 (`LagrangeMultiplier.value`).

    Returns:
        float [B, T], the same dtype.

    Raises:
        ValueError: the shapes differ or the multiplier is negative.
    """
    _check_same_shape(reward_advantages=reward_advantages, cost_advantages=cost_advantages)
    if multiplier < 0:
        raise ValueError(f"the Lagrange multiplier must be >= 0, got {multiplier}")
    return (reward_advantages - multiplier * cost_advantages) / (1.0 + multiplier)


def get_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: int | float | None = None
) -> KLController:
    """Build the KL controller named by ``algorithm.kl_ctrl.type``: ``"fixed"`` or ``"adaptive"``.

    Raises:
        ValueError: unknown ``kind``, or ``"adaptive"`` without ``target_kl`` and ``horizon``.
    """
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                "The adaptive KL controller needs `algorithm.kl_ctrl.target_kl` and `algorithm.kl_ctrl.horizon`; "
                f"got target_kl={target_kl}, horizon={horizon}."
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"Unknown KL controller {kind!r} (config key `algorithm.kl_ctrl.type`); allowed: fixed, adaptive.")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Subtract the KL penalty from the token-level scores: ``r_t = s_t - beta * KL_t`` on response tokens.

    Source: Ziegler et al. 2019 §2.2 (reward ``r - beta * KL(pi, rho)``), applied per token as in InstructGPT
    and verl. ``KL_t`` is `kl_penalty` of the chosen type; ``beta`` is ``kl_ctrl.value`` before this call's update.

    The batch KL reported (and fed to ``kl_ctrl.update(current_kl, n_steps=B)``) is the per-sequence masked mean
    of ``KL_t``, averaged over the sequences that have at least one response token.

    Args:
        token_level_scores: float [B, T], rewards before the penalty (usually the outcome score on the last token).
        log_prob: float [B, T], log-probs of the response tokens under the rollout policy.
        ref_log_prob: float [B, T], log-probs under the reference policy.
        response_mask: bool/int/float [B, T].
        kl_ctrl: a `FixedKLController` or `AdaptiveKLController` (updated in place).
        kl_penalty: KL estimator name, see `kl_penalty` (``algorithm.kl_penalty``).

    Returns:
        ``(token_level_rewards, metrics)``: rewards [B, T] in the scores' dtype (unchanged where masked) and
        ``{"actor/reward_kl_penalty": current KL, "actor/reward_kl_penalty_coeff": beta used}`` as floats.

    Raises:
        ValueError: shapes differ or unknown ``kl_penalty``.
    """
    _check_same_shape(
        token_level_scores=token_level_scores,
        log_prob=log_prob,
        ref_log_prob=ref_log_prob,
        response_mask=response_mask,
    )
    kl, _ = _masked(_kl_estimate(log_prob, ref_log_prob, kl_penalty), response_mask)
    beta = float(kl_ctrl.value)
    token_level_rewards = token_level_scores - beta * kl.to(token_level_scores.dtype)
    current_kl = float(agg_loss(kl, response_mask, "seq-mean-token-mean"))
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics


# --------------------------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------------------------

AGG_LOSS_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Values accepted by `agg_loss` (config key ``actor.loss_agg_mode``)."""


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar loss.

    Modes (``actor.loss_agg_mode``):

    - ``"token-mean"``: mean over all masked tokens of the batch (each token weighs the same).
    - ``"token-sum"``: sum over all masked tokens of the batch (each token weighs the same, and the loss, with its
      gradient, grows with the batch's token count: scale the learning rate accordingly).
    - ``"seq-mean-token-sum"``: sum over each sequence's tokens, then mean over sequences.
    - ``"seq-mean-token-mean"``: mean over each sequence's tokens, then mean over sequences (each sequence weighs
      the same, as in the GRPO paper's objective).
    - ``"seq-mean-token-sum-norm"``: sum over all masked tokens divided by the constant B * T, with
      T = ``loss_mat.shape[-1]``: the mean over the B sequences of each sequence's token sum divided by T. This is
      the Dr. GRPO objective (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"),
      which replaces the per-response length 1/|o_i| of GRPO by a constant, the maximum response length, to remove
      the length bias; T stands for that constant here, so keep the padded length fixed across steps.

    Sequences whose mask is all 0 are excluded from the mean over sequences in the two ``seq-mean-token-sum`` and
    ``seq-mean-token-mean`` modes (they neither add to nor dilute the loss); in ``"seq-mean-token-sum-norm"`` they
    count in B, since that normaliser is a constant by design. An all-zero mask gives a loss of 0 in every mode
    (still a graph node, with zero gradient).

    Args:
        loss_mat: float [B, T].
        loss_mask: bool/int/float [B, T].
        loss_agg_mode: one of `AGG_LOSS_MODES`.

    Returns:
        0-dim tensor in ``loss_mat``'s dtype, differentiable with respect to ``loss_mat``.

    Raises:
        ValueError: unknown mode (lists the allowed values), ``loss_mat`` not 2-D, or shapes differ.
    """
    if loss_agg_mode not in AGG_LOSS_MODES:
        raise ValueError(
            f"Unknown loss_agg_mode {loss_agg_mode!r} (config key `actor.loss_agg_mode`); "
            f"allowed: {list(AGG_LOSS_MODES)}."
        )
    if loss_mat.dim() != 2:
        raise ValueError(f"agg_loss expects loss_mat of shape [B, T], got {list(loss_mat.shape)}.")
    _check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return masked_sum(loss_mat, loss_mask) / loss_mat.numel()
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss_mat, loss_mask, dim=-1)
    else:
        per_seq = masked_mean(loss_mat, loss_mask, dim=-1)
    has_tokens = (loss_mask != 0).any(dim=-1)
    return masked_mean(per_seq, has_tokens)


_POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator that registers a policy loss under ``name`` (the value of ``actor.policy_loss.loss_mode``).

    The function is called as ``fn(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low,
    clip_ratio_high, clip_ratio_c, loss_agg_mode, is_weights)`` (all [B, T] float tensors, `is_weights` optional),
    plus those keys of ``actor.policy_loss`` that its signature names (e.g. ``clip_cov_ratio``), and returns
    ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, 0-dim tensors, ``pg_loss`` differentiable. It is returned
    unchanged.

    Raises:
        ValueError: ``name`` is already registered to a different function.
    """

    def decorator(fn: Callable) -> Callable:
        existing = _POLICY_LOSSES.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"Policy loss {name!r} is already registered (to {existing.__qualname__}); pick another.")
        _POLICY_LOSSES[name] = fn
        return fn

    return decorator


def policy_loss_modes() -> list[str]:
    """The registered policy-loss names (``actor.policy_loss.loss_mode``), sorted."""
    return sorted(_POLICY_LOSSES)


def get_policy_loss_fn(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The policy loss registered under ``name`` (see `register_policy_loss` for its calling convention).

    Raises:
        ValueError: ``name`` is not registered (names the config key and the registered names).
    """
    if name not in _POLICY_LOSSES:
        raise ValueError(
            f"Unknown policy loss {name!r} (config key `actor.policy_loss.loss_mode`); "
            f"registered: {policy_loss_modes()}."
        )
    return _POLICY_LOSSES[name]


def _aggregate_policy_loss(
    pg_losses: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, is_weights: torch.Tensor | None
) -> torch.Tensor:
    """`agg_loss` of the per-token losses [B, T], each first weighted by `is_weights` [B, T] (detached) if given."""
    if is_weights is not None:
        _check_same_shape(is_weights=is_weights, pg_losses=pg_losses)
        pg_losses = pg_losses * is_weights.detach()
    return agg_loss(pg_losses, response_mask, loss_agg_mode)


def _check_clip_ratios(clip_ratio_low: float, clip_ratio_high: float) -> None:
    for key, x in (("actor.clip_ratio_low", clip_ratio_low), ("actor.clip_ratio_high", clip_ratio_high)):
        if x < 0:
            raise ValueError(f"`{key}` must be >= 0, got {x}.")


@register_policy_loss("vanilla")
def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate loss with clip-higher and dual-clip.

    Sources: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7 (clipped surrogate, negated
    into a loss); Yu et al. 2025, "DAPO", §3.1 (clip-higher: separate ``eps_low`` / ``eps_high``); Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning", eq. 5 (dual-clip).

    Per token, with ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``::

        loss = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))
        loss = min(loss, -A * clip_ratio_c)          only where A < 0 (dual-clip)

    then multiplied by `is_weights` when given (see `truncated_is_weights`) and aggregated with `agg_loss`.

    Args:
        old_log_prob: float [B, T], log-probs under the policy that generated the data.
        log_prob: float [B, T], log-probs under the current policy (carries the gradient).
        advantages: float [B, T].
        response_mask: bool/int/float [B, T].
        clip_ratio_low: eps_low >= 0 (``actor.clip_ratio_low``).
        clip_ratio_high: eps_high >= 0 (``actor.clip_ratio_high``).
        clip_ratio_c: dual-clip bound c > 1 (``actor.clip_ratio_c``).
        loss_agg_mode: see `agg_loss` (``actor.loss_agg_mode``).
        is_weights: optional float [B, T] per-token weights without gradient (truncated importance sampling).

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, all 0-dim tensors. ``pg_loss`` is differentiable;
        the others are detached metrics: ``pg_clipfrac`` is the fraction of response tokens where the clipped
        term is the larger (so the clip is active), ``ppo_kl`` the masked mean of ``old_log_prob - log_prob``, and
        ``pg_clipfrac_lower`` the fraction of response tokens where the dual-clip bound is active.

    Raises:
        ValueError: ``clip_ratio_c <= 1``, a negative clip ratio, unknown ``loss_agg_mode`` or shapes differ.
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"`actor.clip_ratio_c` must be > 1 for dual-clip PPO (3.0 is usual), got {clip_ratio_c}.")
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative_adv = advantages < 0
    pg_losses = torch.where(negative_adv, torch.minimum(clip_loss, dual_bound), clip_loss)
    pg_loss = _aggregate_policy_loss(pg_losses, response_mask, loss_agg_mode, is_weights)
    with torch.no_grad():
        pg_clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
        pg_clipfrac_lower = masked_mean((negative_adv & (clip_loss > dual_bound)).float(), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO: PPO's clip on a sequence-level importance ratio, the geometric mean of the tokens' ratios.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv 2507.18071), eq. 7 and its token-level
    form GSPO-token (eq. 13-14)::

        s_i = exp(mean_t (log_prob - old_log_prob))            over response i's tokens
        s_it = sg(s_i) * exp(log_prob_t - sg(log_prob_t))      value s_i, gradient s_i * grad log_prob_t
        loss = max(-A * s_it, -A * clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))

    aggregated with `agg_loss` (the paper's objective is ``seq-mean-token-mean``; its clip ranges are ~1e-4, as the
    ratio is a per-token geometric mean). ``log s_it`` is capped at 10 before the exp. No dual clip
    (`clip_ratio_c` unused; ``pg_clipfrac_lower`` is 0).

    Args:
        old_log_prob, log_prob, advantages, response_mask: float [B, T] (``log_prob`` carries the gradient).
        is_weights: optional float [B, T] per-token weights without gradient.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, 0-dim tensors (see `compute_policy_loss`).

    Raises:
        ValueError: a negative clip ratio, unknown ``loss_agg_mode`` or shapes differ.
    """
    del clip_ratio_c
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = log_prob - old_log_prob
    lengths = (response_mask != 0).sum(-1).clamp(min=1).to(log_prob.dtype)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / lengths
    log_s = (log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = torch.exp(log_s)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)
    pg_loss = _aggregate_policy_loss(pg_losses, response_mask, loss_agg_mode, is_weights)
    with torch.no_grad():
        pg_clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros_like(pg_clipfrac)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO: REINFORCE weighted by the clipped importance ratio, held constant, so no token loses its gradient.

    Source: MiniMax 2025, "MiniMax-M1" (arXiv 2506.13585), eq. 4-5::

        w = sg(clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)),   ratio = exp(log_prob - old_log_prob)
        loss = -w * A * log_prob

    aggregated with `agg_loss`. PPO's clip zeroes the gradient of a clipped token; here every token's gradient is
    ``-w * A * grad log_prob``. No dual clip (`clip_ratio_c` unused).

    Args:
        old_log_prob, log_prob, advantages, response_mask: float [B, T] (``log_prob`` carries the gradient).
        is_weights: optional float [B, T] per-token weights without gradient.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: ``pg_clipfrac`` the share of response tokens whose
        weight was clipped (either side), ``pg_clipfrac_lower`` those clipped below; 0-dim tensors.

    Raises:
        ValueError: a negative clip ratio, unknown ``loss_agg_mode`` or shapes differ.
    """
    del clip_ratio_c
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = (log_prob - old_log_prob).detach()
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = -weight * advantages * log_prob
    pg_loss = _aggregate_policy_loss(pg_losses, response_mask, loss_agg_mode, is_weights)
    with torch.no_grad():
        pg_clipfrac = masked_mean((weight != ratio).float(), response_mask)
        pg_clipfrac_lower = masked_mean((ratio < 1.0 - clip_ratio_low).float(), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def _token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each response token's centred product ``(A - mean A) * (log pi - mean log pi)`` over the batch's response
    tokens, float [B, T], detached: its contribution to the covariance that drives entropy collapse (Cui et al.
    2025, eq. 6-7)."""
    log_prob = log_prob.detach()
    return (advantages - masked_mean(advantages, response_mask)) * (log_prob - masked_mean(log_prob, response_mask))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clip-Cov: PPO's clipped loss, with the gradient of a few high-covariance tokens removed.

    Source: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (arXiv
    2505.22617), §4.2, eq. 10: among the response tokens that PPO's clip leaves active and whose covariance
    (`_token_covariance`) lies in (``clip_cov_lb``, ``clip_cov_ub``), ``max(1, int(clip_cov_ratio x tokens))`` are
    drawn at random (torch's global generator) and contribute nothing. No dual clip.

    Args:
        old_log_prob, log_prob, advantages, response_mask: float [B, T] (``log_prob`` carries the gradient).
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: ``actor.policy_loss.{clip_cov_ratio, clip_cov_lb, clip_cov_ub}``.
        is_weights: optional float [B, T] per-token weights without gradient.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: ``pg_clipfrac`` the share of response tokens whose
        gradient was removed, ``pg_clipfrac_lower`` 0; 0-dim tensors.

    Raises:
        ValueError: ``clip_cov_ratio`` not in (0, 1], a negative clip ratio, unknown ``loss_agg_mode`` or shapes
            differ.
    """
    del clip_ratio_c
    if not 0 < clip_cov_ratio <= 1:
        raise ValueError(f"`actor.policy_loss.clip_cov_ratio` must be in (0, 1] (2e-4 is usual), got {clip_cov_ratio}")
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    real = response_mask != 0
    with torch.no_grad():
        cov = _token_covariance(advantages, log_prob, response_mask)
        candidates = (real & (clipped <= unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)).nonzero()
        count = max(int(clip_cov_ratio * int(real.sum())), 1)
        dropped = candidates[torch.randperm(len(candidates))[:count]]
        keep = torch.ones_like(advantages)
        keep[dropped[:, 0], dropped[:, 1]] = 0.0
    pg_losses = torch.maximum(unclipped, clipped) * keep
    pg_loss = _aggregate_policy_loss(pg_losses, response_mask, loss_agg_mode, is_weights)
    with torch.no_grad():
        pg_clipfrac = masked_mean((keep == 0).float(), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros_like(pg_clipfrac)


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """KL-Cov: the unclipped policy-gradient loss, plus a KL penalty on the tokens of largest covariance.

    Source: Cui et al. 2025 (arXiv 2505.22617), §4.2, eq. 11: the ``max(1, int(kl_cov_ratio x tokens))`` response
    tokens of largest covariance (`_token_covariance`) get ``-A * ratio + ppo_kl_coef * |log ratio|``, every other
    token ``-A * ratio``. No clipping (the clip ratios are unused).

    Args:
        old_log_prob, log_prob, advantages, response_mask: float [B, T] (``log_prob`` carries the gradient).
        kl_cov_ratio, ppo_kl_coef: ``actor.policy_loss.{kl_cov_ratio, ppo_kl_coef}``.
        is_weights: optional float [B, T] per-token weights without gradient.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: ``ppo_kl`` the masked mean of ``|log ratio|`` (as
        verl reports it for this loss), both clip fractions 0; 0-dim tensors.

    Raises:
        ValueError: ``kl_cov_ratio`` not in (0, 1], unknown ``loss_agg_mode`` or shapes differ.
    """
    del clip_ratio_low, clip_ratio_high, clip_ratio_c
    if not 0 < kl_cov_ratio <= 1:
        raise ValueError(f"`actor.policy_loss.kl_cov_ratio` must be in (0, 1] (2e-4 is usual), got {kl_cov_ratio}")
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    real = response_mask != 0
    with torch.no_grad():
        cov = _token_covariance(advantages, log_prob, response_mask).masked_fill(~real, float("-inf"))
        count = min(max(int(kl_cov_ratio * int(real.sum())), 1), int(real.sum()))
        penalised = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
        penalised[cov.flatten().topk(count).indices] = True
    pg_losses = -advantages * ratio + torch.where(penalised.view_as(cov), ppo_kl_coef * log_ratio.abs(), 0.0)
    pg_loss = _aggregate_policy_loss(pg_losses, response_mask, loss_agg_mode, is_weights)
    with torch.no_grad():
        ppo_kl = masked_mean(log_ratio.abs(), response_mask)
    zero = torch.zeros_like(ppo_kl)
    return pg_loss, zero, ppo_kl, zero


def truncated_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(exp(old_log_prob - rollout_log_prob), cap)`` per token.

    Source: Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (TIS):
    the rollout engine samples from pi_rollout, which its kernels and dtype make differ from the trainer's pi_old;
    weighting each token's policy-gradient term by pi_old / pi_rollout, truncated at ``cap`` to bound the variance,
    corrects the policy gradient for that mismatch.

    Args:
        old_log_prob: float [B, T], the actor's log-probs of the sampled tokens before the update.
        rollout_log_prob: float [B, T], the engine's log-probs of the same tokens (``rollout_log_probs``).
        cap: C > 0 (``actor.tis_cap``; 2.0 in the paper).

    Returns:
        float32 [B, T] weights in (0, cap], without gradient (1 where both log-probs agree, e.g. padding).

    Raises:
        ValueError: ``cap <= 0`` or the shapes differ.
    """
    if not cap > 0:
        raise ValueError(f"`actor.tis_cap` must be > 0 (2.0 is usual), got {cap}.")
    _check_same_shape(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob)
    log_ratio = (old_log_prob.detach() - rollout_log_prob).float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio).clamp(max=cap)


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value (critic) loss.

    Source: the value clipping of the PPO reference implementation (OpenAI baselines ppo2; discussed in Engstrom
    et al. 2020, "Implementation Matters in Deep Policy Gradients", §3), as used by verl and OpenRLHF::

        vpred_clipped = values + clamp(vpreds - values, -c, c)
        loss = 0.5 * max((vpreds - returns)^2, (vpred_clipped - returns)^2)

    aggregated with `agg_loss`.

    Args:
        vpreds: float [B, T], the critic's current predictions (carries the gradient).
        values: float [B, T], the predictions recorded at rollout time.
        returns: float [B, T], targets (e.g. from `compute_gae_advantage_return`).
        response_mask: bool/int/float [B, T].
        cliprange_value: c >= 0 (``critic.cliprange_value``).
        loss_agg_mode: see `agg_loss`.

    Returns:
        ``(vf_loss, vf_clipfrac)``: 0-dim tensors; ``vf_loss`` differentiable, ``vf_clipfrac`` (fraction of response
        tokens where the clipped term is the larger) detached.

    Raises:
        ValueError: negative ``cliprange_value``, unknown ``loss_agg_mode`` or shapes differ.
    """
    if cliprange_value < 0:
        raise ValueError(f"`critic.cliprange_value` must be >= 0, got {cliprange_value}.")
    _check_same_shape(vpreds=vpreds, values=values, returns=returns, response_mask=response_mask)
    vpred_clipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    unclipped = (vpreds - returns).square()
    clipped = (vpred_clipped - returns).square()
    vf_loss = agg_loss(0.5 * torch.maximum(unclipped, clipped), response_mask, loss_agg_mode)
    with torch.no_grad():
        vf_clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac


# --------------------------------------------------------------------------------------------------------------------
# Logits helpers
# --------------------------------------------------------------------------------------------------------------------

_LOGPROB_CHUNK_ROWS = 1024


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits`` over the last dimension.

    ``-sum(exp(log_softmax(z)) * log_softmax(z))``: the log-softmax is one fused, shift-stable kernel, and a
    probability that underflows to 0 contributes ``0 * (finite log-prob) = 0``, so large logits give no NaN. Runs in
    ``logits``' dtype (callers wanting fp32 precision from bf16 logits upcast first).

    Args:
        logits: finite float [..., V], e.g. [B, T, V] or [N, V].

    Returns:
        Float tensor [...] (the last dimension removed), differentiable.
    """
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under the categorical distribution given by ``logits``.

    ``log_softmax(z)[y]``, over chunks of 1024 rows (`logprobs_and_entropy`).

    Args:
        logits: float [..., V].
        labels: integer tensor [...] with values in [0, V).

    Returns:
        float32 tensor [...] (fp64 for fp64 logits), differentiable with respect to ``logits``.

    Raises:
        ValueError: ``labels.shape`` is not ``logits.shape[:-1]``.
    """
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels of shape {list(labels.shape)} do not match logits of shape {list(logits.shape)}: "
            "labels must have the logits' shape without the last (vocabulary) dimension."
        )
    flat, _ = logprobs_and_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return flat.reshape(labels.shape)


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, calculate_entropy: bool = False, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each label and (optionally) the entropy, from one log-softmax per chunk of rows.

    Each chunk of 1024 rows is upcast to fp32 (16-bit logits: a log-sum-exp over a large vocabulary in 16 bits
    loses too much precision for PPO ratios) and goes through ``torch.log_softmax`` once; the label's entry is the
    log-prob and ``-sum(p * log p)`` the entropy (`entropy_from_logits`). Memory grows by one fp32 chunk at a time
    without grad; with grad, autograd keeps each chunk's log-softmax for backward.

    Args:
        logits: float [N, V].
        labels: integer [N] with values in [0, V).
        calculate_entropy: also return the entropy.
        entropy_grad: the entropy is differentiable (an entropy bonus); False: a metric, no graph kept for it.

    Returns:
        (log_probs [N], entropy [N] or None): float32 (fp64 for fp64 logits).
    """
    labels = labels.long()
    log_probs, entropies = [], []
    for z, y in zip(logits.split(_LOGPROB_CHUNK_ROWS), labels.split(_LOGPROB_CHUNK_ROWS), strict=True):
        log_p = torch.log_softmax(z.float() if z.dtype in (torch.float16, torch.bfloat16) else z, dim=-1)
        log_probs.append(log_p.gather(-1, y.unsqueeze(-1)).squeeze(-1))
        if calculate_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropies.append(-(log_p.exp() * log_p).sum(dim=-1))
    return torch.cat(log_probs), (torch.cat(entropies) if calculate_entropy else None)
