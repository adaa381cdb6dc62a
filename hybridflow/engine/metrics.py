"""Batch metrics under the names the field greps for (``critic/score/mean``, ``response_length/mean``, ...)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch

from hybridflow.engine.protocol import DataProto
from hybridflow.engine.torch_ops import masked_mean


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def compute_data_metrics(data: DataProto, response_limit: int, prompt_limit: int | None = None) -> dict[str, float]:
    """Score, reward, advantage, return, value and length statistics of a trained-on batch.

    Args:
        data: a batch after the advantage stage (``token_level_scores``, ``token_level_rewards``,
            ``advantages``, ``returns``, ``response_mask``, ``attention_mask``; ``values`` if a critic ran; any
            ``reward_extra/<key>`` [B] column: the extra keys of a custom reward's dict, averaged into
            ``reward_extra/<key>/mean``; ``rm_scores`` [B, T] when a reward model scored the batch:
            ``critic/rm_score/*``). ``critic/score/*`` is the function's score, ``critic/rewards/*`` what was
            trained on (the scores combined, minus the in-reward KL penalty).
        response_limit: ``rollout.response_length``, for ``response_length/clip_ratio`` (share of responses cut
            at the limit).
        prompt_limit: ``data.max_prompt_length``, for ``prompt_length/clip_ratio`` (share of prompts at the limit);
            None: not reported.

    Returns:
        metric name -> float. Lengths are in tokens: ``response_length/*`` counts the model's own tokens
        (``response_mask``); with agent loops, `agent_metrics` adds the tool tokens' counts.
    """
    batch = data.batch
    mask = batch["response_mask"].bool()
    response_len = mask.sum(-1)
    width = mask.shape[1]
    trajectory_len = batch["attention_mask"][:, -width:].sum(-1)  # with an agent's tool tokens
    prompt_len = batch["attention_mask"][:, :-width].sum(-1)
    metrics = {
        **_stats("critic/score", batch["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", batch["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", batch["advantages"][mask]),
        **_stats("critic/returns", batch["returns"][mask]),
        **_stats("response_length", response_len),
        "response_length/clip_ratio": float((trajectory_len >= response_limit).float().mean()),
        **_stats("prompt_length", prompt_len),
    }
    if prompt_limit is not None:  # verl's: the share of prompts at data.max_prompt_length
        metrics["prompt_length/clip_ratio"] = float((prompt_len >= prompt_limit).float().mean())
    if "agent/num_turns" in batch:
        metrics.update(agent_metrics(data))
    if "rm_scores" in batch:
        metrics.update(_stats("critic/rm_score", batch["rm_scores"].sum(-1)))
    for key in batch.keys():  # noqa: SIM118 (a TensorDict iterates its values): the custom reward's extra keys
        if key.startswith("reward_extra/"):
            metrics[f"{key}/mean"] = float(batch[key].double().mean())
    if "values" in batch:
        metrics.update(_stats("critic/values", batch["values"][mask]))
        error = (batch["returns"] - batch["values"])[mask]
        metrics["critic/vf_explained_var"] = float(1.0 - error.var() / (batch["returns"][mask].var() + 1e-8))
    return metrics


def agent_metrics(data: DataProto) -> dict[str, float]:
    """The metrics of agent-loop rollouts (`hybridflow.engine.agent.rollout`), in verl's names where it has them.

    Reads ``agent/num_turns`` int [B], ``agent/tool_calls/<tool>`` and ``agent/tool_errors/<tool>`` int [B],
    ``response_mask`` and ``attention_mask``. Returns ``num_turns/{min,max,mean}`` (turns per trajectory: prompt,
    assistant and tool turns), ``tool_calls/<tool>/mean`` (calls per trajectory), ``tool_calls/<tool>/error_rate``
    (errors / calls, 0 without calls), ``response_length/with_tools/mean`` and ``response_length/tool_tokens/mean``
    (tokens per trajectory, of which tool and template tokens).
    """
    batch = data.batch
    width = batch["response_mask"].shape[1]
    trajectory = batch["attention_mask"][:, -width:].sum(-1).float()
    tool_tokens = trajectory - batch["response_mask"].sum(-1).float()
    metrics = {
        **_stats("num_turns", batch["agent/num_turns"]),
        "response_length/with_tools/mean": float(trajectory.mean()),
        "response_length/tool_tokens/mean": float(tool_tokens.mean()),
    }
    for key in sorted(batch.keys()):
        if key.startswith("agent/tool_calls/"):
            tool = key.removeprefix("agent/tool_calls/")
            calls = batch[key].float()
            errors = batch[f"agent/tool_errors/{tool}"].float()
            metrics[f"tool_calls/{tool}/mean"] = float(calls.mean())
            metrics[f"tool_calls/{tool}/error_rate"] = float(errors.sum() / calls.sum()) if calls.sum() else 0.0
    return metrics


def batch_metrics(
    data: DataProto, response_limit: int, seconds: dict[str, float], devices: int = 1, prompt_limit: int | None = None
) -> dict[str, float]:
    """`compute_data_metrics` of the trained batch plus verl's throughput (``metric_utils.py::
    compute_throughout_metrics``): ``perf/total_num_tokens`` (prompt and response tokens), ``perf/time_per_step``
    (``seconds["step"]``), ``perf/throughput`` (those tokens per second of the iteration per device, `devices` the
    ranks of all the run's pools, as verl divides by its GPUs); and ``perf/gen_throughput`` (response tokens per
    second of generation, ``seconds["gen"]``; one_step_off times the next batch's generation there, of about as
    many tokens; none in an iteration that generated nothing)."""
    metrics = compute_data_metrics(data, response_limit, prompt_limit)
    total = float(data.batch["attention_mask"].sum())
    metrics["perf/total_num_tokens"] = total
    metrics["perf/time_per_step"] = seconds["step"]
    metrics["perf/throughput"] = total / (seconds["step"] * max(1, devices))
    if seconds.get("gen"):
        metrics["perf/gen_throughput"] = float(data.batch["response_mask"].sum()) / seconds["gen"]
    return metrics


class ValidationTally:
    """The validation metrics over scored held-out batches: ``val/<data_source>/score`` (the mean score) and
    ``val/<data_source>/acc`` (the mean of the score function's ``acc`` when it reports one, else of the score);
    and the same means under verl's names (``ray_trainer.py::_val_metrics_update``, one response per prompt):
    ``val-core/<data_source>/acc/mean@1`` when the score function reports ``acc`` (then the score is
    ``val-aux/<data_source>/reward/mean@1``), else ``val-core/<data_source>/reward/mean@1``, so a verl dashboard
    finds its curves."""

    def __init__(self) -> None:
        self.per_source: dict[str, dict[str, list[float]]] = {}
        self.reports_acc = False

    def add(self, scored: DataProto) -> None:
        """Count a scored batch: ``token_level_scores`` [B, T], ``reward_extra/acc`` [B] float64 if reported, and the
        ``data_source`` column."""
        score = scored.batch["token_level_scores"].sum(-1).tolist()
        acc_key = "reward_extra/acc"
        acc = scored.batch[acc_key].tolist() if acc_key in scored.batch else score
        self.reports_acc = self.reports_acc or acc_key in scored.batch
        for source, s, a in zip(scored.non_tensor_batch["data_source"], score, acc, strict=True):
            bucket = self.per_source.setdefault(source, {"score": [], "acc": []})
            bucket["score"].append(s)
            bucket["acc"].append(a)

    def metrics(self) -> dict[str, float]:
        """The means, per data source, under our names and verl's."""
        out = {}
        for source, bucket in self.per_source.items():
            score, acc = float(np.mean(bucket["score"])), float(np.mean(bucket["acc"]))
            out.update({f"val/{source}/score": score, f"val/{source}/acc": acc})
            if self.reports_acc:
                out.update({f"val-core/{source}/acc/mean@1": acc, f"val-aux/{source}/reward/mean@1": score})
            else:
                out[f"val-core/{source}/reward/mean@1"] = score
        return out


class Span(NamedTuple):
    """One timed stage: its name, the pool (worker group) it ran on (None: the controller), and its start and end
    (seconds since the epoch)."""

    name: str
    pool: str | None
    start: float
    end: float


_TIMERS = threading.Lock()
"""Guards every `Timer`: a stage that ends after its timer was handed over records in the one after it."""


class Timer:
    """Accumulates wall-clock seconds per stage: ``with timer("gen"): ...`` -> ``timing_s/gen``, and keeps every
    timed `Span` (the iteration's timeline). Thread-safe: stages running at the same time time themselves from
    their own threads.

    A stage still running when the iteration ends (a generation admitted ahead, ``trainer.mode: async``) is
    recorded, when it ends, in the timer its iteration's was handed over to (`hand_over`): each span and its
    seconds count once, in the iteration during which the stage ended; `open_spans` gives those running now.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.spans: list[Span] = []
        self._open: dict[int, tuple[str, str | None, float]] = {}  # running stages: name, pool, start
        self._next: Timer | None = None
        self._ids = itertools.count()

    @contextmanager
    def __call__(self, name: str, pool: str | None = None) -> Iterator[None]:
        start_wall, start = time.time(), time.perf_counter()
        with _TIMERS:
            key = next(self._ids)
            self._live()._open[key] = (name, pool, start_wall)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with _TIMERS:
                timer = self._live()
                timer._open.pop(key, None)
                timer.seconds[name] = timer.seconds.get(name, 0.0) + elapsed
                timer.spans.append(Span(name, pool, start_wall, start_wall + elapsed))

    def _live(self) -> Timer:
        timer = self
        while timer._next is not None:
            timer = timer._next
        return timer

    def hand_over(self) -> Timer:
        """End this timer's iteration: returns the next iteration's timer, where the stages running now will record
        their spans and seconds when they end (this one keeps what it has)."""
        with _TIMERS:
            successor = Timer()
            successor._open, successor._ids, self._open = self._open, self._ids, {}
            self._next = successor
        return successor

    def open_spans(self, now: float) -> list[Span]:
        """The stages running now, as spans from their start to `now` (seconds since the epoch)."""
        with _TIMERS:
            return [Span(name, pool, start, now) for name, pool, start in self._live()._open.values()]

    def metrics(self) -> dict[str, float]:
        """Seconds per stage so far, keyed ``"timing_s/<name>"`` (stages timed twice add up); first-timed order."""
        with _TIMERS:
            return {f"timing_s/{k}": v for k, v in self.seconds.items()}


def staleness_metrics(data: DataProto, version: int) -> dict[str, float]:
    """How many actor updates old the trained rows' generating weights are, the actor being at `version` (its
    updates so far): ``off_policy/staleness_mean`` and ``off_policy/staleness_max`` over the rows' recorded
    ``rollout_version`` int64 [B] (a streaming rollout's: the row's oldest token's; none without that column).

    A streaming rollout's ``rollout_token_versions`` int64 [B, T] (-1 past a response's end) adds
    ``off_policy/token_staleness_mean`` (over the response tokens) and ``rollout/partial_fraction`` (the share of
    rows sampled by more than one version: partial rollouts continued across a push)."""
    if "rollout_version" not in data.batch:
        return {}
    lag = (version - data.batch["rollout_version"]).double()
    out = {"off_policy/staleness_mean": float(lag.mean()), "off_policy/staleness_max": float(lag.max())}
    tokens = data.batch.get("rollout_token_versions", None)
    sampled = None if tokens is None else tokens >= 0
    if sampled is not None and sampled.any():
        out["off_policy/token_staleness_mean"] = float((version - tokens[sampled]).double().mean())
        newest = torch.where(sampled, tokens, -1).amax(-1)
        out["rollout/partial_fraction"] = float((newest > data.batch["rollout_version"]).double().mean())
    return out


def busy_fractions(spans: list[Span], window: tuple[float, float]) -> dict[str, float]:
    """Each pool's share of the iteration's `window` (start, end; seconds since the epoch) spent in a stage call:
    its spans clipped to the window and merged where they overlap (a generation admitted in an earlier iteration
    counts from the window's start, one still running up to its end): ``perf/busy/<pool>``; the controller's own
    stages (pool None) are left out."""
    start, end = window
    out = {}
    for pool in sorted({s.pool for s in spans if s.pool is not None}):
        busy, covered = 0.0, start
        for span in sorted((s for s in spans if s.pool == pool), key=lambda s: s.start):
            busy += max(0.0, min(span.end, end) - max(span.start, covered))
            covered = max(covered, min(span.end, end))
        out[f"perf/busy/{pool}"] = busy / (end - start) if end > start else 0.0
    return out


def rollout_mismatch(data: DataProto) -> dict[str, float]:
    """How far the rollout engine's log-probs drift from the actor's on the sampled tokens (same weights, other
    kernels): ``rollout/log_prob_diff_mean`` (mean |actor - engine|) and ``rollout/kl`` (mean of engine - actor,
    the k1 estimate of KL(engine || actor)), over response tokens."""
    mask = data.batch["response_mask"]
    diff = data.batch["rollout_log_probs"] - data.batch["old_log_probs"]
    return {
        "rollout/log_prob_diff_mean": float(masked_mean(diff.abs(), mask)),
        "rollout/kl": float(masked_mean(diff, mask)),
    }
