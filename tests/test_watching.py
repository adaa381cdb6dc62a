"""Watching a run, end to end: `hf run` of the tiny GRPO run with every tracker, sample generations and a reward
with extra keys, on a real Prefect server; then what each tracker, the run store, `hf runs samples`, `hf runs plot`
and the Prefect UI (its API, and the flow-run page in headless Chromium) show of it."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_tracking import _wandb_records

from hybridflow.engine.config import load_config
from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
CHROMIUM = shutil.which("chromium")

REWARD = '''
def graded(data_source, solution_str, ground_truth, extra_info):
    """The share of digits as the score, plus two extra keys a user would log."""
    digits = sum(c.isdigit() for c in solution_str)
    return {"score": digits / max(1, len(solution_str)), "acc": 0.0, "digits": float(digits)}
'''


@pytest.fixture(scope="module")
def watched(prefect_api, tmp_path_factory, tiny_model_dir):
    """One `hf run` (2 iterations, validation before and after) with every tracker; returns what the tests need."""
    root = tmp_path_factory.mktemp("watched")
    (root / "graded.py").write_text(REWARD)
    cfg = load_config(
        ROOT / "examples" / "grpo_tiny.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"trainer.output_dir={root / 'out'}",
            f"reward.custom_function={root / 'graded.py'}:graded",
            "trainer.total_iterations=2",
            "trainer.experiment_name=watch",
            "trainer.project_name=watching",
            "trainer.logger=[console,jsonl,tensorboard,wandb,mlflow]",
            "trainer.log_val_generations=3",
            "trainer.log_train_generations=2",
        ],
    )
    config_file = root / "config.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    db = f"sqlite:///{root / 'runs.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TENSORBOARD_"))}
    env["NETRC"] = str(root / "no-netrc")  # no wandb login here: the run must log offline by itself
    proc = subprocess.run(
        [HF, "run", str(config_file), "--db", db, "--prefect-api", prefect_api],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    store = RunStore(db)
    (run,) = store.list_runs()
    return {"root": root, "db": db, "store": store, "run": run, "out": proc.stdout, "api": prefect_api, "env": env}


def _hf(watched, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [HF, *args, "--db", watched["db"]], capture_output=True, text=True, timeout=120, cwd=watched["root"]
    )


def _by_step(store: RunStore, run_id: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for p in store.metrics(run_id):
        out.setdefault(p.step, {})[p.name] = p.value
    return out


def test_every_tracker_has_the_store_metrics(watched):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store, run = watched["store"], watched["run"]
    stored = _by_step(store, run.id)
    assert sorted(stored) == [0, 1, 2]
    run_dir = watched["root"] / "out" / "watch" / run.id

    # reward extras: every extra key of the custom reward's dict, averaged per iteration
    for step in (1, 2):
        assert stored[step]["reward_extra/acc/mean"] == 0.0
        assert stored[step]["reward_extra/digits/mean"] >= 0.0
    assert "step 1  critic/score/mean=" in watched["out"]  # console: one line per iteration

    jsonl = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        jsonl[record.pop("step")] = record
    assert jsonl == stored

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    val_acc = "val/reasoning_gym/basic_arithmetic/acc"
    for name in ("critic/score/mean", "actor/pg_loss", "reward_extra/digits/mean", val_acc):
        expected = [(s, pytest.approx(m[name], rel=1e-6)) for s, m in sorted(stored.items()) if name in m]
        assert [(e.step, e.value) for e in events.Scalars(name)] == expected

    (wandb_file,) = (run_dir / "wandb").glob(f"offline-run-*/run-{run.id}.wandb")
    history: dict[int, dict] = {}
    for record in _wandb_records(wandb_file):
        if record.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(row["_step"], {}).update(row)
    for step, metrics in stored.items():
        assert {k: history[step][k] for k in metrics} == pytest.approx(metrics)
    assert history[2]["val/generations/nrows"] == 3 and history[1]["train/generations/nrows"] == 2

    client = MlflowClient(f"sqlite:///{watched['root'] / 'out' / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("watching").experiment_id])
    assert mlflow_run.info.run_name == run.id and mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.metrics["critic/score/mean"] == pytest.approx(stored[2]["critic/score/mean"])
    artifacts = {a.path for a in client.list_artifacts(mlflow_run.info.run_id, "generations")}
    kept = [("val", 0), ("train", 1), ("val", 2), ("train", 2)]
    assert artifacts == {f"generations/{kind}_step_{step}.json" for kind, step in kept}
    assert (watched["root"] / "out" / "mlartifacts").is_dir()


def test_samples_are_kept_and_printed(watched):
    store, run = watched["store"], watched["run"]
    samples = store.samples(run.id)
    assert [(s.step, s.kind) for s in samples] == [(0, "val")] * 3 + [(1, "train")] * 2 + [(2, "train")] * 2 + [
        (2, "val")
    ] * 3
    val = store.samples(run.id, step=2, kind="val")
    assert all(s.prompt and s.ground_truth and s.data_source == "reasoning_gym/basic_arithmetic" for s in val)
    assert [s.prompt for s in val] == [s.prompt for s in store.samples(run.id, step=0)]  # the same held-out prompts
    printed = _hf(watched, "runs", "samples", run.id, "--step", "2", "--kind", "val")
    assert printed.returncode == 0, printed.stderr
    assert val[0].prompt.splitlines()[0] in printed.stdout and f"ground truth {val[0].ground_truth}" in printed.stdout
    lines = _hf(watched, "runs", "samples", run.id, "--json").stdout.splitlines()
    assert [json.loads(line)["response"] for line in lines] == [s.response for s in samples]
    shown = _hf(watched, "runs", "show", run.id).stdout
    assert f"10 sample generations at steps 0..2: hf runs samples {run.id}" in shown
    generations = (watched["root"] / "out" / "watch" / run.id / "generations.jsonl").read_text().splitlines()
    assert len(generations) == len(samples)


def test_plot_is_a_real_picture(watched):
    import matplotlib.image

    run = watched["run"]
    out = watched["root"] / "plot.png"
    done = _hf(watched, "runs", "plot", run.id, run.id, "--out", str(out), "--no-show")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "critic/score/mean" in done.stdout and "val/reasoning_gym/basic_arithmetic/acc" in done.stdout
    pixels = matplotlib.image.imread(out)
    assert pixels.shape[0] > 300 and pixels.shape[1] > 800  # panels side by side
    assert pixels[..., :3].std() > 0.05  # not a blank canvas: axes, lines, text
    wrong = _hf(watched, "runs", "plot", run.id, "--name", "actor/no_such_metric", "--out", str(out))
    assert wrong.returncode == 2 and "no metric matches" in wrong.stdout and "critic/score/mean" in wrong.stdout
    raw, smoothed = watched["root"] / "raw.png", watched["root"] / "smoothed.png"
    for png, extra in ((raw, []), (smoothed, ["--smooth", "0.6"])):
        done = _hf(watched, "runs", "plot", run.id, *extra, "--out", str(png), "--no-show")
        assert done.returncode == 0, done.stdout + done.stderr
    assert not np.array_equal(matplotlib.image.imread(raw), matplotlib.image.imread(smoothed))  # other lines
    too_much = _hf(watched, "runs", "plot", run.id, "--smooth", "1", "--out", str(smoothed))
    assert too_much.returncode == 2 and "--smooth must be in [0, 1)" in too_much.stdout


def test_smoothing_is_tensorboards_debiased_ema():
    """TensorBoard's formula (its line chart's smoothing): EMA from 0, divided by 1 - w^k; the first point is its
    own value, a constant series stays constant, weight 0 is the identity."""
    from hybridflow.cli.plots import ema

    assert ema([3.0, 5.0], 0.6) == pytest.approx([3.0, (0.6 * 0.4 * 3.0 + 0.4 * 5.0) / (1 - 0.36)], rel=1e-12)
    assert ema([2.0] * 5, 0.9) == pytest.approx([2.0] * 5, rel=1e-12)
    assert ema([1.0, 4.0, 2.0], 0.0) == [1.0, 4.0, 2.0]


def test_plot_is_drawn_inline_in_an_image_terminal(watched):
    """In a terminal that speaks iTerm2's inline-image protocol (stdout a pseudo-terminal, TERM_PROGRAM=iTerm.app),
    the PNG itself is written to the terminal."""
    import base64
    import pty

    out = watched["root"] / "inline.png"
    parent, child = pty.openpty()
    env = {**os.environ, "TERM_PROGRAM": "iTerm.app"}
    proc = subprocess.Popen(
        [HF, "runs", "plot", watched["run"].id, "--out", str(out), "--db", watched["db"]],
        stdout=child,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(child)
    shown = b""
    while True:
        try:
            chunk = os.read(parent, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    os.close(parent)
    head, _, rest = shown.partition(b"\x1b]1337;File=inline=1;")
    assert rest, shown[:300]
    payload = rest.split(b":", 1)[1].split(b"\x07", 1)[0]
    assert base64.b64decode(payload) == out.read_bytes()


def test_version_is_hybridflows():
    from importlib.metadata import version

    for command in (HF, shutil.which("hybridflow", path=str(Path(sys.executable).parent))):
        done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
        assert done.stdout.strip() == f"hybridflow {version('hybridflow')}"


def _prefect(flow_run_id: str):
    """The flow run, its and its subflows' task runs, its logs (oldest first) and artifacts, and its subflows' ids
    by name, each read with a server-side filter on the flow run and paged: the server answers at most
    ``PREFECT_API_DEFAULT_LIMIT`` (200) rows a read, and the test session's one server holds every run's rows."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.client.schemas.sorting import LogSort

    async def paged(read, **kwargs):
        rows, page = [], 200
        while True:
            got = await read(**kwargs, limit=page, offset=len(rows))
            rows += got
            if len(got) < page:
                return rows

    async def read():
        async with get_client() as client:
            flow_run = await client.read_flow_run(flow_run_id)
            subflows = await client.read_flow_runs(  # one per iteration, holding its stages' task runs
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
            )
            ids = [flow_run_id, *(f.id for f in subflows)]
            tasks = await paged(client.read_task_runs, flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
            logs = await paged(
                client.read_logs,
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                sort=LogSort.TIMESTAMP_ASC,
            )
            artifacts = await paged(
                client.read_artifacts,
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])),
            )
            return flow_run, tasks, logs, artifacts, {f.name: f.id for f in subflows}

    return asyncio.run(read())


def test_prefect_shows_the_run(watched):
    run = watched["run"]
    flow_run, tasks, logs, artifacts, subflows = _prefect(run.prefect_flow_run_id)
    assert flow_run.name == f"watch/{run.id}"
    assert {"experiment:watch", "algorithm:grpo", "executor:local", "actor:ddp"} <= set(flow_run.tags)
    names = {t.name for t in tasks}
    assert {"generate-1", "update_actor-1", "update_actor-2", "validate-0", "validate-2", "checkpoint-2"} <= names
    # the timeline groups each iteration's stages under its subflow; validations and checkpoints stay on the run's
    assert set(subflows) == {"iteration 1", "iteration 2"}
    by_flow = {}
    for t in tasks:
        by_flow.setdefault(t.flow_run_id, set()).add(t.name)
    for step in (1, 2):
        inside = by_flow[subflows[f"iteration {step}"]]
        assert {f"generate-{step}", f"update_actor-{step}", f"reward-{step}"} <= inside, inside
        assert all(name.endswith(f"-{step}") for name in inside), inside
    assert {"validate-0", "validate-2", "checkpoint-2"} <= by_flow[flow_run.id]
    assert not any(name.startswith(("generate-", "update_actor-")) for name in by_flow[flow_run.id])
    lines = [log.message for log in logs]
    assert any("rank 0: update_actor done in" in line for line in lines), lines[:20]  # a worker's line
    assert any(line.startswith("[actor_rollout_ref ") for line in lines)
    controller = [log.message for log in logs if log.name == "hybridflow.flows.rlhf"]
    assert controller[0].startswith(f"run {run.id}: iterations 1 to 2; worker groups actor_rollout_ref (1 ranks")
    assert controller[-1].startswith("iteration 2 done in ")
    text = {a.description: a.data for a in artifacts}
    assert set(text) == {f"{run.id} validation before training", f"{run.id} iteration 1", f"{run.id} iteration 2"}
    assert "| critic/score/mean |" in text[f"{run.id} iteration 1"]
    assert "validation generations (first 3)" in text[f"{run.id} iteration 2"]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/setup installs it)")
def test_the_flow_run_page_in_a_browser_shows_the_artifact(watched):
    """Load the flow run's page of the Prefect UI in headless Chromium, open its Artifacts tab and find the text of
    the last iteration's artifact; the screenshot is kept next to the run."""
    from playwright.sync_api import sync_playwright

    run = watched["run"]
    ui = watched["api"].removesuffix("/api")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        shot = watched["root"] / "prefect-flow-run.png"
        try:
            page.goto(f"{ui}/runs/flow-run/{run.prefect_flow_run_id}", wait_until="networkidle")
            page.get_by_text(f"watch/{run.id}").first.wait_for(timeout=30_000)
            page.get_by_text("Artifacts", exact=True).first.click()
            page.get_by_text(f"{run.id} iteration 2").first.click()  # the artifact's page: its Markdown rendered
            page.get_by_text("validation generations (first 3)").first.wait_for(timeout=30_000)
            page.get_by_text("critic/score/mean").first.wait_for(timeout=30_000)
        except Exception as e:
            page.screenshot(path=str(shot))
            raise AssertionError(f"{e}\n(screenshot {shot}) the page says:\n{page.inner_text('body')[:3000]}") from None
        page.screenshot(path=str(shot))
        browser.close()
