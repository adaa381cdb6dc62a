"""Losses: `agg_loss` (how a [B, T] loss matrix becomes a scalar), policy losses in a registry keyed by
``actor.policy_loss.loss_mode`` (``"vanilla"``: `compute_policy_loss`, PPO clip with clip-higher and dual-clip;
``"gspo"``, ``"cispo"``, ``"gpg"``, ``"geo_mean"`` (GMPO), ``"clip_cov"``, ``"kl_cov"``), `reinforce_policy_loss`
(the rollout correction's bypass mode, `hybridflow.engine.algorithms.rollout_correction`) and `compute_value_loss`
(clipped critic loss).

Conventions. B is the number of sequences in the batch and T the padded response length in tokens. A mask is a
[B, T] tensor (bool, int or float) with 1 for real response tokens and 0 for padding; responses are right-padded,
so a row of the mask is ones followed by zeros. Positions where the mask is 0 never influence a result: they are
replaced by 0 before any arithmetic, so even NaN or inf there is harmless. Names follow verl, so that the config
keys (``actor.loss_agg_mode``, ``algorithm.kl_penalty``, ...) mean what verl users expect.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.engine.torch_ops import LOG_RATIO_CLAMP, agg_loss, check_same_shape, masked_mean, masked_sum

# --------------------------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------------------------

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
        check_same_shape(is_weights=is_weights, pg_losses=pg_losses)
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

    then multiplied by `is_weights` when given (see `rollout_is_weights`) and aggregated with `agg_loss`.

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
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
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
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
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
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
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


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
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
    """GPG: the plain policy gradient, no ratio and no clip, ``loss = -A * log_prob`` aggregated with `agg_loss`.

    Source: Chu et al. 2025, "GPG" (arXiv 2504.02546), eq. 5 (verl's ``gpg`` loss); its advantages are the
    ``gpg`` estimator's (`hybridflow.engine.algorithms.estimators.compute_gpg_outcome_advantage`). The clip ratios
    are unused; ``ppo_kl`` is reported as for every loss.

    Args:
        old_log_prob, log_prob, advantages, response_mask: float [B, T] (``log_prob`` carries the gradient).
        is_weights: optional float [B, T] per-token weights without gradient.

    Returns:
        ``(pg_loss, 0, ppo_kl, 0)``, 0-dim tensors.

    Raises:
        ValueError: unknown ``loss_agg_mode`` or shapes differ.
    """
    del clip_ratio_low, clip_ratio_high, clip_ratio_c
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    pg_loss = _aggregate_policy_loss(-advantages * log_prob, response_mask, loss_agg_mode, is_weights)
    with torch.no_grad():
        ppo_kl = masked_mean(old_log_prob - log_prob, response_mask)
    zero = torch.zeros_like(ppo_kl)
    return pg_loss, zero, ppo_kl, zero


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.4,
    clip_ratio_high: float = 0.4,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GMPO: the geometric mean of the tokens' clipped importance ratios times the sequence's advantage.

    Source: Zhao et al. 2025, "Geometric-Mean Policy Optimization" (arXiv 2507.20673), eq. 4, as verl computes it
    (``compute_policy_loss_geo_mean``): with ``l_t = log_prob_t - old_log_prob_t`` and s = sign(A_t),
    each token's log-ratio is clipped in log space, pessimistically for its advantage's sign::

        c_t = s * min(s * l_t, s * clamp(l_t, -clip_ratio_low, clip_ratio_high))
        loss_i = -mean_t(A_t) * exp(mean_t c_t)                         over response i's tokens
        pg_loss = mean_i loss_i

    The loss is a mean over sequences whatever `loss_agg_mode` (the actor combines its micro-batches as
    ``seq-mean-token-mean``: `update_agg_mode`). `is_weights` enter as their per-sequence geometric mean. No dual
    clip (`clip_ratio_c` unused).

    Args:
        old_log_prob, log_prob, advantages, response_mask: float [B, T] (``log_prob`` carries the gradient).
        is_weights: optional float [B, T] per-token weights without gradient.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: the clip fractions count the tokens whose log-ratio
        left [-clip_ratio_low, clip_ratio_high] with a positive / negative advantage; 0-dim tensors.

    Raises:
        ValueError: a negative clip ratio or shapes differ.
    """
    del clip_ratio_c, loss_agg_mode
    _check_clip_ratios(clip_ratio_low, clip_ratio_high)
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    mask = (response_mask != 0).to(log_prob.dtype)
    log_ratio = torch.where(mask > 0, log_prob - old_log_prob, 0.0)
    sign = torch.sign(advantages)
    clamped = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    clipped = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(-1).clamp(min=1)
    ratio = torch.exp((clipped * mask).sum(-1) / lengths)
    advantage = (torch.where(mask > 0, advantages, 0.0)).sum(-1) / lengths
    seq_losses = -advantage * ratio
    if is_weights is not None:
        check_same_shape(is_weights=is_weights, log_prob=log_prob)
        log_weights = torch.log(is_weights.detach().clamp(min=1e-10)) * mask
        seq_losses = seq_losses * torch.exp(log_weights.sum(-1) / lengths)
    pg_loss = seq_losses.mean()
    with torch.no_grad():
        out = (log_ratio != clamped).float()
        pg_clipfrac = masked_mean(out * (advantages > 0), response_mask)
        pg_clipfrac_lower = masked_mean(out * (advantages < 0), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    is_weights: torch.Tensor | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SAPO: a smooth gate of the importance ratio in place of PPO's clip.

    Source: Gao et al. 2025, "Soft Adaptive Policy Optimization" (arXiv 2511.20347), as verl computes it
    (``core_algos.py::compute_policy_loss_sapo``): with ``r_t = exp(clamp(log_prob_t - old_log_prob_t, -20, 20))``
    and tau_t = `tau_pos` where A_t > 0, else `tau_neg`::

        f_t = sigmoid(tau_t (r_t - 1)) * 4 / tau_t          (df/dr = 1 at r = 1: the policy gradient there)
        loss_t = -f_t * A_t (x is_weights_t)

    aggregated by sequences (``seq-mean-token-mean``) whatever `loss_agg_mode`, as verl does (`update_agg_mode`).
    Far from r = 1 the gate's gradient fades instead of stopping at a clip edge; a larger tau fades it faster
    (verl's default tau_neg > tau_pos damps negative-advantage tokens sooner). The clip ratios are unused.

    Args:
        old_log_prob, log_prob, advantages, response_mask: float [B, T] (``log_prob`` carries the gradient).
        is_weights: optional float [B, T] per-token weights without gradient.
        tau_pos, tau_neg: ``actor.policy_loss.tau_pos`` / ``tau_neg`` (> 0).

    Returns:
        ``(pg_loss, 0, ppo_kl, 0)``, 0-dim tensors (no clip to count, as verl reports).

    Raises:
        ValueError: shapes differ.
    """
    del clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(log_prob.dtype)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    pg_loss = _aggregate_policy_loss(-gate * advantages, response_mask, "seq-mean-token-mean", is_weights)
    with torch.no_grad():
        ppo_kl = masked_mean(-log_ratio, response_mask)
    zero = torch.zeros_like(ppo_kl)
    return pg_loss, zero, ppo_kl, zero


SEQUENCE_MEAN_LOSSES = frozenset({"geo_mean", "sapo"})
"""Policy losses that are a mean over sequences whatever ``actor.loss_agg_mode`` (`update_agg_mode`)."""


def update_agg_mode(loss_agg_mode: str, loss_mode: str | None) -> str:
    """How an update combines its micro-batches' losses: ``seq-mean-token-mean`` (by sequences) for a policy loss
    in `SEQUENCE_MEAN_LOSSES`, else `loss_agg_mode`."""
    return "seq-mean-token-mean" if loss_mode in SEQUENCE_MEAN_LOSSES else loss_agg_mode


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
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
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
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
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


def reinforce_policy_loss(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """REINFORCE with explicit importance weights, bypass mode's ``algorithm.rollout_correction.loss_type:
    reinforce`` (verl's ``compute_policy_loss_reinforce``): each token's loss is ``-w * A * log pi(y_t)``, w the
    truncated weight pi / pi_rollout without gradient (1 without `is_weights`), so the gradient is
    ``-w * A * grad log pi``, the importance-sampled policy gradient (Williams 1992; Yao, Liu et al. 2025). No
    clipping.

    Args:
        rollout_log_prob: float [B, T], the rollout engine's log-probs (only for ``ppo_kl``).
        log_prob: float [B, T], the current policy's (carries the gradient).
        advantages, response_mask: [B, T].
        loss_agg_mode: see `agg_loss`.
        is_weights: optional float [B, T] (`rollout_correction.rollout_is_weights`).

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: ``ppo_kl`` the masked mean of ``rollout_log_prob -
        log_prob``; both clip fractions 0; 0-dim tensors.
    """
    check_same_shape(rollout_log_prob=rollout_log_prob, log_prob=log_prob, advantages=advantages, mask=response_mask)
    pg_loss = _aggregate_policy_loss(-advantages * log_prob, response_mask, loss_agg_mode, is_weights)
    with torch.no_grad():
        ppo_kl = masked_mean(rollout_log_prob - log_prob, response_mask)
    zero = torch.zeros_like(ppo_kl)
    return pg_loss, zero, ppo_kl, zero


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
    check_same_shape(vpreds=vpreds, values=values, returns=returns, response_mask=response_mask)
    vpred_clipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    unclipped = (vpreds - returns).square()
    clipped = (vpred_clipped - returns).square()
    vf_loss = agg_loss(0.5 * torch.maximum(unclipped, clipped), response_mask, loss_agg_mode)
    with torch.no_grad():
        vf_clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac
