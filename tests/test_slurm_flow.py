"""`hf run --executor slurm` end to end on the real Slurm cluster: the tiny PPO run with a data-parallel actor group
(2 ranks) and a separate critic group (1 rank), its placement in the store and in `hf runs show`; then Slurm's
time-limit warning (SIGUSR2) stopping a run at a stage boundary with a checkpoint, a killed rank failing it, and
`hf resume` relaunching the groups each time until the run completes."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from tiny_runs import write_reward

from hybridflow.engine.config import load_config
from hybridflow.flows.store import RunStore

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"


def _config_file(tmp_path: Path, tiny_model_dir: Path, example: str, extra: list[str]) -> Path:
    cfg = load_config(
        ROOT / "examples" / example,
        [
            f"model.path={tiny_model_dir}",
            f"trainer.output_dir={tmp_path / 'out'}",
            f"reward.custom_function={write_reward(tmp_path)}",
            "trainer.num_threads=1",
            "placement.slurm.time_min=30",
            *extra,
        ],
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def _hf(*args: str, log: Path) -> subprocess.Popen:
    # output to a file: the Slurm-side processes never hold a pipe of the test open
    with log.open("ab") as out:
        return subprocess.Popen([HF, *args], stdout=out, stderr=subprocess.STDOUT, env={**os.environ})


def _wait_for_iteration(store: RunStore, proc: subprocess.Popen, log: Path, step: int, timeout_s: float = 300) -> str:
    """Wait until the (only) run of `store` has started iteration `step`; returns the run id."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = store.list_runs()
        if runs:
            started = {i.step: i for i in store.iterations(runs[0].id)}
            if step in started and started[step].ended_at is None:
                return runs[0].id
        assert proc.poll() is None, log.read_text()
        time.sleep(0.05)
    raise AssertionError(f"iteration {step} never started:\n{log.read_text()}")


def _current_job(store: RunStore, run_id: str) -> str:
    return store.placements(run_id)[-1].slurm_job_id


def _rank_pid(job: str, rank: int) -> int:
    """The pid of a rank of a Slurm job, from slurmd (``scontrol listpids``: PID JOBID STEPID LOCALID GLOBALID)."""
    listed = subprocess.run(["scontrol", "listpids", job], capture_output=True, text=True, check=True).stdout
    for line in listed.splitlines()[1:]:
        pid, _, step, _, global_id = line.split()[:5]
        if step != "batch" and global_id == str(rank):
            return int(pid)
    raise AssertionError(f"no rank {rank} in scontrol listpids {job}:\n{listed}")


def test_hf_run_on_slurm_with_dp_actor_and_split_critic(slurm_cluster, prefect_api, tmp_path, tiny_model_dir):
    config = _config_file(
        tmp_path,
        tiny_model_dir,
        "ppo_tiny.yaml",
        ["placement.colocate=false", "placement.tasks_per_node=2", "placement.critic_tasks_per_node=1"],
    )
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    log = tmp_path / "run.log"
    proc = _hf("run", str(config), "--executor", "slurm", "--db", db, "--prefect-api", prefect_api, log=log)
    assert proc.wait(timeout=600) == 0, log.read_text()
    store = RunStore(db)
    (run,) = store.list_runs()
    assert run.status == "completed"
    placed = {p.role: p for p in store.placements(run.id)}
    assert {p.executor for p in placed.values()} == {"slurm"}
    actor, critic = placed["actor"], placed["critic"]
    assert actor.ranks == [0, 1] and critic.ranks == [0]  # DP=2 actor group, DP=1 critic group
    assert actor.slurm_job_id and critic.slurm_job_id and actor.slurm_job_id != critic.slurm_job_id
    assert actor.hosts == [slurm_cluster["node"]] * 2
    accounting = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobID,JobName,State", "-j", f"{actor.slurm_job_id},{critic.slurm_job_id}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"{actor.slurm_job_id}|hybridflow-actor_rollout_ref|COMPLETED" in accounting  # shut down cleanly
    assert f"{critic.slurm_job_id}|hybridflow-critic|COMPLETED" in accounting
    steps = {m.step for m in store.metrics(run.id)}
    assert {1, 2} <= steps
    shown = subprocess.run([HF, "runs", "show", run.id, "--db", db], capture_output=True, text=True, check=True)
    assert actor.slurm_job_id in shown.stdout and critic.slurm_job_id in shown.stdout and "slurm" in shown.stdout


TOTAL = 20  # iterations of the time-limit test's run: many more than the warning needs to reach the controller


def test_time_limit_warning_checkpoints_killed_rank_fails_and_resume_completes(
    slurm_cluster, prefect_api, tmp_path, tiny_model_dir
):
    config = _config_file(
        tmp_path,
        tiny_model_dir,
        "grpo_tiny.yaml",
        [
            f"trainer.total_iterations={TOTAL}",
            "trainer.save_freq=0",
            "trainer.val_before_train=false",
            "data.reasoning_gym.val_size=0",
            "rollout.response_length=32",
        ],
    )
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    store = RunStore(db)
    log = tmp_path / "run.log"
    common = ["--db", db, "--prefect-api", prefect_api]

    # 1. SIGUSR2 (what Slurm sends signal_delay_s before the time limit) during iteration 2: the run checkpoints at
    #    the next stage boundary and stops, resumable.
    proc = _hf("run", str(config), "--executor", "slurm", *common, log=log)
    run_id = _wait_for_iteration(store, proc, log, 2)
    subprocess.run(["scancel", "--signal=USR2", _current_job(store, run_id)], check=True)
    assert proc.wait(timeout=300) == 3, log.read_text()
    run = store.get_run(run_id)
    assert run.status == "interrupted" and "SIGUSR2" in run.error, run.error
    warned_at = store.latest_checkpoint(run_id).step
    # the warning reaches the controller within a heartbeat (0.5 s) and a tiny iteration takes 0.2-1 s (its random
    # model often ends a response early): it stops a few iterations after the second, well before the last, keeping
    # that iteration's start state (no update yet) or its end state
    assert 1 <= warned_at <= TOTAL // 2

    # 2. Resume; kill -9 the new group's rank mid-iteration: the run is marked failed, naming group, rank and job.
    first_job = _current_job(store, run_id)
    proc = _hf("resume", run_id, *common, log=log)
    deadline = time.monotonic() + 300
    while (job := _current_job(store, run_id)) == first_job:  # the resumed run's groups are up (models loaded)
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    os.kill(_rank_pid(job, rank=0), signal.SIGKILL)
    assert proc.wait(timeout=120) == 1, log.read_text()
    run = store.get_run(run_id)
    assert run.status == "failed" and f"job {job}, slurm" in run.error and "rank 0" in run.error, run.error
    assert "actor_rollout_ref" in run.error
    assert store.latest_checkpoint(run_id).step == warned_at  # save_freq 0: nothing newer to resume from

    # 3. Resume again: new groups (a new Slurm job), from the warning's checkpoint to the end.
    proc = _hf("resume", run_id, *common, log=log)
    assert proc.wait(timeout=600) == 0, log.read_text()
    run = store.get_run(run_id)
    assert run.status == "completed"
    assert _current_job(store, run_id) not in (first_job, job, None)
    assert {m.step for m in store.metrics(run_id)} >= set(range(1, TOTAL + 1))
    assert [c.step for c in store.checkpoints(run_id)] == [warned_at, TOTAL]
