"""DAPO's dynamic sampling (Yu et al. 2025, §3.2; verl's ``algorithm.filter_groups``): which rows of a scored draw
to keep, and when an iteration has drawn enough.

A group whose responses all score the same has zero group-relative advantage and adds nothing but noise to the
update's token mean, so it is dropped. The iteration draws ``data.gen_batch_size`` prompts at a time, generates and
scores them, keeps the rows of the varied groups (`kept_rows`), and stops once ``data.train_batch_size`` prompts
are kept (`DrawCount`); the batch trained on is the first ``train_batch_size`` kept groups. Every draw advances the
prompt sampler, whose cursor the checkpoint saves, so a resumed run draws exactly what the uninterrupted one did.
Both the flow and the single-process trainer use these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridflow.engine.advantage import shaped_scores
from hybridflow.engine.algorithms.estimators import group_ids
from hybridflow.engine.config import HybridFlowConfig
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.torch_ops import masked_sum

SEQUENCE_METRICS = ("seq_reward", "seq_final_reward")


def varied_groups(values: torch.Tensor, index: Sequence[Any] | np.ndarray) -> torch.Tensor:
    """Which sequences belong to a group whose `values` are not all equal (a group of one counts as varied): the
    groups DAPO's dynamic sampling keeps, since a group of equal rewards has zero group-relative advantage.

    Source: Yu et al. 2025, "DAPO" (arXiv 2503.14476), §3.2, eq. 11: keep a prompt when
    ``0 < |{o_i : is_equivalent(a, o_i)}| < G``, generalised (as verl does) to "the group's metric has std > 0".

    Args:
        values: float [B], one metric value per sequence (e.g. its accuracy or score).
        index: length-B prompt uids; equal uids form a group.

    Returns:
        bool [B].
    """
    ids, n_groups = group_ids(index, values.shape[0])
    values = values.to(torch.float64)
    low = torch.full((n_groups,), float("inf"), dtype=values.dtype).scatter_reduce(0, ids, values, "amin")
    high = torch.full((n_groups,), float("-inf"), dtype=values.dtype).scatter_reduce(0, ids, values, "amax")
    counts = torch.bincount(ids, minlength=n_groups)
    return ((high > low) | (counts == 1))[ids]


class DynamicSamplingError(RuntimeError):
    """An iteration drew ``algorithm.filter_groups.max_num_gen_batches`` times without enough varied groups."""


def metric_columns(metric: str, keys: list[str]) -> list[str]:
    """The columns of a scored batch (with `keys`) that `group_metric` reads for `metric`.

    Raises:
        ValueError: `metric` is neither a sequence metric nor a ``reward_extra/<metric>`` column (lists those).
    """
    if metric in SEQUENCE_METRICS:
        return ["token_level_scores", "response_mask", *(["rm_scores"] if "rm_scores" in keys else [])]
    if f"reward_extra/{metric}" not in keys:
        extras = sorted(k.removeprefix("reward_extra/") for k in keys if k.startswith("reward_extra/"))
        raise ValueError(
            f"algorithm.filter_groups.metric={metric}: the score function reports no {metric!r} (it reports "
            f"{extras or 'nothing else'}); use seq_reward, seq_final_reward or one of those"
        )
    return [f"reward_extra/{metric}"]


def group_metric(data: DataProto, metric: str, **shaping: Any) -> torch.Tensor:
    """Each row's value of ``algorithm.filter_groups.metric``, float64 [B]: ``seq_reward`` the function's score
    summed over the response; ``seq_final_reward`` the training reward before KL (`shaped_scores` with `shaping`:
    function and reward-model coefficients, overlong penalty); any other name the score function's
    ``reward_extra/<metric>`` (e.g. ``acc``).

    Raises:
        ValueError: as `metric_columns`.
    """
    metric_columns(metric, data.keys)
    batch = data.batch
    if metric == "seq_reward":
        return masked_sum(batch["token_level_scores"], batch["response_mask"], dim=-1).double()
    if metric == "seq_final_reward":
        rewards, _ = shaped_scores(data, **shaping)
        return masked_sum(rewards, batch["response_mask"], dim=-1).double()
    return batch[f"reward_extra/{metric}"].double()


def kept_rows(data: DataProto, metric: str, **shaping: Any) -> list[int]:
    """The rows of `data` (a scored draw with ``uid``) in groups whose `metric` varies (`varied_groups`), in order.

    Raises:
        ValueError: as `metric_columns`.
    """
    keep = varied_groups(group_metric(data, metric, **shaping), data.non_tensor_batch["uid"])
    return keep.nonzero().flatten().tolist()


@dataclass
class DrawCount:
    """Counts one iteration's draws and kept prompts against ``data.train_batch_size`` and
    ``algorithm.filter_groups.max_num_gen_batches``."""

    config: HybridFlowConfig
    draws: int = 0
    kept_prompts: int = 0

    def add(self, kept_rows: int) -> bool:
        """Count a draw that kept `kept_rows` rows; True once enough prompts are kept.

        Raises:
            DynamicSamplingError: not enough yet, and the draw limit is reached (nothing was trained: the run
                resumes from its last checkpoint once the data or the limit is changed).
        """
        cfg = self.config
        self.draws += 1
        self.kept_prompts += kept_rows // cfg.rollout.n
        if self.kept_prompts >= cfg.data.train_batch_size:
            return True
        limit = cfg.algorithm.filter_groups.max_num_gen_batches
        if limit and self.draws >= limit:
            raise DynamicSamplingError(
                f"algorithm.filter_groups: {self.draws} draws of {cfg.prompts_per_draw()} prompts kept "
                f"{self.kept_prompts} with a varied {cfg.algorithm.filter_groups.metric}, fewer than "
                f"data.train_batch_size={cfg.data.train_batch_size}: the prompts are too easy or too hard for the "
                "model; raise algorithm.filter_groups.max_num_gen_batches (0: no limit) or data.gen_batch_size"
            )
        return False

    def rows(self) -> int:
        """Rows trained on: the first ``data.train_batch_size`` kept groups."""
        return self.config.data.train_batch_size * self.config.rollout.n
