"""Epochs over a fixed set of training rows (reward-model pairs, SFT conversations): a held-out split and each
epoch's batches, pure functions of a seed, so a resumed run needs only its step count."""

from __future__ import annotations

from typing import Any

import numpy as np


def split_held_out(rows: list[dict[str, Any]], fraction: float, seed: int) -> tuple[list, list]:
    """``(train, held_out)``: `fraction` of `rows` (at least one when `fraction` > 0), chosen by `seed`."""
    if fraction <= 0:
        return rows, []
    order = np.random.default_rng(seed).permutation(len(rows))
    count = max(1, round(fraction * len(rows)))
    held = set(order[:count].tolist())
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def epoch_batches(count: int, batch_size: int, epoch: int, seed: int, shuffle: bool) -> list[np.ndarray]:
    """The row indices of each step of `epoch` over `count` rows: whole batches of `batch_size` (the last partial
    one is dropped), in the order ``np.random.default_rng([seed, epoch]).permutation`` when `shuffle`; a pure
    function of its arguments, so a resumed run needs only its step count."""
    order = np.random.default_rng([seed, epoch]).permutation(count) if shuffle else np.arange(count)
    return [order[i : i + batch_size] for i in range(0, count - batch_size + 1, batch_size)]
