"""The worker process: one rank of a worker group, forked by `hybridflow.slurm.forked`'s fork server (on this machine
for a local group, by `hybridflow.slurm.node_agent` on each node of a Slurm group's job).

`serve` runs in every task of the group's job: it joins torch.distributed (gloo on CPU, NCCL on GPU) with the
group's other ranks, builds the worker class, says hello to the controller (its rank, pid, host and the methods
it serves), then executes calls until told to shut down; between calls, a worker class with a ``background_step``
method (called until it returns False, the next call taken between two of them) keeps working, as a streaming
rollout's engine keeps generating while the controller runs other stages. A background thread sends heartbeats on a
second socket, so the controller can tell a dead or stopped rank from a slow one.

Slurm's warning signals (SIGUSR2 ``signal_delay_s`` before the time limit, SIGTERM on preemption or ``scancel``) do
not stop a rank: it records the signal and reports it in its heartbeats, and the controller checkpoints at the next
stage boundary and stops the run (``hf resume`` continues it). SIGKILL follows SIGTERM after Slurm's ``KillWait``.

Arguments and results are JSON; a batch argument arrives as a `DataHandle` (the rank reads its rows itself), and a
batch result is written as a part file in the run's data folder and returned as its description.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import submitit

from hybridflow.engine.fast_exit import exit_process
from hybridflow.engine.imports import load_object
from hybridflow.engine.rollout.broadcast import HOST_ADDRESS_ENV
from hybridflow.engine.transfer import TransferProtocol, registered_methods
from hybridflow.slurm import network, rendezvous
from hybridflow.slurm.channel import Signer, WorkerConnection, read_secret
from hybridflow.slurm.dispatch import rank_result, rank_share
from hybridflow.slurm.forked import Bootstrap
from hybridflow.slurm.handles import DataHandle, write_part

logger = logging.getLogger(__name__)

HANDLE_KEY = "__handle__"


def decode_args(obj: Any) -> Any:
    """JSON -> Python, turning ``{"__handle__": {...}}`` into `DataHandle` objects (recursively)."""
    if isinstance(obj, dict):
        if set(obj) == {HANDLE_KEY}:
            return DataHandle.from_json(obj[HANDLE_KEY])
        return {k: decode_args(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_args(v) for v in obj]
    return obj


def encode_args(obj: Any) -> Any:
    """Python -> JSON, turning `DataHandle` objects into ``{"__handle__": {...}}`` (recursively)."""
    if isinstance(obj, DataHandle):
        return {HANDLE_KEY: obj.to_json()}
    if isinstance(obj, dict):
        return {k: encode_args(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [encode_args(v) for v in obj]
    return obj


class _SignalNotice:
    """The warning signals this rank received (set by the signal handler, read by the heartbeat thread)."""

    def __init__(self) -> None:
        self.received: list[str] = []

    def install(self) -> None:
        """Replace submitit's handlers (which requeue or raise inside the running call) with recording ones."""
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if name not in self.received:  # first: a failing log write below must not lose the signal
            self.received.append(name)
        logger.warning("received %s: the controller will checkpoint at the next stage boundary", name)


def _heartbeats(
    address: str,
    identity: str,
    signer: Signer,
    interval: float,
    stop: threading.Event,
    orphan_grace_s: float,
    notice: _SignalNotice,
) -> None:
    """Beat every `interval` seconds (with the warning signals received so far); exit the process if the
    controller's connection stays lost for `orphan_grace_s` (the controller died: nobody will call or shut down
    this rank)."""
    conn = WorkerConnection(address, identity, signer, watched=True)
    try:
        while not stop.wait(interval):
            conn.send({"type": "heartbeat", "signals": list(notice.received)})
            if conn.lost_s() > orphan_grace_s:
                logger.error("%s lost its controller for %.0f s; exiting", identity, orphan_grace_s)
                os._exit(3)
    finally:
        conn.close()


def _init_distributed(boot: Bootstrap, controller_host: str, conn: WorkerConnection) -> tuple[int, int, str]:
    """Join the group's torch.distributed world and pick this rank's GPU on GPU nodes. Returns (rank, world size,
    job id).

    The rendezvous (`hybridflow.slurm.rendezvous`): rank 0 serves the store on a port the operating system picks
    free at bind time and tells the controller where (a ``rendezvous`` message on `conn`); the other ranks ask the
    controller for that address. A port fixed in advance (submitit's, drawn from the job id) can already be held by
    any other socket on the node. Every wait is bounded by ``boot.rendezvous_timeout_s``.

    Nothing listens on every interface (`hybridflow.slurm.network`): the store is bound to rank 0's address, which
    the other ranks connect to (127.0.0.1 for a local group; on Slurm `network.node_address`: the address of
    ``placement.slurm.interface``, else of rank 0's node on its route to the controller), and gloo's and NCCL's
    connections use that address's interface (``lo`` locally).

    Raises:
        RendezvousError: the controller did not say where rank 0's store is, this rank could not reach it, or (rank
            0) some ranks did not join, within ``boot.rendezvous_timeout_s`` seconds.
        ValueError: ``placement.slurm.interface`` has no IPv4 address on this node.
    """
    import torch
    import torch.distributed as dist

    env = submitit.JobEnvironment()
    if boot.backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    # this rank's address (`network.node_address`): its listeners (the store, the weight broadcast's) bind it, and
    # gloo's and NCCL's connections use its interface; with none (an address of the development cluster's nodes in
    # the loopback range, not 127.0.0.1), gloo binds the address the host name resolves to, the same one
    interface = boot.interface
    own = "127.0.0.1" if interface == network.LOOPBACK else network.node_address(controller_host, interface)
    nic = interface or network.interface_of(own)
    if nic:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", nic)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", nic)
    os.environ[HOST_ADDRESS_ENV] = own
    if env.num_tasks > 1:
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(key, None)  # inherited from the controller's environment (e.g. set by vLLM there)
        timeout_s = boot.rendezvous_timeout_s
        if env.global_rank == 0:
            address = own
            listen_fd, port = rendezvous.listen(own, env.num_tasks)
            conn.send({"type": "rendezvous", "address": own, "port": port})
        else:
            listen_fd = None
            address, port = rendezvous.ask_controller(conn, timeout_s)
        store = rendezvous.join(
            address, port, env.global_rank, env.num_tasks, _node_of(env), timeout_s, listen_fd=listen_fd
        )
        dist.init_process_group(boot.backend, store=store, rank=env.global_rank, world_size=env.num_tasks)
    return env.global_rank, env.num_tasks, str(env.job_id)


def _node_of(env: submitit.JobEnvironment) -> Callable[[int], str]:
    """Rank -> the name of its node: the job's node list in Slurm's block order (a node's ranks are consecutive, as
    `hybridflow.slurm.node_agent` numbers them); this host's name for a local group."""
    hosts = (list(env.hostnames) if env.num_nodes > 1 else []) or [socket.gethostname()]
    per_node = max(1, env.num_tasks // len(hosts))
    return lambda rank: hosts[min(rank // per_node, len(hosts) - 1)]


def serve(boot: Bootstrap) -> None:
    """Run one rank until the controller sends ``shutdown`` (the function each rank's process executes)."""
    os.umask(0o077)  # checkpoint parts, batch files and logs: the run owner's only
    os.environ.update(boot.env)
    # INFO lines to the rank's log file (<job>_<rank>_log.err), which the controller forwards to the flow's logs
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    notice = _SignalNotice()
    notice.install()
    controller_host = boot.controller_address.removeprefix("tcp://").rsplit(":", 1)[0]
    rank = submitit.JobEnvironment().global_rank
    signer = Signer(read_secret(boot.secret_path))
    identity = f"{boot.group}/rank-{rank}"
    stop = threading.Event()
    beat = threading.Thread(
        target=_heartbeats,
        args=(
            boot.controller_address,
            f"{identity}/hb",
            signer,
            boot.heartbeat_interval_s,
            stop,
            boot.orphan_grace_s,
            notice,
        ),
        daemon=True,
    )
    beat.start()
    conn = WorkerConnection(boot.controller_address, identity, signer)
    try:
        started = time.perf_counter()
        rank, world_size, job_id = _init_distributed(boot, controller_host, conn)
        joined = time.perf_counter()
        cls = load_object(boot.worker_cls, f"worker class of group {boot.group!r}")
        methods = registered_methods(cls)
        worker = cls(rank=rank, world_size=world_size, data_dir=boot.data_dir, **boot.worker_kwargs)
        logger.info(
            "rank %d ready: torch.distributed joined in %.2f s, %s built in %.2f s",
            rank,
            joined - started,
            cls.__name__,
            time.perf_counter() - joined,
        )
        conn.send(
            {
                "type": "hello",
                "rank": rank,
                "world_size": world_size,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "node": os.environ.get("SLURMD_NODENAME", ""),  # Slurm's name for the node (empty when local)
                "job_id": job_id,
                "methods": {name: protocol.mode.value for name, protocol in methods.items()},
            }
        )
        _loop(conn, worker, methods, boot, rank, world_size)
    except Exception:
        conn.send({"type": "fatal", "rank": rank, "traceback": traceback.format_exc()})
        raise
    finally:
        stop.set()
        conn.close()
        _shutdown_distributed()
    # told to shut down, everything closed: end now rather than in the interpreter's 2 s teardown of torch's
    # modules, which the controller would wait for (no result is read back from a rank's job: it exits 0)
    exit_process(0)


def _loop(
    conn: WorkerConnection,
    worker: Any,
    methods: dict[str, TransferProtocol],
    boot: Bootstrap,
    rank: int,
    world_size: int,
) -> None:
    background = getattr(worker, "background_step", None)
    before_call = getattr(worker, "before_call", None)
    while True:
        # between calls a worker with background work (a streaming rollout's engine) does one step of it at a time,
        # and looks for the next call after each
        busy = background is not None and background()
        message = conn.recv(0 if busy else None)
        if message is None:
            continue
        if message.get("type") == "shutdown":
            return
        if message.get("type") != "call":
            continue
        call_id, name = message["id"], message["method"]
        if before_call is not None:  # the background work stops for the call (an engine block's ranks together)
            before_call()
        try:
            if name not in methods:
                raise AttributeError(
                    f"{type(worker).__name__}.{name} is not a registered method; registered: {sorted(methods)}"
                )
            args, kwargs = decode_args(message["args"]), decode_args(message["kwargs"])
            args, dp_rank, collect = rank_share(methods[name], worker, rank, world_size, args)
            started = time.perf_counter()
            result = getattr(worker, name)(*args, **kwargs)
            logger.info("rank %d: %s done in %.2f s", rank, name, time.perf_counter() - started)
            result = rank_result(
                result, dp_rank, collect, lambda out, stage=name: write_part(out, boot.data_dir, stage, rank)
            )
            conn.send({"type": "result", "id": call_id, "rank": rank, "result": encode_args(result)})
        except Exception:
            conn.send({"type": "error", "id": call_id, "rank": rank, "traceback": traceback.format_exc()})


def _shutdown_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
