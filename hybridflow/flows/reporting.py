"""What a run shows to the people watching it: the run store, the experiment trackers and the Prefect UI.

- `RunReport`: every step's metrics and sample generations go to the run store and to the trackers of
  ``trainer.logger`` (`hybridflow.engine.tracking`), and a Markdown artifact of the step (key metrics; at validation,
  a few generations) to the flow run in the Prefect UI.
- `flow_run_name` / `flow_run_tags`: the flow run is named ``<experiment>/<run_id>`` and tagged with the experiment,
  algorithm, model and executor, so the UI's run list reads like ``hf runs list``.
- `FlowLogs`: the controller's ``hybridflow`` log lines and the worker ranks' log lines (tailed from their submitit
  log files after every stage) go to the flow run's logs in the UI.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from uuid import UUID

import httpx
from prefect import flow
from prefect.context import FlowRunContext, SettingsContext, TagsContext, get_settings_context
from prefect.logging.handlers import APILogWorker, set_api_log_sink
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

from hybridflow.engine.config import HybridFlowConfig
from hybridflow.engine.generations import decode_generations
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.tracking import Tracking, markdown_table, mlflow_tracking_uri
from hybridflow.flows.store.run_store import RunStore

logger = logging.getLogger(__name__)
worker_logger = logging.getLogger("hybridflow.workers")

ARTIFACT_METRICS = (
    "critic/score/mean",
    "critic/rm_score/mean",
    "critic/rewards/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/entropy",
    "critic/vf_loss",
    "response_length/mean",
    "perf/throughput",
    "timing_s/step",
)
"""The metrics a step's Prefect artifact shows (those present), then every ``val/*`` and ``reward_extra/*`` one."""
ARTIFACT_SAMPLES = 3
"""Generations shown in a validation step's artifact (the run store keeps all of ``trainer.log_val_generations``)."""


def _with_reward_errors(samples: list[dict[str, Any]], data: DataProto) -> list[dict[str, Any]]:
    """Each sample whose score function failed (non-tensor ``reward_error`` of `data`, "" when scored) with its
    error as ``reward_error`` (the run store's and the trackers' samples: ``hf runs samples`` shows it)."""
    errors = data.non_tensor_batch.get("reward_error")
    if errors is None:
        return samples
    for sample, error in zip(samples, errors, strict=True):
        if error:
            sample["reward_error"] = str(error)
    return samples


def flow_run_name(cfg: HybridFlowConfig, run_id: str) -> str:
    """``<trainer.experiment_name>/<run_id>``: the flow run's name in the Prefect UI."""
    return f"{cfg.trainer.experiment_name}/{run_id}"


def flow_run_tags(cfg: HybridFlowConfig) -> list[str]:
    """The flow run's tags: ``experiment:<name>``, ``algorithm:<adv_estimator>``, ``model:<folder name>``,
    ``executor:<local|slurm>``, ``actor:<strategy>``."""
    return [
        f"experiment:{cfg.trainer.experiment_name}",
        f"algorithm:{cfg.algorithm.adv_estimator}",
        f"model:{Path(cfg.model.path).name}",
        f"executor:{cfg.placement.executor}",
        f"actor:{cfg.actor.strategy}",
    ]


def untagged_task_runs() -> TagsContext:
    """A context in which task runs inherit none of the flow run's tags. Prefect asks the server for tag
    concurrency slots (``tag:<tag>`` limits) before every tagged task run starts; measured on SmolLM2 PPO that took
    up to 2 s before some stages, several times an iteration, for limits nobody set."""
    return TagsContext(current_tags=set())


class RunReport:
    """The run's records of each step, to the store, the trackers and the Prefect UI.

    Args:
        store: the run store.
        run_id: the run.
        cfg: its config (``trainer.logger``, ``project_name``, ``mlflow_tracking_uri``, ``output_dir``).
        run_dir: the run folder (``jsonl``, ``tensorboard``, ``wandb`` files go there).
        tokenizer: the actor's tokenizer, to decode generations.
        first_step: the first step this session records (`hybridflow.engine.tracking.Tracking`'s: a resume's
            trackers drop what they hold of it and later steps).

    Raises:
        ImportError: a tracker's library is missing (named, with the pip command).
    """

    def __init__(
        self, store: RunStore, run_id: str, cfg: HybridFlowConfig, run_dir: Path, tokenizer: Any, first_step: int
    ) -> None:
        self.store, self.run_id, self.tokenizer = store, run_id, tokenizer
        trainer = cfg.trainer
        output_dir = Path(trainer.output_dir).resolve()
        self.tracking = Tracking(
            [b for b in trainer.logger if b != "console"],
            run_dir,
            project_name=trainer.project_name,
            experiment_name=trainer.experiment_name,
            run_id=run_id,
            config=cfg.model_dump(mode="json"),
            mlflow_uri=mlflow_tracking_uri(trainer.mlflow_tracking_uri, output_dir),
            mlflow_artifacts=output_dir / "mlartifacts",
            first_step=first_step,
        )
        self.artifacts = ArtifactSender.for_this_flow_run()

    def step(
        self,
        step: int,
        metrics: Mapping[str, float],
        train: DataProto | None = None,
        val: DataProto | None = None,
        timeline: Sequence[Sequence[Any]] = (),
    ) -> None:
        """Record step `step`: its metrics, its stage `timeline` (`hybridflow.engine.metrics.Span` s, in the
        store's ``stage_times``), and the generations in `train` / `val` (scored rollout rows; see
        `decode_generations`), in the store and the trackers; then its Prefect artifact."""
        self.store.record_metrics(self.run_id, step, metrics)
        if timeline:
            self.store.record_stage_times(self.run_id, step, timeline)
        self.tracking.log(metrics, step)
        shown: list[dict[str, Any]] = []
        for kind, data in (("train", train), ("val", val)):
            if data is None or len(data) == 0:
                continue
            samples = _with_reward_errors(decode_generations(data, self.tokenizer, step), data)
            self.store.record_samples(self.run_id, step, kind, samples)
            self.tracking.log_generations(samples, step, kind)
            if kind == "val":
                shown = samples[:ARTIFACT_SAMPLES]
        if self.artifacts is not None:
            self.artifacts.put(*_artifact(self.run_id, step, metrics, shown))

    def close(self, ok: bool) -> None:
        """Close the trackers (`ok`: the run completed) and send the artifacts still waiting (`ArtifactSender`)."""
        self.tracking.finish(ok)
        if self.artifacts is not None:
            self.artifacts.close()


def _artifact(
    run_id: str, step: int, metrics: Mapping[str, float], samples: Sequence[Mapping[str, Any]]
) -> tuple[str, str]:
    """Step `step`'s Markdown artifact: (its Markdown, its description)."""
    names = [n for n in ARTIFACT_METRICS if n in metrics]
    names += sorted(n for n in metrics if n.startswith(("val/", "reward_extra/")))
    title = "validation before training" if step == 0 else f"iteration {step}"
    lines = [f"## {run_id}: {title}", "", "| metric | value |", "|---|---|"]
    lines += [f"| {n} | {metrics[n]:.4g} |" for n in names if metrics[n] is not None]
    if samples:
        lines += ["", f"### validation generations (first {len(samples)})", "", markdown_table(samples, limit=300)]
    return "\n".join(lines), f"{run_id} {title}"


class ArtifactSender:
    """A flow run's Markdown artifacts, sent to the Prefect server from a thread, in the order put. Reporting never
    costs training work: a server that does not answer (stopped, restarting; the client's own retries take over a
    minute) keeps them waiting in memory, retried with back-off (1 s doubling to 30 s), with one warning naming the
    server; `close` gives them `FLUSH_S` more, then says how many were not sent (the run's metrics are in the run
    store either way).

    Args:
        flow_run_id: the flow run they belong to.
    """

    FLUSH_S = 15.0

    def __init__(self, flow_run_id: str) -> None:
        self.flow_run_id = flow_run_id
        self.pending: deque[tuple[str, str]] = deque()
        self._wake = threading.Condition()
        self._closing_at: float | None = None
        self._thread = threading.Thread(target=self._send, name="hybridflow-artifacts", daemon=True)
        self._thread.start()

    @classmethod
    def for_this_flow_run(cls) -> ArtifactSender | None:
        """A sender for the current flow run; None outside one."""
        from prefect.context import FlowRunContext

        context = FlowRunContext.get()
        return cls(str(context.flow_run.id)) if context is not None and context.flow_run is not None else None

    def put(self, markdown: str, description: str) -> None:
        """Queue one artifact; returns at once."""
        with self._wake:
            self.pending.append((markdown, description))
            self._wake.notify()

    def close(self) -> None:
        """Wait up to `FLUSH_S` for the queue to empty; warn about what is left."""
        with self._wake:
            self._closing_at = time.monotonic()
            self._wake.notify()
        self._thread.join(self.FLUSH_S + 1.0)
        if self.pending:
            logger.warning(
                "%d Prefect artifact(s) of flow run %s not sent: the Prefect server at %s did not answer (the run's "
                "metrics are in the run store: hf runs show)",
                len(self.pending),
                self.flow_run_id,
                os.environ.get("PREFECT_API_URL", "?"),
            )

    def _send(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactCreate

        delay, failing = 1.0, False
        while True:
            with self._wake:
                while not self.pending and self._closing_at is None:
                    self._wake.wait()
                if not self.pending or self._past_flush():
                    return
                markdown, description = self.pending[0]
            try:
                with get_client(sync_client=True) as client:
                    client.create_artifact(
                        ArtifactCreate(
                            type="markdown", data=markdown, description=description, flow_run_id=UUID(self.flow_run_id)
                        )
                    )
            except Exception as error:  # noqa: BLE001 - any failure to report waits for the next try
                if not failing:
                    logger.warning(
                        "the Prefect server at %s does not answer (%s: %s); the flow run's artifacts wait and are "
                        "retried, training goes on",
                        os.environ.get("PREFECT_API_URL", "?"),
                        type(error).__name__,
                        error,
                    )
                    failing = True
                with self._wake:
                    self._wake.wait(delay)
                delay = min(delay * 2, 30.0)
                continue
            with self._wake:
                self.pending.popleft()
            if failing:
                logger.warning("the Prefect server at %s answers again", os.environ.get("PREFECT_API_URL", "?"))
            delay, failing = 1.0, False

    def _past_flush(self) -> bool:
        """Closing and `FLUSH_S` spent (call holding the lock)."""
        return self._closing_at is not None and time.monotonic() - self._closing_at > self.FLUSH_S


class FlowLogs:
    """Send the controller's and the workers' log lines to the current Prefect flow run's logs.

    While open, the ``hybridflow`` logger (level INFO) has a Prefect API handler stamped with the flow run's id (so
    lines from any thread arrive); `pump` forwards the lines the worker ranks appended to their log files
    (``<run folder>/submitit/<group>/*_log.err``/``.out``) since the last call, as ``hybridflow.workers`` records
    ``[<group> <file>] <line>`` (at most `max_lines` per call; the rest is counted). Files that exist when it opens
    (an earlier session's) are skipped. Outside a flow run it does nothing.
    """

    def __init__(self, run_dir: Path, max_lines: int = 300) -> None:
        self.log_root, self.max_lines = run_dir / "submitit", max_lines
        self.offsets: dict[Path, int] = {p: p.stat().st_size for p in self._files()}
        self.handler: logging.Handler | None = None
        self.level = logging.NOTSET

    def _files(self) -> list[Path]:
        return sorted(p for pattern in ("*/*_log.err", "*/*_log.out") for p in self.log_root.glob(pattern))

    def __enter__(self) -> FlowLogs:
        from prefect.context import FlowRunContext
        from prefect.logging.handlers import APILogHandler

        context = FlowRunContext.get()
        if context is None or context.flow_run is None:
            return self
        flow_run_id = context.flow_run.id

        class _Stamped(APILogHandler):
            def emit(self, record: logging.LogRecord) -> None:
                record.flow_run_id = flow_run_id  # any thread's record belongs to this flow run
                super().emit(record)

        self.handler = _Stamped(level=logging.INFO)
        self.handler.setFormatter(logging.Formatter("%(message)s"))  # the UI shows the logger name beside it
        root = logging.getLogger("hybridflow")
        self.level = root.level
        if root.getEffectiveLevel() > logging.INFO:
            root.setLevel(logging.INFO)
        root.addHandler(self.handler)
        return self

    def pump(self) -> None:
        """Forward the worker log lines written since the last call."""
        if self.handler is None:
            return
        sent = dropped = 0
        for path in self._files():
            start = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    chunk = f.read()
            except OSError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next call
            self.offsets[path] = start + len(complete)
            source = f"{path.parent.name} {path.name.removesuffix('.err').removesuffix('.out')}"
            for line in complete.decode(errors="replace").splitlines():
                if not line.strip():
                    continue
                if sent < self.max_lines:
                    worker_logger.info("[%s] %s", source, line)
                    sent += 1
                else:
                    dropped += 1
        if dropped:
            worker_logger.info("... %d more worker log lines (see %s)", dropped, self.log_root)

    def __exit__(self, *exc: object) -> None:
        if self.handler is None:
            return
        self.pump()
        root = logging.getLogger("hybridflow")
        root.removeHandler(self.handler)
        root.setLevel(self.level)
        self.handler.flush()
        self.handler = None


T = TypeVar("T")


class _ReportedAPILogWorker(APILogWorker):
    """Prefect's `APILogWorker` (batches of log lines sent to the flow run's logs), with a batch the server did not
    take reported to `errors` instead of written to stderr."""

    errors = logging.getLogger("prefect.hybridflow.api_logs")

    async def _handle_batch(self, items: list[dict[str, Any]]) -> None:
        try:
            await self._client.create_logs(items)
        except Exception as error:  # noqa: BLE001 - any failure: the lines are dropped, as Prefect drops them
            self.errors.warning(
                "the Prefect server did not take %d log lines: %s: %s", len(items), type(error).__name__, error
            )


@contextlib.contextmanager
def ship_api_logs_to(errors: logging.Logger) -> Iterator[None]:
    """Ship the process's log lines to the Prefect API (the flow run's logs) as Prefect does, but with a batch the
    server did not take reported to `errors` (a warning: how many lines, Prefect's error) instead of written to
    stderr: Prefect's `APILogWorker` writes ``--- Error logging to API ---`` and the error without a newline, so
    the next terminal line starts glued to its end (and during a server outage each batch writes one more)."""
    _ReportedAPILogWorker.errors = errors
    set_api_log_sink(lambda log: _ReportedAPILogWorker.instance().send(log))
    try:
        yield
    finally:
        set_api_log_sink(None)


def number_ranges(numbers: Sequence[int]) -> str:
    """``[2, 3, 4, 7, 9, 10]`` as ``"2-4, 7, 9-10"`` (sorted, each number once)."""
    parts: list[list[int]] = []
    for n in sorted(set(numbers)):
        if parts and n == parts[-1][1] + 1:
            parts[-1][1] = n
        else:
            parts.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


@dataclass
class IterationSubflows:
    """Runs each iteration as the subflow ``iteration <N>`` of the current flow run: the Prefect UI's timeline groups
    each iteration's stages under it ("iteration 12" > ``update_actor-12``).

    Reporting never costs training: a subflow run is created and ended by calls to the Prefect server (task runs go
    as buffered events), so where the server does not answer (it died, it restarts) the iteration runs anyway, once:
    without its subflow if the subflow could not start, with its result kept if the subflow could not record its
    end (that end is recorded later: `flush`); the next `retry_after_s` seconds of iterations then run without
    subflows (each try waits out the client's retries)."""

    retry_after_s: float = 10.0
    paused_until: float = 0.0  # time.monotonic() before which iterations run without subflows
    unrecorded: list[Any] = field(default_factory=list)  # ids of subflows whose end Prefect did not take
    without_subflow: list[int] = field(default_factory=list)  # iterations run without theirs (Prefect did not answer)
    _settings: tuple[Any, Any] | None = None  # (the current Prefect settings, the same without heartbeats)

    def run(self, iteration: int, body: Callable[[], T]) -> T:
        """`body()` in the subflow of iteration `iteration` (no parameters, no result kept: the controller's objects
        stay out of Prefect's records). An error raised by `body` is raised here as it is."""
        if time.monotonic() < self.paused_until:
            self.without_subflow.append(iteration)
            return body()
        self.flush()
        outcome: dict[str, Any] = {}

        def iteration_stages() -> T:
            outcome["id"] = FlowRunContext.get().flow_run.id
            outcome["result"] = body()
            return outcome["result"]

        subflow = flow(iteration_stages, name="iteration", flow_run_name=f"iteration {iteration}", persist_result=False)
        try:
            with self._quiet_settings():
                return subflow()
        except (httpx.HTTPError, OSError) as error:
            if "id" in outcome and "result" not in outcome:  # the iteration's own error
                raise
            self.paused_until = time.monotonic() + self.retry_after_s
            if "result" in outcome:
                logger.warning("iteration %d done; Prefect did not take its subflow's end: %s", iteration, error)
                self.unrecorded.append(outcome["id"])
                return outcome["result"]
            logger.warning("Prefect does not answer (%s): iteration %d runs without its subflow", error, iteration)
            self.without_subflow.append(iteration)
            return body()

    def missing_from_ui(self, run_id: str) -> str | None:
        """The line naming the iterations that ran without their subflow (the Prefect server did not answer), so
        the Prefect UI does not show them as iterations; None when every iteration had its subflow."""
        if not self.without_subflow:
            return None
        which = number_ranges(self.without_subflow)
        noun = "iteration" if len(self.without_subflow) == 1 else "iterations"
        return (
            f"{noun} {which} ran while the Prefect server did not answer: the Prefect UI has no subflow for "
            f"{'it' if noun == 'iteration' else 'them'} (their stages may be missing there too); the run store has "
            f"every iteration: hf runs show {run_id}"
        )

    def _quiet_settings(self) -> SettingsContext:
        """The current Prefect settings without flow run heartbeats, for the subflow: the run's flow run sends
        them, and stopping a subflow's heartbeat thread cost up to 1 s at its end. One settings object for all
        subflows while the current settings stay the same (Prefect's clients are cached per settings)."""
        current = get_settings_context()
        if self._settings is None or self._settings[0] is not current.settings:
            quiet = current.settings.copy_with_update(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
            self._settings = (current.settings, quiet)
        return SettingsContext(profile=current.profile, settings=self._settings[1])

    def flush(self) -> None:
        """Record Completed the subflows whose end Prefect did not take (best effort: kept for a later try)."""
        if not self.unrecorded:
            return
        from prefect.client.orchestration import get_client
        from prefect.states import Completed

        try:
            with get_client(sync_client=True) as client:
                while self.unrecorded:
                    done = Completed(message="its end was recorded after the Prefect server answered again")
                    client.set_flow_run_state(self.unrecorded[0], done, force=True)
                    self.unrecorded.pop(0)
        except (httpx.HTTPError, OSError) as error:
            logger.warning("Prefect does not answer (%s): %d subflows stay Running there", error, len(self.unrecorded))
