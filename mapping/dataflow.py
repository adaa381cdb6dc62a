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


def iteration_stages(models: set[str] | frozenset[str]) -> list[Stage]:
    """The stages of one iteration of a run with `models` (``actor`` always; ``critic``, ``ref``,
    ``reward_model`` when the run has them), in the flow's order (`hybridflow.flows.rlhf._iteration`)."""
    scoring = [
        Stage(name, model, ("gen",))
        for name, model in (
            ("rm_score", "reward_model"),
            ("old_log_prob", "actor"),
            ("ref", "ref"),
            ("values", "critic"),
        )
        if model in models
    ]
    stages = [Stage("gen", "actor"), *scoring, Stage("adv", None, tuple(s.name for s in scoring))]
    if "critic" in models:
        stages.append(Stage("update_critic", "critic", ("adv",)))
    stages.append(Stage("update_actor", "actor", ("adv",)))
    return stages


def simulate(
    stages: list[Stage], pool_of: dict[str, int], stage_s: dict[str, float], concurrent: bool = True
) -> tuple[float, dict[str, tuple[float, float]]]:
    """Schedule `stages` in order: each starts when the stages it reads have ended and its pool (``pool_of[model]``)
    is free (with `concurrent` false, when every earlier stage has ended). Returns the iteration's seconds and each
    stage's (start, end) in seconds."""
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
    return last_end, spans
