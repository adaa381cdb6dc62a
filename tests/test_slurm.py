"""Worker groups as jobs of a real Slurm cluster (hybridflow/slurm/dev_cluster.sh: slurmctld, slurmd, slurmdbd +
MariaDB):
sbatch through submitit, torch.distributed inside the job, several groups at once, many-to-many transfer between
groups of different sizes, and the failures a cluster brings (kill -9 of a rank, scancel, a drained node)."""

import errno
import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from procs import cmdline, parent

from hybridflow.engine.protocol import DataProto
from hybridflow.slurm import cluster
from hybridflow.slurm.channel import create_secret
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup, WorkerGroupError, slurm_parameters

TOY = f"{Path(__file__).parent / 'workers_for_tests.py'}:ToyWorker"


def _slurm_group(tmp: Path, name: str, tasks_per_node: int = 2, **spec) -> WorkerGroup:
    secret = tmp / "secret"
    if not secret.exists():
        create_secret(secret)
    return WorkerGroup(
        GroupSpec(
            name=name,
            worker_cls=TOY,
            tasks_per_node=tasks_per_node,
            executor="slurm",
            slurm=slurm_parameters(partition="debug", cpus_per_task=1, sbatch={"comment": f"test-{name}"}),
            timeout_min=30,
            start_timeout_s=120,
            **spec,
        ),
        run_dir=tmp,
        data_dir=tmp / "data",
        secret_path=secret,
    )


@pytest.fixture(scope="module")
def groups(slurm_cluster, tmp_path_factory):
    """Two groups running at once: 'rollout' with 2 ranks (that may build vLLM engines) and 'actor' with 1."""
    tmp = tmp_path_factory.mktemp("slurm_groups")
    rollout = _slurm_group(tmp, "rollout", tasks_per_node=2, vllm=True)
    try:
        actor = _slurm_group(tmp, "actor", tasks_per_node=1)
    except BaseException:
        rollout.shutdown()
        raise
    yield rollout, actor, tmp
    for group in (rollout, actor):
        group.shutdown()


def test_groups_are_slurm_jobs_with_torch_distributed_inside(groups, slurm_cluster):
    rollout, actor, _ = groups
    queue = subprocess.run(["squeue", "-h", "-o", "%i %j %T %D %C"], capture_output=True, text=True).stdout
    running = {line.split()[0]: line.split()[1:] for line in queue.splitlines()}
    assert running[rollout.job_id][:2] == ["hybridflow-rollout", "RUNNING"]  # both groups run at once
    assert running[actor.job_id][:2] == ["hybridflow-actor", "RUNNING"]
    env = rollout.slurm_env()
    assert [e["SLURM_PROCID"] for e in env] == ["0", "1"]
    assert {e["SLURM_JOB_ID"] for e in env} == {rollout.job_id} and {e["SLURM_NTASKS"] for e in env} == {"2"}
    assert {e["SLURM_CPUS_PER_TASK"] for e in env} == {"1"}  # placement.slurm.cpus_per_task reached sbatch
    assert rollout.all_reduce(2.0) == pytest.approx(2.0 * 1 + 2.0 * 2)  # gloo across the job's two tasks
    assert cluster.job_state(rollout.job_id) == "RUNNING"  # real accounting (slurmdbd) knows the job
    placement = rollout.placement
    assert placement["executor"] == "slurm" and placement["slurm_job_id"] == rollout.job_id
    assert placement["hosts"] == [slurm_cluster["node"]] * 2 and placement["ranks"] == [0, 1]
    script = next((rollout.log_dir).glob("*submission_file.sh"), None) or next(rollout.log_dir.glob("*.sh"))
    assert "#SBATCH --comment=test-rollout" in script.read_text()  # extra sbatch options from config


def test_a_nodes_ranks_are_forked_by_its_one_task_which_imported_the_engine_once(groups):
    """One task per node (the node agent) holds the node's CPUs and forks its ranks from a fork server that imported
    the engine (and, for a group whose ranks may build vLLM engines, vLLM's engine modules): no rank imports them
    itself, each sees its own task's Slurm variables, and each writes its own log."""
    rollout, actor, _ = groups
    views = rollout.process_view("SLURM_LOCALID")
    assert [v["variable"] for v in views] == ["0", "1"]
    assert all(v["engine_imported"] for v in views)  # imported before the fork: the rank never imported it
    vllm = importlib.util.find_spec("vllm") is not None  # CI installs it
    assert [v["vllm_engine_imported"] for v in views] == [vllm, vllm]
    assert [v["vllm_engine_imported"] for v in actor.process_view("SLURM_LOCALID")] == [False]
    [server] = {v["parent"] for v in views}  # both ranks are children of one fork server ...
    assert b"multiprocessing.forkserver" in cmdline(server)
    agent = parent(server)
    assert b"submitit.core._submit" in cmdline(agent)  # ... started by the node's task
    steps = subprocess.run(["sacct", "-n", "-P", "-j", rollout.job_id, "-o", "JobID,NTasks,AllocCPUS"],
                           capture_output=True, text=True).stdout.split()  # fmt: skip
    assert f"{rollout.job_id}.0|1|2" in steps  # the job's step: one task with both ranks' CPUs
    for rank in (0, 1):
        assert f"rank {rank} says hello on stdout" in (rollout.log_dir / f"{rollout.job_id}_{rank}_log.out").read_text()
    assert "forked ranks" in (rollout.log_dir / f"{rollout.job_id}_node0_log.err").read_text()


def test_many_to_many_transfer_between_groups_of_different_sizes(groups):
    rollout, actor, _ = groups
    data = DataProto.from_dict({"x": torch.arange(6)})
    produced = rollout.double(data, factor=2)  # DP=2 producer: two parts of 3 rows, one per rank
    assert [p.length for p in produced.groups[0].parts] == [3, 3]
    consumed = actor.double(produced.select(["y"]), factor=10, key="y")  # DP=2 -> DP=1: reads both parts
    assert consumed.load().batch["y"].tolist() == [0, 20, 40, 60, 80, 100]
    assert consumed.load().batch["rank"].tolist() == [0] * 6 and len(consumed.groups[0].parts) == 1
    back = rollout.double(consumed.select(["y"]), factor=1, key="y")  # DP=1 -> DP=2: each rank its half
    assert back.load().batch["rank"].tolist() == [0, 0, 0, 1, 1, 1]
    assert back.load().batch["y"].tolist() == [0, 20, 40, 60, 80, 100]

    # Each consumer rank reads only its rows: with the producer's rank-0 part gone, rank 1 of the consumer still
    # computes (it never opens that file) and only rank 0 fails.
    Path(produced.groups[0].parts[0].path).unlink()
    with pytest.raises(WorkerGroupError, match=r"rank 0 raised in double") as err:
        rollout.double(produced.select(["y"]), factor=1, key="y")
    assert "rank 1 raised" not in str(err.value)


def _submitit_ports(job_ids: range) -> set[int]:
    """The rendezvous ports submitit's TorchDistributedEnvironment draws for these job ids (seeded by the id)."""
    return {random.Random(str(job_id)).randint(20000, 60000) for job_id in job_ids}


def test_ranks_rendezvous_while_another_socket_holds_the_port_submitit_would_draw(slurm_cluster, tmp_path):
    """A port fixed by the job id can be taken by any socket on the node (CI once lost a group to a client socket
    on it: "Address already in use"); rank 0 binds a free port instead and the controller relays it."""
    ids = subprocess.run(
        ["sacct", "-X", "-n", "-a", "-S", "2000-01-01", "-o", "JobID"], capture_output=True, text=True
    ).stdout.split()
    last = max((int(i) for i in ids if i.isdigit()), default=0)
    held = []
    try:
        for port in _submitit_ports(range(last + 1, last + 11)):  # the next ten jobs' ports, on every address
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError as err:  # some other socket on the node holds it already: just as good for this test
                sock.close()
                if err.errno != errno.EADDRINUSE:
                    raise
                continue
            sock.listen(1)
            held.append(sock)
        group = _slurm_group(tmp_path, "crowded")
        try:
            assert int(group.job_id) <= last + 10
            assert group.all_reduce(3.0) == pytest.approx(3.0 * 1 + 3.0 * 2)  # gloo across both ranks
        finally:
            group.shutdown(timeout_s=10)
    finally:
        for sock in held:
            sock.close()


def _raises_within(group: WorkerGroup, fault, limit_s: float = 30.0) -> tuple[WorkerGroupError, float]:
    """Start a long call, inject `fault` once the call runs, and return the error and the seconds to detect it."""
    timer = threading.Timer(1.0, fault)
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(WorkerGroupError) as err:
            group.sleep(120)
    finally:
        timer.cancel()
    detected = time.monotonic() - start - 1.0
    assert detected < limit_s, f"failure detected after {detected:.1f} s"
    return err.value, detected


def test_kill_9_of_one_rank_fails_the_call_and_the_relaunch_forks_new_ranks_in_the_same_job(slurm_cluster, tmp_path):
    """A rank SIGKILLed mid-call: its node's agent names it at once. The group's allocation is kept, and the group
    relaunched with the same placement (as the run's recovery does) forks its new ranks in the same job, from the
    fork server that imported the engine for the first ranks: no new job, no new import."""
    group = _slurm_group(tmp_path, "victim")
    try:
        pid = group.pids[1]
        [server] = {view["parent"] for view in group.process_view("SLURM_PROCID")}
        err, seconds = _raises_within(group, lambda: os.kill(pid, signal.SIGKILL))
        assert "worker group 'victim'" in str(err) and f"job {group.job_id}" in str(err)
        assert f", pid {pid}) was killed by SIGKILL during sleep" in str(err)  # as its node's agent saw it
        assert str(err).splitlines()[0].count("rank 1 ") == 1, str(err)  # named once, with its host and pid
        assert err.lost  # a relaunch can go on
        print(f"kill -9 of rank 1 detected in {seconds:.1f} s: {str(err).splitlines()[0]}")
    finally:
        group.shutdown(timeout_s=10)
    started = time.monotonic()
    again = _slurm_group(tmp_path, "victim")
    try:
        print(f"relaunched in its allocation in {time.monotonic() - started:.2f} s")
        assert again.job_id == group.job_id and again.log_prefix == f"{group.job_id}.2"
        assert {view["parent"] for view in again.process_view("SLURM_PROCID")} == {server}
        assert pid not in again.pids and again.all_reduce(1.0) == pytest.approx(3.0)
        assert (again.log_dir / f"{group.job_id}.2_1_log.err").exists()
    finally:
        again.shutdown(timeout_s=10)  # no rank lost this time: the job ends
    deadline = time.monotonic() + 30
    while cluster.job_state(group.job_id) in cluster.ACTIVE_STATES:
        assert time.monotonic() < deadline, "the allocation outlived its group's orderly end"
        time.sleep(0.5)


CONTROLLER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_slurm import _slurm_group
group = _slurm_group(Path(sys.argv[1]), "orphaned", heartbeat_timeout_s=3.0)
print(group.job_id, *group.pids, flush=True)
time.sleep(600)
"""


def test_a_groups_job_ends_by_itself_when_its_controller_is_killed(slurm_cluster, tmp_path):
    """The controller SIGKILLed (none of its clean-up runs): each node's agent, like each rank, sees the
    controller's connection lost for ``heartbeat_timeout_s`` (3 s) and exits, killing its ranks, so the job ends
    and gives its node back: no allocation outlives its run."""
    controller = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, str(tmp_path), str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True
    )
    try:
        job, *pids = controller.stdout.readline().split()
    finally:
        controller.kill()
        controller.wait()
    assert len(pids) == 2, pids
    killed = time.monotonic()
    state = _ended_state(job, within_s=60)
    print(f"job {job} ended ({state}) {time.monotonic() - killed:.1f} s after its controller was killed")
    assert state == "COMPLETED"  # its agent returned: nobody cancelled it
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def _ended_state(job: str, within_s: float) -> str:
    """The state job ``job`` ends in, polled every 0.5 s; fails the test if it is still active after ``within_s``."""
    start = time.monotonic()
    while (state := cluster.job_state(job)) in cluster.ACTIVE_STATES:
        assert time.monotonic() - start < within_s, f"job {job} still {state} {within_s} s on"
        time.sleep(0.5)
    return state


def test_scancel_fails_the_call(slurm_cluster, tmp_path):
    group = _slurm_group(tmp_path, "cancelled")
    try:
        err, seconds = _raises_within(group, lambda: subprocess.run(["scancel", group.job_id], check=True))
        assert f"worker group 'cancelled' (job {group.job_id}, slurm)" in str(err)
        assert "the Slurm job ended (state CANCELLED)" in str(err)
        assert "rank 0" in str(err)
        print(f"scancel detected in {seconds:.1f} s: {str(err).splitlines()[0]}")
    finally:
        group.shutdown(timeout_s=10)


def test_drained_node_fails_the_call_and_frees_the_node(slurm_cluster, tmp_path):
    node = slurm_cluster["node"]
    group = _slurm_group(tmp_path, "drained")
    drain = ["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=hybridflow-test"]
    try:
        err, seconds = _raises_within(group, lambda: subprocess.run(drain, check=True))
        assert f"node {node} is drain" in str(err) and "hybridflow-test" in str(err)
        assert f"job {group.job_id}" in str(err) and "rank 0" in str(err) and "rank 1" in str(err)
        print(f"drained node detected in {seconds:.1f} s: {str(err).splitlines()[0]}")
        # the group's job gave the node up (scancel returns before slurmctld has ended the job: stop 91's CI read
        # RUNNING right after it)
        assert _ended_state(group.job_id, within_s=30) == "CANCELLED"
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
        group.shutdown(timeout_s=10)
