"""What the controller asks Slurm about a worker group's job: its state (``squeue`` while slurmctld lists it, then
``sacct``, the accounting record), why it waits in the queue, the state of its nodes (``sinfo``), and cancelling it
(``scancel``).

The worker group polls these every few seconds while it waits on the job, so a cancelled job, a node that went
down and a node an administrator (or a health check such as NHC, on a hardware fault) drained each turn into an
error within seconds, whatever submitit's own (rate-limited) state cache says.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "SIGNALING"}
"""Job states in which the job may still run (or is running); any other state means it has ended (``COMPLETING``:
ended, its processes being killed and cleaned up). ``SIGNALING``: a running job being sent a signal, e.g. the
time-limit warning (``--signal``), seen for a moment; taken for an end it turned the warning into a lost group."""

BAD_NODE_STATES = ("DOWN", "DRAIN", "FAIL")
"""Node state words (``sinfo -o %T``: ``down``, ``drained``, ``draining``, ``fail``, ``failing``) after which a
worker on the node is not to be trusted. A node that merely misses a ping (``*`` suffix) is left to the heartbeats
and to Slurm, which sets it DOWN after ``SlurmdTimeout``."""


class SlurmCommandError(RuntimeError):
    """A Slurm command failed or is missing (the message has its output)."""


def _run(args: list[str], timeout_s: float = 20.0) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise SlurmCommandError(f"{args[0]} not found: is this a Slurm login node (slurm-client installed)?") from None
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(f"{' '.join(args)} did not answer within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise SlurmCommandError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def job_state(job_id: str) -> str:
    """The job's state word (``RUNNING``, ``PENDING``, ``CANCELLED``, ``NODE_FAIL``, ...): from ``squeue`` (the
    controller, cheap) while it lists the job, else from ``sacct`` (the accounting record of an ended job).
    ``UNKNOWN`` if neither knows it.

    Raises:
        SlurmCommandError: both commands fail (slurmctld and slurmdbd unreachable).
    """
    live = ""
    try:
        out = _run(["squeue", "-h", "-o", "%T", "-j", str(job_id)])
        live = out.split()[0] if out.split() else ""
    except SlurmCommandError:  # an ended job is unknown to squeue on some versions ("Invalid job id")
        pass
    if live and live != "COMPLETING":
        return live
    # ended (or ending: COMPLETING): the accounting record says how (CANCELLED, FAILED, NODE_FAIL, TIMEOUT, ...)
    out = _run(["sacct", "-X", "-n", "-P", "-o", "State", "-j", str(job_id)])
    lines = [line.split()[0] for line in out.splitlines() if line.strip()]
    return lines[-1] if lines else (live or "UNKNOWN")  # "CANCELLED by 0" -> "CANCELLED"


def pending_reason(job_id: str) -> str:
    """Why a pending job waits, as ``squeue -o %r`` says it (``Priority``, ``Resources``, ``ReqNodeNotAvail,
    UnavailableNodes:node3``, ``BeginTime``, ...); ``""`` when squeue does not list the job or gives no reason.

    Raises:
        SlurmCommandError: squeue fails (slurmctld unreachable)."""
    out = _run(["squeue", "-h", "-o", "%r", "-j", str(job_id)]).strip()
    return "" if out in ("", "None") else out


def job_fields(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields of the job (``Reason``, ``NodeList``, ``BatchHost``, ``ExitCode``, ...), while
    slurmctld still holds it (``MinJobAge``, 300 s by default, after it ends); ``{}`` when it does not or scontrol
    fails: a caller only explains more with them."""
    try:
        out = _run(["scontrol", "show", "job", "-o", str(job_id)])
    except SlurmCommandError:
        return {}
    return dict(word.split("=", 1) for word in out.split() if "=" in word)


def job_nodes(job_id: str) -> list[str]:
    """The job's nodes in Slurm's order (node 0 first: ``SLURM_NODEID``), expanded from its ``NodeList``
    (``hf-node[1-2]``); ``[]`` when slurmctld does not hold the job or scontrol fails."""
    node_list = job_fields(job_id).get("NodeList", "")
    if not node_list or node_list == "(null)":
        return []
    try:
        return _run(["scontrol", "show", "hostnames", node_list]).split()
    except SlurmCommandError:
        return []


@dataclass(frozen=True)
class NodeState:
    """One node's state as ``sinfo`` prints it (``idle``, ``allocated``, ``draining``, ``down*``, ...) and the
    administrator's reason (empty when none)."""

    node: str
    state: str
    reason: str

    @property
    def said(self) -> str:
        """Its state and the reason, as a message says them: ``down (reason: lost)``."""
        return f"{self.state} (reason: {self.reason})" if self.reason else self.state

    @property
    def bad(self) -> bool:
        """True when the node is down, drained or draining, or failing (see `BAD_NODE_STATES`)."""
        upper = self.state.upper()
        return any(word in upper for word in BAD_NODE_STATES)


def node_states(nodes: list[str]) -> list[NodeState]:
    """The state of each named node (``sinfo -N``). Raises SlurmCommandError when sinfo fails."""
    if not nodes:
        return []
    out = _run(["sinfo", "-h", "-N", "-n", ",".join(sorted(set(nodes))), "-o", "%N|%T|%E"])
    seen: dict[str, NodeState] = {}
    for line in out.splitlines():
        node, state, reason = (line.split("|", 2) + ["", ""])[:3]
        if node:
            seen[node] = NodeState(node, state, "" if reason == "none" else reason)
    return list(seen.values())


def cancel(job_id: str) -> bool:
    """``scancel`` the job (an ended job is not an error). Returns False, with a warning logged, when scancel is
    missing, fails or hangs: the caller goes on cleaning up."""
    try:
        done = subprocess.run(["scancel", str(job_id)], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("scancel %s failed: %s", job_id, e)
        return False
    if done.returncode != 0:
        logger.warning("scancel %s failed: %s", job_id, done.stderr.strip())
    return done.returncode == 0


def partitions() -> dict[str, int]:
    """The cluster's partitions and how many nodes each has (``sinfo -h -o "%P %D"``, summed over its node
    states), in sinfo's order; the default partition's name ends in ``*``, as sinfo prints it.

    Raises:
        SlurmCommandError: sinfo is missing or fails (no Slurm here, or slurmctld does not answer)."""
    found: dict[str, int] = {}
    for line in _run(["sinfo", "-h", "-o", "%P %D"]).splitlines():
        name, _, count = line.strip().partition(" ")
        if name:
            found[name] = found.get(name, 0) + int(count)
    return found
