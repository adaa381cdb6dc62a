"""The development cluster's nodes of their own (`hybridflow/slurm/dev_cluster.sh`: partition ``multi``, each node a
slurmd with its own host name and loopback address), and a Slurm worker group across two of them: its ranks on two
hosts, listening on their own nodes' addresses, joined by gloo."""

import socket
import subprocess
from pathlib import Path

import pytest

from hybridflow.slurm.channel import create_secret
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup, slurm_parameters

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
