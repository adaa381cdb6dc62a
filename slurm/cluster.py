"""What the controller asks Slurm about a worker group's job: its state (``sacct``, real accounting), the state of
its nodes (``sinfo``), and cancelling it (``scancel``).

The worker group polls these every few seconds while it waits on the job, so a cancelled job, a node that went
down and a node an administrator (or a health check) drained each turn into an error within seconds, whatever
submitit's own (rate-limited) state cache says.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}
"""Job states in which the job may still run (or is running); any other state means it has ended."""

BAD_NODE_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "MAINT", "REBOOT", "POWER_DOWN", "POWERING_DOWN")
"""Node state words (``sinfo -o %T`` and its flags) after which a worker on the node is not to be trusted."""


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
    """The job's state word (``RUNNING``, ``CANCELLED``, ``NODE_FAIL``, ...) from ``sacct``; ``squeue`` for a job
    the accounting database does not know yet. ``UNKNOWN`` if neither lists it.

    Raises:
        SlurmCommandError: the commands fail (e.g. slurmdbd unreachable and slurmctld down).
    """
    out = _run(["sacct", "-X", "-n", "-P", "-o", "State", "-j", str(job_id)])
    lines = [line.split()[0] for line in out.splitlines() if line.strip()]
    if lines:
        return lines[-1]  # "CANCELLED by 0" -> "CANCELLED"
    out = _run(["squeue", "-h", "-o", "%T", "-j", str(job_id)])
    return out.split()[0] if out.split() else "UNKNOWN"


@dataclass(frozen=True)
class NodeState:
    """One node's state as ``sinfo`` prints it (``idle``, ``allocated``, ``draining``, ``down*``, ...) and the
    administrator's reason (empty when none)."""

    node: str
    state: str
    reason: str

    @property
    def bad(self) -> bool:
        """True when the node is down, drained or draining, failing, or not responding (``*`` suffix)."""
        upper = self.state.upper()
        return upper.endswith("*") or any(word in upper for word in BAD_NODE_STATES)


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


def cancel(job_id: str) -> None:
    """``scancel`` the job (no error if it has already ended)."""
    subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=20, check=False)
