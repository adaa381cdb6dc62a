"""The advantage stage on a rollout batch: KL-in-reward (optional), then the configured estimator.

Small and controller-side in the HybridFlow design: it reads [B, T] tensors the other stages produced and adds
``token_level_rewards``, ``advantages`` and ``returns``. The estimators themselves live in `core_algos`.
"""

from __future__ import annotations

from hybridflow.engine.config import AlgorithmConfig
from hybridflow.engine.core_algos import KLController, apply_kl_penalty, get_adv_estimator_fn, get_kl_controller
from hybridflow.engine.guards import check_finite
from hybridflow.engine.protocol import DataProto


def build_kl_controller(algorithm: AlgorithmConfig) -> KLController:
    """The in-reward KL coefficient controller from ``algorithm.kl_ctrl`` (fixed or adaptive)."""
    ctrl = algorithm.kl_ctrl
    return get_kl_controller(ctrl.type, ctrl.kl_coef, target_kl=ctrl.target_kl, horizon=ctrl.horizon)


def compute_advantage(
    data: DataProto, algorithm: AlgorithmConfig, kl_ctrl: KLController | None = None
) -> tuple[DataProto, dict[str, float]]:
    """Rewards, advantages and returns for a scored rollout batch.

    Args:
        data: needs ``token_level_scores`` float32 [B, T] and ``response_mask`` [B, T]; ``uid`` (non-tensor) for
            group estimators (grpo, rloo); ``values`` [B, T] for gae; ``old_log_probs`` and ``ref_log_prob``
            [B, T] when ``algorithm.use_kl_in_reward``.
        algorithm: the ``algorithm`` config section.
        kl_ctrl: the controller for ``use_kl_in_reward`` (updated in place with this batch's KL).

    Returns:
        (DataProto with ``token_level_rewards``, ``advantages``, ``returns`` float32 [B, T]; metrics).

    Raises:
        ValueError: if ``use_kl_in_reward`` is set without a controller.
        NonFiniteError: a reward, advantage or return on a response token is NaN or ±inf (names the first sample).
    """
    batch = data.batch
    mask = batch["response_mask"]
    metrics: dict[str, float] = {}
    rewards = batch["token_level_scores"]
    if algorithm.use_kl_in_reward:
        if kl_ctrl is None:
            raise ValueError("algorithm.use_kl_in_reward needs a KL controller (build_kl_controller)")
        rewards, metrics = apply_kl_penalty(
            rewards, batch["old_log_probs"], batch["ref_log_prob"], mask, kl_ctrl, algorithm.kl_penalty
        )
    estimator = get_adv_estimator_fn(algorithm.adv_estimator)
    advantages, returns = estimator(
        rewards,
        mask,
        index=data.non_tensor_batch.get("uid"),
        values=batch.get("values", None),
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
    )
    uids = data.non_tensor_batch.get("uid")
    for name, tensor in (("token_level_rewards", rewards), ("advantages", advantages), ("returns", returns)):
        check_finite(
            tensor, stage="adv", metric=name, mask=mask, describe=None if uids is None else lambda i: f"uid {uids[i]}"
        )
    out = DataProto.from_dict({"token_level_rewards": rewards, "advantages": advantages, "returns": returns})
    return out, metrics
