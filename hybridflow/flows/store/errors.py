"""The run store's errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.flows.store.constants import LEASE_TTL_S
from hybridflow.flows.store.records import Run

if TYPE_CHECKING:
    pass


# --------------------------------------------------------------------------------------------------------- errors


class LeaseHeldError(RuntimeError):
    """Another controller holds the run's lease: it is training the run now (named by its host, pid, last heartbeat
    and Prefect flow run)."""

    def __init__(self, run: Run) -> None:
        self.host, self.pid, self.heartbeat_at = run.lease_host, run.lease_pid, run.heartbeat_at
        host, pid = self.host, self.pid
        beat = f"{run.heartbeat_at:%Y-%m-%d %H:%M:%S} UTC" if run.heartbeat_at else "never"
        flow = f", Prefect flow run {run.prefect_flow_run_id}" if run.prefect_flow_run_id else ""
        super().__init__(
            f"run {run.id} is being trained by another controller (host {host}, pid {pid}{flow}, last heartbeat "
            f"{beat}); wait for it to end or stop it (kill {pid} on {host}); a controller that died is taken over "
            f"(at once from its own host, else once its heartbeat is {LEASE_TTL_S:.0f} s old)"
        )


class LeaseLostError(RuntimeError):
    """This controller's lease on the run was taken over by another controller: it must stop writing the run."""


class RunStoreError(RuntimeError):
    """The store cannot be used: the database is unreachable, or its schema is newer than this code."""


class UnknownPlanError(KeyError):
    """No placement plan with this id in the store; ``str(err)`` suggests ``hf plans list``."""

    def __init__(self, plan_id: str, store_url: str | None = None) -> None:
        where = f" in the run store {store_url}" if store_url else ""
        super().__init__(f"unknown plan id {plan_id!r}{where}; list the known plans with `hf plans list`")

    def __str__(self) -> str:
        return str(self.args[0])


class UnknownRunError(KeyError):
    """No run with this id in the store. ``str(err)`` names the id and suggests ``hf runs list``."""

    def __init__(self, run_id: str, store_url: str | None = None) -> None:
        self.run_id = run_id
        where = f" in the run store {store_url}" if store_url else ""
        super().__init__(f"unknown run id {run_id!r}{where}; list the known runs with `hf runs list`")

    def __str__(self) -> str:  # KeyError's str() would repr() the message
        return str(self.args[0])
