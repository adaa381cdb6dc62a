"""Rollout correction: the gap between the policy that sampled a batch (the rollout engine: its kernels and dtype,
and in the overlapped modes weights some updates old) and the policy being trained, verl's
``algorithm.rollout_correction`` keys.

- **Importance weights** (`rollout_is_weights`): truncated importance sampling of each token (or sequence) by
  pi_train / pi_rollout, optionally renormalised to mean 1 over the batch (`batch_normalized`).
- **Rejection sampling** (`rejection_mask`): tokens or whole responses whose divergence from the rollout policy
  leaves a bound (``rollout_rs``: ``token_k1``, ``seq_mean_k3``, ...; ``rollout_rs_threshold``) are dropped from
  the loss (their response-mask entries set to 0).
- **Two modes.** Decoupled (``bypass_mode: false``, three policies): pi_train is the actor's proximal policy
  ``old_log_probs``; the rejection mask replaces ``response_mask`` before the advantages (`decoupled_mask`, run by
  the controller's advantage stage) and the weights scale each token's PPO term in the update. Bypass
  (``bypass_mode: true``, two policies): no old_log_prob stage, the rollout's log-probs are the old ones; every
  micro-batch computes its weights and mask from the current policy (`bypass_policy_loss`), with PPO's clip
  (``loss_type: ppo_clip``, the ratio is the importance weight, so the weights are only reported) or REINFORCE
  with the weights explicit (``loss_type: reinforce``).

Sources: decoupled PPO (Hilton et al. 2022, eq. 3; AReaL, Fu et al. 2025, eq. 5); truncated IS (Yao, Liu et al.
2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"); the k1/k2/k3 divergence estimators
(Schulman 2020, "Approximating KL Divergence"); verl's semantics (``verl/trainer/ppo/rollout_corr_helper.py``):
k1 = -log(pi_train / pi_rollout) bounded in ratio space by ``lower_upper``, k2 = log_ratio^2 / 2 and
k3 = ratio - 1 - log_ratio bounded above; log-ratios clamped to +-20 before use.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.engine.torch_ops import LOG_RATIO_CLAMP, check_same_shape, masked_mean, masked_sum

REJECTION_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""The ``algorithm.rollout_correction.rollout_rs`` options (comma-separated for several, all must pass): the
divergence estimator k1, k2 or k3 of each token, or its sum, mean or max over each response."""


@dataclass(frozen=True)
class RejectionBound:
    """One rejection criterion: `option` (one of `REJECTION_OPTIONS`) keeps a token or response whose statistic is
    <= `upper` (and, for a k1 option, whose ratio-space statistic lies in [`lower`, `upper`], compared in log
    space); `lower` is None for k2 and k3."""

    option: str
    lower: float | None
    upper: float


@functools.lru_cache(maxsize=32)
def rejection_bounds(rollout_rs: str, threshold: str | float | None) -> tuple[RejectionBound, ...]:
    """Parse ``rollout_rs`` and ``rollout_rs_threshold`` as verl does (once per pair: bypass mode asks for every
    micro-batch): one threshold for every option or one per
    option, comma-separated; a k1 option takes ``lower_upper`` (ratio bounds, e.g. ``0.6_1.6``) or ``upper``
    alone (lower = 1 / upper); k2 and k3 take one positive upper bound.

    Raises:
        ValueError: an unknown option (lists them), no threshold, a count of thresholds other than 1 or the number
            of options, a bound that is not a positive number, ``lower_upper`` for a k2/k3 option; each names
            the ``algorithm.rollout_correction`` key to fix.
    """
    key = "algorithm.rollout_correction"
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    unknown = [o for o in options if o not in REJECTION_OPTIONS]
    if not options or unknown:
        raise ValueError(f"{key}.rollout_rs={rollout_rs!r}: unknown option {unknown}; choose from {REJECTION_OPTIONS}")
    if threshold is None or threshold == "":
        raise ValueError(f"{key}.rollout_rs={rollout_rs!r} needs {key}.rollout_rs_threshold (e.g. 0.5_2.0 for k1)")
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"{key}.rollout_rs_threshold={threshold!r}: give one threshold for all {len(options)} rollout_rs options "
            "or one per option, comma-separated"
        )
    specs = specs * len(options) if len(specs) == 1 else specs
    bounds = []
    for option, spec in zip(options, specs, strict=True):
        if not option.endswith("k1") and "_" in spec:
            raise ValueError(f"{key}.rollout_rs_threshold: {option} takes one upper bound, not {spec!r}")
        try:
            lower, upper = (float(x) for x in spec.split("_", 1)) if "_" in spec else (None, float(spec))
        except ValueError:
            raise ValueError(f"{key}.rollout_rs_threshold: {spec!r} for {option} is not a number") from None
        if option.endswith("k1") and lower is None:
            lower = 1.0 / upper if upper > 0 else upper
        if upper <= 0 or (lower is not None and lower <= 0):
            raise ValueError(f"{key}.rollout_rs_threshold: the bounds of {option} must be > 0, got {spec!r}")
        bounds.append(RejectionBound(option, lower, upper))
    return tuple(bounds)


def _statistic(option: str, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The per-token ([B, T]) or per-response ([B, 1]) statistic of a rejection option."""
    estimator = option[-2:]
    if estimator == "k1":
        token = -log_ratio
    elif estimator == "k2":
        token = 0.5 * log_ratio.square()
    else:
        token = torch.expm1(log_ratio) - log_ratio
    level = option.removesuffix("_" + estimator)
    if level == "token":
        return token
    if level == "seq_sum":
        return masked_sum(token, mask, dim=-1).unsqueeze(-1)
    if level == "seq_mean":
        return masked_mean(token, mask, dim=-1).unsqueeze(-1)
    highest = token.masked_fill(mask == 0, float("-inf")).amax(-1, keepdim=True)
    return torch.where(torch.isinf(highest), 0.0, highest)


def rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, bounds: tuple[RejectionBound, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The response mask with the tokens (token options) or responses (seq options) that fail any bound set to 0.

    Args:
        log_ratio: float [B, T], log pi_train - log pi_rollout of the sampled tokens.
        response_mask: [B, T], 1 on response tokens.
        bounds: `rejection_bounds`' criteria.

    Returns:
        (mask in `response_mask`'s dtype [B, T]; stats, 0-dim tensors: ``rollout_rs_<option>_mean`` (the
        statistic's mean over response tokens), ``rollout_rs_<option>_masked_fraction`` (of response tokens),
        ``rollout_rs_masked_fraction`` and ``rollout_rs_seq_masked_fraction`` (responses with a token dropped)).
    """
    check_same_shape(log_ratio=log_ratio, response_mask=response_mask)
    real = response_mask != 0
    log_ratio = torch.where(real, log_ratio.detach().float(), 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    keep = torch.ones_like(real)
    stats: dict[str, torch.Tensor] = {}
    for bound in bounds:
        value = _statistic(bound.option, log_ratio, response_mask).expand_as(log_ratio)
        if bound.lower is not None:  # k1: bounds in ratio space, compared in log space
            kept = (value >= math.log(bound.lower)) & (value <= math.log(bound.upper))
        else:
            kept = value <= bound.upper
        stats[f"rollout_rs_{bound.option}_mean"] = masked_mean(value, response_mask)
        stats[f"rollout_rs_{bound.option}_masked_fraction"] = masked_mean((~kept).float(), response_mask)
        keep &= kept
    stats["rollout_rs_masked_fraction"] = masked_mean((~keep).float(), response_mask)
    stats["rollout_rs_seq_masked_fraction"] = (real & ~keep).any(-1).float().mean()
    return (response_mask * keep).to(response_mask.dtype), stats


def rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance-sampling weights of the rollout's behaviour policy against the policy being trained
    (the proximal policy ``old_log_probs`` in decoupled mode, the current one in bypass mode), and their statistics
    (verl's ``rollout_corr/*``).

    Args:
        old_log_prob: float [B, T], the trained policy's log-probs of the sampled tokens (pi_train).
        rollout_log_prob: float [B, T], the engine's log-probs of the same tokens (``rollout_log_probs``, pi_behav).
        response_mask: [B, T], 1 on response tokens.
        level: ``"token"``: w_t = pi_train(y_t) / pi_behav(y_t); ``"sequence"``: every token of a response gets the
            product of its tokens' ratios (``algorithm.rollout_correction.rollout_is``).
        threshold: C > 0 (``algorithm.rollout_correction.rollout_is_threshold``; 2.0 usual).

    Returns:
        ``(weights, stats)``: weights float32 [B, T] = min(w, C), 0 off the response, without gradient; stats
        (0-dim tensors, over response tokens, the weights before truncation): ``rollout_is_mean``,
        ``rollout_is_ratio_fraction_high`` (w > C), ``rollout_is_ratio_fraction_low`` (w < 1/C),
        ``rollout_is_eff_sample_size`` (1 / E[(w' / E[w'])^2] with w' = w clamped to [1/C, C]: 1 when every weight
        is equal).

    Raises:
        ValueError: ``threshold <= 0``, an unknown `level`, or the shapes differ.
    """
    if not threshold > 0:
        raise ValueError(
            f"algorithm.rollout_correction.rollout_is_threshold must be > 0 (2.0 is usual), got {threshold}"
        )
    if level not in ("token", "sequence"):
        raise ValueError(f"algorithm.rollout_correction.rollout_is must be token or sequence, got {level!r}")
    check_same_shape(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    log_ratio = torch.where(response_mask != 0, (old_log_prob.detach() - rollout_log_prob).float(), 0.0)
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    raw = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    with torch.no_grad():
        clamped = raw.clamp(1.0 / threshold, threshold)
        spread = clamped / masked_mean(clamped, response_mask)
        stats = {
            "rollout_is_mean": masked_mean(raw, response_mask),
            "rollout_is_ratio_fraction_high": masked_mean((raw > threshold).float(), response_mask),
            "rollout_is_ratio_fraction_low": masked_mean((raw < 1.0 / threshold).float(), response_mask),
            "rollout_is_eff_sample_size": 1.0 / masked_mean(spread.square(), response_mask),
        }
    return (raw.clamp(max=threshold) * (response_mask != 0)).detach(), stats


def batch_mean_weight(
    weights: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    group: dist.ProcessGroup | None = None,
    local: bool = False,
) -> torch.Tensor:
    """The mean of truncated weights over a whole batch, split over the data-parallel ranks of `group` (an
    all-reduce of sums and counts when torch.distributed is up; every rank of `group` must call it), which
    ``rollout_is_batch_normalize`` divides the weights by (verl's ``distributed_masked_mean``).

    Args:
        weights: float [B, T] (`rollout_is_weights`), this rank's rows.
        response_mask: [B, T].
        level: ``token``: the mean over response tokens; ``sequence``: over responses (each response's weight,
            the mean over its tokens, counted once).
        local: the rows are the whole batch (the controller's): no all-reduce.

    Returns:
        0-dim float32 tensor; 1 when the batch has no response token (nothing to normalise).
    """
    if level == "token":
        total = torch.stack([masked_sum(weights, response_mask), (response_mask != 0).sum().float()])
    else:
        has_tokens = (response_mask != 0).any(-1)
        per_response = masked_mean(weights, response_mask, dim=-1)
        total = torch.stack([per_response[has_tokens].sum(), has_tokens.sum().float()])
    total = total.double()
    if dist.is_initialized() and not local:
        dist.all_reduce(total, group=group)
    mean = total[0] / total[1] if total[1] > 0 else total.new_tensor(1.0)
    return (mean if mean > 1e-8 else mean.new_tensor(1.0)).float()


def decoupled_mask(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, rollout_rs: str, threshold
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled mode's rejection sampling, once per batch before the advantages (the controller's advantage
    stage, as verl's driver): the response mask the advantages, the critic and the actor then use.

    Args:
        old_log_prob, rollout_log_prob: float [B, T], the actor's proximal and the engine's log-probs.
        response_mask: [B, T].
        rollout_rs, threshold: ``algorithm.rollout_correction.rollout_rs`` and ``rollout_rs_threshold``.

    Returns:
        (the new ``response_mask`` [B, T], ``rollout_corr/rollout_rs_*`` metrics as floats). Raises as
        `rejection_bounds`.
    """
    mask, stats = rejection_mask(
        old_log_prob - rollout_log_prob, response_mask, rejection_bounds(rollout_rs, threshold)
    )
    return mask, {f"rollout_corr/{k}": float(v) for k, v in stats.items()}


def decoupled_is_weights(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, correction
) -> torch.Tensor | None:
    """The batch's truncated weights in decoupled mode (``rollout_is`` set, not ``bypass_mode``), normalised to
    mean 1 over the batch with ``rollout_is_batch_normalize``: what verl's driver adds as ``rollout_is_weights``,
    for an estimator that reads them (the optimal token baseline); None otherwise. Float32 [B, T]."""
    if correction.rollout_is is None or correction.bypass_mode:
        return None
    level = correction.rollout_is
    weights, _ = rollout_is_weights(
        old_log_prob, rollout_log_prob, response_mask, level, correction.rollout_is_threshold
    )
    if correction.rollout_is_batch_normalize:
        weights = weights / batch_mean_weight(weights, response_mask, level, group=None, local=True)
    return weights


LOSS_DENOMINATORS = {
    "token-mean": "tokens",
    "seq-mean-token-sum": "sequences",
    "seq-mean-token-mean": "sequences",
    "token-sum": None,
    "seq-mean-token-sum-norm": None,
}
"""What each ``loss_agg_mode`` divides by (None: a constant), for `kept_loss_scale`."""


def kept_loss_scale(response_mask: torch.Tensor, kept_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """The factor that turns a loss aggregated over `kept_mask` (a micro-batch after bypass-mode rejection) into
    one with the denominator of `response_mask` (before it), as verl's global-batch aggregation has: rejected
    tokens add nothing, but still count in the mean's denominator (`training.micro_batch_weights` weighs the
    micro-batches by the original mask).

    Returns:
        0-dim float32: kept tokens / tokens (``token-mean``), kept responses / responses (the ``seq-mean`` modes),
        1 (``token-sum``, ``seq-mean-token-sum-norm``); 0 when nothing is kept.
    """
    unit = LOSS_DENOMINATORS[loss_agg_mode]
    if unit is None:
        return torch.tensor(1.0)
    if unit == "tokens":
        before, after = (response_mask != 0).sum(), (kept_mask != 0).sum()
    else:
        before, after = (response_mask != 0).any(-1).sum(), (kept_mask != 0).any(-1).sum()
    return (after.float() / before.float()) if before > 0 else torch.tensor(0.0)


def bypass_policy_loss(
    actor,
    correction,
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]:
    """Bypass mode's policy loss on one micro-batch (verl's ``compute_policy_loss_bypass_mode``): the rollout's
    log-probs are the old ones; the importance weights and the rejection mask come from the current policy against
    them, without gradient; then PPO's clip (``loss_type: ppo_clip``: the ratio to the rollout policy is the
    importance weight, so the weights are only reported) or `losses.reinforce_policy_loss` with the weights
    (``loss_type: reinforce``), over the kept tokens, rescaled by `kept_loss_scale` so rejected tokens still
    count in the denominator of ``loss_agg_mode``.

    Args:
        actor: the ``actor`` section (clip ratios, ``loss_agg_mode``).
        correction: ``algorithm.rollout_correction`` (``bypass_mode`` true).
        log_prob: float [b, T], the current policy's (carries the gradient).
        rollout_log_prob, advantages, response_mask: [b, T].
        group: the data-parallel group over which ``rollout_is_batch_normalize`` averages the weights (every rank
            of it calls this for each micro-batch).

    Returns:
        (``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)`` 0-dim tensors; ``rollout_is_*`` and
        ``rollout_rs_*`` stats, 0-dim tensors).
    """
    from hybridflow.engine.algorithms.losses import compute_policy_loss, reinforce_policy_loss

    stats: dict[str, torch.Tensor] = {}
    weights, kept = None, response_mask
    with torch.no_grad():
        if correction.rollout_is is not None:
            level, threshold = correction.rollout_is, correction.rollout_is_threshold
            weights, stats = rollout_is_weights(log_prob, rollout_log_prob, response_mask, level, threshold)
            if correction.rollout_is_batch_normalize:
                factor = batch_mean_weight(weights, response_mask, level, group)
                weights, stats["rollout_is_batch_norm_factor"] = weights / factor, factor
        if correction.rollout_rs is not None:
            bounds = rejection_bounds(correction.rollout_rs, correction.rollout_rs_threshold)
            kept, rejected = rejection_mask(log_prob - rollout_log_prob, response_mask, bounds)
            stats.update(rejected)
    mode = actor.loss_agg_mode
    if correction.loss_type == "reinforce":
        terms = reinforce_policy_loss(rollout_log_prob, log_prob, advantages, kept, mode, weights)
    else:
        clip = {"clip_ratio_low": actor.clip_ratio_low, "clip_ratio_high": actor.clip_ratio_high}
        terms = compute_policy_loss(
            rollout_log_prob, log_prob, advantages, kept, **clip, clip_ratio_c=actor.clip_ratio_c, loss_agg_mode=mode
        )
    scale = kept_loss_scale(response_mask, kept, mode).to(terms[0].dtype)
    return (terms[0] * scale, *terms[1:]), stats
