"""One RLHF iteration, written once, run by both the Prefect flow and the single-process trainer.

`run_iteration` is the iteration in the order of the HybridFlow paper's PPO listing (generate, score, log-probs,
values, advantages, updates, weight sync: published by the actor's pool first when the rollout has a pool of its
own), with the algorithm as configuration: which stages run (PPO's critic, ReMax's greedy generation, DAPO's repeated
draws, a rollout with weights of its own) and which estimator computes the advantages. It never touches data or
models itself: each stage is a `Call` that a `Stages` runs.

- The flow (`hybridflow.flows.rlhf.StageRunner`) runs each call as a Prefect task on the worker group that hosts
  its role, with data handles; calls of one batch run at the same time where their roles live in different pools.
- The single-process trainer (`hybridflow.engine.trainer.LocalStages`) calls the same worker methods in its own
  process, on `DataProto` batches.

A batch here is whatever the `Stages` passes around: anything with ``union`` (new columns, same rows), ``select``
and ``drop`` (columns), ``take`` (rows) and a ``concat`` classmethod (`DataProto`,
`hybridflow.slurm.handles.DataHandle`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridflow.engine.algorithms.estimators import uses_greedy_baseline
from hybridflow.engine.config import HybridFlowConfig
from hybridflow.engine.dynamic_sampling import DrawCount
from hybridflow.engine.extensions import rollout_spec
from hybridflow.engine.metrics import Timer, batch_metrics, busy_fractions, staleness_metrics
from hybridflow.engine.protocol import DataProto


@dataclass(frozen=True)
class StageMethod:
    """What a stage calls: a method of `hybridflow.engine.worker.RLHFWorker` on the ranks of the role's pool.

    Attributes:
        method: the worker method.
        doc: what the stage computes (the Prefect task's description).
        takes_batch: the first argument of a `Call` is the batch (else the method takes none).
        gathers: every rank returns its share of a batch (or None where another rank returns it), which the stage
            joins in rank order (one batch).
        names: keyword names of a `Call`'s arguments after the batch (``generate``'s random ``stream``).
        fixed: keyword arguments every call passes (ReMax's greedy generation).
        columns: the batch columns the method reads; a data handle sends only these (None: every column).
        metrics: the method returns metrics per rank, which the flow averages over the data-parallel ranks.
    """

    method: str
    doc: str
    takes_batch: bool = True
    gathers: bool = False
    names: tuple[str, ...] = ()
    fixed: dict[str, Any] = field(default_factory=dict)
    columns: tuple[str, ...] | None = None
    metrics: bool = False

    def bind(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A `Call`'s `args` as the method's positional and keyword arguments."""
        head = 1 if self.takes_batch else 0
        return args[:head], {**dict(zip(self.names, args[head:], strict=False)), **self.fixed}


STAGE_METHODS: dict[str, StageMethod] = {
    "generate": StageMethod(
        "generate_sequences",
        "Rollout: prompts [B] -> B*n sequences (responses, response_mask, ...), sampled from the random stream "
        "`stream` (another for each draw of one iteration).",
        names=("stream",),
    ),
    "generate_greedy": StageMethod(
        "generate_sequences",
        "ReMax's baseline rollout: one greedy response per prompt [B] -> B rows, each keeping its prompt's uid "
        "(verl times it as gen_max).",
        fixed={"n": 1, "temperature": 0.0, "stream": "greedy"},
    ),
    "rm_score": StageMethod(
        "compute_rm_score",
        "The reward model's rm_scores [B, T] (its score on each row's last response token, or a judge's verdict "
        "score with reward_extra/judge_*), and Safe-RLHF's cost model's token_level_costs [B, T].",
        columns=("responses", "response_mask", "raw_prompt", "data_source", "reward_model", "extra_info"),
    ),
    "reward": StageMethod(
        "compute_reward",
        "Score the responses: token_level_scores (+ reward_extra/*; Safe-RLHF's token_level_costs).",
        columns=("responses", "response_mask", "data_source", "reward_model", "extra_info"),
    ),
    "old_log_prob": StageMethod("compute_log_prob", "old_log_probs and entropys under the actor that generated."),
    "ref_log_prob": StageMethod("compute_ref_log_prob", "ref_log_prob under the frozen reference policy."),
    "teacher_log_prob": StageMethod(
        "compute_teacher_log_prob", "teacher_log_prob under on-policy distillation's teacher (teacher.model_path)."
    ),
    "values": StageMethod(
        "compute_values", "Critic values for each response token (and Safe-RLHF's cost critic's cost_values), [B, T]."
    ),
    "update_critic": StageMethod("update_critic", "Critic update; critic/* metrics averaged over ranks.", metrics=True),
    "update_actor": StageMethod(
        "update_actor", "Actor (PPO) update; actor/* metrics averaged over ranks.", metrics=True
    ),
    "stream_admit": StageMethod(
        "stream_admit",
        "rollout.streaming: start generating the prompts [B] on the rollout's stream (finished groups are handed over "
        "by stream_batch; the engine generates between calls).",
    ),
    "stream_batch": StageMethod(
        "stream_batch",
        "rollout.streaming: the next batch of whole finished groups within rollout.max_staleness, B*n sequences with "
        "rollout_token_versions [B*n, T]: each rank's share, joined in rank order.",
        takes_batch=False,
        gathers=True,
    ),
    "publish_weights": StageMethod(
        "publish_weights",
        "For a rollout pool of its own: the actor's pool writes its updated weights where the rollout pool reads "
        "them (shared memory on one node); returns the file's handle.",
        takes_batch=False,
        names=("version",),
    ),
    "weight_sync": StageMethod(
        "sync_rollout_weights",
        "Load the updated actor weights into the rollout engine (vLLM): in the actor's processes, or from the file "
        "the actor's pool published; returns its check.",
        takes_batch=False,
        names=("published", "version"),
        metrics=True,
    ),
}
"""The one table of the stages a `Call` names and the worker method each calls: the flow's tasks
(`hybridflow.tasks.stages`) and the single-process trainer (`hybridflow.engine.trainer.LocalStages`) both call
through it."""

STAGES = tuple(STAGE_METHODS)
"""The stages a `Call` names."""

TIMING = {
    "generate": "gen",
    "stream_batch": "gen",
    "generate_greedy": "gen_max",
    "ref_log_prob": "ref",
    "teacher_log_prob": "teacher",
    "advantage": "adv",
}
"""A stage's name in ``timing_s/<name>`` where it differs from the stage's (verl's names)."""


@dataclass
class Call:
    """One stage call: `stage` (one of `STAGES`) on the ranks that host `role`, with `args`; skipped unless `when`."""

    stage: str
    role: str
    args: tuple[Any, ...] = ()
    when: bool = True


class Stages(Protocol):
    """What runs an iteration's stages (see the module docstring)."""

    def __call__(self, *calls: Call) -> list[Any]:
        """Run `calls`, none of which needs another's result. Returns their results in order, None where skipped."""
        ...

    def next_prompts(self, step: int) -> Any:
        """The next ``data.train_batch_size`` prompts, ``meta_info["global_steps"]`` = `step`."""
        ...

    def filter_groups(self, scored: Any, step: int) -> list[int]:
        """DAPO: the rows of the scored draw whose group's metric varies (`dynamic_sampling.kept_rows`)."""
        ...

    def advantage(self, batch: Any, greedy: Any | None, step: int) -> tuple[Any, dict[str, float]]:
        """``token_level_rewards``, ``advantages``, ``returns`` (`hybridflow.engine.advantage.advantage_stage`) as a
        batch of the same rows, and the stage's metrics."""
        ...

    def policy_filtration(self, batch: Any, step: int) -> tuple[list[int], dict[str, float]]:
        """PF-PPO: the rows to train on, redrawn from the scored batch (`hybridflow.engine.advantage.
        policy_filtration`), and their metrics."""
        ...

    def view(self, batch: Any) -> DataProto:
        """The batch's columns the iteration's metrics need (`hybridflow.engine.metrics.batch_metrics`), loaded."""
        ...

    def submit(self, call: Call, after: Any | None = None) -> Any:
        """Start `call` once the pending call `after` has ended (None: now) and return at once: the overlapped
        modes' rollout pool, which serves its generations and weight pushes in the order they were admitted;
        `result` gives its result."""
        ...

    def result(self, pending: Any) -> Any:
        """The result of a `submit`ted call, once it has ended (a result already in hand as it is)."""
        ...


@dataclass
class Ahead:
    """A batch generated ahead (``trainer.mode: one_step_off | async``): the iteration it is for (its prompts'
    ``global_steps``), its prompts (None when restored from a checkpoint), its generation, pending
    (`Stages.submit`) or done (a batch), the weight pushes queued on the rollout's pool just before it, whose
    checks (``rollout/weight_probe_*``) the iteration that trains it reports, and ReMax's greedy responses to the
    same prompts from the same weights (None for the other estimators).

    With ``rollout.streaming`` its prompts' admission to the stream is `admitted` (pending or done) and `rollout`
    is None until the iteration asks the stream for its batch (``stream_batch``: whole groups of any admitted
    prompts, not necessarily these)."""

    step: int
    prompts: Any | None
    rollout: Any
    syncs: list[Any] = field(default_factory=list)
    greedy: Any | None = None
    admitted: Any | None = None


@dataclass
class RolloutQueue:
    """The rollout pool's work across iterations in the overlapped modes (``trainer.mode: one_step_off | async``).

    Attributes:
        ahead: the batches admitted, oldest first (the next iteration's at the head).
        engine_version: the weight version (actor updates) the engine generates the next admitted batch with: that
            of the last weight push queued.
        last: the last call queued on the rollout's pool (the next one waits for it); None: none pending.
        syncs: weight pushes queued since the last admitted batch (their checks not read yet).
        timer: the next iteration's `Timer`, where calls still running at the end of an iteration record their
            spans when they end (`Timer.hand_over`).
    """

    ahead: deque[Ahead] = field(default_factory=deque)
    engine_version: int = 0
    last: Any | None = None
    syncs: list[Any] = field(default_factory=list)
    timer: Timer = field(default_factory=Timer)


@dataclass
class Iteration:
    """What `run_iteration` leaves: its metrics, the trained batch, ReMax's scored greedy batch (None without),
    and every prompt batch and draw it made (the flow deletes their files)."""

    metrics: dict[str, float]
    batch: Any
    greedy: Any | None
    drawn: list[Any] = field(default_factory=list)


def run_iteration(
    cfg: HybridFlowConfig, stages: Stages, step: int, timer: Timer, queue: RolloutQueue | None = None
) -> Iteration:
    """The iteration after `step` iterations (its batch's ``global_steps`` is `step`), timed in `timer`.

    With a `queue` (``trainer.mode: one_step_off | async``, the rollout in a pool of its own) generation runs
    ahead of training: the iteration first admits the next iterations' generations on the rollout's pool as far as
    the staleness bound allows (`admit`), then trains the batch at the queue's head, generated by weights up to
    `HybridFlowConfig.max_staleness` updates old (each row's ``rollout_version``; corrected by
    ``algorithm.rollout_correction``), and queues its weight push behind the generations already admitted (every
    ``trainer.weight_sync_every`` updates, `pushes`): the rollout's pool never waits for training, training only for
    its own batch. Staleness 0 samples exactly what ``trainer.mode: sync`` does. The head leaves the queue only once
    the actor has been updated (a preempted iteration leaves it for the checkpoint).

    Returns:
        Its metrics (field-standard names: ``actor/*``, ``critic/*``, ``timing_s/*``, ``perf/*``,
        ``off_policy/staleness_*``, ``training/global_step`` = step + 1, ...) and its batches.

    Raises:
        hybridflow.engine.dynamic_sampling.DynamicSamplingError: DAPO's draw limit was reached before enough varied
            groups (nothing applied); whatever a stage raises (the flow's `Preempted` before the first update).
    """
    roles = cfg.roles()
    remax, dapo = uses_greedy_baseline(cfg.algorithm.adv_estimator), cfg.algorithm.filter_groups.enable
    scored_by_rm = "reward_model" in roles
    drawn: list[Any] = []
    metrics: dict[str, float] = {}
    with timer("step"):
        if queue is None:
            batch = stages.next_prompts(step)
            rollout, greedy = stages(
                Call("generate", "rollout", (batch,)),
                Call("generate_greedy", "rollout", (batch,), when=remax),  # ReMax's baseline responses
            )
        else:
            admit(cfg, stages, queue, step)
            head = queue.ahead[0]
            if head.rollout is None:  # streaming: the first finished groups the staleness bound lets go
                head.rollout = queue.last = stages.submit(Call("stream_batch", "rollout"), after=queue.last)
            batch, rollout, greedy = head.prompts, stages.result(head.rollout), stages.result(head.greedy)
            if cfg.rollout.streaming:  # the stream's groups, of any admitted prompts, are this iteration's batch
                rollout = rollout.with_meta(global_steps=step)
            for synced in head.syncs:  # queued before it: done
                metrics.update(stages.result(synced))
        drawn.append(batch)
        if dapo:  # dynamic sampling: scored first, then only the varied groups of as many draws as needed
            rollout, draws = _dynamic_sampling(cfg, stages, rollout, step, drawn, queue)
        *scored, greedy_rm, greedy_score = stages(
            Call("rm_score", "reward_model", (rollout,), when=scored_by_rm and not dapo),
            Call("reward", "reward", (rollout,), when=not dapo),
            Call("old_log_prob", "actor", (rollout,), when=not cfg.skips_old_log_prob()),
            Call("ref_log_prob", "ref", (rollout,), when="ref" in roles),
            Call("teacher_log_prob", "teacher", (rollout,), when="teacher" in roles),
            Call("values", "critic", (rollout,), when="critic" in roles),
            Call("rm_score", "reward_model", (greedy,), when=remax and scored_by_rm),
            Call("reward", "reward", (greedy,), when=remax),
        )
        rollout = _joined(rollout, scored)
        greedy = _joined(greedy, [greedy_rm, greedy_score])
        advantages, adv_metrics = stages.advantage(rollout, greedy, step)
        metrics.update(adv_metrics)
        if dapo:
            metrics["train/num_gen_batches"] = draws
        trained = rollout = rollout.union(advantages.drop(["response_mask"]))
        if "response_mask" in advantages.keys:  # decoupled rejection sampling: what the updates train on
            trained = trained.drop(["response_mask"]).union(advantages.select(["response_mask"]))
        # PF-PPO: the updates train on the batch redrawn by reward; the metrics see all samples
        if cfg.algorithm.use_pf_ppo:
            rows, pf_metrics = stages.policy_filtration(rollout, step)
            trained = trained.take(rows)
            metrics.update(pf_metrics)
        for updated in stages(
            Call("update_critic", "critic", (trained,), when="critic" in roles),
            Call("update_actor", "actor", (trained,)),
        ):
            metrics.update(updated or {})
        if queue is not None:
            queue.ahead.popleft()  # trained
        version = step + 1
        if rollout_spec(cfg.rollout.name).syncs_weights and pushes(cfg, version):  # an engine with weights of its own
            # in a pool of its own, the actor's pool publishes the new weights for it first
            [published] = stages(Call("publish_weights", "actor", (version,), when=cfg.rollout_apart()))
            sync = Call("weight_sync", "rollout", (published, version))
            if queue is None:
                [synced] = stages(sync)
                metrics.update(synced)
            else:  # behind the generations admitted so far
                queue.last = stages.submit(sync, after=queue.last)
                queue.syncs.append(queue.last)
                queue.engine_version = version
        if queue is not None and not queue.ahead:  # nothing generates before the pushes: read their checks now
            for synced in queue.syncs:
                metrics.update(stages.result(synced))
            queue.syncs = []
    metrics.update(timer.metrics())
    view = stages.view(rollout)
    devices = sum(pool.world_size for pool in cfg.pools().values())
    metrics.update(batch_metrics(view, cfg.rollout.response_length, timer.seconds, devices, cfg.data.max_prompt_length))
    metrics.update(staleness_metrics(view, step))
    whole = next(span for span in reversed(timer.spans) if span.name == "step")
    window = (whole.start, whole.end)
    metrics.update(busy_fractions([*timer.spans, *timer.open_spans(whole.end)], window))
    metrics["training/global_step"] = step + 1
    return Iteration(metrics, rollout, greedy, drawn)


def admit(cfg: HybridFlowConfig, stages: Stages, queue: RolloutQueue, step: int) -> None:
    """Admission control: queue the generations of the iterations after those already in `queue` (from `step`, the
    one about to train) while the staleness bound can hold. Iteration t's batch, generated by the weights of
    `RolloutQueue.engine_version`, is trained by an actor at version t, so it is admitted only while
    t - engine_version <= `HybridFlowConfig.max_staleness` (and t < ``trainer.total_iterations``): every
    trained row was generated at most that many updates before, and nothing generated is ever dropped. Each draws
    its prompts in iteration order, so the sampler's sequence is the synchronous loop's. ReMax's greedy baseline
    is generated right behind its batch, by the same weights (no push can come between them).

    With ``rollout.streaming`` the prompts join the rollout's stream instead (``stream_admit``), by the same count:
    B groups more while the groups admitted stay within ``(engine_version + s + 1) * B``, AReaL's rule, which the
    stream's `hybridflow.engine.rollout.admission.StreamAdmission` checks again and bounds per group."""
    remax = uses_greedy_baseline(cfg.algorithm.adv_estimator)
    t = queue.ahead[-1].step + 1 if queue.ahead else step
    while t < cfg.trainer.total_iterations and t - queue.engine_version <= cfg.max_staleness():
        prompts = stages.next_prompts(t)
        if cfg.rollout.streaming:
            queue.last = stages.submit(Call("stream_admit", "rollout", (prompts,)), after=queue.last)
            queue.ahead.append(Ahead(t, prompts, None, queue.syncs, admitted=queue.last))
            queue.syncs = []
            t += 1
            continue
        rollout = queue.last = stages.submit(Call("generate", "rollout", (prompts,)), after=queue.last)
        greedy = None
        if remax:
            greedy = queue.last = stages.submit(Call("generate_greedy", "rollout", (prompts,)), after=queue.last)
        queue.ahead.append(Ahead(t, prompts, rollout, queue.syncs, greedy))
        queue.syncs = []
        t += 1


def pushes(cfg: HybridFlowConfig, version: int) -> bool:
    """Whether the actor's weights after `version` updates go to the rollout: every ``trainer.weight_sync_every``
    updates (1 unless ``trainer.mode: async``), after the last update, and before a validation
    (``trainer.test_freq``), which generates with the rollout's engine."""
    trainer = cfg.trainer
    due = trainer.test_freq and version % trainer.test_freq == 0
    return version % trainer.weight_sync_every == 0 or version == trainer.total_iterations or bool(due)


def last_push(cfg: HybridFlowConfig, version: int) -> int:
    """The version of the last weight push (`pushes`) at or before `version` updates (0: the initial weights).

    A resumed queue admits by it, not by the restored actor its engine now serves: what the uninterrupted run
    admitted after the checkpoint, it admits at the same iterations, with the same weights."""
    return next((v for v in range(version, 0, -1) if pushes(cfg, v)), 0)


def _joined(batch: Any, parts: list[Any]) -> Any:
    """`batch` with the columns of every part that ran (None: skipped)."""
    for part in parts:
        batch = batch if part is None else batch.union(part)
    return batch


def _dynamic_sampling(
    cfg: HybridFlowConfig, stages: Stages, rollout: Any, step: int, drawn: list[Any], queue: RolloutQueue | None
) -> tuple[Any, int]:
    """DAPO's dynamic sampling (`hybridflow.engine.dynamic_sampling`): score `rollout` (the first draw), keep its
    varied groups, and draw ``data.gen_batch_size`` more prompts (each draw its own random stream) until
    ``data.train_batch_size`` prompts are kept. Returns the scored batch of the first ``train_batch_size`` kept
    groups and the number of draws; appends every draw to `drawn`.

    With a `queue` (the overlapped modes) a further draw is generated on the rollout's pool behind the generations
    already admitted, by the weights the engine holds then (at most ``max_staleness`` updates old: admission keeps
    the engine that close), and waited for; its prompts come after those admitted, in the sampler's order.

    Raises:
        DynamicSamplingError: ``algorithm.filter_groups.max_num_gen_batches`` draws kept too few prompts.
    """
    count, kept = DrawCount(cfg), []
    scored_by_rm = "reward_model" in cfg.roles()
    while True:
        rollout = _joined(
            rollout,
            stages(
                Call("rm_score", "reward_model", (rollout,), when=scored_by_rm), Call("reward", "reward", (rollout,))
            ),
        )
        drawn.append(rollout)
        rows = stages.filter_groups(rollout, step)
        kept.append(rollout.take(rows))
        if count.add(len(rows)):
            return type(rollout).concat(kept).take(range(count.rows())), count.draws
        batch = stages.next_prompts(step)
        drawn.append(batch)
        generate = Call("generate", "rollout", (batch, f"train-{count.draws}"))
        if queue is None:
            [rollout] = stages(generate)
        else:
            queue.last = stages.submit(generate, after=queue.last)
            rollout = stages.result(queue.last)
