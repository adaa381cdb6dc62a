"""Which address a worker group's sockets listen on: closed by default.

A local group (every rank on this machine) listens on the loopback interface only: the controller's channel, the
torch.distributed rendezvous store and gloo's connections. A Slurm group listens on the node's cluster interface:
the one named by ``placement.slurm.interface`` (e.g. ``ib0``), else the address the node's host name resolves to
(the name Slurm knows the node by), never on every interface.
"""

from __future__ import annotations

import socket

LOOPBACK = "lo"


def interface_address(interface: str) -> str:
    """The IPv4 address of network interface `interface` (``lo`` -> ``127.0.0.1``).

    Raises:
        ValueError: there is no such interface, or it has no IPv4 address (the message lists the interfaces that
            have one: fix ``placement.slurm.interface``).
    """
    if interface == LOOPBACK:
        return "127.0.0.1"
    import psutil

    addresses = {
        name: [a.address for a in addrs if a.family == socket.AF_INET] for name, addrs in psutil.net_if_addrs().items()
    }
    if not addresses.get(interface):
        usable = ", ".join(f"{n} ({a[0]})" for n, a in sorted(addresses.items()) if a) or "none"
        raise ValueError(
            f"network interface {interface!r} has no IPv4 address on {socket.gethostname()}; set "
            f"placement.slurm.interface to one of: {usable} (or remove it to use the host name's address)"
        )
    return addresses[interface][0]


def route_address(host: str) -> str:
    """The local IPv4 address this machine uses to reach `host` (no packet is sent): on a cluster node, its address
    on the network it shares with `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]


def node_address(controller_host: str, interface: str | None = None) -> str:
    """The address a Slurm rank on this node listens on and is reached at by the ranks of other nodes:
    `interface`'s (`interface_address`), else this node's route to `controller_host` (`route_address`). Where that
    route is loopback, the cluster is this machine (the development cluster, whose nodes are host names of their
    own in the loopback range: ``hybridflow/slurm/dev_cluster.sh``), and the node's address is the one its host name
    resolves to.

    Raises:
        ValueError: `interface` has no IPv4 address here (`interface_address`).
    """
    if interface is not None:
        return interface_address(interface)
    route = route_address(controller_host)
    return socket.gethostbyname(socket.gethostname()) if route.startswith("127.") else route


def host_address(interface: str | None = None) -> str:
    """The address this host listens on for a Slurm group: `interface`'s (`interface_address`), else the address
    its host name resolves to."""
    if interface is not None:
        return interface_address(interface)
    return socket.gethostbyname(socket.gethostname())


def interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 `address` (for ``GLOO_SOCKET_IFNAME``), or None if none does."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def free_port() -> int:
    """A port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
