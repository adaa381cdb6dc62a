"""A Slurm group's node agent: the one task of each node of the group's job, which forks that node's ranks.

A worker group on Slurm runs in an allocation (`hybridflow.slurm.allocation`): one job of ``nodes`` tasks, one per
node. Each task is this agent: a light process (it never imports torch or the engine) that starts a fork server
(`hybridflow.slurm.forked`, which imports the rank's modules once) as soon as the job starts, says hello to the
controller, and forks the node's ``tasks_per_node`` ranks when told to (``launch``). A group on N nodes therefore
starts in the time of one import, where one process per rank imported the same modules ``tasks_per_node`` times over
on each node (the cores they share, the file system they read: ~10 s of one core each); and a group relaunched after
it lost a rank forks its new ranks in the same job, from the same fork server, in milliseconds.

Each rank sees what Slurm would have shown a task of its own: the job's environment with ``SLURM_PROCID``,
``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_CPUS_PER_TASK`` (its own CPUs) ... of a job of ``nodes x
tasks_per_node`` tasks, its working directory, and its output in ``<job>_<rank>_log.out`` / ``_log.err`` in the
group's log folder (``<job>.<n>_<rank>_log.*`` for the n-th launch in the job; the agent's own lines go to
``<job>_node<N>_log.err``). The job is allocated as one task per node with all the node's CPUs of the group
(``tasks_per_node x cpus_per_task``) and its GPUs, as torchrun's launchers are; each rank picks its GPU by its local
rank.

The agent tells the controller at once when one of its ranks ends (``rank 1 (pid N) was killed by SIGKILL``), over
the run's authenticated channel as ``<group>/node-<N>``; the controller turns that into the group's error as it does
for a local rank. Told ``kill``, it ends its ranks and answers ``idle``; told ``exit``, it ends them and returns
(the job then ends). Slurm's warning signals (SIGUSR2 before the time limit, SIGTERM on preemption) reach every
process of the job step, the ranks included, which report them; the agent only notes them. An agent whose
controller is gone for ``orphan_grace_s`` ends its ranks and returns, as a rank does.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from hybridflow.slurm.channel import Signer, WorkerConnection, read_secret
from hybridflow.slurm.forked import Bootstrap, ForkedJob, warm_up

logger = logging.getLogger(__name__)

KILL_WAIT_S = 10.0
"""How long an agent told ``kill`` waits for its ranks to end after SIGKILL before it answers (it says which did
not end)."""


@dataclass
class AgentBoot:
    """What a node agent needs to start (pickled into the allocation's job; plain values only).

    Attributes:
        group: the worker group's name (the agent is ``<group>/node-<N>`` on the channel).
        address: the allocation's channel at the controller, ``tcp://host:port``.
        secret_path: the allocation's channel secret.
        tasks_per_node / cpus_per_task: the node's ranks, and each one's CPUs.
        orphan_grace_s: how long the agent lives without its controller.
        vllm: the node's fork server imports vLLM's engine modules too (`hybridflow.slurm.forked.warm_up`).
    """

    group: str
    address: str
    secret_path: str
    tasks_per_node: int
    cpus_per_task: int
    orphan_grace_s: float = 10.0
    vllm: bool = False


def rank_environment(node: int, nodes: int, tasks_per_node: int, cpus_per_task: int) -> dict[int, dict[str, str]]:
    """The Slurm variables each rank of node `node` gets, by global rank: those of task ``node * tasks_per_node +
    local`` of a job of ``nodes x tasks_per_node`` tasks with `cpus_per_task` CPUs each (what submitit's
    `JobEnvironment` reads: ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``; and Slurm's own task layout)."""
    total = nodes * tasks_per_node
    layout = str(tasks_per_node) if nodes == 1 else f"{tasks_per_node}(x{nodes})"
    ranks = [node * tasks_per_node + local for local in range(tasks_per_node)]
    common = {
        "SLURM_NTASKS": str(total),
        "SLURM_NPROCS": str(total),
        "SLURM_STEP_NUM_TASKS": str(total),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_TASKS_PER_NODE": layout,
        "SLURM_STEP_TASKS_PER_NODE": layout,
        "SLURM_CPUS_PER_TASK": str(cpus_per_task),
        "SLURM_GTIDS": ",".join(map(str, ranks)),
    }
    return {rank: common | {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local)} for local, rank in enumerate(ranks)}


class _Launch:
    """One launch's ranks on this node, and the connection that reports their ends to the launching group."""

    def __init__(self, name: str, agent: AgentBoot, node: int, boot: Bootstrap, log_dir: str) -> None:
        nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
        env = rank_environment(node, nodes, agent.tasks_per_node, agent.cpus_per_task)
        self.job = ForkedJob(name, log_dir, env, boot)
        self.running = dict(self.job.pids)
        signer = Signer(read_secret(boot.secret_path))  # the session's secret: each session writes a new one
        self.report = WorkerConnection(boot.controller_address, f"{boot.group}/node-{node}", signer)
        logger.info("launch %s: forked ranks %s", name, self.running)

    def report_ends(self) -> None:
        """Tell the group about every rank that ended since the last call."""
        for rank in [r for r in self.running if self.job.end_of(r) is not None]:
            end = self.job.end_of(rank)
            pid = self.running.pop(rank)
            logger.info("rank %d (pid %d) %s", rank, pid, end)
            self.report.send({"type": "rank_ended", "rank": rank, "pid": pid, "end": end})

    def end(self, wait_s: float) -> list[int]:
        """SIGKILL the ranks still running, wait up to `wait_s` for their ends (reported); the ranks still running
        then."""
        self.job.kill()
        deadline = time.monotonic() + wait_s
        while self.running and time.monotonic() < deadline:
            self.report_ends()
            time.sleep(0.02)
        return sorted(self.running)

    def close(self) -> None:
        self.report.close(linger_ms=200)  # the group that launched them may be gone: do not wait a second for it


def serve_node(agent: AgentBoot) -> None:
    """Serve the controller's launches on this node until told to exit or orphaned (the function each task of a
    Slurm group's allocation runs)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    # Slurm signals every process of the step. The fork server (started below) inherits these two ignored across
    # its exec, and so outlives a warning: were it to die, its ranks would lose their parent, and with it their
    # place in the step (proctrack/linuxproc follows parents), and this agent their exit statuses. Each rank
    # installs its own handlers, which report the signal.
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    warm_up(vllm=agent.vllm)  # its import runs while the controller's launch is on its way
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, _note_signal)
    node, job_id = int(os.environ["SLURM_NODEID"]), os.environ["SLURM_JOB_ID"]
    conn = WorkerConnection(
        agent.address, f"{agent.group}/node-{node}", Signer(read_secret(agent.secret_path)), watched=True
    )
    conn.send({"type": "agent", "node": node, "host": os.environ.get("SLURMD_NODENAME", "")})
    launches = 0
    current: _Launch | None = None
    try:
        while True:
            message = conn.recv(0.05)
            kind = message.get("type") if message else None
            if kind in ("launch", "kill", "exit") and current is not None:
                left = current.end(KILL_WAIT_S)
                current.close()
                current = None
                if kind == "kill":
                    conn.send({"type": "idle", "node": node, "left": left})
            elif kind == "kill":
                conn.send({"type": "idle", "node": node, "left": []})
            if kind == "exit":
                return
            if kind == "launch":
                launches += 1
                name = job_id if launches == 1 else f"{job_id}.{launches}"
                current = _Launch(name, agent, node, Bootstrap(**message["boot"]), message["log_dir"])
            if current is not None:
                current.report_ends()
            if conn.lost_s() > agent.orphan_grace_s:
                logger.error("node %d lost its controller for %.0f s; exiting", node, agent.orphan_grace_s)
                return
    finally:
        if current is not None:
            current.end(KILL_WAIT_S)
            current.close()
        conn.close()


def _note_signal(signum: int, frame: Any) -> None:
    logger.info("received %s (so did the ranks, which report it)", signal.Signals(signum).name)
