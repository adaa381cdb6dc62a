"""The development cluster's nodes of their own (`hybridflow/slurm/dev_cluster.sh`: partition ``multi``, each node a
slurmd with its own host name and loopback address), a Slurm worker group across two of them (its ranks on two hosts,
listening on their own nodes' addresses, joined by gloo), and a GRPO run whose actor is data-parallel across two
nodes, equal to the same run on one."""

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_runs import write_reward

from hybridflow.flows.store.run_store import RunStore
from hybridflow.slurm.channel import create_secret
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup, slurm_parameters

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
    node (rank 0's rendezvous store and the weight broadcast's listeners bind it), gloo across them."""
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
    finally:
        group.shutdown()


COMPARED = ("response_length/mean", "critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm")


def test_grpo_with_its_actor_data_parallel_across_two_nodes_matches_the_run_on_one(
    slurm_cluster, prefect_api, tmp_path, tiny_model_dir
):
    """The tiny GRPO run with its actor + rollout pool of 2 ranks, once on one node (partition ``debug``, 2 ranks
    there) and once across two (``multi``, 1 rank on each): the same data-parallel computation, gloo's all-reduce
    between the two nodes' addresses instead of within one node, and every compared metric of every iteration equal."""
    metrics, hosts = {}, {}
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
        ]
        args = [HF, "run", str(ROOT / "examples" / "grpo_tiny.yaml"), "--executor", "slurm", "--db", db]
        args += ["--prefect-api", prefect_api, *(a for o in overrides for a in ("-o", o))]
        done = subprocess.run(args, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        store = RunStore(db)
        (run,) = store.list_runs()
        metrics[name] = {(m.step, m.name): m.value for m in store.metrics(run.id) if m.name in COMPARED}
        (placement,) = {tuple(p.hosts) for p in store.placements(run.id)}
        hosts[name] = placement
    assert hosts["one"] == (slurm_cluster["node"],) * 2
    assert len(set(hosts["two"])) == 2 and all(h.startswith("hf-node") for h in hosts["two"]), hosts
    assert {step for step, _ in metrics["one"]} == {1, 2, 3} and len(metrics["one"]) == 3 * len(COMPARED)
    assert metrics["two"] == metrics["one"]
