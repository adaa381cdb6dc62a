"""Worker groups: N SPMD worker processes launched as one job, persistent across iterations.

The controller (the Prefect flow's process) creates a `WorkerGroup` for a worker class; one process per rank serves
it (`local`: processes on this machine, forked by `hybridflow.slurm.forked`'s fork server; `slurm`: an allocation,
`hybridflow.slurm.allocation`: one Slurm job of ``nodes`` tasks submitted with sbatch by submitit, each the node agent
of `hybridflow.slurm.node_agent`, which forks the node's ``tasks_per_node`` ranks; a group that lost a rank leaves its
allocation to its relaunch, which forks new ranks there). Ranks rendezvous for torch.distributed at
rank 0's node (gloo on CPU, NCCL on GPU): rank 0 listens on a port free at that moment and the controller relays its
address to the others. Every rank connects back to the controller over the authenticated channel (the controller
listens on 127.0.0.1 for local groups and on its cluster address for Slurm groups, never on every interface: see
`hybridflow.slurm.network`), says hello, and then serves the class's registered methods. Calling
``group.method(...)`` (or ``group.call("method", ...)``) splits the arguments by the method's dispatch mode, runs it
on the ranks, and gathers the results; batches go as `DataHandle`\\ s, never through the channel.

A dead rank never hangs the caller: while it waits, the group watches every rank's heartbeat and the job; a rank
that stops beating for ``heartbeat_timeout_s`` (killed, stopped) or exits raises `WorkerGroupError` naming the
group, the rank, its host and pid, and the job id. On Slurm the group also polls the job's accounting state and its
nodes every ``slurm_poll_s``: a cancelled job (``scancel``), a failed node, or a node drained or set down turns the
pending call into an error (the job is cancelled, so a drained node is freed). A rank whose process is alive but
stuck keeps beating; ``call_timeout_s`` bounds such calls. Time a Slurm job spends pending in the queue does not
count against ``start_timeout_s``.

Warning signals (SIGUSR2 before the time limit, SIGTERM on preemption) reach the ranks, which report them in their
heartbeats; `WorkerGroup.warning_signals` tells the controller, which checkpoints and stops at a stage boundary.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from hybridflow.engine.protocol import DataProto
from hybridflow.engine.transfer import Dispatch
from hybridflow.slurm import allocation, cluster, network
from hybridflow.slurm.allocation import Allocation
from hybridflow.slurm.channel import ControllerEndpoint, Signer, read_secret
from hybridflow.slurm.dispatch import gather_results, split_arguments
from hybridflow.slurm.forked import Bootstrap, ForkedJob, local_job
from hybridflow.slurm.handles import DataHandle
from hybridflow.slurm.rank import decode_args, encode_args

logger = logging.getLogger(__name__)


class WorkerGroupError(RuntimeError):
    """A worker group cannot complete a call: a rank died, stopped answering, or raised.

    Attributes:
        group: the group's name.
        ranks: the ranks the error is about.
        lost: True when ranks are gone (killed, unreachable, silent, their job or node ended): relaunching the
            group and restoring a checkpoint can go on; False when a rank raised (its code, its input).
        nodes: where those ranks ran (the Slurm node, else the host), as far as the group knows.
    """

    def __init__(
        self, message: str, group: str = "", ranks: Sequence[int] = (), lost: bool = False, nodes: Sequence[str] = ()
    ) -> None:
        super().__init__(message)
        self.group, self.ranks, self.lost, self.nodes = group, list(ranks), lost, list(nodes)

    def __reduce__(self) -> tuple[Any, ...]:  # a copy (pickled, deep-copied) keeps what the flow's recovery reads
        return (type(self), (str(self), self.group, self.ranks, self.lost, self.nodes))


@dataclass
class GroupSpec:
    """Where and how to run one worker group.

    Attributes:
        name: group name (in errors, logs and the run store's placement).
        worker_cls: ``"package.module:Class"`` or ``"path/to/file.py:Class"``; its `register`-ed methods are served.
        nodes, tasks_per_node: ranks (processes, one per device) = nodes x tasks_per_node; local groups have 1 node.
        executor: ``local`` (processes on this machine) or ``slurm``.
        slurm: submitit `SlurmExecutor` parameters (``partition``, ``account``, ``qos``, ``cpus_per_task``,
            ``gpus_per_node``, ``mem``, ``signal_delay_s``, ``setup``, ``additional_parameters``; see
            `slurm_parameters`).
        timeout_min: the job's time limit (minutes).
        backend: torch.distributed backend (``gloo`` on CPU, ``nccl`` on GPU).
        heartbeat_interval_s / heartbeat_timeout_s: how often ranks beat, and how long silence means dead.
        start_timeout_s: how long to wait for every rank's hello.
        rendezvous_timeout_s: how long the start waits for a Slurm job's node agents to say hello once the job
            runs, and a rank to join torch.distributed's rendezvous: agents that never reach the controller, a rank
            that cannot reach rank 0's store, or rank 0 missing some ranks end the start with an error naming them
            (`Allocation.silent_agents`, `hybridflow.slurm.rendezvous`).
        call_timeout_s: limit for one method call (None: none). A rank whose process is alive but stuck (e.g. in a
            collective) still beats; this limit is what turns such a hang into an error.
        slurm_poll_s: how often a Slurm group's job and node states are polled while waiting (seconds).
        env: environment variables for the worker processes.
        interface: a Slurm group's network interface (``placement.slurm.interface``, e.g. ``ib0``): the controller's
            channel and the ranks' gloo/NCCL traffic listen there; None: the address of the host name (controller)
            and the route to the controller (ranks). A local group always uses the loopback interface.
        vllm: its ranks may build vLLM engines: a Slurm node's fork server imports vLLM's engine modules too
            (`hybridflow.slurm.forked.warm_up`); a local group's fork server is the controller's, started so or not.
    """

    name: str
    worker_cls: str
    nodes: int = 1
    tasks_per_node: int = 1
    executor: str = "local"
    slurm: dict[str, Any] = field(default_factory=dict)
    timeout_min: int = 24 * 60
    backend: str = "gloo"
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    start_timeout_s: float = 300.0
    rendezvous_timeout_s: float = 120.0
    call_timeout_s: float | None = None
    slurm_poll_s: float = 2.0
    env: dict[str, str] = field(default_factory=dict)
    interface: str | None = None
    vllm: bool = False

    @property
    def world_size(self) -> int:
        """Number of ranks: nodes x tasks_per_node."""
        return self.nodes * self.tasks_per_node


def slurm_parameters(
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    cpus_per_task: int = 1,
    gpus_per_node: int = 0,
    mem_gb: float | None = None,
    signal_delay_s: int = 120,
    sbatch: dict[str, Any] | None = None,
    setup: list[str] | None = None,
) -> dict[str, Any]:
    """submitit `SlurmExecutor` parameters from the ``placement.slurm`` config keys (None: the cluster's default).

    Args:
        mem_gb: memory per node (GiB), sent as ``--mem=<MiB>M``.
        signal_delay_s: SIGUSR2 this many seconds before the time limit (``--signal=USR2@...``).
        sbatch: any other sbatch option, ``{"constraint": "a100", "exclusive": True}`` -> ``--constraint=a100
            --exclusive``. ``--no-requeue`` is always added: a worker group is resumed by `hf resume`, never
            restarted by Slurm with blank models.
        setup: shell lines run in the batch script before the workers start (``module load ...``).
    """
    params: dict[str, Any] = {"cpus_per_task": cpus_per_task, "signal_delay_s": signal_delay_s}
    for key, value in (("partition", partition), ("account", account), ("qos", qos)):
        if value:
            params[key] = value
    if gpus_per_node:
        params["gpus_per_node"] = gpus_per_node
    if mem_gb:
        params["mem"] = f"{int(mem_gb * 1024)}M"
    if setup:
        params["setup"] = list(setup)
    # A requeued job would restart its ranks with fresh, untrained models: never requeue (the run resumes instead).
    params["additional_parameters"] = {"no_requeue": True, **(sbatch or {})}
    return params


@dataclass
class RankInfo:
    rank: int
    pid: int
    host: str
    last_seen: float
    node: str = ""


class WorkerGroup:
    """A running worker group (see the module docstring).

    Args:
        spec: the group's `GroupSpec`.
        run_dir: the run's folder; the group writes ``submitit/<name>/`` (job logs) there.
        data_dir: where batches (`DataHandle` parts) are written; shared by all groups of the run.
        secret_path: the run's channel secret (see `channel.create_secret`).
        worker_kwargs: JSON-serialisable keyword arguments for the worker class's constructor.
        wait: wait for every rank's hello before returning (default). With False the job is only submitted; call
            `wait_ready` later (to submit several groups' jobs at once, so none sits allocated while another
            waits in the queue).

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
        wait: bool = True,
    ):
        self.spec = spec
        self._lock = threading.RLock()  # one call at a time: the controller's stages may run in several threads
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._signer = Signer(read_secret(secret_path))
        local = spec.executor == "local"
        bind = "127.0.0.1" if local else network.host_address(spec.interface)
        self._endpoint = ControllerEndpoint(self._signer, bind_host=bind)
        self.log_dir = Path(run_dir) / "submitit" / spec.name
        self._launch: Bootstrap | None = None  # a Slurm group's ranks, forked once its allocation's agents say hello
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
                interface=network.LOOPBACK if local else spec.interface,
                rendezvous_timeout_s=spec.rendezvous_timeout_s,
            )
        )
        self.job_id = str(self._job.job_id)
        # the ranks' log files: <log_prefix>_<rank>_log.err (a relaunch in a kept allocation: <job>.<n>_...)
        self.log_prefix = self._job.next_log_prefix() if isinstance(self._job, Allocation) else self.job_id
        self._lost = False  # it raised for a lost rank: on shutdown, keep its allocation for the relaunch
        self._cancelled = False
        self.ranks: dict[int, RankInfo] = {}
        self.methods: dict[str, Dispatch] = {}
        self.warning_signals: dict[int, list[str]] = {}
        self._rendezvous: dict[str, Any] | None = None  # where rank 0's store listens, once it has said
        self._asking: set[str] = set()  # ranks that asked before rank 0 said
        self._rank_ends: dict[int, tuple[int, str]] = {}  # rank -> (pid, how its process ended)
        self._closed = False
        self._last_slurm_poll = 0.0
        self._slurm_state = ""
        self._pending_reason = ""
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until every rank has said hello. On failure the job is cancelled and the group closed.

        Raises:
            WorkerGroupError: see the class docstring.
        """
        try:
            self._wait_for_hello()
        except BaseException:  # never leave a job running that nobody will call or stop
            self._closed = True
            self._cancel()
            if isinstance(self._job, Allocation):
                self._job.close(wait_s=0)
            self._endpoint.close()
            raise

    # ------------------------------------------------------------------ start
    def _submit(self, boot: Bootstrap) -> Allocation | ForkedJob:
        spec = self.spec
        if spec.executor == "local":
            if spec.nodes != 1:
                raise ValueError(f"group {spec.name!r}: the local executor runs one node, not {spec.nodes}")
            return local_job(self.log_dir, spec.tasks_per_node, boot)
        if spec.executor != "slurm":
            raise ValueError(f"unknown executor {spec.executor!r} for group {spec.name!r}; use 'local' or 'slurm'")
        # the allocation kept for this group's relaunch after it lost a rank, else a new job; its agents fork the
        # ranks once they have said hello (`_wait_for_hello`)
        self._launch = boot
        return allocation.take(spec, self.log_dir) or Allocation(spec, self.log_dir)

    def _wait_for_hello(self) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        running_since: float | None = None  # a Slurm job's, while its agents have not all said hello
        while len(self.ranks) < self.spec.world_size:
            if self._launch is not None and isinstance(self._job, Allocation):
                if self._job.ready():
                    self._job.launch(self._launch, self.log_dir)
                    self._launch = None
                elif running_since is not None and time.monotonic() - running_since > self.spec.rendezvous_timeout_s:
                    everyone = list(range(self.spec.world_size))
                    raise self._error(self._job.silent_agents(self.spec.rendezvous_timeout_s), everyone)
            state = self._check_job_alive("starting")
            if state == "RUNNING" and running_since is None:
                running_since = time.monotonic()
            if state in ("PENDING", "CONFIGURING"):  # queue and node boot time: the cluster's business
                deadline = time.monotonic() + self.spec.start_timeout_s
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.spec.world_size)) - set(self.ranks))
                raise self._error(
                    f"ranks {missing} did not start within {self.spec.start_timeout_s:.0f} s", missing, located=True
                )
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
        if method not in self.methods:
            raise AttributeError(f"group {self.spec.name!r} serves {sorted(self.methods)}, not {method!r}")
        with self._lock:
            if self._closed:
                raise WorkerGroupError(f"group {self.spec.name!r} is shut down")
            return self._call(method, args, kwargs, timeout_s)

    def _call(self, method: str, args: tuple, kwargs: dict, timeout_s: float | None) -> Any:
        mode = self.methods[method]
        self.poll()  # heartbeats queued while no call ran: every live rank is fresh again
        args = tuple(
            DataHandle.put(a, self.data_dir, f"{method}-input") if isinstance(a, DataProto) else a for a in args
        )
        per_rank = split_arguments(mode, method, self.spec.world_size, args, kwargs)
        call_id = uuid.uuid4().hex
        for rank, (rank_args, rank_kwargs) in per_rank.items():
            message = {
                "type": "call",
                "id": call_id,
                "method": method,
                "args": encode_args(list(rank_args)),
                "kwargs": encode_args(rank_kwargs),
            }
            try:
                self._endpoint.send(self._identity(rank), message)
            except (
                zmq.ZMQError
            ) as e:  # the rank's connection is gone: it died (or lost the network) since its last call
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                self._last_slurm_poll = float("-inf")  # ask Slurm now, not at the next poll period
                self._check_job_alive(during=method)  # names how it ended, when that is known already
                raise self._error(
                    f"{self._where(rank)} is unreachable (its connection closed) when {method} was sent",
                    [rank],
                    lost=True,
                    located=True,
                ) from None
        results = self._collect(call_id, method, set(per_rank), timeout_s)
        ordered = [decode_args(results[r]) for r in sorted(results)]
        return gather_results(mode, ordered, args[0].meta_info if mode is Dispatch.DP_COMPUTE_PROTO else None)

    def _collect(self, call_id: str, method: str, pending: set[int], timeout_s: float | None) -> dict[int, Any]:
        results: dict[int, Any] = {}
        timeout_s = self.spec.call_timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        last_check = started
        # a call shorter than the checks below still sees its job or a node gone (Slurm polled every slurm_poll_s)
        self._check_job_alive(method)
        while pending:
            got = self._endpoint.recv(0.1)
            now = time.monotonic()
            if got is not None:
                message = got[1]
                from_rank = str(message.get("from", "")).startswith(f"{self.spec.name}/rank-")
                if from_rank and message.get("id") == call_id and message.get("type") in ("result", "error"):
                    rank = int(message["rank"])
                    self._beat(rank)
                    if message["type"] == "error":
                        if PEER_LOST.search(message["traceback"]):  # a collective lost a peer: which one died?
                            self._name_the_lost_peer(method, rank, started)
                        raise self._error(
                            f"rank {rank} raised in {method}:\n{message['traceback']}", [rank], located=True
                        )
                    results[rank] = message["result"]
                    pending.discard(rank)
                else:
                    self._handle_side_message(message)
                if now - last_check < 2.0:  # judge silence only once the queue is drained (or every 2 s)
                    continue
            if now - last_check > 0.25:
                self._check_heartbeats(method, pending, since=started)
                self._check_job_alive(method)
                last_check = time.monotonic()
            if deadline is not None and now > deadline:
                raise self._error(f"{method} did not finish within {timeout_s} s", sorted(pending))
        return results

    # ------------------------------------------------------------------ liveness
    def _identity(self, rank: int) -> str:
        return f"{self.spec.name}/rank-{rank}"

    def _handle_side_message(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        sender = str(message.get("from", ""))
        if kind == "rank_ended" and sender.startswith(f"{self.spec.name}/node-"):  # a Slurm node's agent
            self._rank_ends[int(message["rank"])] = (int(message["pid"]), str(message["end"]))
            return
        if not sender.startswith(f"{self.spec.name}/rank-"):
            self._signer.dropped += 1  # signed with the run's secret, but for another group: not ours to act on
            return
        if kind == "hello":
            rank = int(message["rank"])
            if rank in self.ranks and self.ranks[rank].pid != int(message["pid"]):
                raise self._error(
                    f"{self._where(rank)} started again (pid {message['pid']} on {message['host']}): the job was "
                    "requeued or restarted and its state is lost",
                    [rank],
                    lost=True,
                    located=True,
                )
            self.ranks[rank] = RankInfo(
                rank, int(message["pid"]), str(message["host"]), time.monotonic(), str(message.get("node", ""))
            )
            self.methods = {name: Dispatch(mode) for name, mode in message["methods"].items()}
        elif kind == "rendezvous":
            self._relay_rendezvous(sender, message)
        elif kind == "heartbeat":
            rank = int(sender.removeprefix(f"{self.spec.name}/rank-").split("/")[0])
            self._beat(rank)
            signals = [str(s) for s in message.get("signals", [])]
            if signals and signals != self.warning_signals.get(rank):
                logger.warning("group %s rank %d received %s", self.spec.name, rank, ", ".join(signals))
                self.warning_signals[rank] = signals
        elif kind == "fatal":
            rank = int(message["rank"])
            raise self._error(f"rank {rank} failed while starting:\n{message['traceback']}", [rank], located=True)

    def _relay_rendezvous(self, sender: str, message: dict[str, Any]) -> None:
        """Rank 0 says where its rendezvous store listens (``address``, ``port``); every other rank asks, and is
        answered as soon as that is known."""
        if "port" in message:
            self._rendezvous = {"type": "rendezvous", "address": str(message["address"]), "port": int(message["port"])}
        else:
            self._asking.add(sender)
        if self._rendezvous is not None:
            for identity in sorted(self._asking):
                self._endpoint.send(identity, self._rendezvous)
            self._asking.clear()

    def _beat(self, rank: int) -> None:
        if rank in self.ranks:
            self.ranks[rank].last_seen = time.monotonic()

    def _name_the_lost_peer(self, method: str, rank: int, since: float) -> None:
        """Rank `rank` raised in a collective because a peer is gone (`PEER_LOST`): the rank that noticed is
        not the cause. Look for the dead rank with the group's own liveness checks (a local rank's process end:
        at once; on Slurm: the job or a node, or the dead rank's silence) for up to ``heartbeat_timeout_s``,
        reading the live ranks' heartbeats meanwhile, and raise naming it. Returns when none is found."""
        others = set(range(self.spec.world_size)) - {rank}
        deadline = time.monotonic() + self.spec.heartbeat_timeout_s + 1.0
        while time.monotonic() < deadline:
            self._check_job_alive(method)
            self._check_heartbeats(method, others, since)
            got = self._endpoint.recv(0.2)
            if got is not None:
                message = got[1]
                if message.get("type") in ("result", "error") and str(message.get("rank", "")).isdigit():
                    self._beat(int(message["rank"]))  # a live rank's answer to this call (it noticed too)
                else:
                    self._handle_side_message(message)

    def _check_heartbeats(self, method: str, pending: set[int], since: float) -> None:
        """Raise for a pending rank silent for ``heartbeat_timeout_s``, counting from `since` at the earliest (the
        call's start: between calls nobody reads the socket, so older silence says nothing)."""
        now = time.monotonic()
        for rank in sorted(pending):
            info = self.ranks.get(rank)
            if info is None:
                continue
            silent = now - max(info.last_seen, since)
            if silent > self.spec.heartbeat_timeout_s:
                raise self._error(
                    f"{self._where(rank)} sent no heartbeat for {silent:.1f} s during {method} (dead, stopped or hung)",
                    [rank],
                    lost=True,
                    located=True,
                )

    def poll(self) -> None:
        """Handle the messages that arrived while no call was running (heartbeats with warning signals; results
        of an abandoned call are dropped). Returns at once while a call runs (a generation ahead, in another
        thread): that call's own receive loop handles them."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            while (got := self._endpoint.recv(0)) is not None:
                if got[1].get("type") in ("heartbeat", "hello", "fatal", "rendezvous", "rank_ended"):
                    self._handle_side_message(got[1])
        finally:
            self._lock.release()

    def _check_job_alive(self, during: str) -> str:
        """Raise if the job has ended, or (Slurm) if one of its nodes is down or drained. Returns the Slurm job's
        state (``RUNNING``, ``PENDING``...; polled every ``slurm_poll_s``) or ``""`` for local groups."""
        everyone = sorted(range(self.spec.world_size))
        if isinstance(self._job, ForkedJob):
            for rank, pid in self._job.pids.items():
                if (end := self._job.end_of(rank)) is not None:
                    self._rank_ends[rank] = (pid, end)
        for rank, (pid, end) in sorted(self._rank_ends.items()):  # a local rank's, or as a Slurm node's agent said
            raise self._error(f"{self._where(rank, pid)} {end} during {during}", [rank], lost=True, located=True)
        if isinstance(self._job, ForkedJob):
            return ""
        now = time.monotonic()
        if now - self._last_slurm_poll < self.spec.slurm_poll_s:
            return self._slurm_state
        self._last_slurm_poll = now
        try:
            state = cluster.job_state(self.job_id)
        except cluster.SlurmCommandError as e:  # the controller lost Slurm: say so, but heartbeats still decide
            logger.warning("cannot poll Slurm job %s of group %s: %s", self.job_id, self.spec.name, e)
            return self._slurm_state
        self._slurm_state = state
        if state == "PENDING":
            self._say_why_pending()
        if state not in cluster.ACTIVE_STATES and state != "UNKNOWN":
            if not self.ranks and (unlaunched := self._launch_failure()):  # a fault of the run's set-up: no retry
                raise self._error(f"the Slurm job ended (state {state}) during {during}: {unlaunched}", everyone)
            bad = "".join(f"; node {node.node} is {node.said}" for node in self._bad_nodes())  # why, if a node
            raise self._error(f"the Slurm job ended (state {state}{bad}) during {during}", everyone, lost=True)
        for node in self._bad_nodes():
            on_node = sorted(r for r, info in self.ranks.items() if info.node == node.node)
            cancelled = self._cancel()
            outcome = "the job was cancelled" if cancelled else "cancelling the job failed (scancel it)"
            raise self._error(f"node {node.node} is {node.said} during {during}; {outcome}", on_node, lost=True)
        return state

    def _launch_failure(self) -> str:
        """Why Slurm could not launch the job, with the fix, when it says so (``Reason=JobLaunchFailure``): its
        node could not open the job's files in this group's folder, i.e. the run's folder is not on a file system
        that node mounts; ``""`` otherwise."""
        fields = cluster.job_fields(self.job_id)
        if fields.get("Reason") != "JobLaunchFailure":
            return ""
        node = fields.get("BatchHost") or fields.get("NodeList", "?")
        return (
            f"Slurm could not launch it on node {node} (JobLaunchFailure): that node cannot open the job's files in "
            f"{self.log_dir}, so it does not see the run's folder (trainer.output_dir). Put trainer.output_dir on a "
            "file system every node mounts (your home or a shared scratch; not a login node's /tmp or local disk); "
            "the node's slurmd log names the file"
        )

    def _bad_nodes(self) -> list[cluster.NodeState]:
        """The nodes of this group's ranks that are down, drained, draining or failing (none when sinfo fails)."""
        nodes = sorted({info.node for info in self.ranks.values() if info.node})
        try:
            return [node for node in cluster.node_states(nodes) if node.bad]
        except cluster.SlurmCommandError:
            return []

    def _say_why_pending(self) -> None:
        """Log why the job waits in the queue whenever Slurm's reason changes: a group relaunched after its node
        was lost waits here until the partition has the nodes its placement asks for (``ReqNodeNotAvail``,
        ``Resources``), which a user otherwise sees only as a run that stopped moving."""
        try:
            reason = cluster.pending_reason(self.job_id)
        except cluster.SlurmCommandError:
            return
        if reason and reason != self._pending_reason:
            logger.warning(
                "group %s: Slurm job %s waits in the queue for %d node(s) x %d task(s) (reason: %s); it starts when "
                "partition %s has them (sinfo shows its nodes)",
                self.spec.name,
                self.job_id,
                self.spec.nodes,
                self.spec.tasks_per_node,
                reason,
                self.spec.slurm.get("partition") or "(default)",
            )
        self._pending_reason = reason

    def _cancel(self) -> bool:
        """End the job: SIGKILL a local group's ranks (a rank reads SIGTERM as a warning), scancel a Slurm job.
        Returns False when scancel failed."""
        if isinstance(self._job, ForkedJob):
            self._job.kill()
            return True
        self._cancelled = True  # nothing left to keep
        return self._job.cancel()

    def _where(self, rank: int, pid: int | None = None) -> str:
        """``rank N (host H, pid P)``, as far as known (`pid`: the rank's process as its launcher saw it)."""
        info = self.ranks.get(rank)
        host = f"host {info.host}, " if info else ""
        pid = pid if pid is not None else info.pid if info else None
        return f"rank {rank} ({host}pid {pid})" if pid is not None else f"rank {rank}"

    def _error(self, what: str, ranks: list[int], lost: bool = False, located: bool = False) -> WorkerGroupError:
        """The error of `ranks`: `what` happened, then where each rank runs (unless `located`: `what` says it)."""
        where = "" if located else "; " + ", ".join(self._where(rank) for rank in ranks)
        logs = "".join(self._log_tail(r) for r in ranks[:1])
        self._lost = self._lost or lost
        return WorkerGroupError(
            f"worker group {self.spec.name!r} (job {self.job_id}, {self.spec.executor}): {what}{where}{logs}",
            self.spec.name,
            ranks,
            lost,
            self.nodes_of(ranks),
        )

    def nodes_of(self, ranks: Sequence[int]) -> list[str]:
        """Where `ranks` run, sorted and once each: the Slurm node, else the host (ranks not heard from left out)."""
        return sorted({info.node or info.host for r in ranks if (info := self.ranks.get(r)) is not None})

    def _log_tail(self, rank: int, lines: int = 15) -> str:
        paths = sorted(self.log_dir.glob(f"{self.log_prefix}_{rank}_log.err")) or sorted(self.log_dir.glob("*_log.err"))
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
            "hosts": [self.ranks[r].node or self.ranks[r].host for r in sorted(self.ranks)],  # Slurm's node names
        }

    @property
    def pids(self) -> list[int]:
        """Process id of each rank, in rank order."""
        return [self.ranks[r].pid for r in sorted(self.ranks)]

    # ------------------------------------------------------------------ stop
    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to exit, wait for the job to end (cancel it after `timeout_s`), close the socket.

        A call still running in another thread (a stage of a concurrent batch, when the controller is stopped)
        is given `timeout_s` to end; then the job is cancelled, which ends that call with an error."""
        if self._closed:
            return
        self._closed = True
        if not self._lock.acquire(timeout=timeout_s):
            self._cancel()
            if not self._lock.acquire(timeout=max(timeout_s, self.spec.heartbeat_timeout_s + 5)):
                logger.warning("group %s: a call did not end after its job was cancelled", self.spec.name)
                return
        try:
            self._stop(timeout_s)
        finally:
            self._lock.release()

    def _stop(self, timeout_s: float) -> None:
        if len(self.ranks) < self.spec.world_size:  # never (fully) started: nobody to tell, cancel the job now
            self._cancel()
        for rank in self.ranks:
            with contextlib.suppress(zmq.ZMQError):  # a dead rank cannot be told
                self._endpoint.send(self._identity(rank), {"type": "shutdown"})
        deadline = time.monotonic() + timeout_s
        if isinstance(self._job, ForkedJob):
            while not self._job.done() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not self._job.done():
                self._cancel()
        else:
            self._release_allocation(deadline)
        self._endpoint.close()

    def _release_allocation(self, deadline: float) -> None:
        """A Slurm group's end: wait until its agents say every rank ended (or the job did, or `deadline`), then
        keep the allocation for this group's relaunch when the group lost a rank and Slurm did not warn it (a
        time limit or a preemption needs a new job), else end it (`Allocation.close`)."""
        last_check = time.monotonic()
        while len(self._rank_ends) < self.spec.world_size and time.monotonic() < deadline:
            got = self._endpoint.recv(0.05)
            if got is not None and got[1].get("type") == "rank_ended":
                self._handle_side_message(got[1])
            if time.monotonic() - last_check > 1.0:
                last_check = time.monotonic()
                if self._job.ended():
                    break
        keepable = self._lost and not self._cancelled and not self.warning_signals
        if keepable and allocation.keep(self._job, self.log_dir):
            logger.info("group %s: allocation %s kept for its relaunch", self.spec.name, self.job_id)
            return
        self._job.close()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
    r"NCCL communicator was aborted|NCCL error.*(unhandled system error|remote)",
    re.IGNORECASE,
)
"""What a rank's error says when a collective lost a peer (gloo, NCCL): the cause is another rank."""
