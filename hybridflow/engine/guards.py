"""Numerical guards: a NaN or an infinity in a reward, an advantage, a loss or a gradient norm stops the iteration
before any optimizer step, with an error that names where it came from.

A non-finite value never heals: stepping the optimizer with it turns the weights (and Adam's moments) into NaN,
and every later iteration is lost. So the check runs where the value is made (the reward manager, the advantage
stage, the optimizer step), raising `NonFiniteError` before anything is written; the run is recorded ``failed``
and its last checkpoint is untouched, so ``hf resume RUN_ID`` continues once the cause is fixed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FIX = "fix the cause, then `hf resume RUN_ID` continues from the last checkpoint (nothing was stepped)"


class NonFiniteError(ValueError):
    """A NaN or ±inf was produced in a stage of an iteration. The message names the stage (``reward``, ``adv``,
    ``update_actor``, ``update_critic``), the metric, how many values are bad and the first offending sample; the
    iteration stopped before any optimizer step, so the run resumes from its last checkpoint once the cause (a reward
    function, a learning rate, a dtype, bad data) is fixed."""


def check_finite(
    values: torch.Tensor,
    *,
    stage: str,
    metric: str,
    mask: torch.Tensor | None = None,
    describe: Callable[[int], str] | None = None,
) -> None:
    """Raise `NonFiniteError` if any element of `values` where `mask` is set is NaN or ±inf.

    Args:
        values: float tensor [B, ...] (or a 0-d tensor for a scalar such as a grad norm).
        stage: the iteration stage, e.g. ``adv``.
        metric: the quantity, e.g. ``advantages`` or ``actor/grad_norm``.
        mask: bool/int tensor of the same shape as `values` (1 = counts), e.g. ``response_mask``; None: all count.
        describe: row index -> what identifies that sample (data source, uid, the start of the response), for the
            message.

    Raises:
        NonFiniteError: naming the stage, the metric, the number of bad values and the first bad row.
    """
    bad = ~torch.isfinite(values.detach())
    if mask is not None:
        bad &= mask.bool()
    if not bool(bad.any()):
        return
    count = int(bad.sum())
    if values.dim() == 0:
        raise NonFiniteError(f"{stage}: {metric} is {float(values)}; {FIX}")
    row = int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0])
    first = values[row][bad[row]].flatten()[0].item()
    about = f" ({describe(row)})" if describe is not None else ""
    raise NonFiniteError(
        f"{stage}: {count} non-finite value(s) of {metric}; the first in sample {row}{about} is {first}; {FIX}"
    )
