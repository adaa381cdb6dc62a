"""`hf run --executor slurm` end to end on the real Slurm cluster: the tiny PPO run with all four models on four
resource pools (a data-parallel actor pool of 2 ranks), its placement in the store and in `hf runs show`, and an
exact `hf resume --from`; then a run longer than its Slurm time limit finishing across allocations (the warning
SIGUSR2, a checkpoint at a stage boundary, new jobs), a killed rank recovered inside the flow (new groups, from the
newest checkpoint), both with the metrics of the uninterrupted run, and with resubmitting off the warning stopping
the run, resumable."""

import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tiny_runs import COMPARED, DENSE_REWARD, wait_inside_iteration, write_reward

from hybridflow.engine.config import load_config
from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
WIDE = {**os.environ, "COLUMNS": "250"}  # rich's width: no line of a table or a message wraps


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


def _current_job(store: RunStore, run_id: str) -> str:
    return store.placements(run_id)[-1].slurm_job_id


def _rank_pid(job: str, rank: int) -> int:
    """The pid of a rank of a Slurm job: the process whose stderr is that rank's log file, ``<job>_<rank>_log.err``
    (its node's task forked it; ``scontrol listpids`` lists every process of that task as the task's)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stderr = os.readlink(proc / "fd" / "2")
        except OSError:
            continue
        if stderr.endswith(f"/{job}_{rank}_log.err"):
            return int(proc.name)
    raise AssertionError(f"no process of rank {rank} of job {job}")


def test_hf_run_on_slurm_with_four_pools_then_resume_repeats_an_iteration_exactly(
    slurm_cluster, prefect_api, tmp_path, tiny_model_dir
):
    """The tiny PPO run with all four models on four resource pools, each its own Slurm job: a data-parallel actor
    + rollout pool (2 ranks), ref, critic and reward model (1 rank each). Its pools, ranks, strategies and jobs are
    on record (and in ``hf runs show``), every job ends COMPLETED, the stages of different pools overlap in the
    timeline; then ``hf resume --from global_step_1`` relaunches the four jobs and redoes iteration 2 exactly."""
    from tiny_runs import write_reward_model
    from transformers import AutoTokenizer

    rm = write_reward_model(tmp_path / "rm", AutoTokenizer.from_pretrained(tiny_model_dir), seed=1)
    pools = {
        "actor_rollout": {"roles": ["actor", "rollout"], "tasks_per_node": 2},
        "ref": {"roles": ["ref"]},
        "critic": {"roles": ["critic"]},
        "rm": {"roles": ["reward_model"]},
    }
    config = _config_file(
        tmp_path,
        tiny_model_dir,
        "ppo_tiny.yaml",
        [
            f"placement.pools={json.dumps(pools)}",
            "actor.use_kl_loss=true",
            "reward_model.enable=true",
            f"reward_model.path={rm}",
            "trainer.save_freq=1",
        ],
    )
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    log = tmp_path / "run.log"
    common = ["--db", db, "--prefect-api", prefect_api]
    proc = _hf("run", str(config), "--executor", "slurm", *common, log=log)
    assert proc.wait(timeout=600) == 0, log.read_text()
    store = RunStore(db)
    (run,) = store.list_runs()
    assert run.status == "completed"
    placed = {p.role: p for p in store.placements(run.id)}
    assert {p.executor for p in placed.values()} == {"slurm"}
    assert {role: (p.group_name, p.ranks) for role, p in placed.items()} == {
        "actor": ("actor_rollout", [0, 1]),  # a DP=2 pool
        "rollout": ("actor_rollout", [0, 1]),
        "reward": ("actor_rollout", [0, 1]),
        "ref": ("ref", [0]),
        "critic": ("critic", [0]),
        "reward_model": ("rm", [0]),
    }
    layout = {r: {k: v for k, v in (p.parallel or {}).items() if not k.endswith("params")} for r, p in placed.items()}
    assert layout["actor"] == {"strategy": "ddp", "train": {"pp": 1, "tp": 1, "dp": 2}}
    assert layout["critic"] == layout["reward_model"] == {"strategy": "ddp"}
    assert placed["actor"].parallel["params"] == placed["actor"].parallel["trainable_params"] > 0  # no adapter
    jobs = {name: placed[role].slurm_job_id for name, role in [("actor_rollout", "actor"), ("ref", "ref"),
            ("critic", "critic"), ("rm", "reward_model")]}  # fmt: skip
    assert len(set(jobs.values())) == 4 and all(jobs.values())
    assert placed["actor"].hosts == [slurm_cluster["node"]] * 2
    accounting = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobID,JobName,State", "-j", ",".join(jobs.values())],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name, job in jobs.items():
        assert f"{job}|hybridflow-{name}|COMPLETED" in accounting, accounting  # shut down cleanly
    first = {(m.step, m.name): m.value for m in store.metrics(run.id)}
    spans = {s.stage: s for s in store.stage_times(run.id, 2)}
    assert spans["ref"].pool == "ref" and spans["values"].pool == "critic" and spans["rm_score"].pool == "rm"

    def updates_overlap(step: int) -> bool:
        updates = [s for s in store.stage_times(run.id, step) if s.stage in ("update_critic", "update_actor")]
        return max(s.started_at for s in updates) < min(s.ended_at for s in updates)

    # the two updates ran at the same time, on their own pools' jobs: in one iteration at least (the tiny critic's
    # update can end before the actor's two ranks start theirs on two busy cores; CI saw them 1.5 ms apart once)
    assert updates_overlap(1) or updates_overlap(2)
    shown = subprocess.run([HF, "runs", "show", run.id, "--db", db], capture_output=True, text=True, check=True)
    assert all(job in shown.stdout for job in jobs.values()) and "slurm" in shown.stdout

    proc = _hf("resume", run.id, "--from", "global_step_1", *common, log=log)
    assert proc.wait(timeout=600) == 0, log.read_text()
    assert store.get_run(run.id).status == "completed"
    assert len({p.slurm_job_id for p in store.placements(run.id)}) == 8  # four new jobs
    again = {(m.step, m.name): m.value for m in store.metrics(run.id)}
    for name in ["critic/score/mean", "critic/rm_score/mean", "actor/pg_loss", "actor/kl_loss", "critic/vf_loss"]:
        assert again[(2, name)] == pytest.approx(first[(2, name)], rel=1e-6, abs=1e-9), name


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_a_rollout_pool_on_another_node_gets_its_weights_by_gloo_broadcast_and_matches_the_run_on_one_node(
    slurm_cluster, prefect_api, tmp_path
):
    """``rollout.checkpoint_engine.backend: gloo`` with the actor and the rollout in two Slurm jobs on two nodes
    (the development cluster's partition ``multi``, a node each: ``--exclusive``), one step off: the actor's rank 0
    serves the broadcast's rendezvous on its node's address, the rollout's rank joins from the other node, and every
    push (after each update) is sent, received and probed. The same run with both jobs on one node (partition
    ``debug``) records every compared metric equal, value for value: the same weights reach the same engine."""
    from hybridflow.engine.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny32", hidden_size=64, head_dim=32)
    on_two_nodes = ["placement.slurm.partition=multi", 'placement.slurm.sbatch={"exclusive": true}']
    store, run = _split_run(tmp_path / "across", model, on_two_nodes, prefect_api)
    placed = {p.role: p for p in store.placements(run.id)}
    assert placed["actor"].slurm_job_id != placed["rollout"].slurm_job_id  # two jobs ...
    (train,), (generate,) = placed["actor"].hosts, placed["rollout"].hosts
    assert train != generate and {train, generate} <= {"hf-node1", "hf-node2", "hf-node3"}  # ... on two nodes
    metrics = {(m.step, m.name): m.value for m in store.metrics(run.id)}
    probes = [value for (_, name), value in metrics.items() if name == "rollout/weight_probe_diff"]
    assert probes and max(probes) < 1e-4  # the engine serves the actor's weights
    logs = tmp_path / "across" / "out" / "grpo_tiny" / run.id / "submitit"
    received = "".join(path.read_text() for path in (logs / "generate").glob("*_log.err"))
    for version in (1, 2):  # from the address of the actor's node
        assert f"rank 0: weights v{version} received by gloo broadcast from {socket.gethostbyname(train)}:" in received

    one_store, one_run = _split_run(tmp_path / "one", model, ["placement.slurm.partition=debug"], prefect_api)
    assert {host for p in one_store.placements(one_run.id) for host in p.hosts} == {socket.gethostname()}
    expected = _compared(one_store, one_run.id)
    assert {step for step, _ in expected} == {1, 2}
    assert _compared(store, run.id) == expected


def _split_run(folder: Path, model: Path, extra: list[str], prefect_api: str) -> tuple[RunStore, object]:
    """The tiny GRPO run one step off with its rollout (vLLM) on a pool of its own fed by gloo broadcast, on Slurm
    with the placement overrides `extra`, in `folder`; checks it completed and returns its store and run."""
    folder.mkdir(parents=True)
    pools = {"train": {"roles": ["actor", "ref", "reward"]}, "generate": {"roles": ["rollout"]}}
    overrides = [
        f"placement.pools={json.dumps(pools)}",
        "rollout.name=vllm",
        "rollout.vllm_kv_cache_gb=0.25",
        "rollout.vllm_dtype=float32",
        "rollout.checkpoint_engine.backend=gloo",
        "trainer.mode=one_step_off",
        "trainer.total_iterations=2",
    ]
    config = _config_file(folder, model, "grpo_tiny.yaml", [*overrides, *extra])
    db = f"sqlite:///{folder / 'runs.db'}"
    log = folder / "run.log"
    proc = _hf("run", str(config), "--executor", "slurm", "--db", db, "--prefect-api", prefect_api, log=log)
    assert proc.wait(timeout=600) == 0, log.read_text()
    store = RunStore(db)
    (run,) = store.list_runs()
    assert run.status == "completed"
    return store, run


TOTAL = 16  # iterations: more than the run reaches before its drained node holds it (each fault comes within an
# iteration of its job's start, a kill or a drain goes back to the last checkpoint; Slurm is polled every 2 s)


def _held_reward(root: Path) -> str:
    """`write_reward`'s dense reward, held (waiting, not computing) while the file ``root/hold`` exists: a run
    stays inside an iteration until Slurm's warning comes, on a machine of any speed. Its ``custom_function``."""
    path = root / "held_reward.py"
    path.write_text(
        f"import os\nimport time\n{DENSE_REWARD}\n\n"
        "def held(data_source, solution_str, ground_truth, extra_info):\n"
        f"    while os.path.exists({str(root / 'hold')!r}):\n"
        "        time.sleep(0.05)\n"
        "    return digit_share(data_source, solution_str, ground_truth, extra_info)\n"
    )
    return f"{path}:held"


def _compared(store: RunStore, run_id: str) -> dict[tuple[int, str], float]:
    return {(m.step, m.name): m.value for m in store.metrics(run_id) if m.name in COMPARED}


def test_a_run_longer_than_its_time_limit_finishes_across_allocations_and_a_killed_rank_is_recovered(
    slurm_cluster, prefect_api, tmp_path, tiny_model_dir
):
    """A run whose groups get 1-minute Slurm allocations: Slurm sends SIGUSR2 before the limit (the run held in
    its reward stage until then), the flow checkpoints at the next stage boundary and resubmits its groups (new
    jobs). Then, mid-iteration: a rank
    SIGKILLed (the group lost: relaunched from the newest checkpoint, its new ranks forked in the job it kept), the
    job scancelled (its SIGTERM read as
    preemption's, checkpointed and resubmitted, or its end read first, the group lost), its node drained (the
    group lost; the next job waits in the queue until the node is back, and says why), the job preempted by a job
    of a higher-priority partition (SIGTERM, then cancelled after the partition's GraceTime). The run finishes by
    itself with every metric equal to the same run in one allocation."""
    overrides = [
        f"trainer.total_iterations={TOTAL}",
        "trainer.save_freq=0",
        "trainer.val_before_train=false",
        "data.reasoning_gym.val_size=0",
        "rollout.response_length=32",
        f"reward.custom_function={_held_reward(tmp_path)}",
    ]
    config = _config_file(tmp_path, tiny_model_dir, "grpo_tiny.yaml", overrides)
    common = ["--prefect-api", prefect_api]
    hold = tmp_path / "hold"

    def run(name: str, *extra: str) -> tuple[RunStore, subprocess.Popen, Path]:
        db = f"sqlite:///{tmp_path / name}.db"
        log = tmp_path / f"{name}.log"
        proc = _hf("run", str(config), "--executor", "slurm", "--db", db, *extra, *common, log=log)
        return RunStore(db), proc, log

    store, proc, log = run("one")  # time_min=30: one allocation
    started = time.monotonic()
    assert proc.wait(timeout=600) == 0, log.read_text()
    print(f"one allocation: {time.monotonic() - started:.1f} s")
    (whole,) = store.list_runs()
    expected = _compared(store, whole.id)
    assert {step for step, _ in expected} == set(range(1, TOTAL + 1))

    # 1-minute allocations, SIGUSR2 10 s before each limit (measured: Slurm sends it 41-48 s after the job starts;
    # the limit itself ends a job 64-78 s in); three lost groups, one spare recovery. After two iterations the run is
    # held in its reward stage until a rank logs the signal: a warning after trained iterations on any machine
    limited = ["placement.slurm.time_min=1", "placement.slurm.signal_delay_s=10", "trainer.max_recoveries=4"]
    store, proc, log = run("limited", *(a for o in [*limited, "trainer.recovery_backoff_s=1"] for a in ("-o", o)))
    deadline = time.monotonic() + 300
    while not (store.list_runs() and max((i.step for i in store.iterations(store.list_runs()[0].id)), default=0) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    hold.touch()
    try:
        while not any("received SIGUSR2" in err.read_text() for err in (tmp_path / "out").rglob("*_log.err")):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        hold.unlink()
    while not store.recoveries(run_id := store.list_runs()[0].id):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    [warned] = store.recoveries(run_id)
    node = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    drained_node = False
    try:
        # in the second allocation a rank SIGKILLed, in the third the job scancelled (SIGTERM, as on preemption), in
        # the fourth its node drained (the next job waits in the queue until the node is back)
        killed = _training_in_a_new_job(proc, store, run_id, store.placements(run_id)[0].slurm_job_id, log)
        before = len(store.recoveries(run_id))
        os.kill(_rank_pid(killed, rank=0), signal.SIGKILL)
        cancelled = _training_again(proc, store, run_id, before, log)
        # the relaunch forked its new ranks in the job it kept (launch i + 1 follows recovery i; by the time training
        # starts again the kept job may have had its own warning and been resubmitted, so `cancelled` may be newer)
        launches = [p.slurm_job_id for p in store.placements(run_id) if p.role == "actor"]
        [lost] = [i for i, r in enumerate(store.recoveries(run_id)) if "SIGKILL" in r.cause]
        assert launches[lost + 1] == killed, (launches, store.recoveries(run_id))
        subprocess.run(["scancel", cancelled], check=True)
        drained = _training_in_a_new_job(proc, store, run_id, cancelled, log)
        before = len(store.recoveries(run_id))
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=drain", "reason=test"], check=True)
        drained_node = True
        while len(store.recoveries(run_id)) == before:  # the group saw the drain and cancelled its job
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        deadline = time.monotonic() + 120
        while "waits in the queue" not in log.read_text():  # the relaunched group says why it does not start
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        if drained_node:  # resuming a node that is not drained is an error of its own, hiding the test's
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=True)
    # in the fifth, a job of the higher-priority partition "urgent" that needs the whole node: Slurm preempts the
    # run's job (SIGTERM, cancelled GraceTime=20 s later), and the run's next job waits until the urgent one is done
    preempted = _training_in_a_new_job(proc, store, run_id, drained, log)
    before = len(store.recoveries(run_id))
    urgent = subprocess.run(
        ["sbatch", "--parsable", "-p", "urgent", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 3"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert proc.wait(timeout=600) == 0, log.read_text()
    assert store.get_run(run_id).status == "completed"
    relaunches = store.recoveries(run_id)
    by_preemption = relaunches[before]  # read as Slurm's warning (checkpointed) or, if the job's end came first, lost
    assert "SIGTERM" in by_preemption.cause or f"job {preempted}, slurm): the Slurm job ended" in by_preemption.cause
    ran = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "State", "-j", urgent], capture_output=True, text=True)
    assert ran.stdout.strip() == "COMPLETED", ran.stdout + ran.stderr  # it got the node the run's job held
    [sigkill] = [r for r in relaunches if f"job {killed}, slurm" in r.cause and "SIGKILL" in r.cause]
    [drain] = [r for r in relaunches if f"job {drained}, slurm" in r.cause]
    assert "drain" in drain.cause and sigkill.group_name == "actor_rollout_ref", relaunches
    assert sigkill.resumed_from == warned.resumed_from  # save_freq 0: the warning's checkpoint
    assert {tuple(r.nodes) for r in relaunches} == {(node,)}  # where each lost or warned rank ran
    resubmitted = [r for r in relaunches if "Slurm's warning" in r.cause]
    assert any("SIGUSR2" in r.cause for r in resubmitted)
    # scancel: SIGTERM, then the job ends; whichever the controller reads first (a warning, or the job's end)
    cancel = [r for r in relaunches if f"job {cancelled}, slurm" in r.cause and "CANCELLED" in r.cause]
    assert cancel or any("SIGTERM" in r.cause for r in resubmitted), relaunches
    timed_out = [r for r in relaunches if "TIMEOUT" in r.cause]  # a limit that came before its warning was read
    ended = [r for r in relaunches if f"job {preempted}, slurm): the Slurm job ended" in r.cause]  # preempted
    assert len(resubmitted) + len(timed_out) + len(cancel) + len(ended) + 2 == len(relaunches), relaunches
    jobs = [p.slurm_job_id for p in store.placements(run_id) if p.role == "actor"]  # one row a launch
    assert len(jobs) == len(relaunches) + 1 and len(set(jobs)) == len(relaunches)  # a new job each but the SIGKILL's
    # each resubmission goes on from a checkpoint on record: the one its warning took, or, for a warning read before
    # the iteration's first update (nothing of it applied), the one the iteration began from
    assert [c.step for c in store.checkpoints(run_id)] == [*sorted({r.resumed_from for r in resubmitted}), TOTAL]
    assert "resubmitting the worker groups" in log.read_text()
    waiting = [line for line in log.read_text().splitlines() if "waits in the queue" in line]  # once per reason
    assert waiting and all("reason: " in w and "partition (default)" in w for w in waiting), waiting
    assert _compared(store, run_id) == expected


def _training_again(proc: subprocess.Popen, store: RunStore, run_id: str, recoveries: int, log: Path) -> str:
    """Wait until the run has recovered once more than `recoveries` times and an iteration started after that; the
    job its group then runs in."""
    deadline = time.monotonic() + 300
    while len(store.recoveries(run_id)) <= recoveries:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    _iteration_started(proc, store, run_id, deadline, log)
    return _current_job(store, run_id)


def _training_in_a_new_job(proc: subprocess.Popen, store: RunStore, run_id: str, old_job: str, log: Path) -> str:
    """Wait until the run's group runs in a job other than `old_job` and an iteration started there; its job id."""
    deadline = time.monotonic() + 300
    while (job := _current_job(store, run_id)) in (old_job, None):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    _iteration_started(proc, store, run_id, deadline, log)
    return job


def _iteration_started(proc: subprocess.Popen, store: RunStore, run_id: str, deadline: float, log: Path) -> None:
    """Wait until an iteration of the run starts from now on (by `deadline`, `time.monotonic`)."""
    from datetime import UTC, datetime

    seen = datetime.now(UTC)
    while not any(i.ended_at is None and i.started_at > seen for i in store.iterations(run_id)):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def test_resubmitting_off_stops_on_the_warning_resumable(slurm_cluster, prefect_api, tmp_path, tiny_model_dir):
    """``trainer.resubmit_on_preemption=false``: SIGUSR2 (what Slurm sends before the time limit) during iteration 2
    stops the run at the next stage boundary with a checkpoint, ``interrupted``, exit code 3."""
    overrides = [
        f"trainer.total_iterations={TOTAL}",
        "trainer.save_freq=0",
        "trainer.val_before_train=false",
        "data.reasoning_gym.val_size=0",
        "trainer.resubmit_on_preemption=false",
    ]
    config = _config_file(tmp_path, tiny_model_dir, "grpo_tiny.yaml", overrides)
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    store = RunStore(db)
    log = tmp_path / "run.log"
    proc = _hf("run", str(config), "--executor", "slurm", "--db", db, "--prefect-api", prefect_api, log=log)
    run_id = wait_inside_iteration(proc, store, 2, log=log, timeout_s=300)
    subprocess.run(["scancel", "--signal=USR2", _current_job(store, run_id)], check=True)
    assert proc.wait(timeout=300) == 3, log.read_text()
    run = store.get_run(run_id)
    assert run.status == "interrupted" and "SIGUSR2" in run.error and f"hf resume {run_id}" in run.error, run.error
    assert not store.recoveries(run_id)
    # the warning reaches the controller within a heartbeat (0.5 s), a tiny iteration takes 0.2-1 s
    assert 1 <= store.latest_checkpoint(run_id).step <= TOTAL // 2


def test_only_time_limit_warnings_before_an_iteration_count_toward_stopping_the_resubmissions():
    """The run stops resubmitting after two allocations in a row reached their time limit (SIGUSR2) before an
    iteration. A preemption or scancel (SIGTERM) says nothing of the limit and does not count; an allocation that
    trained breaks the row. Stop 62's CI run: scancel read as a warning, a drained node, then a preemption, none of
    them after an iteration, stopped a run that had time to train in every allocation."""
    from hybridflow.flows.rlhf import Warned, allocations_short_of_time

    def warned(trained: int, signals: str) -> Warned:
        return Warned(2, trained, {"actor_rollout_ref": [0]}, ["vm"], f"actor_rollout_ref rank 0: {signals}", {})

    short = 0
    for ended in [warned(0, "SIGTERM"), warned(0, "SIGTERM"), warned(0, "SIGTERM")]:
        short = allocations_short_of_time(short, ended)
    assert short == 0
    assert allocations_short_of_time(0, warned(0, "SIGUSR2")) == 1
    assert allocations_short_of_time(1, warned(0, "SIGTERM")) == 1
    assert allocations_short_of_time(1, warned(0, "SIGUSR2, SIGTERM")) == 2
    assert allocations_short_of_time(1, warned(1, "SIGUSR2")) == 0


def test_a_plan_for_three_nodes_runs_across_them_beside_its_estimate(
    slurm_cluster, prefect_api, tmp_path, tiny_model_dir
):
    """`hf plan --executor slurm --nodes 3 --gpus-per-node 2` for the development cluster's partition ``multi`` (3
    nodes of 2 CPUs) writes pools and strategies; `hf run` of that file runs one Slurm job per planned pool, each
    with the planned ranks on the planned number of nodes (the pools fill the nodes: three pools, three nodes), and
    records the plan's id; `hf runs show` and `hf plans show` set the measured iteration beside the estimate."""
    config = _config_file(
        tmp_path,
        tiny_model_dir,
        "ppo_tiny.yaml",
        ["actor.use_kl_loss=true", "trainer.total_iterations=3", "placement.slurm.partition=multi"],
    )
    planned = tmp_path / "planned.yaml"
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    shown = subprocess.run(
        [HF, "plan", str(config), "--executor", "slurm", "--nodes", "3", "--gpus-per-node", "2", "--gpu", "h200",
         "--output", str(planned), "--db", db],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stdout + shown.stderr
    written = yaml.safe_load(planned.read_text())
    assert written["placement"]["executor"] == "slurm" and written["placement"]["slurm"]["partition"] == "multi"
    pools = written["placement"]["pools"]
    log = tmp_path / "run.log"
    proc = _hf("run", str(planned), "--db", db, "--prefect-api", prefect_api, log=log)
    assert proc.wait(timeout=600) == 0, log.read_text()
    store = RunStore(db)
    [run] = store.list_runs()
    [plan] = store.plans()
    assert run.status == "completed" and run.plan_id == plan.id == written["placement"]["plan"]
    placed = {p.group_name: p for p in store.placements(run.id)}
    assert {p.executor for p in placed.values()} == {"slurm"}
    for name, pool in pools.items():
        assert len(placed[name].ranks) == pool["nodes"] * pool["tasks_per_node"], (name, placed[name])
        assert len(set(placed[name].hosts)) == pool["nodes"], (name, placed[name])
    assert len({p.slurm_job_id for p in placed.values()}) == len(pools)  # one Slurm job per planned pool
    hosts = {host for p in placed.values() for host in p.hosts}
    assert hosts <= {"hf-node1", "hf-node2", "hf-node3"} and len(hosts) == sum(p["nodes"] for p in pools.values())

    steps = sorted((m.step, m.value) for m in store.metrics(run.id) if m.name == "timing_s/step")
    measured = statistics.median(value for _, value in steps[1:])  # the first iteration warms caches up
    runs_show = subprocess.run(
        [HF, "runs", "show", run.id, "--db", db], capture_output=True, text=True, timeout=120, env=WIDE
    )
    assert (
        f"{plan.chosen_seconds:.3g} s per iteration estimated (h200), {measured:.3g} s measured (median), "
        f"{measured / plan.chosen_seconds:.3g} x the estimate" in runs_show.stdout
    ), runs_show.stdout
    plans_show = subprocess.run(
        [HF, "plans", "show", plan.id, "--db", db], capture_output=True, text=True, timeout=120, env=WIDE
    )
    beside = plans_show.stdout[plans_show.stdout.index("the plan's estimate beside the runs that ran it") :]
    iteration_row = next(line for line in beside.splitlines() if "│ iteration" in line)
    assert [cell.strip() for cell in iteration_row.split("│")[1:-1]] == [
        "iteration",
        f"{plan.chosen_seconds:.3g}",
        f"{measured:.3g}",
        f"{measured / plan.chosen_seconds:.3g}",
    ], beside
