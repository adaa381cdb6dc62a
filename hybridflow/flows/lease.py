"""One controller per run: the run lease a controller holds in the run store while it trains the run.

The controller takes the lease before it touches anything of the run (`RunStore.acquire_lease`: refused while
another controller's lease is live, a crashed one's is taken over) and renews it from a background thread every
`LEASE_RENEW_S` seconds. Should another controller take the run over (this one was stalled for longer than
`LEASE_TTL_S`, e.g. a suspended laptop), the renewal fails and `check` raises at the next stage boundary, before this
controller writes a checkpoint or any other record. The lease is released when the flow ends, however it ends.
"""

from __future__ import annotations

import logging
import secrets
import threading

from hybridflow.flows.store.run_store import LEASE_RENEW_S, LeaseLostError, Run, RunStore, controller_state

logger = logging.getLogger(__name__)

_controller_pid: int | None = None


def record_controller_pid(pid: int) -> None:
    """Record `pid`, not this process's, as the controller's in the leases this process takes: the ``hf`` process
    of a warm-started command (`hybridflow.cli.warm_start`), which the user sees and signals, and whose death ends
    this one."""
    global _controller_pid
    _controller_pid = pid


class RunLease:
    """This process's lease on one run (see the module docstring).

    Args:
        store: the run store.
        run_id: the run.
        renew_s: seconds between heartbeats (default `LEASE_RENEW_S`).
    """

    def __init__(self, store: RunStore, run_id: str, renew_s: float = LEASE_RENEW_S) -> None:
        self.store, self.run_id, self.renew_s = store, run_id, renew_s
        self.token = secrets.token_hex(16)
        self.taken_over: Run | None = None  # the run as recorded before, when this lease replaced a crashed one
        self._lost: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> RunLease:
        """Take the lease and start renewing it.

        Raises:
            LeaseHeldError: another controller is training the run (names its host and pid).
        """
        before = self.store.acquire_lease(self.run_id, self.token, pid=_controller_pid)
        if controller_state(before) == "crashed":
            self.taken_over = before
            beat = f"{before.heartbeat_at:%Y-%m-%d %H:%M:%S} UTC" if before.heartbeat_at else "never"
            logger.warning(
                "run %s: its controller (host %s, pid %s) crashed (last heartbeat %s); this one takes over",
                self.run_id,
                before.lease_host,
                before.lease_pid,
                beat,
            )
        self._thread = threading.Thread(target=self._renew, name=f"lease-{self.run_id}", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                self.store.renew_lease(self.run_id, self.token)
            except LeaseLostError as e:
                self._lost = e
                return
            except Exception as e:  # the store is unreachable for a moment: try again at the next beat
                logger.warning("renewing the lease on run %s failed (%s); retrying", self.run_id, e)

    def check(self) -> None:
        """Raise LeaseLostError if another controller has taken the run over (call it before writing)."""
        if self._lost is not None:
            raise LeaseLostError(f"{self._lost}: this controller stops without writing anything more")

    @property
    def lost(self) -> bool:
        """Whether another controller took the run over."""
        return self._lost is not None

    def release(self) -> None:
        """Stop renewing and give the lease up (unless it was lost: then it is the other controller's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lost is None:
            self.store.release_lease(self.run_id, self.token)
