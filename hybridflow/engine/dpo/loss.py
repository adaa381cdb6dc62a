"""The DPO family of preference losses, on the summed (or, for IPO, per-token mean) log-probabilities of each
pair's responses under the policy and the frozen reference.

With h = (log pi(y_w|x) - log pi(y_l|x)) - (log ref(y_w|x) - log ref(y_l|x)) for a pair of chosen y_w and rejected
y_l:

- ``sigmoid`` (DPO, Rafailov et al. 2023, "Direct Preference Optimization", eq. 7; with label smoothing eps, the
  conservative DPO of Mitchell 2023): ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``;
- ``ipo`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences", eq. 17):
  ``(h - 1 / (2 beta))^2``, where TRL feeds each response's per-token mean log-probability instead of its sum (so
  do we: `sequence_log_probs` returns both).

The implicit rewards are TRL's: ``rewards/chosen = beta (log pi(y_w|x) - log ref(y_w|x))``, ``rewards/rejected``
likewise, ``rewards/margins`` their difference, ``rewards/accuracies`` the share of pairs whose chosen reward is
higher (strictly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PreferenceLoss:
    """Per-pair results, each float32 [N]: the loss (differentiable through the policy's log-probs) and the
    implicit rewards (detached)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> PreferenceLoss:
    """The loss of each pair (module docstring) from its responses' log-probabilities, float [N] each (sums over
    the response tokens; per-token means for ``ipo``).

    Raises:
        ValueError: an unknown `loss_type` (``dpo.loss_type``: sigmoid or ipo).
    """
    pc, pr, rc, rr = (t.float() for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected))
    h = (pc - pr) - (rc - rr)
    if loss_type == "sigmoid":
        logsig = torch.nn.functional.logsigmoid
        losses = -(1 - label_smoothing) * logsig(beta * h) - label_smoothing * logsig(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo.loss_type={loss_type!r} is not a loss here: sigmoid (DPO) or ipo")
    return PreferenceLoss(losses, (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach())


def reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """TRL's reward metrics of pairs, float [N] implicit rewards in: ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/margins`` (means) and ``rewards/accuracies`` (the share with chosen > rejected)."""
    chosen, rejected = chosen.double(), rejected.double()
    return {
        "rewards/chosen": float(chosen.mean()),
        "rewards/rejected": float(rejected.mean()),
        "rewards/margins": float((chosen - rejected).mean()),
        "rewards/accuracies": float((chosen > rejected).double().mean()),
    }


def sequence_log_probs(token_log_probs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response's summed and per-token mean log-probability, float32 [N] each, from the log-probability of
    every token given those before it, float [N, L] (position t: token t; position 0 holds nothing), and the
    response mask int [N, L] (1 on the response's tokens)."""
    mask = loss_mask[:, 1:].float()
    summed = (token_log_probs[:, 1:].float() * mask).sum(-1)
    return summed, summed / mask.sum(-1).clamp(min=1.0)
