"""Worker groups as real processes (forked by the local fork server), real torch.distributed (gloo), real pyzmq."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from procs import alive

from hybridflow.engine.protocol import DataProto
from hybridflow.slurm.channel import TAG, Signer, create_secret
from hybridflow.slurm.handles import DataHandle
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup, WorkerGroupError

TOY = f"{Path(__file__).parent / 'workers_for_tests.py'}:ToyWorker"


def _group(tmp, name="toy", tasks_per_node=2, **spec):
    secret = tmp / "secret"
    if not secret.exists():
        create_secret(secret)
    (tmp / "markers").mkdir(exist_ok=True)
    return WorkerGroup(
        GroupSpec(name=name, worker_cls=TOY, tasks_per_node=tasks_per_node, **spec),
        run_dir=tmp,
        data_dir=tmp / "data",
        secret_path=secret,
        worker_kwargs={"marker_dir": str(tmp / "markers")},
    )


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("group")
    g = _group(tmp)
    yield g, tmp
    g.shutdown()


def test_ranks_are_separate_processes_in_one_job(group):
    g, _ = group
    who = g.whoami()
    assert [w["rank"] for w in who] == [0, 1] and {w["world_size"] for w in who} == {2}
    assert len({w["pid"] for w in who} | {os.getpid()}) == 3
    assert g.pids == [w["pid"] for w in who] and g.placement["executor"] == "local"


def test_rank_zero_with_a_collective(group):
    g, _ = group
    assert g.all_reduce(1.5) == pytest.approx(1.5 * 1 + 1.5 * 2)  # gloo all_reduce across the two ranks


def test_dp_compute_proto_splits_rows_and_gathers_in_order(group):
    g, tmp = group
    data = DataProto.from_dict({"x": torch.arange(5)}, {"s": list("abcde")})
    out = g.double(data, factor=3)
    assert isinstance(out, DataHandle) and out.length == 5
    assert [p.length for p in out.groups[0].parts] == [2, 3]  # contiguous shares, one file per rank
    loaded = out.load()
    assert loaded.batch["y"].tolist() == [0, 3, 6, 9, 12]
    assert loaded.batch["rank"].tolist() == [0, 0, 1, 1, 1]
    assert out.load(slice(1, 4)).batch["y"].tolist() == [3, 6, 9]  # a consumer reads only its rows
    both = DataHandle.put(data, tmp / "data").union(out)
    assert both.load().non_tensor_batch["tag"].tolist() == ["r0", "r0", "r1", "r1", "r1"]


def test_all_to_all_and_errors(group):
    g, _ = group
    assert g.scale([1, 2]) == [10, 21]
    with pytest.raises(ValueError, match="one per rank"):
        g.scale([1])
    with pytest.raises(WorkerGroupError, match=r"rank (\d) raised in crash:(.|\n)*boom on rank \1"):
        g.crash()
    with pytest.raises(AttributeError, match="not_registered"):
        g.call("not_registered")
    assert len(g.whoami()) == 2, "the group still serves after a method raised"


def test_forged_and_unauthenticated_messages_execute_nothing(group):
    g, tmp = group
    before = g.call_count()
    endpoint = g._endpoint
    identity = g._identity(0).encode()
    call = {"type": "call", "id": "x", "method": "touch", "args": ["forged"], "kwargs": {}, "from": "controller"}
    wrong_key = Signer(b"not the run secret").pack(call)
    unsigned = [TAG, wrong_key[1]]
    bad_mac = [TAG, wrong_key[1], b"\0" * 32]
    raw_json = [b'{"type": "call", "method": "touch", "args": ["forged"], "kwargs": {}}']
    for frames in (wrong_key, unsigned, bad_mac, raw_json):
        endpoint._sock.send_multipart([identity, *frames])
    # and to the controller: a rogue peer connecting to its port
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.IDENTITY, b"rogue")
    rogue.connect(endpoint.address)
    dropped = endpoint.signer.dropped
    rogue.send_multipart(Signer(b"wrong").pack({"type": "result", "id": "x", "rank": 0, "from": "rogue"}))
    rogue.send_multipart([b"garbage"])
    # correctly signed by the run's secret but claiming another rank's name: dropped too
    rogue.send_multipart(endpoint.signer.pack({"type": "heartbeat", "from": "toy/rank-0"}))
    time.sleep(0.5)
    assert g.call_count() == before, "a forged call was executed"
    assert not list((tmp / "markers").glob("forged-*")), "a forged call touched a file"
    deadline = time.monotonic() + 5  # the socket fair-queues peers: drain what the rogue sent
    while endpoint.signer.dropped < dropped + 3 and time.monotonic() < deadline:
        endpoint.recv(0.05)
    assert endpoint.signer.dropped >= dropped + 3
    rogue.close(linger=0)
    assert g.touch("genuine") == [True, True] and (tmp / "markers" / "genuine-0").exists()


@pytest.mark.parametrize(
    ("sig", "expect"),
    [
        # killed: named at once, with the signal while the zombie is still there (its parent reaps it within ~1 s)
        (signal.SIGKILL, r"rank 1 \(host [^,]+, pid \d+\) (was killed by SIGKILL|died \(its process is gone)"),
        (signal.SIGSTOP, "no heartbeat"),
    ],
)
def test_dead_or_stopped_rank_fails_the_call_within_seconds(tmp_path, sig, expect):
    g = _group(tmp_path, name=f"victim{sig.value}", heartbeat_timeout_s=3.0)
    try:
        pid = g.pids[1]
        start = time.monotonic()
        os.kill(pid, sig)
        with pytest.raises(WorkerGroupError) as err:
            g.sleep(60)
        elapsed = time.monotonic() - start
        message = str(err.value)
        assert elapsed < 15, f"failure noticed after {elapsed:.1f} s"
        assert f"victim{sig.value}" in message and g.job_id in message
        assert "rank 1" in message or "ranks [0, 1]" in message or "rank 0" in message
        assert re.search(expect, message), message
        first_line = message.splitlines()[0]
        assert first_line.count("rank 1 ") == 1 or "rank 1 " not in first_line, message  # named once
    finally:
        if sig == signal.SIGSTOP:
            os.kill(pid, signal.SIGCONT)
        g.shutdown(timeout_s=10)


def test_a_rank_killed_inside_a_collective_is_named_not_the_rank_that_lost_its_peer(tmp_path):
    """Rank 1 SIGKILLed while both ranks all-reduce: rank 0 raises first (gloo: "Connection closed by peer"), and
    the error names rank 1, its pid and the signal, from the group's own process bookkeeping."""
    g = _group(tmp_path, name="collective", heartbeat_timeout_s=3.0)
    try:
        pid = g.pids[1]
        threading.Timer(2.0, os.kill, (pid, signal.SIGKILL)).start()
        with pytest.raises(WorkerGroupError) as err:
            g.reduce_for(30)
        message = str(err.value)
        ended = r"(was killed by SIGKILL|died \(its process is gone[^)]*\))"  # read before or after it was reaped
        assert re.search(rf"rank 1 \(host [^,]+, pid {pid}\) {ended} during reduce_for", message), message
        assert message.splitlines()[0].count("rank 1 ") == 1, message  # named once, where it is with it
    finally:
        g.shutdown(timeout_s=10)


def test_a_rank_that_died_between_calls_is_named_when_the_next_call_is_sent(tmp_path):
    """The call is sent after the dead rank's connection is gone (ZeroMQ: host unreachable): the error names the
    group, the job and the rank, as when a rank dies during a call."""
    g = _group(tmp_path, name="between", heartbeat_timeout_s=3.0)
    try:
        os.kill(g.pids[1], signal.SIGKILL)
        time.sleep(2.0)  # its socket is closed and the controller's ZeroMQ has seen the peer go
        with pytest.raises(WorkerGroupError) as err:
            g.sleep(0)
        message = str(err.value)
        assert "between" in message and g.job_id in message and "rank 1" in message, message
    finally:
        g.shutdown(timeout_s=10)


CONTROLLER = """
import sys, time
from pathlib import Path
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup
tmp = Path(sys.argv[1])
g = WorkerGroup(GroupSpec(name="orphans", worker_cls=sys.argv[2], tasks_per_node=2, heartbeat_timeout_s=3.0),
                run_dir=tmp, data_dir=tmp / "data", secret_path=tmp / "secret",
                worker_kwargs={"marker_dir": str(tmp / "markers")})
print(" ".join(map(str, g.pids)), flush=True)
time.sleep(600)
"""


def test_workers_exit_when_their_controller_is_killed(tmp_path):
    create_secret(tmp_path / "secret")
    (tmp_path / "markers").mkdir()
    controller = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, str(tmp_path), TOY], stdout=subprocess.PIPE, text=True
    )
    pids = [int(p) for p in controller.stdout.readline().split()]
    assert len(pids) == 2
    controller.kill()  # SIGKILL: no shutdown message, no clean-up code runs
    controller.wait()
    deadline = time.monotonic() + 30
    left = pids
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = [p for p in pids if alive(p)]
    assert not left, f"worker processes {left} outlived their controller by 30 s"


def test_ranks_idle_between_calls_are_not_reported_dead(tmp_path):
    """Nobody reads the socket between calls: heartbeats queue up. A call after a long idle spell drains them
    first, so the silence of the idle spell never counts against any rank."""
    g = _group(tmp_path, name="idle", heartbeat_timeout_s=2.0)
    try:
        assert len(g.whoami()) == 2
        time.sleep(5.0)  # > heartbeat_timeout_s, controller busy elsewhere
        assert [w["rank"] for w in g.whoami()] == [0, 1]
        time.sleep(5.0)
        assert g.all_reduce(1.0) == pytest.approx(3.0)
    finally:
        g.shutdown()
