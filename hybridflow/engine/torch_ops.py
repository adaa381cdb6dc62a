"""Tensor operations under every stage: masked statistics over response tokens and log-probabilities / entropy
from logits. Pure torch, importing nothing of HybridFlow: the bottom of the engine.

- masked statistics: `masked_sum`, `masked_mean`, `masked_var`, `masked_whiten`, and `check_same_shape`;
- `agg_loss`: how a [B, T] loss matrix becomes a scalar (``actor.loss_agg_mode``);
- `entropy_from_logits`, `logprobs_from_logits` and `logprobs_and_entropy` (both from one log-softmax).

Conventions. B is the number of sequences in the batch and T the padded response length in tokens. A mask is a
[B, T] tensor (bool, int or float) with 1 for real response tokens and 0 for padding; responses are right-padded,
so a row of the mask is ones followed by zeros. Positions where the mask is 0 never influence a result: they are
replaced by 0 before any arithmetic, so even NaN or inf there is harmless. Names follow verl, so that the config
keys (``actor.loss_agg_mode``, ``algorithm.kl_penalty``, ...) mean what verl users expect.
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8
"""Added to the variance in `masked_whiten` before the square root."""

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-20, 20] before `exp` (exp(20) is about 4.9e8), so the ratio never overflows."""

# --------------------------------------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------------------------------------


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming every shape when the given tensors do not all have the same shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"Shape mismatch: {listed}. These tensors must all have the same shape (usually [B, T]).")


def masked_values(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    kept, _ = masked_values(values, mask)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def last_positions(mask: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the index of the last nonzero entry of each row of `mask` [B, T] (0 for an all-zero row).

    The last response token of a row whose mask has gaps (an agent trajectory: tool tokens are 0 between the model's
    turns) is not ``mask.sum(-1) - 1``; this is.
    """
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask != 0, positions, 0).amax(dim=-1)


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
    kept, weights = masked_values(values, mask)
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
    _, weights = masked_values(values, mask)
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
    check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
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


@torch.no_grad()
def top_k_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` likeliest tokens of each row's softmax and their log-probs, in fp32 chunks of rows as
    `logprobs_and_entropy` (no gradient: the distillation teacher's support, ``teacher.top_k``).

    Args:
        logits: float [N, V].
        k: tokens per row, 1 <= k <= V.

    Returns:
        (ids int64 [N, k], log_probs float32 [N, k]), likeliest first.
    """
    ids, values = [], []
    for z in logits.split(_LOGPROB_CHUNK_ROWS):
        top = torch.log_softmax(_fp32(z), dim=-1).topk(k, dim=-1)
        ids.append(top.indices)
        values.append(top.values)
    return torch.cat(ids), torch.cat(values)


def log_probs_at(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log_softmax(z)[ids]`` of each row at its own `k` token ids, differentiable, without keeping a [N, V]
    log-softmax for backward: ``z[ids] - logsumexp(z)`` in fp32 chunks of rows.

    Args:
        logits: float [N, V].
        ids: integer [N, k] with values in [0, V).

    Returns:
        float32 [N, k] (fp64 for fp64 logits).
    """
    parts = []
    for z, at in zip(logits.split(_LOGPROB_CHUNK_ROWS), ids.long().split(_LOGPROB_CHUNK_ROWS), strict=True):
        z = _fp32(z)
        parts.append(z.gather(-1, at) - torch.logsumexp(z, dim=-1, keepdim=True))
    return torch.cat(parts)


def sum_pi_squared(logits: torch.Tensor) -> torch.Tensor:
    """sum_v pi(v)^2 of each row's softmax, exp(logsumexp(2 z) - 2 logsumexp(z)), in fp32 chunks of rows as
    `logprobs_and_entropy` (verl's ``calculate_sum_pi_squared_from_logits``; the optimal token baseline's
    ||s||^2 = 1 - 2 pi(y) + sum pi^2).

    Args:
        logits: float [N, V].

    Returns:
        float32 [N] (fp64 for fp64 logits), in (0, 1].
    """
    parts = []
    for z in logits.split(_LOGPROB_CHUNK_ROWS):
        z = _fp32(z)
        parts.append(torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1)))
    return torch.cat(parts)


def _fp32(z: torch.Tensor) -> torch.Tensor:
    """16-bit logits upcast to fp32 (a log-sum-exp over a large vocabulary in 16 bits loses too much); others as
    they are."""
    return z.float() if z.dtype in (torch.float16, torch.bfloat16) else z


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
        log_p = torch.log_softmax(_fp32(z), dim=-1)
        log_probs.append(log_p.gather(-1, y.unsqueeze(-1)).squeeze(-1))
        if calculate_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropies.append(-(log_p.exp() * log_p).sum(dim=-1))
    return torch.cat(log_probs), (torch.cat(entropies) if calculate_entropy else None)
