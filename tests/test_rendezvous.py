"""No silent hang at a worker group's rendezvous (`hybridflow.slurm.rendezvous`): a rank that cannot reach rank 0's
store, and rank 0 missing a rank that never joins, each end within ``placement.rendezvous_timeout_s`` with a
message naming the node, the address and the fix. Real torch TCPStores, real sockets, a real second process.

"An address that answers nothing" (a firewall dropping packets) is made on the loopback interface: a socket that
listens with a backlog of 0 and never accepts, its queue filled, so the kernel drops every further connection
request without an answer, as a dropping firewall does."""

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from hybridflow.slurm import rendezvous


def _node(rank: int) -> str:
    return f"hf-node{rank + 1}"


@pytest.fixture
def silent_port():
    """A port on 127.0.0.1 where connection requests get no answer (see the module docstring)."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    port = hole.getsockname()[1]
    queued = []
    for _ in range(3):
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex(("127.0.0.1", port))
        queued.append(client)
    time.sleep(0.2)
    probe = socket.socket()
    probe.settimeout(1.0)
    with pytest.raises(TimeoutError):  # it answers nothing
        probe.connect(("127.0.0.1", port))
    probe.close()
    yield port
    for client in queued:
        client.close()
    hole.close()


def test_a_rank_that_cannot_reach_rank_0s_store_ends_within_the_timeout_naming_node_address_and_fix(silent_port):
    started = time.monotonic()
    with pytest.raises(rendezvous.RendezvousError) as raised:
        rendezvous.join("127.0.0.1", silent_port, 1, 2, _node, timeout_s=3.0)
    took = time.monotonic() - started
    assert 3.0 <= took < 8.0, took
    message = str(raised.value)
    assert message.startswith(
        f"rank 1 on node hf-node2 could not reach rank 0's rendezvous store at 127.0.0.1:{silent_port} (node "
        "hf-node1) within 3 s (placement.rendezvous_timeout_s)"
    ), message
    assert "open the cluster's internal network between the nodes" in message
    assert "set placement.slurm.interface to that network's interface" in message


def test_rank_0_names_the_ranks_that_never_joined_and_their_nodes(tmp_path):
    """A world of 3: rank 1 joins from a process of its own, rank 2 never comes. Rank 0 raises after the timeout
    (plus its quarter), naming rank 2 and its node, not rank 1."""
    listen_fd, port = rendezvous.listen("127.0.0.1", 3)
    joined = tmp_path / "joined"
    rank_1 = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import pathlib, time
                from hybridflow.slurm import rendezvous
                store = rendezvous.join("127.0.0.1", {port}, 1, 3, lambda r: f"hf-node{{r + 1}}", 30.0)
                pathlib.Path({str(joined)!r}).write_text(store.get("hybridflow/joined/0").decode())
                time.sleep(60)
            """),
        ]
    )
    try:
        started = time.monotonic()
        with pytest.raises(rendezvous.RendezvousError) as raised:
            rendezvous.join("127.0.0.1", port, 0, 3, _node, timeout_s=4.0, listen_fd=listen_fd)
        took = time.monotonic() - started
        assert joined.read_text() == "hf-node1"  # rank 1 joined and saw rank 0 there
    finally:
        rank_1.kill()
        rank_1.wait()
    assert 4.0 <= took < 8.0, took
    assert str(raised.value).startswith(
        f"rank 0 on node hf-node1: ranks [2] (node hf-node3) did not join the rendezvous at 127.0.0.1:{port} within "
        "4 s (placement.rendezvous_timeout_s)"
    ), raised.value


def test_a_world_that_joins_in_time_gets_a_working_store(tmp_path):
    """Both ranks join; each sees the other's mark (the store init_process_group then uses), whose later waits
    have the longer timeout."""
    listen_fd, port = rendezvous.listen("127.0.0.1", 2)
    rank_1 = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from hybridflow.slurm import rendezvous\n"
            f"store = rendezvous.join('127.0.0.1', {port}, 1, 2, str, 30.0)\n"
            "assert store.get('hybridflow/joined/0') == b'0'\n",
        ]
    )
    store = rendezvous.join("127.0.0.1", port, 0, 2, str, timeout_s=30.0, listen_fd=listen_fd)
    assert store.get("hybridflow/joined/1") == b"1"
    assert store.timeout == rendezvous.AFTER_JOINING  # later waits are not the rendezvous' bound
    assert rank_1.wait(timeout=60) == 0
