"""End to end through the real stack: a real Prefect server (started by `hybridflow.cli.server`), submitit local
worker groups as separate processes, the SQLite run store, the tiny model. Includes SIGKILL + `hf resume`."""

import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import alive
from tiny_runs import rank_pids, wait_inside_iteration, write_cost, write_reward

from hybridflow.engine.checkpoint import read_trainer_state, verify_checkpoint
from hybridflow.engine.config import load_config
from hybridflow.flows.store.run_store import RunStore

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


def _flow_run_state(flow_run_id: str) -> tuple[str, str]:
    """A flow run's state type and message, from the Prefect server."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    return state.type.value, state.message or ""


def _subflows(flow_run_id: str) -> list:
    """The flow run's subflow runs (one per iteration), from the Prefect server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        of_run = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        return client.read_flow_runs(flow_run_filter=of_run)


def _task_names(flow_run_id: str) -> set[str]:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    async def read():
        async with get_client() as client:
            subflows = await client.read_flow_runs(  # the iterations (each one's stages are its task runs)
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
            )
            ids = [flow_run_id, *(f.id for f in subflows)]
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
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


DAPO = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward", "data.gen_batch_size=2"]


@pytest.mark.parametrize(
    ("example", "colocate", "algorithm"),
    # plain GRPO runs in the resume tests below, colocated PPO as the reference of the four-pool tests; Safe-RLHF is
    # PPO with a cost critic beside the critic (here in a pool of its own) and the Lagrangian multiplier
    [
        ("grpo_tiny.yaml", True, "dapo"),
        ("grpo_tiny.yaml", True, "remax"),
        ("ppo_tiny.yaml", False, "safe_rlhf"),
        ("ppo_tiny.yaml", True, "pf_ppo"),
    ],
)
def test_run_records_metrics_placement_and_checkpoints(
    prefect_api, tmp_path, tiny_model_dir, example, colocate, algorithm
):
    from hybridflow.flows.rlhf import rlhf_flow

    extra = ["trainer.total_iterations=2", "trainer.save_freq=1", f"placement.colocate={str(colocate).lower()}"]
    if algorithm == "safe_rlhf":  # every response costs more than 0: lambda rises each iteration
        extra += ["algorithm.adv_estimator=gae", "algorithm.cost_limit=0"]
        extra += [f"reward.cost_function={write_cost(tmp_path)}"]
    elif algorithm == "pf_ppo":  # PPO trains on the batch redrawn by reward (rows repeated across the data files)
        extra += ["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true"]
    else:
        extra += DAPO if algorithm == "dapo" else [f"algorithm.adv_estimator={algorithm}"]
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
        assert 0 < metrics[step]["perf/mfu/actor"] < 1  # the update's needed FLOPs over its seconds and the peak
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
        assert (Path(c.path) / "cost_critic").is_dir() == (algorithm == "safe_rlhf")
    data_files = [p.name for p in (Path(ckpts[0].path).parent.parent / "data").iterdir()]
    assert data_files and all(name.startswith("val-") for name in data_files), data_files  # iterations cleaned up
    names = _task_names(run.prefect_flow_run_id)
    expected = {"generate", "reward", "old_log_prob", "advantage", "update_actor", "checkpoint", "validate"}
    expected |= {"values", "update_critic"} if critic else {"ref_log_prob"}
    assert expected <= names, names
    assert ("generate_greedy" in names) == (algorithm == "remax")  # ReMax's baseline: a stage of its own
    assert ("filter_groups" in names) == (algorithm == "dapo")
    assert ("policy_filtration" in names) == (algorithm == "pf_ppo")
    for step in (1, 2):
        if algorithm == "remax":
            assert metrics[step]["timing_s/gen_max"] > 0 and math.isfinite(metrics[step]["critic/reward_baseline/mean"])
        if algorithm == "dapo":  # 2 prompts a draw for a batch of 4: at least two draws, each its own samples
            assert metrics[step]["train/num_gen_batches"] >= 2
        if algorithm == "pf_ppo":  # 8 rows drawn with replacement (seeded): some repeat
            assert 0 < metrics[step]["pf_ppo/distinct_fraction"] < 1 and metrics[step]["critic/vf_loss"] >= 0
    if algorithm == "dapo":  # every draw advanced the cursor the checkpoint keeps
        state = read_trainer_state(ckpts[1].path)["sampler"]
        assert state["index"] == 2 * (metrics[1]["train/num_gen_batches"] + metrics[2]["train/num_gen_batches"])
    if critic:
        assert math.isfinite(metrics[2]["critic/vf_loss"])
    if algorithm == "safe_rlhf":  # the cost critic trained, lambda rose from 1 and the checkpoint keeps it
        lambdas = [metrics[step]["actor/lagrange_multiplier"] for step in (1, 2)]
        assert 1.0 < lambdas[0] < lambdas[1] and metrics[2]["critic/cost/mean"] > 0
        assert math.isfinite(metrics[2]["cost_critic/vf_loss"]) and metrics[2]["cost_critic/grad_norm"] > 0
        saved = read_trainer_state(ckpts[1].path)["lagrange_multiplier"]  # log lambda and the cost window
        assert math.exp(saved["log_lambda"]) == pytest.approx(lambdas[1]) and len(saved["episode_costs"]) == 16


def test_an_on_policy_run_skips_the_old_log_prob_stage_and_its_metrics_equal_the_staged_run(
    prefect_api, tmp_path, tiny_model_dir
):
    """One optimizer step per iteration (actor.ppo_mini_batch_size = data.train_batch_size): the flow runs no
    old_log_prob task and records no timing for it, and every metric of both iterations equals the run that
    computes the old log-probs in their stage (actor.recompute_log_prob=true) within float32 rounding (the same
    forward on other row groupings, see test_training)."""
    from hybridflow.flows.rlhf import rlhf_flow

    extra = ["trainer.total_iterations=2", "trainer.val_before_train=false", "actor.ppo_mini_batch_size=4"]
    runs = {}
    for recompute in (False, True):
        home = tmp_path / str(recompute)
        home.mkdir()
        cfg = _cfg(home, tiny_model_dir, extra=[*extra, f"actor.recompute_log_prob={str(recompute).lower()}"])
        assert cfg.skips_old_log_prob() is not recompute
        store = RunStore(f"sqlite:///{tmp_path / f'{recompute}.db'}")
        run_id = store.create_run(cfg.model_dump(mode="json"), cfg.trainer.experiment_name)
        rlhf_flow(run_id=run_id, db_url=store.url)
        runs[recompute] = (_by_step(store, run_id), _task_names(store.get_run(run_id).prefect_flow_run_id))
    (skipped, skipped_tasks), (staged, staged_tasks) = runs[False], runs[True]
    assert "old_log_prob" in staged_tasks and "old_log_prob" not in skipped_tasks
    assert "update_actor" in skipped_tasks
    for step in (1, 2):
        assert "timing_s/old_log_prob" in staged[step] and "timing_s/old_log_prob" not in skipped[step]
        compared = {k for k in staged[step] if not k.startswith(("timing_s/", "perf/"))}
        assert compared == {k for k in skipped[step] if not k.startswith(("timing_s/", "perf/"))}
        assert "actor/entropy" in compared
        for name in compared:
            assert skipped[step][name] == pytest.approx(staged[step][name], rel=1e-4, abs=1e-6), (step, name)


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


def _start_hf_run(
    prefect_api, tmp_path, tiny_model_dir, extra, example="grpo_tiny.yaml"
) -> tuple[subprocess.Popen, RunStore, str]:
    """`hf run` of `example` with the resume tests' overrides `extra` as a separate process, its own store."""
    import yaml

    config = _cfg(tmp_path, tiny_model_dir, example, extra).model_dump(mode="json")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    proc = subprocess.Popen(
        [HF, "run", str(config_file), "--db", db, "--prefect-api", prefect_api],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return proc, RunStore(db), db


def _hf(prefect_api, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HF, *args, "--prefect-api", prefect_api], capture_output=True, text=True, timeout=300)


def test_sigkill_mid_iteration_then_resume_matches_uninterrupted(prefect_api, tmp_path, tiny_model_dir, reference):
    # the run through the CLI, killed with SIGKILL in the middle of iteration 3
    proc, store, db = _start_hf_run(prefect_api, tmp_path, tiny_model_dir, RESUMED)
    run_id = wait_inside_iteration(proc, store, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert store.get_run(run_id).status == "running"  # killed hard: nothing could record the end
    assert store.latest_checkpoint(run_id).step == 2
    killed = store.get_run(run_id).prefect_flow_run_id
    assert _flow_run_state(killed)[0] == "RUNNING"  # nothing could tell the server
    [in_iteration_3] = [f for f in _subflows(killed) if f.name == "iteration 3"]
    assert in_iteration_3.state.type.value == "RUNNING"

    result = _hf(prefect_api, "resume", run_id, "--db", db)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming" in result.stdout and "from iteration 2" in result.stdout
    assert store.get_run(run_id).status == "completed"
    # the controller that took over marked the dead one's flow run crashed, naming its own
    state, message = _flow_run_state(killed)
    assert state == "CRASHED" and store.get_run(run_id).prefect_flow_run_id in message, message
    assert _flow_run_state(str(in_iteration_3.id))[0] == "CRASHED"  # and the iteration it was in
    resumed = _by_step(store, run_id)
    assert sorted(resumed) == [1, 2, 3, 4]
    # On CPU the resumed iterations are bit-identical (same weights, optimizer state, data cursor, and sampling
    # seeded from (seed, step)); rel 1e-6 only leaves room for non-deterministic kernels elsewhere.
    for step in (3, 4):
        for name in COMPARED:
            assert resumed[step][name] == pytest.approx(reference[step][name], rel=1e-6, abs=1e-9), (step, name)
    assert [c.step for c in store.checkpoints(run_id)] == [1, 2, 3, 4]


def test_a_rank_killed_mid_run_is_recovered_inside_the_flow_with_the_uninterrupted_metrics(
    prefect_api, tmp_path, tiny_model_dir, reference
):
    """SIGKILL of a rank inside iteration 3 of `hf run`: the flow puts the recovery on record, relaunches its worker
    group and goes on from global_step_2, with no `hf resume`; the run completes with the uninterrupted run's
    metrics, and `hf runs show` lists the recovery."""
    recovering = [*RESUMED, "trainer.recovery_backoff_s=0"]
    proc, store, db = _start_hf_run(prefect_api, tmp_path, tiny_model_dir, recovering)
    run_id = wait_inside_iteration(proc, store, 3)
    [pid] = rank_pids(run_id, "actor_rollout_ref")
    os.kill(pid, signal.SIGKILL)
    output = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, output
    assert "recovering by itself (1 of 2, trainer.max_recoveries)" in output, output
    assert store.get_run(run_id).status == "completed"
    [recovery] = store.recoveries(run_id)
    assert (recovery.step, recovery.group_name, recovery.ranks, recovery.resumed_from) == (
        3,
        "actor_rollout_ref",
        [0],
        2,
    )
    host = os.uname().nodename
    assert f"rank 0 (host {host}, pid {pid})" in recovery.cause and recovery.lost_s >= 0 and recovery.nodes == [host]
    recovered = _by_step(store, run_id)
    for step in (1, 2, 3, 4):
        for name in COMPARED:
            assert recovered[step][name] == pytest.approx(reference[step][name], rel=1e-6, abs=1e-9), (step, name)
    shown = subprocess.run([HF, "runs", "show", run_id, "--db", db], capture_output=True, text=True)
    assert "recoveries" in shown.stdout and "global_step_2" in shown.stdout, shown.stdout


def test_the_local_prefect_server_killed_mid_run_is_restarted_and_the_run_completes(
    tmp_path, tiny_model_dir, reference
):
    """`hf run` on its home's own Prefect server (no --prefect-api), the server SIGKILLed inside iteration 2: the
    CLI restarts it on the same port with the same database, the run trains on meanwhile and completes with the
    uninterrupted run's metrics, and the restarted server holds the flow run Completed, every task run Completed
    (the events queued during the outage delivered) and every iteration's artifact."""
    import httpx
    import yaml

    home = tmp_path / "home"
    env = {**os.environ, "HYBRIDFLOW_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(_cfg(tmp_path, tiny_model_dir, extra=RESUMED).model_dump(mode="json")))
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    proc = subprocess.Popen(
        [HF, "run", str(config_file), "--db", db], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    try:
        store = RunStore(db)
        run_id = wait_inside_iteration(proc, store, 2)
        served = json.loads((home / "prefect" / "server.json").read_text())
        os.kill(served["pid"], signal.SIGKILL)
        output = proc.communicate(timeout=300)[0].decode()
        assert proc.returncode == 0, output
        restarted = f"the local Prefect server (pid {served['pid']}) ended: restarted it on port {served['port']}"
        lines = output.splitlines()
        assert any(line.startswith(restarted) for line in lines), output  # on a line of its own
        # Prefect's client errors of the outage went to the run's log file, not to the terminal
        assert "Error logging to API" not in output and "All connection attempts" not in output, output
        prefects = re.compile(r"(DEBUG|INFO|WARNING|ERROR) (prefect|hybridflow\.flows\.reporting)|\| prefect\.")
        assert not [line for line in lines if prefects.search(line)], output
        log = (home / "logs" / f"{run_id}.log").read_text()
        assert f"run {run_id}: iterations 1 to 4" in log and "INFO prefect.flow_runs" in log
        assert any(line.startswith("the Prefect server of") and "stops by itself once" in line for line in lines)
        assert store.get_run(run_id).status == "completed"
        finished = _by_step(store, run_id)
        for step in (1, 2, 3, 4):
            for name in COMPARED:
                assert finished[step][name] == pytest.approx(reference[step][name], rel=1e-6, abs=1e-9), (step, name)
        api = f"http://127.0.0.1:{served['port']}/api"
        [flow_run] = [f for f in httpx.post(f"{api}/flow_runs/filter", json={}).json() if run_id in f["name"]]
        assert flow_run["state_type"] == "COMPLETED", flow_run["state_type"]
        children = {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run["id"]]}}}
        subflows = httpx.post(f"{api}/flow_runs/filter", json=children).json()  # one per iteration
        # iterations whose subflow could not start while the server was down ran without one; any whose end it
        # missed is recorded once it answers again
        names = {f["name"] for f in subflows}
        assert "iteration 1" in names and names <= {f"iteration {step}" for step in (1, 2, 3, 4)}, names
        # the iterations without a subflow are named on the terminal (2 of them: "iterations 3-4 ran while ...")
        missing = sorted(step for step in (1, 2, 3, 4) if f"iteration {step}" not in names)
        named = [line for line in lines if "ran while the Prefect server did not answer" in line]
        if missing:
            from hybridflow.flows.reporting import number_ranges

            assert len(named) == 1 and f"{number_ranges(missing)} ran while" in named[0], (missing, output)
        else:
            assert not named, output
        assert {f["state_type"] for f in subflows} == {"COMPLETED"}
        of_run = {"flow_runs": {"id": {"any_": [flow_run["id"], *(f["id"] for f in subflows)]}}, "limit": 200}
        task_runs = httpx.post(f"{api}/task_runs/filter", json=of_run).json()
        assert task_runs and {t["state_type"] for t in task_runs} == {"COMPLETED"}
        of_run = {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}}
        assert len(httpx.post(f"{api}/artifacts/filter", json=of_run).json()) >= 4  # one per iteration at least
    finally:
        proc.kill()
        subprocess.run([HF, "server", "stop"], env=env, capture_output=True, timeout=60)


def test_a_postgresql_store_stopped_mid_run_is_waited_for_and_the_run_completes(
    prefect_api, tmp_path, tiny_model_dir, reference
):
    """`hf run` on a PostgreSQL store, the server stopped inside iteration 2 until the controller has said it waits
    for it, and 5 s more: the controller waits at its next store write (saying which service and how long it
    waits), goes on once the server is back, and the run completes with the uninterrupted run's metrics: nothing
    lost, nothing written twice."""
    import yaml
    from postgres import postgres_server, unavailable_reason

    if reason := unavailable_reason():
        pytest.skip(reason)
    with postgres_server() as server:
        db = server.url(server.create_database())
        config_file = tmp_path / "config.yaml"
        config_file.write_text(yaml.safe_dump(_cfg(tmp_path, tiny_model_dir, extra=RESUMED).model_dump(mode="json")))
        command = [HF, "run", str(config_file), "--db", db, "--prefect-api", prefect_api]
        log = tmp_path / "run.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        store = RunStore(db)
        run_id = wait_inside_iteration(proc, store, 2, log=log)
        store.close()
        server.stop()
        deadline = time.monotonic() + 120
        while "the run waits" not in log.read_text():  # the controller reached a store write and waits there
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        time.sleep(5)
        assert proc.poll() is None, log.read_text()  # still waiting for the store, not failed
        server.start()
        assert proc.wait(timeout=300) == 0, log.read_text()
        output = log.read_text()
        assert "does not answer" in output and "the run waits" in output and "answers again" in output, output
        store = RunStore(db)
        assert store.get_run(run_id).status == "completed"
        finished = _by_step(store, run_id)
        assert sorted(finished) == [1, 2, 3, 4]
        for step in (1, 2, 3, 4):
            for name in COMPARED:
                assert finished[step][name] == pytest.approx(reference[step][name], rel=1e-6, abs=1e-9), (step, name)
        assert [c.step for c in store.checkpoints(run_id)] == [1, 2, 3, 4]
        store.close()


def test_a_run_deleted_while_it_trains_stops_without_advising_a_resume(prefect_api, tmp_path, tiny_model_dir):
    """`hf runs delete RUN --force` of a live run: its controller stops, and says the run is gone rather than
    advising `hf resume` of a run that no longer exists."""
    proc, store, db = _start_hf_run(prefect_api, tmp_path, tiny_model_dir, RESUMED)
    run_id = wait_inside_iteration(proc, store, 2)
    deleted = subprocess.run([HF, "runs", "delete", run_id, "--force", "--db", db], capture_output=True, text=True)
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode != 0, output
    assert f"run {run_id} is no longer in the run store" in output, output
    assert "hf resume" not in output, output


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
    run_id = wait_inside_iteration(proc, store, 2)
    workers = rank_pids(run_id)
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
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if alive(pid)], "worker processes outlived hf run"
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


def _truncate(path: Path) -> None:
    """Cut a file to half its size (a write that never finished)."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit_weights_and_manifest(folder: Path) -> None:
    """Flip a byte of the actor's weights and rewrite the manifest to match: the folder verifies on its own, only
    the sha256 the store recorded tells the edit."""
    import hashlib
    import json

    weights = next((folder / "actor").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = manifest["files"][weights.relative_to(folder).as_posix()]
    entry["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in [root, *root.rglob("*")]}


def test_one_controller_per_run_and_resume_past_bad_checkpoints(prefect_api, tmp_path, tiny_model_dir, reference):
    """While `hf run` trains, a second `hf resume` is refused naming its host and pid. SIGKILLed inside iteration 4,
    the run shows as crashed; its newest checkpoint truncated and the one before edited together with its manifest,
    `hf resume` takes the run over, marks both bad, falls back to global_step_1 and still reproduces the
    uninterrupted run; `hf resume --from global_step_2` replays iterations 3-4 the same again. The run folder is
    0700 with files 0600, the SQLite store 0600."""
    proc, store, db = _start_hf_run(prefect_api, tmp_path, tiny_model_dir, RESUMED)
    run_id = wait_inside_iteration(proc, store, 2)
    second = _hf(prefect_api, "resume", run_id, "--db", db)
    assert second.returncode == 2, second.stdout + second.stderr
    refusal = " ".join(second.stdout.split())
    assert f"run {run_id} is being trained by another controller" in refusal and f"pid {proc.pid}" in refusal
    wait_inside_iteration(proc, store, 4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    listed = subprocess.run([HF, "runs", "list", "--db", db], capture_output=True, text=True, timeout=60)
    assert "crashed (last heartbeat" in listed.stdout, listed.stdout
    ckpts = {c.step: Path(c.path) for c in store.checkpoints(run_id)}
    assert sorted(ckpts) == [1, 2, 3]
    run_dir = ckpts[1].parent.parent
    old_secret = (run_dir / "secret").read_bytes()
    leftovers = list((run_dir / "data").iterdir())  # the killed iteration's batch files
    assert leftovers
    _truncate(next((ckpts[3] / "actor").glob("*.safetensors")))
    _edit_weights_and_manifest(ckpts[2])
    verify_checkpoint(ckpts[2])  # consistent with its own manifest: only the store's hash catches it

    resumed = _hf(prefect_api, "resume", run_id, "--db", db)
    output = " ".join(resumed.stdout.split())
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"its controller (host {os.uname().nodename}, pid {proc.pid}) crashed" in output
    assert "checkpoint global_step_3 is unusable" in output and "falling back to global_step_2" in output
    terminal = " ".join((resumed.stdout + resumed.stderr).split())  # one notice, not one per channel
    assert terminal.count("checkpoint global_step_3 is unusable") == 1, terminal
    assert "checkpoint global_step_2 is unusable" in output and "not the" in output and "recorded" in output
    assert "falling back to global_step_1" in output
    assert store.get_run(run_id).status == "completed"
    assert (run_dir / "secret").read_bytes() != old_secret  # a new channel secret for the new controller session
    assert not [p for p in leftovers if p.exists()]  # the killed session's batch files are gone
    by_step = _by_step(store, run_id)
    for step in (2, 3, 4):
        for name in COMPARED:
            assert by_step[step][name] == pytest.approx(reference[step][name], rel=1e-6, abs=1e-9), (step, name)
    assert [(c.step, c.bad_reason) for c in store.checkpoints(run_id)] == [(s, None) for s in (1, 2, 3, 4)]
    for step in (1, 2, 3, 4):  # rewritten where they were bad; each verifies against the store's hash
        assert (
            verify_checkpoint(store.checkpoints(run_id)[step - 1].path).sha256
            == store.checkpoints(run_id)[step - 1].sha256
        )

    replay = _hf(prefect_api, "resume", run_id, "--db", db, "--from", "global_step_2")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "from iteration 2" in replay.stdout
    by_step = _by_step(store, run_id)
    for step in (3, 4):
        for name in COMPARED:
            assert by_step[step][name] == pytest.approx(reference[step][name], rel=1e-6, abs=1e-9), (step, name)
    wrong = _hf(prefect_api, "resume", run_id, "--db", db, "--from", "global_step_9")
    assert wrong.returncode == 2 and "no usable checkpoint of step 9" in " ".join(wrong.stdout.split())

    modes = _modes(run_dir)
    assert modes["."] == 0o700
    loose = {name: oct(mode) for name, mode in modes.items() if mode & 0o077}
    assert not loose, f"group/world-accessible in {run_dir}: {loose}"
    assert (tmp_path / "runs.db").stat().st_mode & 0o777 == 0o600


POISONED_REWARD = '''
import math, os

def digit_share(data_source, solution_str, ground_truth, extra_info):
    """The dense reward, NaN from the 17th call on (iteration 1 scores 4 prompts x 4 samples)."""
    fd = os.open(os.path.join(os.path.dirname(__file__), "calls"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, b"x")
    calls = os.fstat(fd).st_size
    os.close(fd)
    if calls > 16:
        return {"score": math.nan, "acc": 0.0}
    return {"score": sum(c.isdigit() for c in solution_str) / max(1, len(solution_str)), "acc": 0.0}
'''


def test_nan_reward_stops_the_run_and_resume_continues_after_the_fix(prefect_api, tmp_path, tiny_model_dir):
    """A reward function that turns NaN in iteration 2 stops `hf run` with an error naming the stage, the metric,
    the reward function and the first sample; checkpoint 1 is untouched; fixed, `hf resume` completes the run."""
    from tiny_runs import DENSE_REWARD

    two = [*RESUMED, "trainer.total_iterations=2", "placement.tasks_per_node=1"]
    proc, store, db = _start_hf_run(prefect_api, tmp_path, tiny_model_dir, two)
    reward_file = tmp_path / "my_reward.py"  # the file _cfg wrote; poisoned before the workers import it
    reward_file.write_text(POISONED_REWARD)
    output = " ".join(proc.communicate(timeout=300)[0].decode().split())
    assert proc.returncode == 1, output
    [run] = store.list_runs()
    assert run.status == "failed"
    assert "NonFiniteError" in output and "token_level_scores" in output and "digit_share" in output, output
    assert str(reward_file) in output and "sample" in output
    assert f"hf resume {run.id}" in output
    assert "Traceback" not in output, output  # the failure once, in two lines: Prefect's tracebacks are in its UI
    assert store.recoveries(run.id) == []  # a rank that raised: no recovery, the cause needs a fix
    [ckpt] = store.checkpoints(run.id)
    assert ckpt.step == 1 and verify_checkpoint(ckpt.path).sha256 == ckpt.sha256

    reward_file.write_text(DENSE_REWARD)  # the fix
    fixed = _hf(prefect_api, "resume", run.id, "--db", db)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "from iteration 1" in fixed.stdout
    assert store.get_run(run.id).status == "completed"
    assert math.isfinite(_by_step(store, run.id)[2]["critic/score/mean"])


MEGATRON = ["actor.strategy=megatron", "actor.tp=2", "actor.pp=2", "rollout.gen_tp=1", "placement.tasks_per_node=4"]


@pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None and os.environ.get("CI") != "true",
    reason="megatron-core is not installed (bash .ci/setup installs it)",
)
def test_megatron_run_records_its_layout_and_resumes_exactly(prefect_api, tmp_path, tiny_model_dir):
    """PPO with a megatron actor (its KL loss against the ref) and a megatron critic (tp=2, pp=2 on 4 ranks,
    generating at tp=1 through the 3D-HybridEngine): the run completes, its placement records the layouts and
    groups, and a second run started from the first one's iteration-1 checkpoint (``trainer.resume_from``, its own
    checkpoints in ``trainer.checkpoint_dir``) reproduces its iteration 2. (One run covers what a GRPO run with the
    megatron actor would: the estimator does not touch the training engine.)"""
    from hybridflow.flows.rlhf import rlhf_flow

    example = "ppo_tiny.yaml"
    extra = ["trainer.total_iterations=2", "trainer.save_freq=1", "trainer.val_before_train=false", *MEGATRON]
    extra += ["critic.strategy=megatron", "actor.use_kl_loss=true"]
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    runs = {}
    (tmp_path / "reference").mkdir()
    cfg = _cfg(tmp_path / "reference", tiny_model_dir, example, extra)
    runs["reference"] = store.create_run(cfg.model_dump(mode="json"), "reference")
    rlhf_flow(run_id=runs["reference"], db_url=store.url)
    assert store.get_run(runs["reference"]).status == "completed"
    reference = _by_step(store, runs["reference"])
    checked = ["actor/pg_loss", "actor/grad_norm", "hybrid_engine/to_generation_s", "actor/kl_loss"]
    checked += ["critic/vf_loss", "critic/grad_norm"]
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
    for role in ("actor", "critic"):
        assert (ckpt / role / "megatron_optim" / "pp1_tp1.pt").is_file(), role

    (tmp_path / "resumed").mkdir()
    more = [f"trainer.resume_from={ckpt}", f"trainer.checkpoint_dir={tmp_path / 'elsewhere'}"]
    cfg = _cfg(tmp_path / "resumed", tiny_model_dir, example, [*extra, *more])
    runs["resumed"] = store.create_run(cfg.model_dump(mode="json"), "resumed")
    rlhf_flow(run_id=runs["resumed"], db_url=store.url)
    resumed = _by_step(store, runs["resumed"])
    assert sorted(resumed) == [2]
    [own] = store.checkpoints(runs["resumed"])
    assert Path(own.path) == tmp_path / "elsewhere" / runs["resumed"] / "global_step_2"
    for name in [*COMPARED, "critic/vf_loss", "critic/grad_norm"]:
        if name in reference[2]:  # bit-identical on CPU, as for the ddp actor above
            assert resumed[2][name] == pytest.approx(reference[2][name], rel=1e-6, abs=1e-9), name


# ------------------------------------------------------------------------------- PPO with all four models
# actor + critic + ref (KL loss) + a reward model (a random tiny classifier) beside the dense function reward


@pytest.fixture(scope="module")
def four_models(prefect_api, tmp_path_factory, tiny_model_dir) -> tuple[list[str], RunStore, str]:
    """The uninterrupted colocated run: (its overrides, its store, its run id)."""
    from tiny_runs import write_reward_model
    from transformers import AutoTokenizer

    from hybridflow.flows.rlhf import rlhf_flow

    tmp = tmp_path_factory.mktemp("four")
    rm = write_reward_model(tmp / "rm", AutoTokenizer.from_pretrained(tiny_model_dir), seed=1)
    extra = [*RESUMED, "trainer.total_iterations=3", "actor.use_kl_loss=true", "reward_model.enable=true"]
    extra += [f"reward_model.path={rm}", "reward_model.coef=0.5", "reward_model.micro_batch_size=3"]
    cfg = _cfg(tmp, tiny_model_dir, "ppo_tiny.yaml", extra)
    store = RunStore(f"sqlite:///{tmp / 'runs.db'}")
    run_id = store.create_run(cfg.model_dump(mode="json"), "four")
    rlhf_flow(run_id=run_id, db_url=store.url)
    return extra, store, run_id


FOUR_COMPARED = [*COMPARED, "critic/rm_score/mean", "critic/rewards/mean", "critic/vf_loss", "critic/values/mean"]


def test_four_model_ppo_trains_on_the_reward_model_and_the_function(four_models):
    """The reward model scores every iteration in a stage of its own (``rm_score``); the training reward is
    ``reward_model.coef`` x RM score + the function score (``critic/rewards`` = ``critic/score`` + 0.5 x
    ``critic/rm_score``: the KL is a loss here, not in the reward); the RM's placement is on record."""
    _, store, run_id = four_models
    run = store.get_run(run_id)
    assert run.status == "completed"
    metrics = _by_step(store, run_id)
    for step in (1, 2, 3):
        m = metrics[step]
        assert m["critic/rm_score/min"] < m["critic/rm_score/mean"] < m["critic/rm_score/max"]  # one per response
        combined = m["critic/score/mean"] + 0.5 * m["critic/rm_score/mean"]
        assert m["critic/rewards/mean"] == pytest.approx(combined, rel=1e-5, abs=1e-6), step
        assert m["timing_s/rm_score"] > 0
    roles = {p.role: p.group_name for p in store.placements(run_id)}
    assert roles == dict.fromkeys(["actor", "rollout", "reward", "ref", "critic", "reward_model"], "actor_rollout_ref")
    names = _task_names(run.prefect_flow_run_id)
    assert {"generate", "rm_score", "reward", "ref_log_prob", "values", "update_critic", "update_actor"} <= names


FOUR_POOLS = {
    "actor_rollout": {"roles": ["actor", "rollout", "reward"]},
    "ref": {"roles": ["ref"]},
    "critic": {"roles": ["critic"]},
    "rm": {"roles": ["reward_model"]},
}
POOLED = [f"placement.pools={json.dumps(FOUR_POOLS)}"]


def _overlap(a, b) -> float:
    """Seconds two stage spans ran at the same time (0: one after the other)."""
    return max(0.0, (min(a.ended_at, b.ended_at) - max(a.started_at, b.started_at)).total_seconds())


def test_four_pools_run_their_stages_at_once_and_equal_the_colocated_run(
    prefect_api, tmp_path, tiny_model_dir, four_models
):
    """Actor + rollout, ref, critic and reward model on four pools (worker groups): the stages after generation
    and the two updates run at the same time (their spans in the store's timeline overlap), each on its own pool,
    and every metric equals the colocated run's, where the same stages ran one after another."""
    from hybridflow.flows.rlhf import rlhf_flow

    extra, reference_store, reference_id = four_models
    cfg = _cfg(tmp_path, tiny_model_dir, "ppo_tiny.yaml", [*extra, *POOLED])
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = store.create_run(cfg.model_dump(mode="json"), "four-pools")
    rlhf_flow(run_id=run_id, db_url=store.url)
    placed = {p.role: p for p in store.placements(run_id)}
    assert {role: p.group_name for role, p in placed.items()} == {
        "actor": "actor_rollout",
        "rollout": "actor_rollout",
        "reward": "actor_rollout",
        "ref": "ref",
        "critic": "critic",
        "reward_model": "rm",
    }
    assert {r: placed[r].parallel["strategy"] for r in ("actor", "critic", "reward_model")} == dict.fromkeys(
        ("actor", "critic", "reward_model"), "ddp"
    )
    pooled, reference = _by_step(store, run_id), _by_step(reference_store, reference_id)
    for step in (1, 2, 3):
        for name in FOUR_COMPARED:
            assert pooled[step][name] == pytest.approx(reference[step][name], rel=1e-6, abs=1e-9), (step, name)
        spans = {s.stage: s for s in store.stage_times(run_id, step)}
        pools = {stage: span.pool for stage, span in spans.items()}
        assert pools == {
            "step": None,
            "gen": "actor_rollout",
            "rm_score": "rm",
            "reward": "actor_rollout",
            "old_log_prob": "actor_rollout",
            "ref": "ref",
            "values": "critic",
            "adv": None,
            "update_critic": "critic",
            "update_actor": "actor_rollout",
        }
        after_gen = [spans[k] for k in ("rm_score", "reward", "old_log_prob", "ref", "values")]
        assert all(s.started_at >= spans["gen"].ended_at for s in after_gen)
        assert spans["old_log_prob"].started_at >= spans["reward"].ended_at  # one pool: one after the other
        assert all(s.ended_at <= spans["adv"].started_at for s in after_gen)
        assert _overlap(spans["update_critic"], spans["update_actor"]) > 0, step
        busy = sum(s.duration_s for s in after_gen)
        wall = (max(s.ended_at for s in after_gen) - spans["gen"].ended_at).total_seconds()
        assert busy > wall, (step, busy, wall)  # four pools' stages at once take less time than their sum
    names = _task_names(store.get_run(run_id).prefect_flow_run_id)
    assert {"rm_score", "ref_log_prob", "values", "update_critic", "update_actor"} <= names
    shown = subprocess.run(
        [HF, "runs", "timeline", run_id, "--step", "2", "--db", store.url],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    text = " ".join(shown.stdout.split())
    factor = re.search(r"stages: ([\d.]+) s of work in ([\d.]+) s \(([\d.]+)x\)", text)
    assert "iteration 2" in text and "update_critic │ critic │" in text and factor and float(factor[3]) > 1, text
    as_json = subprocess.run(
        [HF, "runs", "timeline", run_id, "--step", "2", "--json", "--db", store.url], capture_output=True, text=True
    ).stdout
    assert {json.loads(line)["stage"]: json.loads(line)["pool"] for line in as_json.splitlines()} == pools


def test_four_pool_run_killed_mid_iteration_resumes_bit_identically(prefect_api, tmp_path, tiny_model_dir, four_models):
    """The four pools with their stages one after another (``placement.concurrent: false``): killed with SIGKILL
    inside iteration 3, resumed by ``hf resume``; every iteration equals the colocated run's."""
    extra, reference_store, reference_id = four_models
    pooled = [*extra, *POOLED, "placement.concurrent=false"]
    proc, store, db = _start_hf_run(prefect_api, tmp_path, tiny_model_dir, pooled, "ppo_tiny.yaml")
    run_id = wait_inside_iteration(proc, store, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert store.latest_checkpoint(run_id).step == 2
    result = _hf(prefect_api, "resume", run_id, "--db", db)
    assert result.returncode == 0, result.stdout + result.stderr
    resumed, reference = _by_step(store, run_id), _by_step(reference_store, reference_id)
    assert sorted(resumed) == [1, 2, 3]
    for step in (1, 2, 3):
        for name in FOUR_COMPARED:
            assert resumed[step][name] == pytest.approx(reference[step][name], rel=1e-6, abs=1e-9), (step, name)
        spans = sorted((s for s in store.stage_times(run_id, step) if s.stage != "step"), key=lambda s: s.started_at)
        assert len(spans) == 9 and all(a.ended_at <= b.started_at for a, b in itertools.pairwise(spans)), step
    placements = store.placements(run_id)
    assert {p.group_name for p in placements} == set(FOUR_POOLS) and len(placements) == 2 * 6  # both sessions


def test_an_iteration_runs_once_and_ungrouped_where_prefect_does_not_answer_for_its_subflow(prefect_api):
    """`IterationSubflows`: each iteration in a subflow of the run's flow run, named after it; where the Prefect
    server does not answer when the subflow would start (here: the client pointed at a closed port), the iteration
    runs anyway, once, without a subflow, and the next iterations skip the try for `retry_after_s`; an error of the
    iteration itself is raised as it is (its subflow Failed), never run twice."""
    import time

    from prefect import flow
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from hybridflow.flows.reporting import IterationSubflows

    ran: list[int] = []

    def iteration(n: int):
        def body() -> str:
            ran.append(n)
            if n == 5:
                raise KeyError("the iteration's own error")
            return f"result {n}"

        return body

    @flow(name="subflow-test")
    def parent() -> str:
        subflows = IterationSubflows()
        assert subflows.run(1, iteration(1)) == "result 1"
        with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # nothing listens on port 9
            assert subflows.run(2, iteration(2)) == "result 2"
        assert subflows.paused_until > time.monotonic()
        assert subflows.run(3, iteration(3)) == "result 3"  # paused: not tried
        subflows.paused_until = 0.0
        assert subflows.run(4, iteration(4)) == "result 4"
        with pytest.raises(KeyError, match="own error"):
            subflows.run(5, iteration(5))
        return str(FlowRunContext.get().flow_run.id)

    parent_id = parent()
    assert ran == [1, 2, 3, 4, 5]  # each once
    states = {f.name: f.state.type.value for f in _subflows(parent_id)}
    assert states == {"iteration 1": "COMPLETED", "iteration 4": "COMPLETED", "iteration 5": "FAILED"}, states
