"""PF-PPO, policy filtration for PPO (Shen et al. 2024, "Policy Filtration in RLHF to Fine-Tune LLM for Code
Generation", arXiv 2409.06957; verl's ``algorithm.use_pf_ppo``): after the advantages, the batch the update trains on
is redrawn from itself with replacement, each response weighted by its reward, so responses whose reward is more
reliable (the extremes, for a noisy reward model) count more and the others less or not at all.

`resampled_rows` is verl's ``compute_pf_ppo_reweight_data`` in row indices: the weights of ``reweight_method``
(``pow``: |score|^weight_pow; ``max_min``: 1 for the batch's highest and lowest scores, else 0; ``max_random``: 0.4
for the highest, else 0.1), plus 1e-8 so every row can be drawn, and B draws with replacement. The generator is
seeded per iteration here (verl draws from the process's global stream), so a resumed run redraws the same rows.
"""

from __future__ import annotations

from typing import Literal

import torch

ReweightMethod = Literal["pow", "max_min", "max_random"]


def filtration_weights(scores: torch.Tensor, method: ReweightMethod, weight_pow: float) -> torch.Tensor:
    """The drawing weight of each response (not normalised).

    Args:
        scores: float [B], each response's score (the sum of its ``token_level_scores``).
        method: ``pow``, ``max_min`` or ``max_random`` (the module docstring).
        weight_pow: the exponent of ``pow``.

    Returns:
        float [B], each at least 1e-8.

    Raises:
        ValueError: an unknown `method` (names the three).
    """
    if method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).float()
    elif method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1)
    else:
        raise ValueError(f"algorithm.pf_ppo.reweight_method={method!r}: use pow, max_min or max_random")
    return torch.clamp(weights.float() + 1e-8, min=1e-8)


def resampled_rows(
    scores: torch.Tensor, method: ReweightMethod, weight_pow: float, generator: torch.Generator
) -> list[int]:
    """B row indices drawn with replacement in proportion to `filtration_weights`, in ascending order (a row drawn
    k times appears k times; the update shuffles its mini-batches itself).

    Args:
        scores: float [B], each response's score.
        method, weight_pow: as `filtration_weights`.
        generator: the draw's torch generator (seeded per iteration by the caller).

    Returns:
        The B indices, ascending, repeats allowed.
    """
    weights = filtration_weights(scores, method, weight_pow)
    drawn = torch.multinomial(weights, len(scores), replacement=True, generator=generator)
    return sorted(int(i) for i in drawn)
