"""End to end through the real stack: a real Prefect server (started by `hybridflow.cli.server`), submitit local
worker groups as separate processes, the SQLite run store, the tiny model. Includes SIGKILL + `hf resume`."""

import importlib.util
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_runs import write_reward

from hybridflow.engine.checkpoint import verify_checkpoint
from hybridflow.engine.config import load_config
from hybridflow.flows.store import RunStore

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"

# compared between the resumed and the uninterrupted run (timings and throughputs differ by nature)
COMPARED = [
    "critic/score/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/kl_loss",
    "response_length/mean",
    "critic/advantages/mean",
]


def _cfg(tmp_path, tiny_model_dir, example="grpo_tiny.yaml", extra=()):
    return load_config(
        ROOT / "examples" / example,
        [
            f"model.path={tiny_model_dir}",
            f"trainer.output_dir={tmp_path / 'out'}",
            f"reward.custom_function={write_reward(tmp_path)}",
            "actor.optim.lr=1e-3",
            *extra,
        ],
    )


def _task_names(flow_run_id: str) -> set[str]:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            flow = await client.read_flow_run(flow_run_id)
            return {r.name.rsplit("-", 1)[0] for r in runs}, flow.state.type.value

    names, state = asyncio.run(read())
    assert state == "COMPLETED"
    return names


def _by_step(store: RunStore, run_id: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for p in store.metrics(run_id):
        out.setdefault(p.step, {})[p.name] = p.value
    return out


@pytest.mark.parametrize(
    ("example", "colocate"), [("grpo_tiny.yaml", True), ("ppo_tiny.yaml", True), ("ppo_tiny.yaml", False)]
)
def test_run_records_metrics_placement_and_checkpoints(prefect_api, tmp_path, tiny_model_dir, example, colocate):
    from hybridflow.flows.rlhf import rlhf_flow

    extra = ["trainer.total_iterations=2", "trainer.save_freq=1", f"placement.colocate={str(colocate).lower()}"]
    cfg = _cfg(tmp_path, tiny_model_dir, example, extra)
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = store.create_run(cfg.model_dump(mode="json"), cfg.trainer.experiment_name)
    rlhf_flow(run_id=run_id, db_url=store.url)

    run = store.get_run(run_id)
    assert run.status == "completed" and run.prefect_flow_run_id
    metrics = _by_step(store, run_id)
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        for name in ["actor/pg_loss", "actor/grad_norm", "critic/score/mean", "timing_s/gen", "perf/throughput"]:
            assert math.isfinite(metrics[step][name]), (step, name)
        assert metrics[step]["critic/score/mean"] > 0  # the dense custom reward reached the batch
    val_acc = "val/reasoning_gym/basic_arithmetic/acc"
    assert val_acc in metrics[0] and val_acc in metrics[2]
    critic = example == "ppo_tiny.yaml"
    roles = {p.role for p in store.placements(run_id)}
    assert roles == ({"actor", "rollout", "reward", "critic"} if critic else {"actor", "rollout", "reward", "ref"})
    assert {p.executor for p in store.placements(run_id)} == {"local"}
    groups = {p.role: p.group_name for p in store.placements(run_id)}
    if critic and not colocate:  # split placement: the critic has a worker group of its own
        assert groups["critic"] == "critic" and groups["actor"] == "actor_rollout_ref"
    else:
        assert set(groups.values()) == {"actor_rollout_ref"}
    ckpts = store.checkpoints(run_id)
    assert [c.step for c in ckpts] == [1, 2] and all(c.complete for c in ckpts)
    for c in ckpts:
        assert verify_checkpoint(c.path).sha256 == c.sha256
        assert (Path(c.path) / "critic").is_dir() == critic
    data_files = [p.name for p in (Path(ckpts[0].path).parent.parent / "data").iterdir()]
    assert data_files and all(name.startswith("val-") for name in data_files), data_files  # iterations cleaned up
    names = _task_names(run.prefect_flow_run_id)
    expected = {"generate", "reward", "old_log_prob", "advantage", "update_actor", "checkpoint", "validate"}
    expected |= {"values", "update_critic"} if critic else {"ref_log_prob"}
    assert expected <= names, names
    if critic:
        assert math.isfinite(metrics[2]["critic/vf_loss"])


# the resume tests' runs: 4 iterations of the tiny GRPO run, long enough responses to stop one mid-iteration
RESUMED = ["trainer.total_iterations=4", "trainer.save_freq=1", "trainer.val_before_train=false"]
RESUMED += ["rollout.response_length=48"]


@pytest.fixture(scope="module")
def reference(prefect_api, tmp_path_factory, tiny_model_dir) -> dict[int, dict[str, float]]:
    """Metrics by step of the uninterrupted 4-iteration run that the resumed runs must reproduce."""
    from hybridflow.flows.rlhf import rlhf_flow

    tmp = tmp_path_factory.mktemp("reference")
    cfg = _cfg(tmp, tiny_model_dir, extra=RESUMED)
    store = RunStore(f"sqlite:///{tmp / 'runs.db'}")
    ref_id = store.create_run(cfg.model_dump(mode="json"), "reference")
    rlhf_flow(run_id=ref_id, db_url=store.url)
    return _by_step(store, ref_id)


def _start_hf_run(prefect_api, tmp_path, tiny_model_dir, extra) -> tuple[subprocess.Popen, RunStore, str]:
    """`hf run` of the resume tests' config (with `extra` overrides) as a separate process, its own store."""
    import yaml

    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(_cfg(tmp_path, tiny_model_dir, extra=extra).model_dump(mode="json")))
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    proc = subprocess.Popen(
        [HF, "run", str(config_file), "--db", db, "--prefect-api", prefect_api],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return proc, RunStore(db), db


def _wait_inside_iteration(proc: subprocess.Popen, store: RunStore, step: int) -> str:
    """Wait until the run of `proc` is inside iteration `step` (started, not ended); returns the run id."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        runs = store.list_runs()
        if runs:
            started = {i.step: i for i in store.iterations(runs[0].id)}
            if step in started and started[step].ended_at is None:
                return runs[0].id
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.02)
    raise AssertionError(f"hf run never reached iteration {step}")


def _hf(prefect_api, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HF, *args, "--prefect-api", prefect_api], capture_output=True, text=True, timeout=300)


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigkill_mid_iteration_then_resume_matches_uninterrupted(prefect_api, tmp_path, tiny_model_dir, reference):
    # the run through the CLI, killed with SIGKILL in the middle of iteration 3
    proc, store, db = _start_hf_run(prefect_api, tmp_path, tiny_model_dir, RESUMED)
    run_id = _wait_inside_iteration(proc, store, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert store.get_run(run_id).status == "running"  # killed hard: nothing could record the end
    assert store.latest_checkpoint(run_id).step == 2

    result = _hf(prefect_api, "resume", run_id, "--db", db)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming" in result.stdout and "from iteration 2" in result.stdout
    assert store.get_run(run_id).status == "completed"
    resumed = _by_step(store, run_id)
    assert sorted(resumed) == [1, 2, 3, 4]
    # On CPU the resumed iterations are bit-identical (same weights, optimizer state, data cursor, and sampling
    # seeded from (seed, step)); rel 1e-6 only leaves room for non-deterministic kernels elsewhere.
    for step in (3, 4):
        for name in COMPARED:
            assert resumed[step][name] == pytest.approx(reference[step][name], rel=1e-6, abs=1e-9), (step, name)
    assert [c.step for c in store.checkpoints(run_id)] == [1, 2, 3, 4]


def test_sigterm_records_interrupted_and_resume_extends_the_run(
    prefect_api, tmp_path, tiny_model_dir, reference, monkeypatch
):
    """SIGTERM in the middle of iteration 2 of a 2-iteration run: `hf run` exits 143 within seconds, the run is
    recorded ``interrupted``, its worker processes are gone; `hf resume` finishes it; `hf resume -o
    trainer.total_iterations=4` trains the completed run on, and iterations 3 and 4 equal those of the
    uninterrupted 4-iteration run; an override that changes the computation is refused; `hf runs delete --files`
    removes the run's records and folder."""
    from typer.testing import CliRunner

    from hybridflow.cli.main import app

    two = [*RESUMED, "trainer.total_iterations=2"]
    proc, store, db = _start_hf_run(prefect_api, tmp_path, tiny_model_dir, two)
    run_id = _wait_inside_iteration(proc, store, 2)
    workers = _descendants(proc.pid)
    assert workers, "hf run has no worker processes"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0].decode()
    took = time.monotonic() - sent
    assert proc.returncode == 143, output
    assert took < 20, f"hf run took {took:.1f} s to stop"  # measured ~5 s: a 3 s grace for the busy rank
    assert f"interrupted; continue with: hf resume {run_id}" in output
    record = store.get_run(run_id)
    assert record.status == "interrupted" and "SIGTERM" in record.error
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if _alive(pid)], "worker processes outlived hf run"
    assert store.latest_checkpoint(run_id).step == 1

    finished = _hf(prefect_api, "resume", run_id, "--db", db)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert store.get_run(run_id).status == "completed"

    monkeypatch.setenv("HYBRIDFLOW_DB_URL", db)  # the in-process CLI sets it from --db; restored after the test
    runner = CliRunner()
    done = runner.invoke(app, ["resume", run_id, "--db", db])
    assert done.exit_code == 0 and "already completed (2 iterations)" in done.output
    refused = runner.invoke(
        app, ["resume", run_id, "--db", db, "-o", "trainer.total_iterations=4", "-o", "rollout.n=8"]
    )
    assert refused.exit_code == 2 and "cannot change rollout.n" in " ".join(refused.output.split())
    assert store.get_run(run_id).config["trainer"]["total_iterations"] == 2  # the refusal changed nothing

    extended = _hf(prefect_api, "resume", run_id, "--db", db, "-o", "trainer.total_iterations=4")
    assert extended.returncode == 0, extended.stdout + extended.stderr
    assert "from iteration 2" in extended.stdout and "to iteration 4" in extended.stdout
    record = store.get_run(run_id)
    assert record.status == "completed" and record.config["trainer"]["total_iterations"] == 4
    resumed = _by_step(store, run_id)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):  # stopped, resumed and extended, it is still the uninterrupted run
        for name in COMPARED:
            assert resumed[step][name] == pytest.approx(reference[step][name], rel=1e-6, abs=1e-9), (step, name)

    folder = Path(store.latest_checkpoint(run_id).path).parent.parent
    assert folder.name == run_id and folder.is_dir()
    deleted = runner.invoke(app, ["runs", "delete", run_id, "--files", "--db", db])
    assert deleted.exit_code == 0, deleted.output
    assert [r.id for r in store.list_runs()] == [] and not folder.exists()
    with store.engine.connect() as conn:  # the cascade took every table's rows
        for table in ("iterations", "metrics", "checkpoints", "placements"):
            assert conn.exec_driver_sql(f"select count(*) from {table}").scalar() == 0, table


MEGATRON = ["actor.strategy=megatron", "actor.tp=2", "actor.pp=2", "rollout.gen_tp=1", "placement.tasks_per_node=4"]


@pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None and os.environ.get("CI") != "true",
    reason="megatron-core is not installed (bash .ci/setup installs it)",
)
@pytest.mark.parametrize("example", ["grpo_tiny.yaml", "ppo_tiny.yaml"])
def test_megatron_run_records_its_layout_and_resumes_exactly(prefect_api, tmp_path, tiny_model_dir, example):
    """GRPO with the megatron actor, and PPO with a megatron actor and critic (tp=2, pp=2 on 4 ranks, generating
    at tp=1 through the 3D-HybridEngine): the run completes, its placement records the layouts and groups, and a
    second run resumed from the first one's iteration-1 checkpoint reproduces its iteration 2."""
    from hybridflow.flows.rlhf import rlhf_flow

    critic = example == "ppo_tiny.yaml"
    extra = ["trainer.total_iterations=2", "trainer.save_freq=1", "trainer.val_before_train=false", *MEGATRON]
    extra += ["critic.strategy=megatron"] if critic else []
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    runs = {}
    for name in ("reference", "resumed"):
        (tmp_path / name).mkdir()
        cfg = _cfg(tmp_path / name, tiny_model_dir, example, extra)
        runs[name] = store.create_run(cfg.model_dump(mode="json"), name)
    rlhf_flow(run_id=runs["reference"], db_url=store.url)
    assert store.get_run(runs["reference"]).status == "completed"
    reference = _by_step(store, runs["reference"])
    checked = ["actor/pg_loss", "actor/grad_norm", "hybrid_engine/to_generation_s"]
    checked += ["critic/vf_loss", "critic/grad_norm"] if critic else ["actor/kl_loss"]
    for step in (1, 2):
        for name in checked:
            assert math.isfinite(reference[step][name]), (step, name)
        assert reference[step]["hybrid_engine/received_mib"] > 0  # tp=2, pp=2 -> tp=1: every rank gathers
    placed = {p.role: p.parallel for p in store.placements(runs["reference"])}
    assert placed["actor"]["strategy"] == "megatron" and placed["actor"]["reshard"] == "hybridflow"
    assert placed["actor"]["train"] == {"pp": 2, "tp": 2, "dp": 1}
    assert placed["actor"]["generate"] == {"pp": 1, "tp": 1, "micro_dp": 4, "replicas": 4}
    assert placed["actor"]["micro_dp_groups"] == [[0, 1, 2, 3]] and placed.get("ref") is None
    ckpt = Path(store.checkpoints(runs["reference"])[0].path)
    for role in ("actor", "critic") if critic else ("actor",):
        assert (ckpt / role / "megatron_optim" / "pp1_tp1.pt").is_file(), role

    info = verify_checkpoint(ckpt)
    store.add_checkpoint(runs["resumed"], 1, ckpt, info.bytes, info.sha256)  # as if it had stopped after step 1
    rlhf_flow(run_id=runs["resumed"], db_url=store.url)
    resumed = _by_step(store, runs["resumed"])
    assert sorted(resumed) == [2]
    for name in [*COMPARED, *(["critic/vf_loss", "critic/grad_norm"] if critic else [])]:
        if name in reference[2]:  # bit-identical on CPU, as for the ddp actor above
            assert resumed[2][name] == pytest.approx(reference[2][name], rel=1e-6, abs=1e-9), name
