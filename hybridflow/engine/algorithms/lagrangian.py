"""Safe-RLHF's Lagrangian: the multiplier of the cost constraint (`LagrangeMultiplier`) and the advantage it weighs
(`lagrangian_advantages`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.engine.torch_ops import check_same_shape


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
    check_same_shape(reward_advantages=reward_advantages, cost_advantages=cost_advantages)
    if multiplier < 0:
        raise ValueError(f"the Lagrange multiplier must be >= 0, got {multiplier}")
    return (reward_advantages - multiplier * cost_advantages) / (1.0 + multiplier)
