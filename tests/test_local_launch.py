"""Local ranks forked by the fork server (`hybridflow.slurm.forked`): what a rank sees, and that nothing outlives its
controller. Real processes, real torch.distributed (gloo)."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from procs import alive

from hybridflow.slurm.channel import create_secret
from hybridflow.slurm.forked import warm_up
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup

TOY = f"{Path(__file__).parent / 'workers_for_tests.py'}:ToyWorker"


def test_a_rank_is_forked_with_the_engine_imported_and_sees_the_controller_as_it_is_at_launch(tmp_path, monkeypatch):
    warm_up()  # the fork server starts with this process's environment and folder as they are now
    mark = uuid.uuid4().hex
    monkeypatch.setenv("HYBRIDFLOW_TEST_MARK", mark)  # set after the fork server started
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    create_secret(tmp_path / "secret")
    spec = GroupSpec(name="forked", worker_cls=TOY, tasks_per_node=2)
    group = WorkerGroup(spec, run_dir=tmp_path, data_dir=tmp_path / "data", secret_path=tmp_path / "secret")
    try:
        views = group.process_view("HYBRIDFLOW_TEST_MARK")
        assert [v["variable"] for v in views] == [mark, mark]
        assert {v["cwd"] for v in views} == {str(tmp_path / "here")}
        # the ranks' parent is the fork server, which imported the engine: a rank never imported it itself
        assert all(v["engine_imported"] for v in views)
        [parent] = {v["parent"] for v in views}
        assert parent != os.getpid() and b"multiprocessing.forkserver" in Path(f"/proc/{parent}/cmdline").read_bytes()
        assert group.call("all_reduce", 1.0) == 3.0  # gloo across the two forked ranks
        logs = tmp_path / "submitit" / "forked"
        for rank in (0, 1):
            assert f"rank {rank} says hello on stdout" in (logs / f"{group.job_id}_{rank}_log.out").read_text()
            assert "Traceback" not in (logs / f"{group.job_id}_{rank}_log.err").read_text()
    finally:
        group.shutdown()
    assert not any(alive(pid) for pid in group.pids)


CONTROLLER = """
import multiprocessing.forkserver, sys
from pathlib import Path
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup
tmp = Path(sys.argv[1])
g = WorkerGroup(GroupSpec(name="left", worker_cls=sys.argv[2], tasks_per_node=2), run_dir=tmp, data_dir=tmp / "data",
                secret_path=tmp / "secret")
print(*g.pids, multiprocessing.forkserver._forkserver._forkserver_pid, flush=True)
# exits without shutting the group down
"""


def test_a_controller_that_exits_without_stopping_its_group_leaves_no_rank_and_no_fork_server(tmp_path):
    create_secret(tmp_path / "secret")
    controller = subprocess.run(
        [sys.executable, "-c", CONTROLLER, str(tmp_path), TOY], capture_output=True, text=True, timeout=120
    )  # returns when the pipes close: nothing started by the controller holds them after it
    assert controller.returncode == 0, controller.stderr
    *ranks, server = map(int, controller.stdout.split())
    assert len(ranks) == 2
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in (*ranks, server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in (*ranks, server) if alive(pid)], "a rank or the fork server outlived its controller"
