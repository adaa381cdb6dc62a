"""`hybridflow/slurm/dev_cluster.sh start` on a machine where the cluster is stopped returns promptly to a caller that
reads its
output through pipes: no daemon it starts keeps the script's stdout/stderr open (issue: a MariaDB started in a
background subshell held them, and the first `pytest` on a fresh machine waited 15 minutes)."""

import contextlib
import subprocess
import time
from pathlib import Path

import pytest
from conftest import start_dev_cluster

SCRIPT = Path(__file__).resolve().parent.parent / "hybridflow" / "slurm" / "dev_cluster.sh"


def _daemons() -> set[str]:
    names = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                names.add(proc.joinpath("comm").read_text().strip())
    return names


def _holding_login_only() -> set[str]:
    """Commands of the processes whose mount namespace has a node's empty ``login-only`` file system."""
    names = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if "hybridflow-login-only" in proc.joinpath("mountinfo").read_text():
                    names.add(proc.joinpath("comm").read_text().strip())
    return names


def test_start_from_stopped_returns_through_pipes(slurm_cluster):
    """And `stop` leaves no daemon, nor a node's mount namespace (its `login-only` file system) behind."""
    subprocess.run(["bash", str(SCRIPT), "stop"], check=True, capture_output=True, timeout=120)
    assert not {"slurmctld", "slurmd", "slurmdbd", "mariadbd"} & _daemons(), "stop left daemons running"
    assert not _holding_login_only(), "stop left a node's mount namespace behind"
    started = time.monotonic()
    why = start_dev_cluster(timeout_s=120)  # pipes, as the fixture and a fresh machine's first test run use them
    took = time.monotonic() - started
    assert why is None, why
    assert took < 60, f"start from stopped took {took:.0f} s"  # measured ~4 s with the packages installed
    assert {"slurmctld", "slurmd", "slurmdbd", "mariadbd", "munged"} <= _daemons()
    assert _holding_login_only() == {"slurmd"}  # the nodes of partition multi only; this host sees the folder
    state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, check=True).stdout.split()
    assert state and state[0] in ("idle", "mixed", "allocated")
    queue = subprocess.run(["sacct", "-n", "-X", "-o", "JobID"], capture_output=True, text=True)
    assert queue.returncode == 0, f"accounting (slurmdbd + MariaDB) does not answer: {queue.stderr}"


def test_the_slurm_tests_run_in_one_xdist_group(request, slurm_cluster):
    """Under pytest-xdist (the README's test command), every test on the cluster is in the group ``slurm`` (tests/
    conftest.py), which runs in one worker, one test after another: two at once would queue each other's jobs, and
    some drain the node or preempt its jobs. The group shows in the test's id; a pytest that drops it (9.2 with
    pytest-xdist 3.8) ran them two at once."""
    if not hasattr(request.config, "workerinput"):
        pytest.skip("not under pytest-xdist (-n 0)")
    assert request.node.nodeid.endswith("@slurm"), request.node.nodeid
