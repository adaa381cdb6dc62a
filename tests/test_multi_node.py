"""The development cluster's nodes of their own (`hybridflow/slurm/dev_cluster.sh`: partition ``multi``, each node a
slurmd with its own host name and loopback address), a Slurm worker group across two of them (its ranks on two hosts,
listening on their own nodes' addresses, joined by gloo), and GRPO runs whose actor spans two nodes (data-parallel;
megatron's pipeline stages), each equal to the same run on one node."""

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from postgres import postgres_server
from tiny_runs import COMPARED, wait_inside_iteration, write_reward

from hybridflow.flows.store.run_store import RunStore
from hybridflow.slurm.channel import create_secret
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup, WorkerGroupError, slurm_parameters

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
TOY = f"{Path(__file__).parent / 'workers_for_tests.py'}:ToyWorker"


def test_the_multi_partitions_nodes_are_hosts_of_their_own(slurm_cluster):
    """A job step on each of the three nodes runs under that node's host name, which resolves to its own address;
    the controller's host (this machine) is none of them."""
    shown = subprocess.run(
        ["srun", "-p", "multi", "-N", "3", "--ntasks-per-node=1", "-t", "1",
         "bash", "-c", 'echo "$(hostname) $SLURMD_NODENAME $(getent hosts "$(hostname)" | cut -d" " -f1)"'],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    rows = sorted(line.split() for line in shown.stdout.splitlines())
    assert rows == [[f"hf-node{k}", f"hf-node{k}", f"127.0.1.{k}"] for k in (1, 2, 3)], shown.stdout
    assert slurm_cluster["node"] not in {row[0] for row in rows}


def test_a_worker_group_across_two_nodes_listens_on_each_nodes_address(slurm_cluster, tmp_path):
    """A group of 2 nodes x 1 rank in partition ``multi``: one rank per host, each listening on the address of its own
    node only (rank 0's rendezvous store, gloo's pairs; never every interface), gloo across them. The controller's
    channel drops forged messages sent from the third node (the run's secret signs every message), and the group
    still answers; once the group has ended, no port of its ranks is open."""
    secret = tmp_path / "secret"
    create_secret(secret)
    group = WorkerGroup(
        GroupSpec(
            name="across",
            worker_cls=TOY,
            nodes=2,
            tasks_per_node=1,
            executor="slurm",
            slurm=slurm_parameters(partition="multi", cpus_per_task=1),
            timeout_min=10,
            start_timeout_s=120,
        ),
        run_dir=tmp_path,
        data_dir=tmp_path / "data",
        secret_path=secret,
    )
    try:
        hosts = group.placement["hosts"]
        assert len(set(hosts)) == 2 and all(h.startswith("hf-node") for h in hosts), hosts
        views = group.network_view()
        assert [v["host"] for v in views] == hosts
        assert [v["address"] for v in views] == [socket.gethostbyname(h) for h in hosts]
        assert len({v["address"] for v in views}) == 2  # not one shared loopback address
        assert group.all_reduce(2.0) == pytest.approx(2.0 * 1 + 2.0 * 2)  # gloo between the two nodes
        listening = {pid: _listening(pid) for pid in group.pids}
        for pid, view in zip(group.pids, views, strict=True):
            assert listening[pid] and {address for address, _ in listening[pid]} == {view["address"]}, listening
        ports = [(address, port) for pid in group.pids for address, port in listening[pid]]

        third = ({"hf-node1", "hf-node2", "hf-node3"} - set(hosts)).pop()
        before = group._endpoint.signer.dropped
        _send_forged(third, group._endpoint.address, "across/rank-0", count=20)
        assert group.all_reduce(1.0) == pytest.approx(3.0)  # the channel read past them; the group answers
        assert group._endpoint.signer.dropped - before == 20
    finally:
        group.shutdown()
    for address, port in ports:  # the store's and gloo's listeners are gone with the ranks
        with pytest.raises(ConnectionRefusedError), socket.create_connection((address, port), timeout=5):
            pass


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    import psutil

    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def _send_forged(node: str, address: str, claimed: str, count: int) -> None:
    """From a job step on `node`: `count` messages to the controller channel at `address`, claiming to come from
    `claimed` (a rank of the group), each a well-formed call result signed with a guessed key."""
    script = (
        "import sys, time, zmq\n"
        "from hybridflow.slurm.channel import Signer\n"
        "sock = zmq.Context.instance().socket(zmq.DEALER)\n"
        "sock.setsockopt(zmq.IDENTITY, b'rogue')\n"
        "sock.setsockopt(zmq.LINGER, 5000)\n"
        "sock.connect(sys.argv[1])\n"
        "forger = Signer(b'a guessed key')\n"
        f"for i in range({count}):\n"
        "    sock.send_multipart(forger.pack({'type': 'result', 'id': str(i), 'rank': 0, 'from': sys.argv[2]}))\n"
        "sock.close()\n"
    )
    sent = subprocess.run(
        ["srun", "-p", "multi", "-w", node, "-t", "1", sys.executable, "-c", script, address, claimed],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr


def test_a_group_whose_folder_its_nodes_cannot_see_ends_at_once_naming_the_node_and_the_fix(slurm_cluster):
    """The run's folder in the development cluster's ``login-only`` folder, which its nodes do not see (as a login
    node's local disk): Slurm cannot launch the group's job there (JobLaunchFailure). The group's start ends within
    seconds naming the node, the folder and ``trainer.output_dir``, and not as a lost rank (no relaunch: every
    relaunch would fail the same way)."""
    hidden = Path(os.environ.get("HYBRIDFLOW_SLURM_DIR", "/var/lib/hybridflow-slurm")) / "login-only"
    run_dir = hidden / f"test-{os.getpid()}"
    run_dir.mkdir(parents=True)
    try:
        secret = create_secret(run_dir / "secret")
        started = time.monotonic()
        with pytest.raises(WorkerGroupError) as raised:
            WorkerGroup(
                GroupSpec(
                    name="unseen",
                    worker_cls=TOY,
                    executor="slurm",
                    slurm=slurm_parameters(partition="multi"),
                    timeout_min=10,
                    slurm_poll_s=0.5,
                ),
                run_dir=run_dir,
                data_dir=run_dir / "data",
                secret_path=secret,
            )
        took = time.monotonic() - started
    finally:
        shutil.rmtree(run_dir)
    message = str(raised.value)
    assert took < 60, took
    assert "the Slurm job ended (state FAILED) during starting: Slurm could not launch it on node hf-node" in message
    assert f"cannot open the job's files in {run_dir / 'submitit' / 'unseen'}" in message, message
    assert "Put trainer.output_dir on a file system every node mounts" in message, message
    assert not raised.value.lost


def test_node_agents_that_never_reach_the_controller_end_the_start_within_the_rendezvous_timeout(
    slurm_cluster, tmp_path
):
    """A group of 2 nodes whose job runs but whose node agents never say hello (here its set-up line hangs; on a
    real cluster, nodes that cannot reach the controller's address): the start ends ``rendezvous_timeout_s`` after
    the job started, naming the silent nodes, the controller's address and the fix, and the job is cancelled."""
    secret = create_secret(tmp_path / "secret")
    started = time.monotonic()
    with pytest.raises(WorkerGroupError) as raised:
        WorkerGroup(
            GroupSpec(
                name="silent",
                worker_cls=TOY,
                nodes=2,
                executor="slurm",
                slurm=slurm_parameters(partition="multi", setup=["sleep 300"]),
                timeout_min=10,
                slurm_poll_s=0.5,
                rendezvous_timeout_s=5,
            ),
            run_dir=tmp_path,
            data_dir=tmp_path / "data",
            secret_path=secret,
        )
    took = time.monotonic() - started
    message = str(raised.value)
    assert 5 < took < 60, took
    job = message.split("(job ", 1)[1].split(",", 1)[0]
    nodes = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "NodeList", "-j", job], capture_output=True, text=True)
    silent = subprocess.run(["scontrol", "show", "hostnames", nodes.stdout.strip()], capture_output=True, text=True)
    assert len(silent.stdout.split()) == 2, silent.stdout
    assert f"the node agents on {', '.join(silent.stdout.split())} did not reach the controller at tcp://" in message
    assert "within 5 s of the job's start (placement.rendezvous_timeout_s)" in message, message
    assert "set placement.slurm.interface to the interface of the network they share with this host" in message
    deadline = time.monotonic() + 30
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still queued or running"
        time.sleep(0.5)


MEGATRON_PP2 = ["actor.strategy=megatron", "actor.pp=2", "actor.tp=1", "rollout.gen_tp=1"]


@pytest.mark.parametrize(
    "actor",
    [
        pytest.param([], id="fsdp"),
        pytest.param(
            MEGATRON_PP2,
            id="megatron_pp2",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("megatron.core") is None and os.environ.get("CI") != "true",
                reason="megatron-core is not installed (bash .ci/setup installs it)",
            ),
        ),
    ],
)
def test_grpo_with_its_actor_across_two_nodes_matches_the_run_on_one(
    actor, slurm_cluster, prefect_api, tmp_path, tiny_model_dir
):
    """The tiny GRPO run with its actor + rollout pool of 2 ranks, once on one node (partition ``debug``, 2 ranks
    there) and once across two (``multi``, 1 rank on each): every compared metric of every iteration equal. FSDP:
    the actor data-parallel, gloo's all-reduce between the two nodes' addresses. Megatron: its two pipeline stages on
    two nodes (activations and gradients between them), and the 3D-HybridEngine gathering the weights across them for
    generation at pp=1."""
    metrics, placed = {}, {}
    for name, partition, nodes, tasks in (("one", "debug", 1, 2), ("two", "multi", 2, 1)):
        db = f"sqlite:///{tmp_path / name}.db"
        overrides = [
            f"model.path={tiny_model_dir}",
            f"reward.custom_function={write_reward(tmp_path)}",
            f"trainer.output_dir={tmp_path / name}",
            "trainer.total_iterations=3",
            "trainer.val_before_train=false",
            "data.reasoning_gym.val_size=0",
            f"placement.slurm.partition={partition}",
            f"placement.nodes={nodes}",
            f"placement.tasks_per_node={tasks}",
            "placement.slurm.time_min=10",
            *actor,
        ]
        args = [HF, "run", str(ROOT / "examples" / "grpo_tiny.yaml"), "--executor", "slurm", "--db", db]
        args += ["--prefect-api", prefect_api, *(a for o in overrides for a in ("-o", o))]
        done = subprocess.run(args, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        store = RunStore(db)
        (run,) = store.list_runs()
        metrics[name] = {(m.step, m.name): m.value for m in store.metrics(run.id)}
        placed[name] = {p.role: p for p in store.placements(run.id)}["actor"]
    assert placed["one"].hosts == [slurm_cluster["node"]] * 2
    hosts = placed["two"].hosts
    assert len(set(hosts)) == 2 and all(h.startswith("hf-node") for h in hosts), hosts
    compared = {key: value for key, value in metrics["one"].items() if key[1] in COMPARED}
    assert {step for step, _ in compared} == {1, 2, 3} and len(compared) == 3 * len(COMPARED)
    assert {key: metrics["two"].get(key) for key in compared} == compared
    if actor:  # the stages on two nodes, and the weights gathered across them for generation
        assert placed["two"].parallel["train"] == {"pp": 2, "tp": 1, "dp": 1}
        assert all(metrics["two"][(step, "hybrid_engine/received_mib")] > 0 for step in (1, 2, 3))


def _node_processes(node: str) -> list[int]:
    """The processes of the development cluster's node `node`: those in the UTS namespace of its slurmd (the
    namespace that gives them its host name), slurmd's own included."""
    slurm_dir = Path(os.environ.get("HYBRIDFLOW_SLURM_DIR", "/var/lib/hybridflow-slurm"))
    slurmd = int((slurm_dir / f"slurmd-{node}.pid").read_text())
    namespace = os.readlink(f"/proc/{slurmd}/ns/uts")
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(proc / "ns" / "uts") == namespace:
                found.append(int(proc.name))
        except OSError:  # ended meanwhile
            continue
    return found


def test_a_node_lost_mid_run_is_replaced_by_a_spare_and_the_run_matches_the_uninterrupted_one(
    slurm_cluster, prefect_api, tmp_path, tiny_model_dir
):
    """GRPO on 2 of the partition's 3 nodes, its controller on its own host (this machine, no node of ``multi``)
    and its store on PostgreSQL reached by address. In iteration 3 one node is lost: every process on it SIGKILLed
    (its slurmd, the group's node agent and rank) and the node set DOWN. The run recovers by itself: its group
    relaunched in a new job on the other node and the spare one, from the newest checkpoint, and every compared
    metric equal to the same run uninterrupted (on SQLite)."""
    overrides = [
        f"model.path={tiny_model_dir}",
        f"reward.custom_function={write_reward(tmp_path)}",
        "trainer.total_iterations=4",
        "trainer.save_freq=1",
        "trainer.val_before_train=false",
        "trainer.recovery_backoff_s=1",
        "data.reasoning_gym.val_size=0",
        "placement.slurm.partition=multi",
        "placement.nodes=2",
        "placement.tasks_per_node=1",
        "placement.slurm.time_min=10",
    ]

    def hf_run(name: str, db: str) -> tuple[subprocess.Popen, RunStore, Path]:
        args = [HF, "run", str(ROOT / "examples" / "grpo_tiny.yaml"), "--executor", "slurm", "--db", db]
        args += ["--prefect-api", prefect_api, "-o", f"trainer.output_dir={tmp_path / name}"]
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:  # a file: the Slurm-side processes never hold a pipe of the test open
            proc = subprocess.Popen([*args, *(a for o in overrides for a in ("-o", o))], stdout=out, stderr=out)
        return proc, RunStore(db), log

    proc, store, log = hf_run("uninterrupted", f"sqlite:///{tmp_path / 'uninterrupted.db'}")
    assert proc.wait(timeout=600) == 0, log.read_text()
    (run,) = store.list_runs()
    expected = {(m.step, m.name): m.value for m in store.metrics(run.id) if m.name in COMPARED}
    assert {step for step, _ in expected} == {1, 2, 3, 4}

    with postgres_server() as postgres:
        _lose_a_node_mid_run(hf_run, postgres.url(postgres.create_database()), expected)


def _lose_a_node_mid_run(hf_run, db: str, expected: dict) -> None:
    """The faulted run of the test above, recorded in store `db`: lose a node in iteration 3, check the recovery."""
    proc, store, log = hf_run("faulted", db)
    lost = None
    try:
        run_id = wait_inside_iteration(proc, store, 3, log=log, timeout_s=300)
        first = store.placements(run_id)[-1]
        lost = first.hosts[1]
        for pid in _node_processes(lost):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["scontrol", "update", f"nodename={lost}", "state=down", "reason=lost"], check=True)
        assert proc.wait(timeout=600) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        if lost is not None:  # the node back: its slurmd started again, the node resumed
            started = subprocess.run(["bash", str(ROOT / "hybridflow" / "slurm" / "dev_cluster.sh"), "start"],
                                     capture_output=True, text=True, timeout=300)  # fmt: skip
            assert started.returncode == 0, started.stdout + started.stderr
    # one recovery, naming the lost node: either the job ended with it (NODE_FAIL: both ranks lost) or, when sinfo
    # shows the node down before the job has ended, the ranks on that node (the job then cancelled)
    (recovery,) = store.recoveries(run_id)
    assert recovery.step == 3 and lost in recovery.nodes and set(recovery.nodes) <= set(first.hosts), recovery
    assert f"node {lost} is down" in recovery.cause and "reason: lost" in recovery.cause, recovery.cause
    relaunched = store.placements(run_id)[-1]
    assert relaunched.slurm_job_id != first.slurm_job_id and lost not in relaunched.hosts, relaunched
    assert len(set(relaunched.hosts)) == 2
    got = {(m.step, m.name): m.value for m in store.metrics(run_id) if m.name in COMPARED}
    assert got == expected
