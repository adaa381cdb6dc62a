"""The KL machinery: per-token estimators (`kl_penalty`), fixed and adaptive coefficient controllers, and
`apply_kl_penalty`, which folds the KL to the reference policy into the token-level rewards.

Conventions. B is the number of sequences in the batch and T the padded response length in tokens. A mask is a
[B, T] tensor (bool, int or float) with 1 for real response tokens and 0 for padding; responses are right-padded,
so a row of the mask is ones followed by zeros. Positions where the mask is 0 never influence a result: they are
replaced by 0 before any arithmetic, so even NaN or inf there is harmless. Names follow verl, so that the config
keys (``actor.loss_agg_mode``, ``algorithm.kl_penalty``, ...) mean what verl users expect.
"""

from __future__ import annotations

import torch

from hybridflow.engine.torch_ops import LOG_RATIO_CLAMP, agg_loss, check_same_shape, masked_values

# --------------------------------------------------------------------------------------------------------------------
# KL: per-token estimators, coefficient controllers, reward penalty
# --------------------------------------------------------------------------------------------------------------------

KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+")
"""Names accepted by `kl_penalty` (aliases: k1 = kl, k2 = mse, k3 = low_var_kl; a trailing ``+``: the same value
with k2's gradient, straight through)."""

K3_CLAMP = 10.0
"""`kl_penalty` clamps the k3 estimate to [-10, 10] (in practice [0, 10], since k3 >= 0)."""


def _kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    check_same_shape(log_prob=log_prob, ref_log_prob=ref_log_prob)
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
    check_same_shape(
        token_level_scores=token_level_scores,
        log_prob=log_prob,
        ref_log_prob=ref_log_prob,
        response_mask=response_mask,
    )
    kl, _ = masked_values(_kl_estimate(log_prob, ref_log_prob, kl_penalty), response_mask)
    beta = float(kl_ctrl.value)
    token_level_rewards = token_level_scores - beta * kl.to(token_level_scores.dtype)
    current_kl = float(agg_loss(kl, response_mask, "seq-mean-token-mean"))
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
