"""Closed by default: every socket a local worker group listens on is on the loopback interface (real processes,
real gloo, real pyzmq; the sockets are read from the kernel with psutil)."""

from pathlib import Path

import psutil
import pytest

from hybridflow.slurm import network
from hybridflow.slurm.channel import create_secret
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup

TOY = f"{Path(__file__).parent / 'workers_for_tests.py'}:ToyWorker"


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def test_a_local_group_listens_on_loopback_only(tmp_path):
    """A 2-rank local group after a gloo collective: rank 0 serves the rendezvous store, both ranks hold gloo's
    listeners, the controller its channel; every one of them is bound to 127.0.0.1."""
    secret = create_secret(tmp_path / "secret")
    group = WorkerGroup(
        GroupSpec(name="net", worker_cls=TOY, tasks_per_node=2),
        run_dir=tmp_path,
        data_dir=tmp_path / "data",
        secret_path=secret,
    )
    try:
        assert group.all_reduce(1.0) == pytest.approx(3.0)  # gloo's pairs are connected
        sockets = {pid: _listening(pid) for pid in group.pids}
        assert all(sockets.values()), f"a rank listens on nothing: {sockets}"  # the store and gloo are there
        assert len(sockets[group.pids[0]]) >= 2  # rank 0: the rendezvous store and gloo
        exposed = {pid: [s for s in socks if s[0] != "127.0.0.1"] for pid, socks in sockets.items()}
        assert not any(exposed.values()), f"listening beyond loopback: {exposed}"
        controller = [s for s in _listening(psutil.Process().pid) if s[1] == group._endpoint.port]
        assert controller == [("127.0.0.1", group._endpoint.port)]
    finally:
        group.shutdown()


def test_interface_addresses_and_a_clear_error_for_a_missing_one():
    assert network.interface_address("lo") == "127.0.0.1"
    assert network.interface_of("127.0.0.1") == "lo"
    assert network.route_address("127.0.0.1") == "127.0.0.1"
    with pytest.raises(
        ValueError, match=r"interface 'nope0' has no IPv4 address .*placement.slurm.interface .*lo \(127.0.0.1\)"
    ):
        network.interface_address("nope0")


def test_a_flood_of_forged_messages_logs_two_lines_and_counts_all(caplog):
    """3,000 forged messages to a real controller endpoint: every one dropped and counted, two warning lines."""
    import logging
    import time

    import zmq

    from hybridflow.slurm.channel import ControllerEndpoint, Signer

    endpoint = ControllerEndpoint(Signer(b"the run's secret"))
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.IDENTITY, b"rogue")
    rogue.connect(endpoint.address)
    forger = Signer(b"a guess")
    try:
        with caplog.at_level(logging.WARNING, logger="hybridflow.slurm.channel"):
            for i in range(3000):
                rogue.send_multipart(forger.pack({"type": "result", "id": str(i), "from": "rogue"}))
            deadline = time.monotonic() + 30
            while endpoint.signer.dropped < 3000 and time.monotonic() < deadline:
                assert endpoint.recv(0.05) is None
            endpoint._drops.interval_s = 0.0  # the next drop reports the count since the first line
            rogue.send_multipart([b"garbage"])
            while endpoint.signer.dropped < 3001 and time.monotonic() < deadline:
                endpoint.recv(0.05)
        assert endpoint.signer.dropped == 3001
        lines = [r.getMessage() for r in caplog.records if r.name == "hybridflow.slurm.channel"]
        assert len(lines) == 2, lines
        assert lines[0].startswith("dropped an unauthenticated") and "rogue" in lines[0]
        assert lines[1].startswith("dropped 3000 messages in the last")
    finally:
        rogue.close(linger=0)
        endpoint.close()
