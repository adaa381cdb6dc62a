"""A worker group's torch.distributed rendezvous, bounded in time and explained when it fails.

Rank 0 serves the rendezvous store (torch's `TCPStore`) on its own address (never every interface) and a port the
operating system picks free at bind time, and tells the controller where; the other ranks ask the controller for
that address and connect. Each rank then marks itself joined in the store, and rank 0 waits until every rank has.

Nothing here waits without bound: within ``placement.rendezvous_timeout_s`` seconds a rank that cannot reach rank
0's store (a firewall between the nodes, an address on a network the nodes do not share, an address that answers
nothing) raises `RendezvousError` naming its node, the address and port and the fix, and rank 0 raises naming the
ranks, and their nodes, that never joined. torch's own default is 30 minutes of silence (verl #3873, OpenRLHF #865:
idle devices and no error). The rank reports the error to the controller, which ends the group's start with it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

JOINED_KEY = "hybridflow/joined/{rank}"
"""The store key a rank sets once it has joined (its value: the rank's node)."""

AFTER_JOINING = timedelta(minutes=5)
"""The store's timeout once every rank has joined: its later waits (NCCL's communicators of a new group, made at
their first collective) may rightly wait for a rank still busy, e.g. loading a large checkpoint."""


class RendezvousError(RuntimeError):
    """A rank could not join its group's rendezvous within the time limit (the message says which, where, why)."""


def listen(address: str, world_size: int) -> tuple[int, int]:
    """A listening socket bound to `address` only (torch's own store server would listen on every interface) on a
    free port. Returns (its file descriptor, which the store's server then owns; the port)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind((address, 0))
    server.listen(max(128, world_size))
    port = server.getsockname()[1]
    return server.detach(), port


def ask_controller(conn: Any, timeout_s: float) -> tuple[str, int]:
    """Rank 0's store address from the controller over `conn` (a `WorkerConnection`), as (host address, port).

    Raises:
        RendezvousError: the controller did not say within `timeout_s` seconds (rank 0 never started, or failed).
    """
    conn.send({"type": "rendezvous"})
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        message = conn.recv(remaining)
        if message is not None and message.get("type") == "rendezvous":
            return str(message["address"]), int(message["port"])
    raise RendezvousError(
        f"{conn.identity}: the controller did not say where rank 0's rendezvous store is within {timeout_s:.0f} s "
        "(placement.rendezvous_timeout_s): rank 0 did not start; its log says why"
    )


def join(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    node_of: Callable[[int], str],
    timeout_s: float,
    listen_fd: int | None = None,
) -> Any:
    """Connect rank `rank` of `world_size` to the store at `address`:`port` (rank 0 serves it on `listen_fd`, from
    `listen`), mark it joined, and on rank 0 wait until every rank has. Returns the `torch.distributed.TCPStore`,
    ready for ``init_process_group(store=...)``, its later operations timing out after `AFTER_JOINING` (or
    `timeout_s` if longer).

    `node_of(r)` names the node of rank r (for the messages).

    Raises:
        RendezvousError: this rank (not 0) reached no store at `address`:`port` within `timeout_s` seconds; or, on
            rank 0, some ranks did not join within `timeout_s` seconds (plus a quarter of it, at most 10 s, so that
            such a rank's own error, which says why, usually arrives first).
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    where = f"rank {rank} on node {node_of(rank)}"
    try:
        store = dist.TCPStore(
            address, port, world_size, rank == 0, timeout=timeout, master_listen_fd=listen_fd, wait_for_workers=False
        )
    except RuntimeError as e:  # torch's DistNetworkError, DistStoreError: it timed out connecting
        raise RendezvousError(
            f"{where} could not reach rank 0's rendezvous store at {address}:{port} (node {node_of(0)}) within "
            f"{timeout_s:.0f} s (placement.rendezvous_timeout_s): {_first_line(e)}. The nodes must reach each other "
            "by TCP on any port (ask your admins to open the cluster's internal network between the nodes); if "
            f"{address} is not on the network the nodes share, set placement.slurm.interface to that network's "
            "interface (e.g. ib0, eth1: `ip -4 addr` on a node lists them)"
        ) from None
    store.set(JOINED_KEY.format(rank=rank), node_of(rank))
    if rank == 0:
        _wait_for_everyone(store, world_size, node_of, timeout_s, f"{address}:{port}")
    store.set_timeout(max(timeout, AFTER_JOINING))
    return store


def _wait_for_everyone(
    store: Any, world_size: int, node_of: Callable[[int], str], timeout_s: float, served_at: str
) -> None:
    keys = [JOINED_KEY.format(rank=r) for r in range(world_size)]
    deadline = time.monotonic() + timeout_s + min(10.0, timeout_s / 4)
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            nodes = sorted({node_of(r) for r in missing})
            raise RendezvousError(
                f"rank 0 on node {node_of(0)}: ranks {missing} (node{'s' if len(nodes) > 1 else ''} "
                f"{', '.join(nodes)}) did not join the rendezvous at {served_at} within {timeout_s:.0f} s "
                "(placement.rendezvous_timeout_s): they could not reach this address (their logs say so: a "
                "firewall between the nodes, or placement.slurm.interface), or are stuck before joining"
            )
        time.sleep(0.05)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")
