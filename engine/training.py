"""Pieces shared by the actor and critic updates: optimizer, LR schedule, mini-batches, the optimizer step."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import numpy as np
import torch

from hybridflow.engine.config import OptimConfig
from hybridflow.engine.protocol import DataProto


def build_optimizer(
    model: torch.nn.Module, optim: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters, with linear warm-up over ``optim.warmup_steps`` optimizer steps
    from lr/warmup_steps to lr, then constant lr (verl's default "constant" schedule)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    warmup = optim.warmup_steps

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def mini_batches(
    data: DataProto, mini_batch_size: int, epochs: int, shuffle: bool, seed: tuple[int, ...]
) -> Iterator[DataProto]:
    """Yield `epochs` passes over `data` in mini-batches of `mini_batch_size` sequences.

    Each epoch's order is ``np.random.default_rng([*seed, epoch]).permutation`` when `shuffle`, so the order is
    a pure function of (seed, epoch): nothing to checkpoint.

    Raises:
        ValueError: if ``len(data)`` is not a multiple of `mini_batch_size` (names the config keys).
    """
    n = len(data)
    if n % mini_batch_size:
        raise ValueError(
            f"batch of {n} sequences is not a multiple of the mini-batch size {mini_batch_size} sequences "
            "(ppo_mini_batch_size x rollout.n); adjust data.train_batch_size or ppo_mini_batch_size"
        )
    for epoch in range(epochs):
        order = np.random.default_rng([*seed, epoch]).permutation(n) if shuffle else np.arange(n)
        shuffled = data[order]
        yield from shuffled.split(mini_batch_size)


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_clip: float,
) -> float:
    """Clip the global grad norm to `grad_clip`, step, and zero the grads.

    A non-finite grad norm skips the step (the update would destroy the weights) but still zeroes the grads.

    Returns:
        The grad norm before clipping (float; inf/nan when the step was skipped).
    """
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if torch.isfinite(grad_norm):
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


class MetricLog:
    """Collect per-micro/mini-batch values under metric names; `mean()` averages each name."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = defaultdict(list)

    def add(self, **values: float | torch.Tensor) -> None:
        for name, value in values.items():
            self._values[name].append(float(value.detach()) if isinstance(value, torch.Tensor) else float(value))

    def mean(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/{k}": float(np.mean(v)) for k, v in self._values.items()}
