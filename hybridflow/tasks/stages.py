"""The stages of an RLHF iteration as Prefect tasks.

Each task is a thin wrapper: it calls one worker-group method with data handles and returns a handle (or metrics),
so the Prefect UI shows every stage of every iteration with its timing, while bulk tensors stay with the workers.
The exception is `advantage`, which is small and runs in the controller (as in the HybridFlow paper's listing).
Task results are handles and metric dicts; caching is off (their inputs are live worker groups). Each task run is
named after its stage and iteration (``update_actor-7``; ``validate-0`` before training) from `ITERATION`, which the
flow sets before each stage, and times itself in the iteration's `TIMER` (stages of different pools run at the same
time as Prefect task futures, each in a thread of its own).
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from hybridflow.engine.advantage import ADVANTAGE_INPUTS, advantage_stage
from hybridflow.engine.advantage import policy_filtration as engine_policy_filtration
from hybridflow.engine.algorithms.kl import KLController
from hybridflow.engine.algorithms.lagrangian import LagrangeMultiplier
from hybridflow.engine.checkpoint import AHEAD_DIR, begin_checkpoint, finish_checkpoint
from hybridflow.engine.config import AlgorithmConfig, TeacherConfig
from hybridflow.engine.dpo.loss import reward_metrics
from hybridflow.engine.dynamic_sampling import kept_rows, metric_columns
from hybridflow.engine.generations import GENERATION_KEYS
from hybridflow.engine.iteration import STAGE_METHODS, TIMING
from hybridflow.engine.metrics import Timer, ValidationTally
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.reward.preference import pair_scores
from hybridflow.slurm.handles import DataHandle
from hybridflow.slurm.worker_group import WorkerGroup

ITERATION: ContextVar[int] = ContextVar("hybridflow_iteration", default=0)
"""The iteration the next stage belongs to (1 for the first; validation and checkpoint: the step they follow)."""

TIMER: ContextVar[Timer | None] = ContextVar("hybridflow_stage_timer", default=None)
"""The current iteration's `Timer`: each stage task times its own run there (in its own thread when it runs beside
others), under its stage name (``timing_s/<stage>``) and the worker group it calls; None: not timed."""


def _stage(name: str) -> Callable[[Callable[..., Any]], Any]:
    """Make a function a stage task: a Prefect task named `name`, its runs ``<name>-<iteration>``, no caching, no
    persisted results, its run timed as ``timing_s/<name>`` (verl's name where it differs, `iteration.TIMING`) in
    `TIMER` with the pool of the `WorkerGroup` it is given first."""

    def decorate(fn: Callable[..., Any]) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            timer = TIMER.get()
            if timer is None:
                return fn(*args, **kwargs)
            pool = args[0].spec.name if args and isinstance(args[0], WorkerGroup) else None
            with timer(TIMING.get(name, name), pool):
                return fn(*args, **kwargs)

        return task(
            timed,
            name=name,
            task_run_name=lambda: f"{name}-{ITERATION.get()}",
            cache_policy=NO_CACHE,
            persist_result=False,
        )

    return decorate


def _mean_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the data-parallel ranks."""
    return {k: float(np.mean([m[k] for m in per_rank])) for k in per_rank[0]}


@_stage("filter_groups")
def filter_groups(scored: DataHandle, metric: str, shaping: dict[str, Any]) -> list[int]:
    """DAPO's dynamic sampling: the rows of the scored draw whose group's `metric` varies
    (`hybridflow.engine.dynamic_sampling.kept_rows`). Runs in the controller on [B] columns."""
    data = scored.select(["uid", *metric_columns(metric, scored.keys)]).load()
    return kept_rows(data, metric, **shaping)


@_stage("policy_filtration")
def policy_filtration(
    batch: DataHandle, algorithm: AlgorithmConfig, seed: int, step: int
) -> tuple[list[int], dict[str, float]]:
    """PF-PPO's rows of `batch` to train on (`hybridflow.engine.advantage.policy_filtration`). Runs in the controller
    on the [B, T] scores; the caller takes the rows (`DataHandle.take`: nothing is copied)."""
    return engine_policy_filtration(batch.select(["token_level_scores"]).load(), algorithm, seed, step)


@_stage("advantage")
def advantage(
    batch: DataHandle,
    algorithm: AlgorithmConfig,
    kl_ctrl: KLController | None,
    data_dir: Path,
    shaping: dict[str, Any],
    greedy: DataHandle | None = None,
    lagrangian: LagrangeMultiplier | None = None,
    teacher: TeacherConfig | None = None,
) -> tuple[DataHandle, dict[str, float]]:
    """``token_level_rewards``, ``advantages``, ``returns`` (`algorithms.advantage.advantage_stage`; `shaping`:
    its reward keywords, `algorithms.advantage.reward_shaping`; `greedy`: the scored greedy responses of ReMax's
    baseline; `lagrangian`: Safe-RLHF's multiplier, stepped here, which adds ``cost_returns``; `teacher`: on-policy
    distillation's, which weighs the advantages and adds its dense reward).

    Runs in the controller: it reads only the [B, T] columns it needs, and writes its three columns as a new part.
    """
    data = batch.select([k for k in ADVANTAGE_INPUTS if k in batch.keys]).load()
    baseline = None
    if greedy is not None:
        columns = ["uid", "token_level_scores", "response_mask", *(["rm_scores"] if "rm_scores" in greedy.keys else [])]
        baseline = greedy.select(columns).load()
    out, metrics = advantage_stage(data, baseline, algorithm, kl_ctrl, shaping, lagrangian, teacher)
    return DataHandle.put(out, data_dir, "advantage"), metrics


def _worker_task(name: str) -> Any:
    """The task of stage `name`: one call of its worker method (`iteration.STAGE_METHODS`) on the group, the batch
    handle narrowed to the columns the method reads; per-rank metrics averaged over the ranks, per-rank shares of a
    batch joined in rank order."""
    spec = STAGE_METHODS[name]

    def call(group: WorkerGroup, *args: Any) -> Any:
        args, kwargs = spec.bind(args)
        if spec.columns is not None:
            args = (args[0].select(list(spec.columns)), *args[1:])
        result = getattr(group, spec.method)(*args, **kwargs)
        if spec.gathers:  # each rank's share of one batch (None: a rank whose share another rank returns)
            return DataHandle.concat([part for part in result if part is not None])
        return _mean_metrics(result) if spec.metrics else result

    call.__name__, call.__doc__ = name, spec.doc
    return _stage(name)(call)


ITERATION_TASKS = {name: _worker_task(name) for name in STAGE_METHODS}
"""The task of each stage of `hybridflow.engine.iteration.STAGE_METHODS`, as the flow runs it on a worker group."""


@_stage("checkpoint")
def checkpoint(
    groups: list[WorkerGroup],
    checkpoint_dir: str,
    step: int,
    trainer_state: dict[str, Any],
    ahead: dict[str, DataHandle] | None = None,
) -> dict:
    """Write the checkpoint of iteration `step` atomically: every group writes the roles it hosts into one staging
    folder, then the controller adds the batches generated `ahead`, by file name (the overlapped modes:
    ``<AHEAD_DIR>/<iteration>.safetensors``, ReMax's greedy batch in ``<iteration>.greedy.safetensors``, so a
    resume trains each, neither lost nor generated twice), the trainer state and the manifest, and renames it.

    A ``global_step_<step>`` folder already there was written just before a crash and never recorded in the run
    store (the store, not the folder, lists complete checkpoints): it is replaced.

    Returns:
        ``{"path", "step", "bytes", "sha256"}`` for the run store.
    """
    unrecorded = Path(checkpoint_dir) / f"global_step_{step}"
    if unrecorded.exists():
        shutil.rmtree(unrecorded)
    staging = begin_checkpoint(checkpoint_dir, step)
    try:
        for group in groups:
            group.save_checkpoint_part(str(staging))
        if ahead:
            (staging / AHEAD_DIR).mkdir(exist_ok=True)  # a streaming rollout's group wrote its stream there
            for name, batch in ahead.items():
                batch.load().save(staging / AHEAD_DIR / f"{name}.safetensors")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    info = finish_checkpoint(staging, trainer_state)
    return {"path": str(info.path), "step": info.step, "bytes": info.bytes, "sha256": info.sha256}


@_stage("validate")
def validate(
    rollout_group: WorkerGroup,
    reward_group: WorkerGroup,
    prompts: list[DataHandle],
    temperature: float,
    step: int,
    keep: int = 0,
) -> tuple[dict[str, float], DataProto | None]:
    """Generate once per held-out prompt and score it: ``val/<data_source>/score`` and ``val/<data_source>/acc``
    (the reward's exact-answer ``acc`` when it reports one, else the score).

    Returns:
        the metrics, and the first `keep` scored rows (`GENERATION_KEYS`, ``data_source``, ``reward_model``) for
        the sample generations; None when `keep` is 0.
    """
    tally = ValidationTally()
    kept: list[DataProto] = []
    for index, batch in enumerate(prompts):  # each batch its own random stream: training's samples never shift
        rollout = rollout_group.generate_sequences(
            batch.with_meta(global_steps=step), n=1, temperature=temperature, stream=f"val-{index}"
        )
        scores = reward_group.compute_reward(rollout, costs=False)  # validation reports no cost
        tally.add(scores.union(rollout.select(["data_source"])).load())
        wanted = keep - sum(len(k) for k in kept)
        if wanted > 0:
            columns = [k for k in (*GENERATION_KEYS, "data_source", "reward_model") if k in rollout.keys]
            scored = scores.select(["token_level_scores", "reward_error"])  # the error: why a sample scored 0.0
            kept.append(rollout.select(columns).union(scored).load(slice(0, wanted)))
        for handle in (rollout, scores):  # read once: free the disk
            handle.delete()
    metrics = tally.metrics()
    return metrics, DataProto.concat(kept) if kept else None


@_stage("update_reward_model")
def update_reward_model(group: WorkerGroup, pairs: DataHandle) -> dict[str, float]:
    """One Bradley-Terry optimizer step of reward-model training on a step's preference pairs; ``rm/*`` metrics
    averaged over the ranks' equal shares."""
    return _mean_metrics(group.update_reward_model(pairs))


def _scored(group: WorkerGroup, method: str, batches: list[DataHandle]) -> Any:
    """The columns worker method `method` returns for every batch of an evaluation, joined (a `TensorDict` of
    [sum of the batches' rows]); each batch's result file deleted once read."""
    scored = []
    for batch in batches:
        handle = getattr(group, method)(batch)
        scored.append(handle.load())
        handle.delete()
    return DataProto.concat(scored).batch


@_stage("evaluate_reward_model")
def evaluate_reward_model(group: WorkerGroup, batches: list[DataHandle]) -> dict[str, float]:
    """Score every held-out pair: ``val/rm/acc`` (share with chosen above rejected), ``val/rm/margin``,
    ``val/rm/loss`` (`hybridflow.engine.reward.preference.pair_scores`)."""
    both = _scored(group, "compute_pair_scores", batches)
    return {f"val/rm/{k}": v for k, v in pair_scores(both["chosen_scores"], both["rejected_scores"]).items()}


@_stage("update_dpo")
def update_dpo(group: WorkerGroup, pairs: DataHandle) -> dict[str, float]:
    """One DPO optimizer step on a step's preference pairs; ``train/*`` metrics averaged over the ranks' equal
    shares."""
    return _mean_metrics(group.update_dpo(pairs))


@_stage("evaluate_dpo")
def evaluate_dpo(group: WorkerGroup, batches: list[DataHandle]) -> dict[str, float]:
    """Every held-out pair's loss and implicit rewards: ``val/loss``, TRL's ``val/rewards/{chosen,rejected,
    margins,accuracies}`` (`hybridflow.engine.dpo.loss.reward_metrics`), and ``val/logps/accuracies``: the share
    of pairs whose chosen response the policy itself finds likelier (at step 0: the base model's)."""
    both = _scored(group, "compute_dpo_scores", batches)
    metrics = reward_metrics(both["chosen_rewards"], both["rejected_rewards"])
    prefers = float((both["chosen_logps"] > both["rejected_logps"]).double().mean())  # the policy's own choice
    return {
        "val/loss": float(both["loss"].double().mean()),
        **{f"val/{k}": v for k, v in metrics.items()},
        "val/logps/accuracies": prefers,
    }


@_stage("precompute_ref_log_prob")
def precompute_ref_log_probs(group: WorkerGroup, batches: list[DataHandle]) -> Any:
    """Every pair's log-probabilities under the frozen reference (``dpo.precompute_ref_log_probs``):
    ``ref_chosen_logps`` and ``ref_rejected_logps``, float32 [the batches' pairs, in their order] (a `TensorDict`)."""
    return _scored(group, "compute_ref_log_probs", batches)


@_stage("update_sft")
def update_sft(group: WorkerGroup, conversations: DataHandle) -> dict[str, float]:
    """One optimizer step of supervised fine-tuning on a step's conversations; ``train/loss`` the token-mean over
    all ranks' learned tokens (each rank's mean weighted by its tokens), ``train/grad_norm`` and ``train/lr``."""
    per_rank = group.update_sft(conversations)
    tokens = sum(m["train/tokens"] for m in per_rank)
    loss = sum(m["train/loss"] * m["train/tokens"] for m in per_rank) / max(tokens, 1.0)
    return {**_mean_metrics(per_rank), "train/loss": loss, "train/tokens": tokens}


@_stage("evaluate_sft")
def evaluate_sft(group: WorkerGroup, batches: list[DataHandle]) -> dict[str, float]:
    """The held-out conversations' token-mean loss, ``val/loss``, over their learned tokens."""
    total = tokens = 0.0
    for batch in batches:
        handle = group.compute_nll(batch)
        scored = handle.load().batch
        handle.delete()
        total, tokens = total + float(scored["nll_sum"].sum()), tokens + float(scored["tokens"].sum())
    return {"val/loss": total / max(tokens, 1.0)}
