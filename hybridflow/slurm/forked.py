"""Ranks forked from a fork server that has already imported the rank's modules: a local group's, and a Slurm node's.

A rank imports torch, tensordict, transformers and HybridFlow's engine before it can serve: about 10 s of one core
(``python -X importtime``), paid by every rank of every group, again at every relaunch. Ranks therefore come from
Python's `multiprocessing` fork server: one process, started from a clean interpreter (never a fork of its caller,
whose threads and sockets a child must not inherit), which imports `PRELOAD` once and then forks a rank in
milliseconds on each request. Three callers start one:

- the controller, for its local groups (`local_job`); ``hf run`` calls `warm_up` as soon as its config says the
  executor is local, so the import runs beside the controller's own start (vLLM's engine modules too when the
  rollout is vLLM: `VLLM_PRELOAD`);
- a warm process (`hybridflow.cli.warm_start`), when it starts, with vLLM's engine modules: the controllers it forks
  use its fork server (`use_inherited_server`), warm before they start;
- each node of a Slurm group's job (`hybridflow.slurm.node_agent`): one task per node forks that node's ranks, so a
  group on N nodes starts in the time of one import.

Each rank sees what a freshly started process would see: its caller's environment and working directory at launch
(not the fork server's) with the rank's own variables on top (submitit's job environment, which
`hybridflow.slurm.rank` reads its rank and world size from), and its stdout and stderr in the group's log folder as
``<job>_<rank>_log.out`` / ``_log.err`` (the files the controller forwards to the flow's logs), line buffered.

The fork server ends with the process that started it. A rank still alive then is killed, so none outlives the
process that could call or stop it (the ranks of a controller killed by SIGKILL end by themselves after
``placement.heartbeat_timeout_s`` without it).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRELOAD = (
    "hybridflow.slurm.rank",
    "hybridflow.engine.worker",
    "hybridflow.engine.reward.rm_training",
    "hybridflow.engine.sft.trainer",
    "hybridflow.engine.sharded_state",
    "hybridflow.engine.data",
    "transformers.modeling_layers",
    "reasoning_gym",
)
"""The modules the fork server imports before it forks a rank: the rank's serving loop, the worker classes
HybridFlow's own groups serve (another class's module is imported by the rank itself), and what their ranks import
as they start (``python -X importtime`` in a rank of the tiny GRPO run): checkpointing, reasoning-gym, which scores
the rollouts of its tasks (1.4 s: it imports matplotlib)."""

VLLM_PRELOAD = "hybridflow.engine.rollout.vllm_modules"
"""Imported too by a fork server whose ranks may build vLLM engines (`warm_up` with ``vllm=True``): the modules
vLLM imports while it builds its first engine, ~4 s of one core a rank otherwise."""

RANK_MAIN = "hybridflow.slurm.rank:serve"
"""What a forked rank runs (``module:function``, called with its `Bootstrap`): named, not imported, so that a Slurm
node's agent, which forks ranks but never serves, does not import the engine itself."""

_CONTEXT = multiprocessing.get_context("forkserver")
_LIVE_JOBS: set[ForkedJob] = set()
_warm = False
_inherited = False  # the fork server is the one of the process this one was forked from (`use_inherited_server`)
_WARM_LOCK = threading.Lock()


@dataclass
class Bootstrap:
    """What a rank needs to start (pickled into a Slurm job or a forked process; plain values only, and a module
    that imports nothing heavy: a node agent unpickles it without the engine).

    Attributes:
        group: the worker group's name.
        worker_cls: ``"package.module:Class"`` or ``"path/to/file.py:Class"``.
        worker_kwargs: the worker's constructor keyword arguments (JSON-serialisable).
        controller_address: the controller's channel, ``tcp://host:port``.
        secret_path: the run's channel secret.
        data_dir: where batches are written.
        heartbeat_interval_s / orphan_grace_s: how often a rank beats; how long it lives without its controller.
        backend: torch.distributed backend (``gloo``, ``nccl``).
        env: environment variables the rank sets first.
        interface: where the group's sockets listen: ``lo`` (local groups), a NIC name, or None (the route to the
            controller).
        rendezvous_timeout_s: how long a rank waits to join torch.distributed's rendezvous (`hybridflow.slurm.
            rendezvous`).
    """

    group: str
    worker_cls: str
    worker_kwargs: dict[str, Any]
    controller_address: str
    secret_path: str
    data_dir: str
    heartbeat_interval_s: float = 1.0
    orphan_grace_s: float = 10.0
    backend: str = "gloo"
    env: dict[str, str] = field(default_factory=dict)
    interface: str | None = "lo"
    rendezvous_timeout_s: float = 120.0


def warm_up(vllm: bool = False) -> None:
    """Start the fork server now (it imports `PRELOAD`, ~10 s of one core, and with `vllm` `VLLM_PRELOAD`, ~5 s
    more, while the caller goes on); returns at once. Later calls, and launches, reuse it as it was started. Its
    stdout and stderr, and those of multiprocessing's resource tracker started with it, are /dev/null: neither writes
    anything, and a caller reading this process's output to its end (a pipe) never waits for them."""
    global _warm
    with _WARM_LOCK:
        if not _warm:
            _CONTEXT.set_forkserver_preload([*PRELOAD, VLLM_PRELOAD] if vllm else list(PRELOAD))
            with _output_to_devnull():
                multiprocessing.forkserver.ensure_running()
            _warm = True


def restart_if_dead() -> None:
    """Start the fork server again if it died (killed, out of memory) since `warm_up`: what a warm process
    (`hybridflow.cli.warm_start`) checks before it forks each controller. For a caller without other threads
    writing: file descriptors 1 and 2 point at /dev/null while a new server starts."""
    with _WARM_LOCK, _output_to_devnull():
        multiprocessing.forkserver.ensure_running()  # a waitpid for the server's end; a start where it ended


def use_inherited_server() -> None:
    """In a process forked from one that called `warm_up` (a warm process's controller, `hybridflow.cli.warm_start`):
    fork ranks from that process's fork server, which imported `PRELOAD` already, and leave it running at exit (it
    is its starter's). Multiprocessing would otherwise check the server's life with ``waitpid``, which only its
    parent may call; a server that died is noticed when a launch cannot reach it (`ForkedJob` raises OSError)."""
    global _warm, _inherited
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is None:
        raise RuntimeError("this process has no inherited fork server: its parent never called warm_up")
    server.ensure_running = lambda: None  # the instance's, shadowing ForkServer.ensure_running
    _warm = _inherited = True


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


class ForkedJob:
    """Ranks forked from the fork server, each running `RANK_MAIN` with `boot`.

    Args:
        job_id: the job's id (the Slurm job's, or ``local<pid>.<n>``); names the log files.
        log_dir: the group's log folder; rank r writes ``<job_id>_<r>_log.out`` and ``<job_id>_<r>_log.err``.
        rank_env: each rank's own environment variables, by global rank, set on top of this process's
            environment as it is now.
        boot: the ranks' `Bootstrap`.

    Raises:
        OSError: the fork server could not be started or reached.
    """

    def __init__(self, job_id: str, log_dir: str | Path, rank_env: Mapping[int, dict[str, str]], boot: Any) -> None:
        self.job_id = job_id
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # a process's exit code is read once from the fork server's pipe
        warm_up()
        env = dict(os.environ)
        start = (os.getcwd(), list(sys.path))  # where the rank starts, and where it imports from: this process's
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        _LIVE_JOBS.add(self)
        for rank, own in rank_env.items():
            process = _CONTEXT.Process(
                target=_run_rank,
                args=(boot, env | own, *start, str(self.log_path(rank, "out")), str(self.log_path(rank, "err"))),
                name=f"{job_id}_{rank}",
            )
            process.start()
            self.processes[rank] = process

    def log_path(self, rank: int, stream: str) -> Path:
        """Rank `rank`'s ``out`` or ``err`` log file."""
        return self.log_dir / f"{self.job_id}_{rank}_log.{stream}"

    @property
    def pids(self) -> dict[int, int]:
        """Each rank's process id, by global rank."""
        return {rank: p.pid for rank, p in self.processes.items()}

    def end_of(self, rank: int) -> str | None:
        """How rank `rank`'s process ended (``was killed by SIGKILL``, ``exited with status 1 without a Python
        error``: a Python error reaches the controller first, as the rank's own message), or None while it runs."""
        with self._lock:
            process = self.processes[rank]
            code = process.exitcode
        if code is None:
            return None
        if code == 255 and _running(process.pid):  # multiprocessing's code when the fork server died: it runs on
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)  # no one could tell how it ends: end it now
            return "was killed: its fork server had died"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code} without a Python error"

    def done(self) -> bool:
        """True when every rank's process has ended."""
        ended = all(self.end_of(rank) is not None for rank in self.processes)
        if ended:
            _LIVE_JOBS.discard(self)
        return ended

    def kill(self) -> None:
        """SIGKILL every rank still running (a rank records SIGTERM as a warning and goes on)."""
        for rank, process in self.processes.items():
            with contextlib.suppress(ProcessLookupError):
                if self.end_of(rank) is None:
                    os.kill(process.pid, signal.SIGKILL)


_LOCAL_JOBS = itertools.count(1)


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def local_job(log_dir: str | Path, ntasks: int, boot: Any) -> ForkedJob:
    """A local group's `ntasks` ranks on this machine, with submitit's local job environment (``SUBMITIT_LOCAL_*``),
    which `hybridflow.slurm.rank` reads its rank and world size from, as on Slurm."""
    job_id = f"local{os.getpid()}.{next(_LOCAL_JOBS)}"
    common = {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_JOB_ID": job_id,
        "SUBMITIT_LOCAL_NTASKS": str(ntasks),
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_NODEID": "0",
    }
    env = {r: common | {"SUBMITIT_LOCAL_GLOBALID": str(r), "SUBMITIT_LOCAL_LOCALID": str(r)} for r in range(ntasks)}
    return ForkedJob(job_id, log_dir, env, boot)


def _run_rank(boot: Any, env: dict[str, str], cwd: str, path: list[str], out_path: str, err_path: str) -> None:
    """A rank's process: output to its log files, its environment, working directory and ``sys.path`` (its caller's,
    not the fork server's), then `RANK_MAIN` (imported by the fork server already)."""
    for fd, log in ((1, out_path), (2, err_path)):
        file = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(file, fd)
        os.close(file)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # lines reach the flow's logs as they are written
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    module, function = RANK_MAIN.split(":")
    getattr(importlib.import_module(module), function)(boot)


@atexit.register
def _end_with_the_caller() -> None:
    """At this process's exit, kill the ranks it forked that still run (this hook runs before multiprocessing's own,
    which would wait for them), then the fork server: it would end by itself only after its imports, ~10 s of a
    core, when the caller stops early (a refused input)."""
    for job in list(_LIVE_JOBS):
        job.kill()
        for process in job.processes.values():
            process.join(5)
    server_pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)  # CPython's, 3.8-3.14
    if server_pid is not None and not _inherited:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server_pid, signal.SIGKILL)
