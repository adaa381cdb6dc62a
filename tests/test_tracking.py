"""The experiment trackers through their real libraries, read back from what each wrote: jsonl files, TensorBoard
event files, a wandb offline run file, an MLflow store (file: and sqlite:)."""

import json
import struct
from pathlib import Path

import pytest

from hybridflow.engine.tracking import GENERATION_COLUMNS, Tracking, markdown_table, missing_libraries

STEPS = {
    0: {"val/gsm8k/acc": 0.25},
    1: {"critic/score/mean": 0.5, "actor/pg_loss": -0.125, "val/gsm8k/acc": 0.5, "timing_s/gen": 1.5},
    2: {"critic/score/mean": 0.75, "actor/pg_loss": 0.0625, "val/gsm8k/acc": 0.75, "val-core/gsm8k/acc/mean@1": 0.75},
}
SAMPLES = [
    {"step": 2, "data_source": "gsm8k", "prompt": "1+1=?", "response": "2 | two\nlines", "score": 1.0,
     "ground_truth": "2"},
    {"step": 2, "data_source": "gsm8k", "prompt": "2+2=?", "response": "5", "score": 0.0, "ground_truth": "4"},
]  # fmt: skip


def _log_all(tracking: Tracking) -> None:
    for step, metrics in STEPS.items():
        tracking.log({**metrics, "skipped/none": None}, step)
    tracking.log_generations(SAMPLES, 2, "val")
    tracking.finish()


def _expected(name: str) -> list[tuple[int, float]]:
    return [(step, m[name]) for step, m in STEPS.items() if name in m]


def _wandb_records(path):
    """The records of a wandb transaction log (``run-<id>.wandb``): a 7-byte header, then LevelDB-style 32 KiB
    blocks of chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block, offset, pending = path.read_bytes(), 32768, 7, b""
    assert raw[:4] == b":W&B"
    while offset + 7 <= len(raw):
        if block - offset % block < 7:  # the block's tail is padding
            offset += block - offset % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[offset : offset + 7])
        pending += raw[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_jsonl_tensorboard_wandb_mlflow_read_back(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for var in ("WANDB_MODE", "WANDB_API_KEY", "TENSORBOARD_DIR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no wandb login: it must go offline by itself
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    uri = f"file:{tmp_path / 'mlruns'}"
    config = {"trainer": {"project_name": "proj", "total_iterations": 2}, "actor": {"optim": {"lr": 1e-6}}}
    _log_all(Tracking(["jsonl", "tensorboard", "wandb", "mlflow"], tmp_path / "run", "proj", "exp", "run-1", config,
                      mlflow_uri=uri))  # fmt: skip

    # jsonl: one line per step, None dropped; generations with their kind
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": step, **metrics} for step, metrics in STEPS.items()]
    generations = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert generations == [{"kind": "val", **s} for s in SAMPLES]

    # TensorBoard: the scalars under the store's names, the generations as a Markdown table
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    for name in ("critic/score/mean", "val/gsm8k/acc", "actor/pg_loss"):
        assert [(e.step, e.value) for e in events.Scalars(name)] == _expected(name)
    (text,) = events.Tensors("val/generations/text_summary")
    assert text.step == 2 and "2 \\| two<br>lines" in text.tensor_proto.string_val[0].decode()

    # wandb: an offline run with the run id, its history rows per step, the generations table
    (wandb_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-run-1.wandb")
    history, run_ids = {}, set()
    for record in _wandb_records(wandb_file):
        if record.WhichOneof("record_type") == "run":
            run_ids.add((record.run.run_id, record.run.project, record.run.run_group))
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(row["_step"], {}).update(row)
    assert run_ids == {("run-1", "proj", "exp")}
    for step, metrics in STEPS.items():
        assert {k: history[step][k] for k in metrics} == metrics
    assert history[2]["val/generations/_type"] == "table-file" and history[2]["val/generations/nrows"] == 2

    # MLflow: experiment = project, run named and tagged with the run id, metric histories, params, the table
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags["hybridflow.run_id"] == "run-1" and run.info.run_name == "run-1"
    assert run.info.status == "FINISHED" and run.data.params["actor.optim.lr"] == "1e-06"
    for name in ("critic/score/mean", "val/gsm8k/acc"):
        assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)) == _expected(name)
    verl_named = client.get_metric_history(run.info.run_id, "val-core/gsm8k/acc/mean_at_1")  # verl's '@' -> '_at_'
    assert [(m.step, m.value) for m in verl_named] == [(2, 0.75)]
    saved = client.download_artifacts(run.info.run_id, "generations/val_step_2.json", str(tmp_path))
    table = json.loads(Path(saved).read_text())
    assert table["columns"] == list(GENERATION_COLUMNS) and [row[3] for row in table["data"]] == ["2 | two\nlines", "5"]


def test_a_resumed_run_continues_its_mlflow_and_wandb_runs(tmp_path, monkeypatch):
    """A second session of the same run id logs into the same MLflow run (sqlite store, artifacts beside it) and
    the same wandb run id; a failed session leaves its MLflow run FAILED."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = dict(project_name="proj", experiment_name="exp", run_id="run-2", config={}, mlflow_uri=uri)
    first = Tracking(["mlflow", "wandb"], tmp_path / "run", mlflow_artifacts=tmp_path / "mlartifacts", **common)
    first.log(STEPS[1], 1)
    first.finish(ok=False)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.status == "FAILED"
    second = Tracking(["mlflow", "wandb"], tmp_path / "run", mlflow_artifacts=tmp_path / "mlartifacts", **common)
    second.log(STEPS[2], 2)
    second.log_generations(SAMPLES, 2, "train")
    second.finish()
    (again,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert sorted((m.step, m.value) for m in history) == _expected("critic/score/mean")
    assert (tmp_path / "mlartifacts").is_dir()  # a local store keeps its artifacts beside it, not in the cwd
    assert len(list((tmp_path / "run" / "wandb").glob("offline-run-*/run-run-2.wandb"))) == 2


def test_a_resume_rewinds_jsonl_and_tensorboard_so_each_step_shows_once(tmp_path, monkeypatch):
    """A run that logged steps 0-2 and resumes from its checkpoint of step 1 logs step 2 again: its jsonl files and
    TensorBoard events keep the first session's steps 0-1 and the second session's 2-3, each step once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    first = Tracking(["jsonl", "tensorboard"], tmp_path / "run", "proj", "exp", "run-3", {}, first_step=0)
    _log_all(first)  # steps 0, 1, 2 and step 2's generations
    second = Tracking(["jsonl", "tensorboard"], tmp_path / "run", "proj", "exp", "run-3", {}, first_step=2)
    again = {2: {"critic/score/mean": 0.875}, 3: {"critic/score/mean": 1.0}}
    for step, metrics in again.items():
        second.log(metrics, step)
    second.log_generations(SAMPLES[:1], 2, "train")
    second.finish()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert lines[2] == {"step": 2, **again[2]}
    generations = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert generations == [{"kind": "train", **SAMPLES[0]}]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    shown = [(e.step, e.value) for e in events.Scalars("critic/score/mean")]
    assert shown == [(1, 0.5), (2, 0.875), (3, 1.0)]


def test_markdown_table_escapes_cells_and_missing_libraries():
    table = markdown_table(SAMPLES, limit=4)
    assert table.splitlines()[0] == "| " + " | ".join(GENERATION_COLUMNS) + " |"
    assert "| 2 \\| … |" in table  # cut to 4 characters, then the pipe escaped
    assert missing_libraries(["console", "jsonl", "tensorboard"]) == []


def test_an_unknown_tracker_is_a_config_error():
    from hybridflow.engine.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="trainer.logger"):
        load_config(None, ["data.reasoning_gym.name=basic_arithmetic", "trainer.logger=[console,neptune]"])
    cfg = load_config(None, ["data.reasoning_gym.name=basic_arithmetic", "trainer.logger=wandb"])
    assert cfg.trainer.logger == ["wandb"]
