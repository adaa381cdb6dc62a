"""A Slurm group's node agent: the one task of each node of the group's job, which forks that node's ranks.

A worker group on Slurm is one job of ``nodes`` tasks, one per node (submitit's function job; see
`hybridflow.slurm.worker_group`). Each task is this agent: a light process (it never imports torch or the engine)
that starts a fork server (`hybridflow.slurm.forked`, which imports the rank's modules once) and forks the node's
``tasks_per_node`` ranks from it. A group on N nodes therefore starts in the time of one import, where one process
per rank imported the same modules ``tasks_per_node`` times over on each node (the cores they share, the file
system they read: ~10 s of one core each).

Each rank sees what Slurm would have shown a task of its own: the job's environment with ``SLURM_PROCID``,
``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_CPUS_PER_TASK`` (its own CPUs) ... of a job of ``nodes x
tasks_per_node`` tasks, its working directory, and its output in ``<job>_<rank>_log.out`` / ``_log.err`` in the
group's log folder (the agent's own lines go to ``<job>_node<N>_log.err``). The job is allocated as one task per
node with all the node's CPUs of the group (``tasks_per_node x cpus_per_task``) and its GPUs, as torchrun's
launchers are; each rank picks its GPU by its local rank.

The agent tells the controller at once when one of its ranks ends (``rank 1 (pid N) was killed by SIGKILL``), over
the run's authenticated channel as ``<group>/node-<N>``; the controller turns that into the group's error as it
does for a local rank. Slurm's warning signals (SIGUSR2 before the time limit, SIGTERM on preemption) reach every
process of the job step, the ranks included, which report them; the agent only notes them. The agent returns when
its ranks have all ended (the job then ends), and kills any still running if it is itself stopped.
"""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing.connection import wait
from typing import Any

from hybridflow.slurm.channel import Signer, WorkerConnection, read_secret
from hybridflow.slurm.forked import Bootstrap, ForkedJob

logger = logging.getLogger(__name__)


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


def serve_node(boot: Bootstrap, tasks_per_node: int, cpus_per_task: int, log_dir: str) -> None:
    """Fork this node's ranks of the group and report each one's end to the controller until all have ended (the
    function each task of a Slurm group's job runs).

    Args:
        boot: the ranks' `Bootstrap`.
        tasks_per_node: ranks on this node.
        cpus_per_task: CPUs of each rank (the job's task holds ``tasks_per_node x cpus_per_task``).
        log_dir: the group's log folder.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    # Slurm signals every process of the step. The fork server (started below) inherits these two ignored across
    # its exec, and so outlives a warning: were it to die, its ranks would lose their parent, and with it their
    # place in the step (proctrack/linuxproc follows parents), and this agent their exit statuses. Each rank
    # installs its own handlers, which report the signal.
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    env = os.environ
    node, nodes, job_id = int(env["SLURM_NODEID"]), int(env["SLURM_JOB_NUM_NODES"]), env["SLURM_JOB_ID"]
    job = ForkedJob(job_id, log_dir, rank_environment(node, nodes, tasks_per_node, cpus_per_task), boot)
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, _note_signal)
    logger.info("node %d of job %s: forked ranks %s", node, job_id, job.pids)
    conn = WorkerConnection(boot.controller_address, f"{boot.group}/node-{node}", Signer(read_secret(boot.secret_path)))
    try:
        running = dict(job.processes)
        while running:
            wait([process.sentinel for process in running.values()])
            for rank in [r for r in running if job.end_of(r) is not None]:
                end = job.end_of(rank)
                logger.info("rank %d (pid %d) %s", rank, running.pop(rank).pid, end)
                conn.send({"type": "rank_ended", "rank": rank, "pid": job.pids[rank], "end": end})
    finally:
        job.kill()  # only what still runs: the agent was stopped (an exception here, or its job's end)
        conn.close()


def _note_signal(signum: int, frame: Any) -> None:
    logger.info("received %s (so did the ranks, which report it)", signal.Signals(signum).name)
