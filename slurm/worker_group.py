"""Worker groups: N SPMD worker processes launched as one submitit job, persistent across iterations.

The controller (the Prefect flow's process) creates a `WorkerGroup` for a worker class; submitit starts one task
per rank (`local`: submitit's LocalExecutor, processes on this machine; `slurm`: one Slurm job with
``tasks_per_node`` ranks). Every rank connects back to the controller over the authenticated channel, says hello,
and then serves the class's registered methods. Calling ``group.method(...)`` (or ``group.call("method", ...)``)
splits the arguments by the method's dispatch mode, runs it on the ranks, and gathers the results; batches go as
`DataHandle`\\ s, never through the channel.

A dead rank never hangs the caller: while it waits, the group watches every rank's heartbeat and the job's
processes; a rank that stops beating for ``heartbeat_timeout_s`` (killed, stopped) or exits raises
`WorkerGroupError` naming the group, the rank, its host and pid, and the job id. A rank whose process is alive but
stuck keeps beating; ``call_timeout_s`` bounds such calls.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit
import zmq

from hybridflow.engine.dispatch import Dispatch
from hybridflow.engine.protocol import DataProto
from hybridflow.slurm.channel import ControllerEndpoint, Signer, read_secret
from hybridflow.slurm.handles import DataHandle
from hybridflow.slurm.worker import PART_KEY, Bootstrap, decode_args, encode_args, serve

logger = logging.getLogger(__name__)


class WorkerGroupError(RuntimeError):
    """A worker group cannot complete a call: a rank died, stopped answering, or raised."""


@dataclass
class GroupSpec:
    """Where and how to run one worker group.

    Attributes:
        name: group name (in errors, logs and the run store's placement).
        worker_cls: ``"package.module:Class"`` or ``"path/to/file.py:Class"``; its `register`-ed methods are served.
        world_size: number of ranks (processes), one per device.
        executor: ``local`` (processes on this machine) or ``slurm``.
        slurm: extra submitit Slurm parameters (partition, account, qos, cpus_per_task, gpus_per_node, ...).
        timeout_min: the job's time limit (minutes).
        backend: torch.distributed backend (``gloo`` on CPU, ``nccl`` on GPU).
        heartbeat_interval_s / heartbeat_timeout_s: how often ranks beat, and how long silence means dead.
        start_timeout_s: how long to wait for every rank's hello.
        call_timeout_s: limit for one method call (None: none). A rank whose process is alive but stuck (e.g. in a
            collective) still beats; this limit is what turns such a hang into an error.
        env: environment variables for the worker processes.
    """

    name: str
    worker_cls: str
    world_size: int = 1
    executor: str = "local"
    slurm: dict[str, Any] = field(default_factory=dict)
    timeout_min: int = 24 * 60
    backend: str = "gloo"
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    start_timeout_s: float = 300.0
    call_timeout_s: float | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class RankInfo:
    rank: int
    pid: int
    host: str
    last_seen: float


class WorkerGroup:
    """A running worker group (see the module docstring).

    Args:
        spec: the group's `GroupSpec`.
        run_dir: the run's folder; the group writes ``submitit/<name>/`` (job logs) there.
        data_dir: where batches (`DataHandle` parts) are written; shared by all groups of the run.
        secret_path: the run's channel secret (see `channel.create_secret`).
        worker_kwargs: JSON-serialisable keyword arguments for the worker class's constructor.

    Raises:
        WorkerGroupError: if the job fails to start or a rank does not say hello within ``start_timeout_s``
            (the message includes the tail of the rank's log).
    """

    def __init__(
        self,
        spec: GroupSpec,
        run_dir: str | Path,
        data_dir: str | Path,
        secret_path: str | Path,
        worker_kwargs: dict[str, Any] | None = None,
    ):
        self.spec = spec
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._signer = Signer(read_secret(secret_path))
        bind = "127.0.0.1" if spec.executor == "local" else "0.0.0.0"
        self._endpoint = ControllerEndpoint(self._signer, bind_host=bind)
        self.log_dir = Path(run_dir) / "submitit" / spec.name
        self._job = self._submit(
            Bootstrap(
                group=spec.name,
                worker_cls=spec.worker_cls,
                worker_kwargs=dict(worker_kwargs or {}),
                controller_address=self._endpoint.address,
                secret_path=str(secret_path),
                data_dir=str(self.data_dir),
                heartbeat_interval_s=spec.heartbeat_interval_s,
                orphan_grace_s=spec.heartbeat_timeout_s,
                backend=spec.backend,
                env=dict(spec.env),
            )
        )
        self.job_id = str(self._job.job_id)
        self.ranks: dict[int, RankInfo] = {}
        self.methods: dict[str, Dispatch] = {}
        self._closed = False
        try:
            self._wait_for_hello()
        except BaseException:  # never leave a job running that nobody will call or stop
            self._job.cancel(check=False)
            self._endpoint.close()
            self._closed = True
            raise

    # ------------------------------------------------------------------ start
    def _submit(self, boot: Bootstrap) -> submitit.Job:
        spec = self.spec
        if spec.executor == "local":
            executor = submitit.LocalExecutor(folder=self.log_dir)
            executor.update_parameters(nodes=1, tasks_per_node=spec.world_size, timeout_min=spec.timeout_min)
        elif spec.executor == "slurm":
            executor = submitit.SlurmExecutor(folder=self.log_dir)
            executor.update_parameters(
                nodes=1,
                ntasks_per_node=spec.world_size,
                time=spec.timeout_min,
                job_name=f"hybridflow-{spec.name}",
                **spec.slurm,
            )
        else:
            raise ValueError(f"unknown executor {spec.executor!r} for group {spec.name!r}; use 'local' or 'slurm'")
        return executor.submit(serve, boot)

    def _wait_for_hello(self) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        while len(self.ranks) < self.spec.world_size:
            self._check_job_alive("starting")
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.spec.world_size)) - set(self.ranks))
                raise self._error(f"ranks {missing} did not start within {self.spec.start_timeout_s:.0f} s", missing)
            got = self._endpoint.recv(0.2)
            if got is not None:
                self._handle_side_message(got[1])

    # ------------------------------------------------------------------ calls
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self.__dict__.get("methods", {}):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Run `method` on the ranks as its dispatch mode says and return the gathered result.

        A `DataProto` argument is first written to the data folder and passed as a `DataHandle`; a `DataProto`
        result comes back as a `DataHandle`.

        Args:
            timeout_s: optional limit for the whole call (seconds); None waits as long as the ranks are alive.

        Raises:
            WorkerGroupError: a rank raised (its traceback is included), died, or stopped beating.
            AttributeError: the worker class does not register `method`.
        """
        if self._closed:
            raise WorkerGroupError(f"group {self.spec.name!r} is shut down")
        if method not in self.methods:
            raise AttributeError(f"group {self.spec.name!r} serves {sorted(self.methods)}, not {method!r}")
        mode = self.methods[method]
        args = tuple(
            DataHandle.put(a, self.data_dir, f"{method}-input") if isinstance(a, DataProto) else a for a in args
        )
        per_rank = self._split(mode, method, args, kwargs)
        call_id = uuid.uuid4().hex
        for rank, (rank_args, rank_kwargs) in per_rank.items():
            self._endpoint.send(
                self._identity(rank),
                {
                    "type": "call",
                    "id": call_id,
                    "method": method,
                    "args": encode_args(list(rank_args)),
                    "kwargs": encode_args(rank_kwargs),
                },
            )
        results = self._collect(call_id, method, set(per_rank), timeout_s)
        return self._gather(mode, results, args)

    def _split(self, mode: Dispatch, method: str, args: tuple, kwargs: dict) -> dict[int, tuple[list, dict]]:
        ranks = range(self.spec.world_size)
        if mode is Dispatch.ALL_TO_ALL:
            for value in [*args, *kwargs.values()]:
                if not isinstance(value, list | tuple) or len(value) != self.spec.world_size:
                    raise ValueError(
                        f"{method} is ALL_TO_ALL: every argument must be a list of "
                        f"{self.spec.world_size} entries (one per rank)"
                    )
            return {r: ([a[r] for a in args], {k: v[r] for k, v in kwargs.items()}) for r in ranks}
        if mode is Dispatch.DP_COMPUTE_PROTO and (not args or not isinstance(args[0], DataHandle)):
            raise ValueError(f"{method} is DP_COMPUTE_PROTO: its first argument must be a DataProto or DataHandle")
        return {r: (list(args), dict(kwargs)) for r in ranks}

    def _gather(self, mode: Dispatch, results: dict[int, Any], args: tuple) -> Any:
        ordered = [decode_args(results[r]) for r in sorted(results)]
        if mode is Dispatch.DP_COMPUTE_PROTO and all(isinstance(r, dict) and set(r) == {PART_KEY} for r in ordered):
            return DataHandle.from_parts([r[PART_KEY] for r in ordered], meta_info=args[0].meta_info)
        ordered = [self._part_to_handle(r) for r in ordered]  # e.g. per-rank metrics of a DP update
        return ordered[0] if mode is Dispatch.RANK_ZERO else ordered

    @staticmethod
    def _part_to_handle(result: Any) -> Any:
        if isinstance(result, dict) and set(result) == {PART_KEY}:
            return DataHandle.from_parts([result[PART_KEY]])
        return result

    def _collect(self, call_id: str, method: str, pending: set[int], timeout_s: float | None) -> dict[int, Any]:
        results: dict[int, Any] = {}
        timeout_s = self.spec.call_timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last_check = 0.0
        while pending:
            got = self._endpoint.recv(0.1)
            if got is not None:
                message = got[1]
                from_rank = str(message.get("from", "")).startswith(f"{self.spec.name}/rank-")
                if from_rank and message.get("id") == call_id and message.get("type") in ("result", "error"):
                    rank = int(message["rank"])
                    self._beat(rank)
                    if message["type"] == "error":
                        raise self._error(f"rank {rank} raised in {method}:\n{message['traceback']}", [rank])
                    results[rank] = message["result"]
                    pending.discard(rank)
                    continue
                self._handle_side_message(message)
            now = time.monotonic()
            if now - last_check > 0.25:
                last_check = now
                self._check_heartbeats(method, pending)
                self._check_job_alive(method)
            if deadline is not None and now > deadline:
                raise self._error(f"{method} did not finish within {timeout_s} s", sorted(pending))
        return results

    # ------------------------------------------------------------------ liveness
    def _identity(self, rank: int) -> str:
        return f"{self.spec.name}/rank-{rank}"

    def _handle_side_message(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        sender = str(message.get("from", ""))
        if not sender.startswith(f"{self.spec.name}/rank-"):
            self._signer.dropped += 1  # signed with the run's secret, but for another group: not ours to act on
            return
        if kind == "hello":
            rank = int(message["rank"])
            self.ranks[rank] = RankInfo(rank, int(message["pid"]), str(message["host"]), time.monotonic())
            self.methods = {name: Dispatch(mode) for name, mode in message["methods"].items()}
        elif kind == "heartbeat":
            rank = int(sender.removeprefix(f"{self.spec.name}/rank-").split("/")[0])
            self._beat(rank)
        elif kind == "fatal":
            rank = int(message["rank"])
            raise self._error(f"rank {rank} failed while starting:\n{message['traceback']}", [rank])

    def _beat(self, rank: int) -> None:
        if rank in self.ranks:
            self.ranks[rank].last_seen = time.monotonic()

    def _check_heartbeats(self, method: str, pending: set[int]) -> None:
        now = time.monotonic()
        for rank in sorted(pending):
            info = self.ranks.get(rank)
            if info is not None and now - info.last_seen > self.spec.heartbeat_timeout_s:
                raise self._error(
                    f"rank {rank} sent no heartbeat for {now - info.last_seen:.1f} s during {method} "
                    "(dead, stopped or hung)",
                    [rank],
                )

    def _check_job_alive(self, during: str) -> None:
        if self._job.done():
            state = self._job.state
            raise self._error(f"the job ended (state {state}) during {during}", sorted(range(self.spec.world_size)))

    def _error(self, what: str, ranks: list[int]) -> WorkerGroupError:
        where = []
        for rank in ranks:
            info = self.ranks.get(rank)
            where.append(f"rank {rank}" + (f" (host {info.host}, pid {info.pid})" if info else ""))
        logs = "".join(self._log_tail(r) for r in ranks[:1])
        return WorkerGroupError(
            f"worker group {self.spec.name!r} (job {self.job_id}, {self.spec.executor}): {what}; "
            f"{', '.join(where)}{logs}"
        )

    def _log_tail(self, rank: int, lines: int = 15) -> str:
        paths = sorted(self.log_dir.glob(f"{self.job_id}_{rank}_log.err")) or sorted(self.log_dir.glob("*_log.err"))
        if not paths:
            return ""
        tail = paths[0].read_text(errors="replace").splitlines()[-lines:]
        return f"\n--- last lines of {paths[0]} ---\n" + "\n".join(tail) if tail else ""

    @property
    def placement(self) -> dict[str, Any]:
        """Where the group runs: the run store's placement row (without the role)."""
        return {
            "group_name": self.spec.name,
            "ranks": sorted(self.ranks),
            "executor": self.spec.executor,
            "slurm_job_id": self.job_id if self.spec.executor == "slurm" else None,
            "hosts": [self.ranks[r].host for r in sorted(self.ranks)],
        }

    @property
    def pids(self) -> list[int]:
        """Process id of each rank, in rank order."""
        return [self.ranks[r].pid for r in sorted(self.ranks)]

    # ------------------------------------------------------------------ stop
    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to exit, wait for the job to end (cancel it after `timeout_s`), close the socket."""
        if self._closed:
            return
        self._closed = True
        for rank in self.ranks:
            with contextlib.suppress(zmq.ZMQError):  # a dead rank cannot be told
                self._endpoint.send(self._identity(rank), {"type": "shutdown"})
        deadline = time.monotonic() + timeout_s
        while not self._job.done() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not self._job.done():
            self._job.cancel(check=False)
            if self.spec.executor == "local":  # submitit's local launcher ignores the first SIGTERM
                for pid in self.pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        self._endpoint.close()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
