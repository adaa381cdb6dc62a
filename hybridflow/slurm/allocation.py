"""A Slurm group's allocation: the job whose node agents fork the group's ranks, submitted early, kept for a relaunch.

A worker group on Slurm is launched in an `Allocation`: one job of ``nodes`` tasks, each a node agent
(`hybridflow.slurm.node_agent`) that imports the engine once in its fork server and forks the node's ranks when
told. When the group loses a rank (killed, silent) the run relaunches it from a checkpoint; the allocation is then
kept (`keep`) for `KEEP_S` seconds, and the relaunched group with the same placement takes it back (`take`): its
agents kill what is left of the old ranks and fork new ones in milliseconds, with no new job in the queue and no
import. An allocation is never kept when its job or one of its nodes is in trouble, or Slurm warned its ranks (time
limit, preemption): those relaunches need a new job. ``hf run`` also submits its groups' allocations as soon as it
has read its config (`submit_early`), for its groups to take when it launches them: the job's queue wait and its agents'
import then overlap the controller's own start. One not taken in time, or still kept when the controller exits, is
told to end (its agents exit, so the job ends; ``scancel`` if they do not).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import submitit

from hybridflow.slurm import cluster, network
from hybridflow.slurm.channel import ControllerEndpoint, Signer, create_secret, read_secret
from hybridflow.slurm.forked import Bootstrap
from hybridflow.slurm.node_agent import AgentBoot, serve_node

logger = logging.getLogger(__name__)

KEEP_S = 120.0
"""How long an allocation waits to be taken back by its relaunched group (seconds): longer than the run's recovery
back-off (``trainer.recovery_backoff_s``, 5 s, doubled for each earlier recovery)."""

IDLE_TIMEOUT_S = 15.0
"""How long `keep` waits for every agent to say its ranks ended (seconds) before it gives the allocation up."""


class GroupShape(Protocol):
    """What an allocation reads of its group (`hybridflow.slurm.worker_group.GroupSpec` has it all): the name and
    placement its job is shaped by, how long an agent lives without its controller (seconds), whether its fork
    server imports vLLM's engine modules."""

    name: str
    nodes: int
    tasks_per_node: int
    slurm: dict[str, Any]
    timeout_min: int
    interface: str | None
    heartbeat_timeout_s: float
    vllm: bool


_KEPT: dict[tuple, Allocation] = {}
_KEPT_LOCK = threading.Lock()


class Allocation:
    """One Slurm job of node agents for a worker group (see the module docstring).

    Args:
        spec: the group's `GroupShape` (a `GroupSpec`): its name (the job is ``hybridflow-<name>``), layout (``nodes``,
            ``tasks_per_node``), ``slurm`` parameters (``cpus_per_task`` is each rank's: the job's one task per node
            holds ``tasks_per_node`` times that), ``timeout_min``, ``interface`` (where the controller listens for
            the agents) and ``heartbeat_timeout_s`` (how long an agent lives without its controller).
        folder: the job's own files (submitit's, the batch script's and the agents' output); each launch says where
            its ranks write their logs (the group's log folder).

    Raises:
        submitit.core.utils.FailedJobError: sbatch refused the job.
    """

    def __init__(self, spec: GroupShape, folder: Path) -> None:
        self.shape = _shape(spec)
        self.owner: Path | None = None  # log folder of the group it is kept for (`keep`); None: any (`submit_early`)
        self.name, self.nodes = spec.name, spec.nodes
        log_dir = self.folder = Path(folder)
        log_dir.mkdir(parents=True, exist_ok=True)
        secret = log_dir / "allocation.secret"  # its own: each controller session writes a new run secret
        secret.unlink(missing_ok=True)
        create_secret(secret)
        self._endpoint = ControllerEndpoint(Signer(read_secret(secret)), bind_host=network.host_address(spec.interface))
        self.agents: set[int] = set()  # nodes whose agent said hello
        self.hosts: set[str] = set()  # their Slurm node names
        self.launches = 0
        self._closed = False
        params = dict(spec.slurm)
        cpus_per_task = int(params.pop("cpus_per_task", 1))
        # its own output in <job>_node<N>_log.*, the batch script's in <job>_batch.*: <job>_<rank>_log.* are the ranks'
        node_log = str(log_dir / "%j_node%n_log")
        params["srun_args"] = ["--output", f"{node_log}.out", "--error", f"{node_log}.err"]
        params["additional_parameters"] = {
            **params.get("additional_parameters", {}),
            "output": str(log_dir / "%j_batch.out"),
            "error": str(log_dir / "%j_batch.err"),
        }
        executor = submitit.SlurmExecutor(folder=log_dir, python=sys.executable)
        executor.update_parameters(
            nodes=spec.nodes,
            ntasks_per_node=1,
            cpus_per_task=spec.tasks_per_node * cpus_per_task,
            time=spec.timeout_min,
            job_name=f"hybridflow-{spec.name}",
            **params,
        )
        boot = AgentBoot(
            spec.name,
            self._endpoint.address,
            str(secret),
            spec.tasks_per_node,
            cpus_per_task,
            spec.heartbeat_timeout_s,
            spec.vllm,
        )
        self.job_id = str(executor.submit(serve_node, boot).job_id)

    def ready(self) -> bool:
        """Whether every node's agent has said hello (reads what arrived)."""
        self._read()
        return len(self.agents) == self.nodes

    def silent_agents(self, waited_s: float) -> str:
        """Which nodes' agents have not said hello `waited_s` seconds after the job started running, the likely
        causes and where their output is (for the group's error)."""
        self._read()
        nodes = cluster.job_nodes(self.job_id)
        silent = [name for n, name in enumerate(nodes) if n not in self.agents] or [
            f"node {n}" for n in range(self.nodes) if n not in self.agents
        ]
        host = self._endpoint.address.removeprefix("tcp://").rsplit(":", 1)[0]
        return (
            f"the node agents on {', '.join(silent)} did not reach the controller at {self._endpoint.address} within "
            f"{waited_s:.0f} s of the job's start (placement.rendezvous_timeout_s): those nodes cannot reach this "
            f"host's address {host} (set placement.slurm.interface to the interface of the network they share with "
            "this host; `ip -4 addr` lists them), or the job's set-up lines (placement.slurm.setup) have not "
            f"finished; the job's output: {self.folder / f'{self.job_id}_batch.err'}, "
            f"{self.folder / f'{self.job_id}_node<N>_log.err'}"
        )

    def launch(self, boot: Bootstrap, log_dir: Path) -> None:
        """Tell every agent to fork its node's ranks of `boot`, their logs in `log_dir` (`ready` must be true)."""
        self.launches += 1
        message = {"type": "launch", "boot": boot.__dict__, "log_dir": str(log_dir)}
        for node in sorted(self.agents):
            self._endpoint.send(f"{self.name}/node-{node}", message)

    @property
    def log_prefix(self) -> str:
        """What the ranks of the latest launch name their logs by: the job id, then ``<job>.<n>`` for the n-th."""
        return self.job_id if self.launches <= 1 else f"{self.job_id}.{self.launches}"

    def next_log_prefix(self) -> str:
        """`log_prefix` of the next launch."""
        return self.job_id if self.launches == 0 else f"{self.job_id}.{self.launches + 1}"

    def end_ranks(self, timeout_s: float = IDLE_TIMEOUT_S) -> bool:
        """Tell every agent to kill its ranks; True when each said they ended within `timeout_s`."""
        idle: set[int] = set()
        try:
            for node in sorted(self.agents):
                self._endpoint.send(f"{self.name}/node-{node}", {"type": "kill"})
        except Exception:  # an agent's connection is gone (zmq.ZMQError): this allocation cannot be kept
            return False
        deadline = time.monotonic() + timeout_s
        while idle != self.agents and time.monotonic() < deadline:
            got = self._endpoint.recv(0.1)
            if got is not None and got[1].get("type") == "idle":
                idle.add(int(got[1]["node"]))
                if got[1].get("left"):
                    logger.warning("allocation %s: ranks %s did not end when killed", self.job_id, got[1]["left"])
                    return False
        return idle == self.agents

    def queued(self) -> bool:
        """Whether the job still waits in the queue (or its nodes boot)."""
        with contextlib.suppress(cluster.SlurmCommandError):
            return cluster.job_state(self.job_id) in ("PENDING", "CONFIGURING")
        return False

    def running(self) -> bool:
        """Whether the job runs, on nodes that are neither down nor drained."""
        try:
            if cluster.job_state(self.job_id) != "RUNNING":
                return False
            return not any(node.bad for node in cluster.node_states(sorted(self.hosts)))
        except cluster.SlurmCommandError:
            return False

    def ended(self) -> bool:
        """Whether the job has ended (False while Slurm does not answer)."""
        with contextlib.suppress(cluster.SlurmCommandError):
            return cluster.job_state(self.job_id) not in cluster.ACTIVE_STATES
        return False

    def close(self, wait_s: float = 30.0) -> None:
        """End the job: every agent told to exit (its ranks killed), the job's end awaited up to `wait_s` seconds
        (a group submitted next may need its nodes), ``scancel`` if it has not ended. Once only."""
        if self._closed:
            return
        self._closed = True
        for node in sorted(self.agents):
            with contextlib.suppress(Exception):  # an agent already gone
                self._endpoint.send(f"{self.name}/node-{node}", {"type": "exit"})
        self._read()
        if len(self.agents) < self.nodes:
            wait_s = 0  # an agent that never said hello cannot be told: scancel
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.ended():
                break
            time.sleep(0.25)
        else:
            self.cancel()
        self._endpoint.close()

    def cancel(self) -> bool:
        """``scancel`` the job; False when scancel failed."""
        return cluster.cancel(self.job_id)

    def _read(self) -> None:
        while (got := self._endpoint.recv(0)) is not None:
            if got[1].get("type") == "agent":
                self.agents.add(int(got[1]["node"]))
                self.hosts.add(str(got[1]["host"]))


def _shape(spec: GroupShape) -> tuple:
    """What a group needs of an allocation: its name and placement (equal parts, equal shape)."""
    parts = (spec.name, spec.nodes, spec.tasks_per_node, spec.slurm, spec.timeout_min, spec.interface, spec.vllm)
    return tuple(repr(part) for part in parts)


def submit_early(allocation: Allocation, keep_s: float = KEEP_S) -> None:
    """Offer `allocation`, just submitted, to the group of its name and placement that this controller launches
    next (`take`): ``hf run`` submits its groups' allocations as soon as its config is read, so that their jobs
    wait in the queue and their agents import the engine while the controller checks its inputs and starts its
    flow. Closed after `keep_s` seconds if no group took it."""
    _hold(allocation, keep_s)


def take(spec: GroupShape, log_dir: Path) -> Allocation | None:
    """The allocation kept for the group whose logs are in `log_dir` (`keep`), else one submitted early for a
    group of this name and placement (`submit_early`), if its job is queued or runs on healthy nodes; else None (one
    found unfit is closed)."""
    shape = _shape(spec)
    with _KEPT_LOCK:
        found = _KEPT.pop((shape, log_dir), None) or _KEPT.pop((shape, None), None)
    if found is None:
        return None
    if found.running() or (found.owner is None and found.queued()):
        return found
    found.cancel()
    found.close(wait_s=0)
    return None


def keep(allocation: Allocation, owner: Path, keep_s: float = KEEP_S) -> bool:
    """Keep `allocation` for the relaunch of its group (whose logs are in `owner`): its ranks ended (every agent
    says so), then `take` finds it for `keep_s` seconds, after which it is closed. False when its ranks would not
    end or its job or nodes are in trouble: the caller ends it (`Allocation.close`)."""
    if not allocation.running() or not allocation.end_ranks():
        return False
    allocation.owner = owner
    _hold(allocation, keep_s)
    return True


def _hold(allocation: Allocation, keep_s: float) -> None:
    """Put `allocation` where `take` finds it, and close it after `keep_s` seconds unless taken meanwhile."""
    key = (allocation.shape, allocation.owner)
    with _KEPT_LOCK:
        _KEPT[key] = allocation
    timer = threading.Timer(keep_s, _expire, (key, allocation))
    timer.daemon = True
    timer.start()


def _expire(key: tuple, allocation: Allocation) -> None:
    with _KEPT_LOCK:
        if _KEPT.get(key) is not allocation:
            return  # taken meanwhile
        del _KEPT[key]
    allocation.close()


@atexit.register
def _close_kept() -> None:
    """At the controller's exit, end every allocation still kept (no group will take it back)."""
    with _KEPT_LOCK:
        kept = list(_KEPT.values())
        _KEPT.clear()
    for allocation in kept:
        allocation.close(wait_s=5.0)
