"""The RLHF iteration as a dataflow of stages, and its latency on a placement (HybridFlow paper, section 6:
``d_cost``): stages of models in one pool run one after another, stages of different pools at the same time, each
once the stages it reads from have finished."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """One stage: its timing name (``timing_s/<name>``), the model that runs it (None: the controller), and the
    stages whose output it reads."""

    name: str
    model: str | None
    after: tuple[str, ...] = ()


def iteration_stages(models: set[str] | frozenset[str], greedy: bool = False) -> list[Stage]:
    """The stages of one iteration of a run with `models` (``actor`` always; ``critic``, ``ref``,
    ``reward_model``, ``teacher`` when the run has them), in the flow's order (`hybridflow.flows.rlhf._iteration`); with
    `greedy`, ReMax's greedy generation ``gen_max`` after ``gen`` on the actor's pool."""
    scoring = [
        Stage(name, model, ("gen",))
        for name, model in (
            ("rm_score", "reward_model"),
            ("old_log_prob", "actor"),
            ("ref", "ref"),
            ("teacher", "teacher"),
            ("values", "critic"),
        )
        if model in models
    ]
    gen = [Stage("gen", "actor"), *([Stage("gen_max", "actor")] if greedy else [])]
    reads = tuple(s.name for s in scoring) + (("gen_max",) if greedy else ())
    stages = [*gen, *scoring, Stage("adv", None, reads)]
    if "critic" in models:
        stages.append(Stage("update_critic", "critic", ("adv",)))
    stages.append(Stage("update_actor", "actor", ("adv",)))
    return stages


def simulate(
    stages: list[Stage],
    pool_of: dict[str, int],
    stage_s: dict[str, float],
    concurrent: bool = True,
    pool_devices: tuple[int, ...] = (),
    host_cores: int = 0,
    contended_s: float = 0.0,
) -> tuple[float, dict[str, tuple[float, float]]]:
    """Schedule `stages` in order: each starts when the stages it reads have ended and its pool (``pool_of[model]``)
    is free (with `concurrent` false, when every earlier stage has ended). Returns the iteration's seconds and each
    stage's (start, end) in seconds.

    Where the devices are the host's own cores (`host_cores` > 0: a CPU machine, whose controller shares them with
    the ranks), a model stage that runs while ranks on `host_cores` devices or more are busy (its pool's devices,
    ``pool_devices[pool]``, and those of the other pools' stages overlapping it) takes `contended_s` longer: the
    controller's own work then preempts a rank, and ranks in lockstep wait for it. The stages are scheduled once
    without that, to find the overlaps, and again with it."""
    spans = _schedule(stages, pool_of, stage_s, concurrent)
    if host_cores and contended_s:
        slowed = dict(stage_s)
        for stage in stages:
            if stage.model is None or stage.name not in stage_s:
                continue
            pool = pool_of[stage.model]
            start, end = spans[stage.name]
            busy = {pool}
            for other in stages:
                if other.model is not None and other.name in stage_s and pool_of[other.model] != pool:
                    other_start, other_end = spans[other.name]
                    if other_start < end and start < other_end:
                        busy.add(pool_of[other.model])
            if sum(pool_devices[b] for b in busy) >= host_cores:
                slowed[stage.name] += contended_s
        spans = _schedule(stages, pool_of, slowed, concurrent)
    return max((end for _, end in spans.values()), default=0.0), spans


def _schedule(
    stages: list[Stage], pool_of: dict[str, int], stage_s: dict[str, float], concurrent: bool
) -> dict[str, tuple[float, float]]:
    free: dict[int, float] = {}
    spans: dict[str, tuple[float, float]] = {}
    last_end = 0.0
    for stage in stages:
        ready = max((spans[name][1] for name in stage.after), default=0.0)
        if not concurrent:
            ready = last_end
        pool = pool_of.get(stage.model, -1) if stage.model else -1
        start = max(ready, free.get(pool, 0.0))
        end = start + stage_s.get(stage.name, 0.0)
        spans[stage.name] = (start, end)
        free[pool] = end
        last_end = max(last_end, end)
    return spans
