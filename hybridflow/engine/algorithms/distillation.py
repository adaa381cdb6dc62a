"""On-policy distillation: the student (the actor) samples, a frozen teacher scores each sampled token, and the
student is trained on the per-token reverse KL, KL(student || teacher), estimated on its own tokens (Agarwal et al.
2024, "On-Policy Distillation of Language Models" (GKD), eq. 2 with lambda = 1 and the reverse KL; Lu and Thinking
Machines 2025, "On-Policy Distillation": the negative per-token reverse KL as each token's advantage).

The two ways the KL trains (``teacher.use_as``):

- `distilled_advantages` (``reward``): each response token's advantage becomes
  ``task_coef * A_t - kl_coef * (log pi_old(y_t) - log pi_teacher(y_t))``: the k1 estimate of the reverse KL of the
  token the student sampled, as a dense reward of that token only (no discounting across tokens, no normalisation),
  added after the estimator's advantages as slime's ``--use-opd`` and Tinker's cookbook add it. Its policy-gradient
  expectation is the gradient of the sequence's reverse KL (GKD, section 3).
- `distillation_loss` (``loss``): ``kl_coef`` x the ``kl_loss_type`` estimate of the per-token KL to the teacher,
  aggregated as the policy loss is, with the gradient of the student's log-probs: the way ``actor.use_kl_loss`` keeps
  the actor near ref, pointed at the teacher. On the student's own samples the gradient of k2,
  ``(log p - log q)^2 / 2``, is in expectation the reverse KL's, hence the default; k3's (``low_var_kl``) is the
  forward KL(teacher || student)'s (Tang and Munos 2025, "On a few pitfalls in KL divergence gradient estimation
  for RL", section 4).

With ``teacher.top_k`` = k > 0 the loss is instead the reverse KL itself at each position, computed exactly over
the teacher's k likeliest tokens and one bucket for the rest of the vocabulary (`top_k_reverse_kl`): no sampling
noise, and the gradient reaches k + 1 logits per position instead of one.

Shapes: B sequences, T padded response tokens, k support tokens; masks [B, T], 1 on real response tokens.
"""

from __future__ import annotations

import torch

from hybridflow.engine.algorithms.kl import kl_penalty
from hybridflow.engine.torch_ops import agg_loss, check_same_shape, masked_mean, masked_values


def reverse_kl_tokens(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k1 estimate of each sampled token's reverse KL: ``log pi_student(y_t) - log pi_teacher(y_t)``, float32
    [B, T], 0 off the mask. Its mean over the student's own samples is KL(student || teacher) per token."""
    check_same_shape(log_probs=log_probs, teacher_log_probs=teacher_log_probs, mask=mask)
    return masked_values(log_probs.float() - teacher_log_probs.float(), mask)[0]


def distilled_advantages(
    advantages: torch.Tensor,
    log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    task_coef: float,
    kl_clamp: float | None = None,
) -> torch.Tensor:
    """``task_coef * advantages - kl_coef * reverse_kl_tokens(...)``, float32 [B, T], 0 off the mask (the dense
    reward of ``teacher.use_as: reward``); with `kl_clamp` = c each token's KL clamped to [-c, c] first (verl's
    ``distillation.distillation_loss.loss_max_clamp``, ``verl/trainer/distillation/losses.py``).

    Args:
        advantages: float [B, T], the advantage estimator's (of the task reward).
        log_probs: float [B, T], the student's log-probs of its sampled tokens under the policy that sampled them
            (the old_log_prob stage's ``old_log_probs``; in bypass mode the rollout engine's).
        teacher_log_probs: float [B, T], the teacher's of the same tokens (``teacher_log_prob``).
        mask: [B, T], 1 on response tokens.
        kl_coef, task_coef: ``teacher.kl_coef``, ``teacher.task_coef``.
    """
    kl = clamped(reverse_kl_tokens(log_probs, teacher_log_probs, mask), kl_clamp)
    return masked_values(task_coef * advantages.float() - kl_coef * kl, mask)[0]


def clamped(kl: torch.Tensor, bound: float | None) -> torch.Tensor:
    """`kl` [B, T] clamped to [-bound, bound] (no gradient where clamped); None: as it is (``teacher.kl_clamp``)."""
    return kl if bound is None else kl.clamp(-bound, bound)


def distillation_loss(
    log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor,
    mask: torch.Tensor,
    kl_loss_type: str,
    loss_agg_mode: str,
    kl_clamp: float | None = None,
) -> torch.Tensor:
    """The per-token KL to the teacher as a loss (``teacher.use_as: loss``): `kl_penalty` of the student's
    log-probs `log_prob` [B, T] (carrying the gradient) against the teacher's [B, T], estimator `kl_loss_type`
    (``teacher.kl_loss_type``), each token's clamped to [-kl_clamp, kl_clamp] when given (`clamped`), reduced by
    `agg_loss` with ``actor.loss_agg_mode``. Returns a 0-dim tensor; the caller weighs it by ``teacher.kl_coef``."""
    return agg_loss(clamped(kl_penalty(log_prob, teacher_log_prob, kl_loss_type), kl_clamp), mask, loss_agg_mode)


def distillation_metrics(
    log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """``distill/reverse_kl``: the mean k1 reverse KL per response token (nats; the student's samples);
    ``distill/teacher_log_prob``: the teacher's mean log-prob of the student's tokens (higher: the teacher would
    have said it too); ``distill/seq_reverse_kl``: the mean over sequences of their summed per-token KL (nats)."""
    kl = reverse_kl_tokens(log_probs, teacher_log_probs, mask)
    return {
        "distill/reverse_kl": float(masked_mean(kl, mask)),
        "distill/teacher_log_prob": float(masked_mean(teacher_log_probs.float(), mask)),
        "distill/seq_reverse_kl": float(kl.sum(-1).mean()),
    }


def _log_rest(log_probs: torch.Tensor) -> torch.Tensor:
    """log(1 - sum_k p_k) of [..., k] log-probs: the log-probability of every token outside the k, float32 [..., 1]
    (its probability floored at 1e-30: a support that holds all the mass leaves an empty bucket, 0 in the KL)."""
    inside = torch.logsumexp(log_probs.float(), dim=-1, keepdim=True).clamp(max=0.0)
    return torch.log((-torch.expm1(inside)).clamp(min=1e-30))


def top_k_reverse_kl(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) at each position over the teacher's top-k tokens and one bucket for the rest:
    ``sum_{v in S} p(v) (log p(v) - log q(v)) + p(R) (log p(R) - log q(R))``, with R the tokens outside S and
    p(R) = 1 - sum_S p. The KL of the two distributions merged onto these k + 1 outcomes, so it is >= 0, at most the
    full-vocabulary KL (merging outcomes never raises a KL: the data-processing inequality), equal to it when S holds
    all the mass, and the student's mass on tokens the teacher leaves out is paid for in R (a KL over S alone, or
    renormalised on S, would not see it).

    Args:
        log_probs: float [B, T, k], the student's log-probs of the teacher's support tokens (differentiable: the
            actor's forward, `hybridflow.engine.models.response_token_stats` with ``support``).
        teacher_log_probs: float [B, T, k], the teacher's (``teacher_top_k_log_probs``).
        mask: [B, T], 1 on response tokens.

    Returns:
        float32 [B, T] in nats, 0 off the mask.
    """
    check_same_shape(log_probs=log_probs, teacher_log_probs=teacher_log_probs)
    check_same_shape(log_probs=log_probs[..., 0], mask=mask)
    p = torch.cat([log_probs.float(), _log_rest(log_probs)], dim=-1)
    q = torch.cat([teacher_log_probs.float(), _log_rest(teacher_log_probs)], dim=-1)
    return masked_values((p.exp() * (p - q)).sum(-1), mask)[0]


def top_k_forward_kl(
    log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor, floor: float | None = None
) -> torch.Tensor:
    """verl's ``forward_kl_topk``: at each position ``max(0, sum_{v in S} q(v) (log q(v) - log p(v)))``, S the
    teacher's top-k tokens, q the teacher, p the student, both log-probs floored at `floor` first when given
    (``verl/trainer/distillation/fsdp/losses.py::compute_forward_kl_topk`` with ``log_prob_min_clamp``, and the
    floor at 0 of ``losses.py::compute_forward_kl_topk``). The forward KL(teacher || student) restricted to S: a
    mode-covering pull toward every token the teacher rates, unlike the reverse KL's mode seeking; the mass outside S
    is not counted, so the sum can dip below 0, hence the floor (`top_k_reverse_kl` keeps a bucket for it instead).

    Args:
        log_probs: float [B, T, k], the student's log-probs of the teacher's support tokens (differentiable).
        teacher_log_probs: float [B, T, k], the teacher's (``teacher_top_k_log_probs``).
        mask: [B, T], 1 on response tokens.
        floor: ``teacher.log_prob_floor`` (verl's ``log_prob_min_clamp``), or None.

    Returns:
        float32 [B, T] in nats, >= 0, 0 off the mask.
    """
    check_same_shape(log_probs=log_probs, teacher_log_probs=teacher_log_probs)
    check_same_shape(log_probs=log_probs[..., 0], mask=mask)
    p, q = log_probs.float(), teacher_log_probs.float()
    if floor is not None:
        p, q = p.clamp(min=floor), q.clamp(min=floor)
    return masked_values((q.exp() * (q - p)).sum(-1).clamp(min=0.0), mask)[0]
