"""Local worker groups: each rank a process forked from a fork server that has already imported the rank's modules.

A rank imports torch, tensordict, transformers and HybridFlow's engine before it can serve: about 10 s of one core
here (``python -X importtime``), paid by every rank of every group, again at every relaunch. A local group's ranks
therefore come from Python's `multiprocessing` fork server: one process per controller, started from a clean
interpreter (never a fork of the controller, whose threads and sockets a child must not inherit), which imports
`PRELOAD` once and then forks a rank in milliseconds on each request. `warm_up` starts it early (``hf run`` does
so as soon as its config says the executor is local), so its import runs beside the controller's own start.

Each rank sees what a freshly started process would see: the controller's environment and working directory at
launch (not the fork server's), stdout and stderr in the group's log folder as ``<job>_<rank>_log.out`` /
``_log.err`` (the files the controller forwards to the flow's logs), and submitit's local job environment
(``SUBMITIT_LOCAL_*``), which `hybridflow.slurm.rank` reads its rank and world size from, as on Slurm.

The fork server ends when its controller does. A rank still alive when the controller exits is killed then, so
none outlives the process that could call or stop it (the ranks of a controller killed by SIGKILL end by
themselves after ``placement.heartbeat_timeout_s`` without it).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PRELOAD = (
    "hybridflow.slurm.rank",
    "hybridflow.engine.worker",
    "hybridflow.engine.reward.rm_training",
    "hybridflow.engine.sft.trainer",
)
"""The modules the fork server imports before it forks a rank: the rank's serving loop and the worker classes
HybridFlow's own groups serve (another class's module is imported by the rank itself)."""

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(list(PRELOAD))
_JOB_NUMBERS = itertools.count(1)
_LIVE_JOBS: set[LocalJob] = set()
_warm = False
_WARM_LOCK = threading.Lock()


def warm_up() -> None:
    """Start the fork server now (it imports `PRELOAD`, ~10 s of one core, while the caller goes on); returns at
    once. Later calls, and launches, reuse it. Its stdout and stderr, and those of multiprocessing's resource
    tracker started with it, are /dev/null: neither writes anything, and a caller reading this process's output to
    its end (a pipe) never waits for them."""
    global _warm
    with _WARM_LOCK:
        if not _warm:
            with _output_to_devnull():
                multiprocessing.forkserver.ensure_running()
            _warm = True


@contextlib.contextmanager
def _output_to_devnull() -> Iterator[None]:
    """Point file descriptors 1 and 2 at /dev/null for the block (what a process started inside inherits)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


class LocalJob:
    """The processes of one local worker group: rank ``r`` of ``ntasks`` runs ``target(boot)`` (``serve``).

    Args:
        log_dir: the group's log folder; rank r writes ``<job_id>_<r>_log.out`` and ``<job_id>_<r>_log.err``.
        ntasks: the number of ranks (processes).
        target: a module-level function of one argument (the rank's `Bootstrap`), importable by the rank.
        boot: its argument (picklable).

    Raises:
        OSError: the fork server could not be started or reached.
    """

    def __init__(self, log_dir: str | Path, ntasks: int, target: Any, boot: Any) -> None:
        self.job_id = f"local{os.getpid()}.{next(_JOB_NUMBERS)}"
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # a process's exit code is read once from the fork server's pipe
        warm_up()
        env = dict(os.environ)
        self.processes = []
        _LIVE_JOBS.add(self)
        for rank in range(ntasks):
            rank_env = env | {
                "SUBMITIT_EXECUTOR": "local",
                "SUBMITIT_LOCAL_JOB_ID": self.job_id,
                "SUBMITIT_LOCAL_NTASKS": str(ntasks),
                "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
                "SUBMITIT_LOCAL_NODEID": "0",
                "SUBMITIT_LOCAL_GLOBALID": str(rank),
                "SUBMITIT_LOCAL_LOCALID": str(rank),
            }
            process = _CONTEXT.Process(
                target=_run_rank,
                args=(target, boot, rank_env, str(self.log_path(rank, "out")), str(self.log_path(rank, "err"))),
                name=f"{self.job_id}_{rank}",
            )
            process.start()
            self.processes.append(process)

    def log_path(self, rank: int, stream: str) -> Path:
        """Rank `rank`'s ``out`` or ``err`` log file."""
        return self.log_dir / f"{self.job_id}_{rank}_log.{stream}"

    @property
    def pids(self) -> list[int]:
        """Each rank's process id, in rank order."""
        return [p.pid for p in self.processes]

    def exit_code(self, rank: int) -> int | None:
        """Rank `rank`'s exit code (negative: the signal that killed it), or None while it runs."""
        with self._lock:
            return self.processes[rank].exitcode

    def end_of(self, rank: int) -> str | None:
        """How rank `rank`'s process ended (``was killed by SIGKILL``, ``exited with status 1 without a Python
        error``: a Python error reaches the controller first, as the rank's own message), or None while it runs."""
        code = self.exit_code(rank)
        if code is None:
            return None
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code} without a Python error"

    def done(self) -> bool:
        """True when every rank's process has ended."""
        ended = all(self.exit_code(rank) is not None for rank in range(len(self.processes)))
        if ended:
            _LIVE_JOBS.discard(self)
        return ended

    def kill(self) -> None:
        """SIGKILL every rank still running (a rank records SIGTERM as a warning and goes on)."""
        for rank, process in enumerate(self.processes):
            with contextlib.suppress(ProcessLookupError):
                if self.exit_code(rank) is None:
                    os.kill(process.pid, signal.SIGKILL)


def _run_rank(target: Any, boot: Any, env: dict[str, str], out_path: str, err_path: str) -> None:
    """A rank's process: output to its log files, the controller's environment, then `target(boot)`."""
    for fd, path in ((1, out_path), (2, err_path)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(file, fd)
        os.close(file)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # lines reach the flow's logs as they are written
    os.environ.clear()
    os.environ.update(env)
    target(boot)


@atexit.register
def _end_with_the_controller() -> None:
    """At the controller's exit, kill the ranks of its local groups that still run (this hook runs before
    multiprocessing's own, which would wait for them), then the fork server: it would end by itself only after
    its imports, ~10 s of a core, when the controller stops early (a refused input)."""
    for job in list(_LIVE_JOBS):
        job.kill()
        for process in job.processes:
            process.join(5)
    server_pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)  # CPython's, 3.8-3.14
    if server_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server_pid, signal.SIGKILL)
