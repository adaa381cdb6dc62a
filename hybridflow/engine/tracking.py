"""Experiment trackers: the run's metrics and sample generations, sent to the libraries ``trainer.logger`` names.

`Tracking` fans every record out to its backends, each through its own library: ``jsonl`` (``metrics.jsonl`` and
``generations.jsonl``), ``tensorboard`` (``torch.utils.tensorboard`` event files), ``wandb`` (offline, with a note,
when no login is configured) and ``mlflow`` (any tracking URI). Metric names are the run store's
(``critic/score/mean``, ``val/<data_source>/acc``, ...); the step is the iteration (``training/global_step``; 0 is
the validation before training). ``console`` is the terminal display's business (``hf run`` prints one line per
iteration; `hybridflow.cli.progress`) and needs nothing here.

A resumed run logs into the same tracker run: the same folders, the same wandb run id (``resume="allow"``) and the
MLflow run tagged ``hybridflow.run_id``. Iterations redone after a crash are logged again (the last record of a step
is the one that counts, as in the run store).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridflow.engine.config import dotted_leaves

logger = logging.getLogger(__name__)

GENERATION_COLUMNS = ("step", "data_source", "prompt", "response", "score", "ground_truth")
"""The columns of a generations table, in every tracker and in the run store's ``samples`` table."""

_LIBRARIES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
_MLFLOW_NAME = re.compile(r"[^\w\-. /:]")  # characters MLflow refuses in metric names


def mlflow_name(metric: str) -> str:
    """`metric` as MLflow takes it, as verl's tracker writes it (``verl/utils/tracking.py::_sanitize_key``): ``@`` as
    ``_at_`` (``val-core/openai/gsm8k/reward/mean_at_1``), any other character MLflow refuses as ``_``."""
    return _MLFLOW_NAME.sub("_", metric.replace("@", "_at_"))


def missing_libraries(backends: Sequence[str]) -> list[str]:
    """The backends of `backends` whose library is not installed (to say so before a run starts)."""
    import importlib.util

    return [b for b in backends if b in _LIBRARIES and importlib.util.find_spec(_LIBRARIES[b]) is None]


def mlflow_tracking_uri(configured: str | None, output_dir: str | os.PathLike[str]) -> str:
    """The MLflow tracking URI: ``trainer.mlflow_tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else a SQLite file
    ``<output_dir>/mlflow.db`` (MLflow's file store refuses to start unless opted into)."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(output_dir).resolve()}/mlflow.db"


def markdown_table(samples: Sequence[Mapping[str, Any]], limit: int = 400) -> str:
    """Samples as a Markdown table (`GENERATION_COLUMNS`; cells cut to `limit` characters, ``|`` and newlines
    escaped), for TensorBoard's text plugin and the Prefect UI."""

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        text = text if len(text) <= limit else text[:limit] + "…"
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(GENERATION_COLUMNS) + " |", "|" + "---|" * len(GENERATION_COLUMNS)]
    lines += ["| " + " | ".join(cell(s.get(c, "")) for c in GENERATION_COLUMNS) + " |" for s in samples]
    return "\n".join(lines)


class _Jsonl:
    """``<log_dir>/metrics.jsonl`` (``{"step": N, <name>: value, ...}`` per line; NaN and ±inf as null) and
    ``generations.jsonl`` (one sample per line, with ``kind``: train or val)."""

    def __init__(self, log_dir: Path, first_step: int | None) -> None:
        self.metrics, self.generations = log_dir / "metrics.jsonl", log_dir / "generations.jsonl"
        if first_step is not None:
            for path in (self.metrics, self.generations):
                _rewind_jsonl(path, first_step)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        finite = {k: v if math.isfinite(v) else None for k, v in metrics.items()}  # NaN/inf: null, as in the store
        with open(self.metrics, "a") as f:
            f.write(json.dumps({"step": step, **finite}) + "\n")

    def log_generations(self, samples: Sequence[Mapping[str, Any]], step: int, kind: str) -> None:
        with open(self.generations, "a") as f:
            f.writelines(json.dumps({"kind": kind, **s}) + "\n" for s in samples)

    def finish(self, ok: bool = True) -> None:
        pass


def _rewind_jsonl(path: Path, first_step: int) -> None:
    """Drop the lines of `path` (if it exists) whose ``step`` is `first_step` or later (a resumed run logs them
    again), atomically: a temporary file renamed over it."""
    if not path.exists():
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", -1) < first_step]
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text("".join(kept))
    os.replace(partial, path)


class _TensorBoard:
    """Event files under ``$TENSORBOARD_DIR`` (verl's variable) or ``<log_dir>/tensorboard``; generations as a
    Markdown table in the text plugin (tag ``<kind>/generations``)."""

    def __init__(self, log_dir: Path, first_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder = Path(os.environ.get("TENSORBOARD_DIR") or log_dir / "tensorboard")
        resumed = first_step is not None and folder.is_dir() and any(folder.iterdir())
        # purge_step: TensorBoard drops the events written before of that step and later
        self.writer = SummaryWriter(str(folder), purge_step=first_step if resumed else None)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_generations(self, samples: Sequence[Mapping[str, Any]], step: int, kind: str) -> None:
        self.writer.add_text(f"{kind}/generations", markdown_table(samples), step)
        self.writer.flush()

    def finish(self, ok: bool = True) -> None:
        self.writer.close()


class _Wandb:
    """A wandb run with id = the run id (resumed runs append), group = experiment, files under ``<log_dir>/wandb``.

    Without a login (no ``WANDB_API_KEY``, no ``~/.netrc`` entry) and no ``WANDB_MODE``, it runs offline and says
    how to upload later (``wandb sync``)."""

    def __init__(self, log_dir: Path, project: str, experiment: str, run_id: str, config: Mapping[str, Any]) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_logged_in() else "offline")
        if mode == "offline" and not os.environ.get("WANDB_MODE"):
            logger.warning("wandb: no login found (WANDB_API_KEY, wandb login); logging offline under %s", log_dir)
        self.wandb = wandb
        self.run = wandb.init(
            project=project,
            group=experiment,
            name=run_id,
            id=run_id,
            resume="allow",
            dir=str(log_dir),
            config=dict(config),
            mode=mode,
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_generations(self, samples: Sequence[Mapping[str, Any]], step: int, kind: str) -> None:
        rows = [[s.get(c) for c in GENERATION_COLUMNS] for s in samples]
        self.run.log({f"{kind}/generations": self.wandb.Table(columns=list(GENERATION_COLUMNS), data=rows)}, step=step)

    def finish(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace")


class _MLflow:
    """An MLflow run in experiment `project` named after the run id, tagged ``hybridflow.run_id`` (a resumed run
    continues it), with the config's leaves as params; generations as table artifacts
    ``generations/<kind>_step_<N>.json``. A new experiment in a SQLite store keeps its artifacts in `artifacts`
    (``hf run``: ``<output_dir>/mlartifacts``; MLflow's default would be ``./mlruns`` of whatever folder the run
    started in); a file store or a server keeps them where it does."""

    def __init__(self, uri: str, artifacts: Path, project: str, run_id: str, config: Mapping[str, Any]) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # not its database set-up lines in the live display
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the user chose a file store: let MLflow use it
        self.client = MlflowClient(uri)
        self.mlflow = mlflow
        experiment = self.client.get_experiment_by_name(project)
        if experiment is None:
            location = artifacts.resolve().as_uri() if uri.startswith("sqlite:") else None  # else: the store's own
            experiment_id = self.client.create_experiment(project, artifact_location=location)
        else:
            experiment_id = experiment.experiment_id
        found = self.client.search_runs([experiment_id], f"tags.`hybridflow.run_id` = '{run_id}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {"hybridflow.run_id": run_id, "mlflow.runName": run_id}
            self.run_id = self.client.create_run(experiment_id, tags=tags, run_name=run_id).info.run_id
            params = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in dotted_leaves(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        import time

        now = int(time.time() * 1000)
        batch = [self.mlflow.entities.Metric(mlflow_name(k), float(v), now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_generations(self, samples: Sequence[Mapping[str, Any]], step: int, kind: str) -> None:
        table = {c: [s.get(c) for s in samples] for c in GENERATION_COLUMNS}
        self.client.log_table(self.run_id, table, artifact_file=f"generations/{kind}_step_{step}.json")

    def finish(self, ok: bool = True) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


class Tracking:
    """The run's trackers (verl's ``Tracking``): ``log(metrics, step)``, ``log_generations(samples, step, kind)``,
    ``finish()``.

    Args:
        backends: ``trainer.logger`` (``console`` is ignored here: the terminal display prints it).
        log_dir: the folder for ``jsonl``, ``tensorboard`` and ``wandb`` files (``hf run``: the run folder).
        project_name: ``trainer.project_name``: the wandb project, the MLflow experiment.
        experiment_name: ``trainer.experiment_name``: the wandb group.
        run_id: the run store's id: the wandb run id, the MLflow run name.
        config: the validated config as JSON data: wandb's config, MLflow's params.
        mlflow_uri: the MLflow tracking URI (`mlflow_tracking_uri`); None: the default for ``<log_dir>``.
        mlflow_artifacts: where a new MLflow experiment in a SQLite store keeps its artifacts (default
            ``<log_dir>/mlartifacts``).
        first_step: the first step this session logs: a resumed run's jsonl files and TensorBoard events of that
            step and later, logged before the resume, are dropped, so each step shows once (as in the run store);
            None: nothing dropped. wandb and MLflow keep theirs (their APIs rewind no history offline).

    Raises:
        ImportError: a backend's library is not installed (``pip install 'hybridflow[trackers]'``).
    """

    def __init__(
        self,
        backends: Sequence[str],
        log_dir: str | os.PathLike[str],
        project_name: str,
        experiment_name: str,
        run_id: str,
        config: Mapping[str, Any],
        mlflow_uri: str | None = None,
        mlflow_artifacts: str | os.PathLike[str] | None = None,
        first_step: int | None = None,
    ) -> None:
        if missing := missing_libraries(backends):
            raise ImportError(
                f"trainer.logger names {', '.join(missing)}, not installed: pip install 'hybridflow[trackers]' "
                f"(or drop {', '.join(missing)} from trainer.logger)"
            )
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.backends: dict[str, Any] = {}
        try:
            for name in backends:
                if name == "jsonl":
                    self.backends[name] = _Jsonl(log_dir, first_step)
                elif name == "tensorboard":
                    self.backends[name] = _TensorBoard(log_dir, first_step)
                elif name == "wandb":
                    self.backends[name] = _Wandb(log_dir, project_name, experiment_name, run_id, config)
                elif name == "mlflow":
                    uri = mlflow_uri or mlflow_tracking_uri(None, log_dir)
                    artifacts = Path(mlflow_artifacts) if mlflow_artifacts else log_dir / "mlartifacts"
                    self.backends[name] = _MLflow(uri, artifacts, project_name, run_id, config)
        except BaseException:
            self.finish(ok=False)
            raise

    def log(self, metrics: Mapping[str, float | None], step: int) -> None:
        """Send one step's scalar metrics (None and non-numbers are skipped) to every backend."""
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}
        if clean:
            for backend in self.backends.values():
                backend.log(clean, step)

    def log_generations(self, samples: Sequence[Mapping[str, Any]], step: int, kind: str) -> None:
        """Send samples (dicts with `GENERATION_COLUMNS`) of step `step`; `kind` is ``train`` or ``val``."""
        if samples:
            for backend in self.backends.values():
                backend.log_generations(samples, step, kind)

    def finish(self, ok: bool = True) -> None:
        """Close every backend (flush files; end the wandb and MLflow runs, as failed unless `ok`: a failed or
        interrupted run, which a resume continues); errors are logged, not raised."""
        for name, backend in self.backends.items():
            try:
                backend.finish(ok)
            except Exception:
                logger.exception("closing the %s tracker failed", name)
        self.backends.clear()
