"""Weights broadcast by torch.distributed from the actor's rank 0 to every rank of a rollout pool of its own
(``rollout.checkpoint_engine.backend: gloo``): no file and no shared folder, so the pools may sit on any nodes that
reach each other over TCP.

The two pools are separate worker groups, each with a default process group of its own; the broadcast runs over a
third group of 1 + R ranks (the actor's rank 0 as rank 0, rollout rank r as rank r + 1) that rendezvous on a
TCPStore the actor's rank 0 serves on a free port of its address on the cluster's network (`HOST_ADDRESS_ENV`;
nothing listens on every interface). One push is, in broadcast order: the header's length
(int64 [1]) and the header (JSON bytes, uint8: the version, the weights' dtype, each tensor's name, shape, bucket
and byte offset, each bucket's size), the probe log-probabilities (float32 [V],
`hybridflow.engine.rollout.published.actor_probe_log_probs`), then each bucket (uint8, at most
``rollout.checkpoint_engine.update_weights_bucket_megabytes``; a larger tensor goes alone). The receiving rank
streams a bucket's tensors into its engine before the next bucket arrives, so it holds one bucket at a time.

The actor's side sends from a thread: `WeightSender.send` copies the weights into buckets and returns, so the actor
trains on while the rollout's load waits its turn behind generations (``trainer.mode: one_step_off | async``).
Pushes are sent in the order they are made and must be received in that order (`WeightReceiver.receive` checks
the version).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

HOST_ADDRESS_ENV = "HYBRIDFLOW_HOST_ADDRESS"
"""The environment variable a worker rank finds its listening address in (set by `hybridflow.slurm.rank`: 127.0.0.1
for a local group, on Slurm its address on the network gloo uses); 127.0.0.1 where unset."""

TIMEOUT = timedelta(hours=2)
"""How long one broadcast waits for every rank: a load queued behind generations may start long after its push."""

_ALIGN = 64  # bytes: every tensor starts at a multiple, so a bucket's slice views as any dtype


@dataclass
class _Push:
    """One version's weights, packed: the header (JSON bytes), the probe float32 [V], the buckets uint8, and the
    weights' bytes (alignment left out)."""

    version: int
    header: bytes
    probe: torch.Tensor
    buckets: list[torch.Tensor]
    weight_bytes: int


def _group(store: dist.Store, rank: int, world: int, timeout: timedelta) -> dist.ProcessGroup:
    """The gloo group of the actor's rank 0 and the rollout's ranks (blocks until all `world` ranks join)."""
    return dist.ProcessGroupGloo(dist.PrefixStore("hybridflow-weights", store), rank, world, timeout)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` in place from the group's rank 0."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def pack(
    tensors: Iterable[tuple[str, torch.Tensor]],
    probe: torch.Tensor,
    version: int,
    dtype: torch.dtype,
    bucket_bytes: int,
) -> _Push:
    """Copy (name, tensor) pairs, cast to `dtype`, into buckets of at most `bucket_bytes` bytes (a larger tensor in
    a bucket of its own), each tensor at a 64-byte-aligned offset, and describe them in a header."""
    pairs = list(tensors)
    element = torch.empty((), dtype=dtype).element_size()
    entries: list[dict[str, Any]] = []
    sizes: list[int] = []
    for name, tensor in pairs:
        nbytes = tensor.numel() * element
        start = -(-sizes[-1] // _ALIGN) * _ALIGN if sizes else 0
        if not sizes or start + nbytes > bucket_bytes:
            sizes.append(0)
            start = 0
        sizes[-1] = start + nbytes
        entries.append({"name": name, "shape": list(tensor.shape), "bucket": len(sizes) - 1, "offset": start})
    buckets = [torch.empty(size, dtype=torch.uint8) for size in sizes]
    for entry, (_, tensor) in zip(entries, pairs, strict=True):
        nbytes = tensor.numel() * element
        view = buckets[entry["bucket"]][entry["offset"] : entry["offset"] + nbytes].view(dtype)
        view.view(tensor.shape).copy_(tensor.detach())
    weight_bytes = sum(tensor.numel() * element for _, tensor in pairs)
    header = {
        "version": version,
        "bytes": weight_bytes,
        "dtype": str(dtype).removeprefix("torch."),
        "tensors": entries,
        "buckets": sizes,
        "probe": probe.numel(),
    }
    return _Push(version, json.dumps(header).encode(), probe.float().contiguous(), buckets, weight_bytes)


class WeightSender:
    """The actor's rank 0 end: serves the rendezvous and broadcasts each push from a thread, in order.

    Args:
        receivers: the rollout pool's ranks (its world size).
        bucket_bytes: the most bytes one bucket carries.
        timeout: how long a broadcast waits for the rollout's ranks.
    """

    def __init__(self, receivers: int, bucket_bytes: int, timeout: timedelta = TIMEOUT) -> None:
        host = os.environ.get(HOST_ADDRESS_ENV, "127.0.0.1")
        world = receivers + 1
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # bound to that address only, not every interface
        server.bind((host, 0))
        server.listen(max(128, world))
        port = server.getsockname()[1]
        self._store = dist.TCPStore(
            host, port, world, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=server.detach()
        )
        self.address = {"host": host, "port": port, "world": world}
        self._bucket_bytes = bucket_bytes
        self._timeout = timeout
        self._pushes: queue.Queue[_Push] = queue.Queue()
        self._failure: BaseException | None = None
        threading.Thread(target=self._serve, name="hybridflow-weight-sender", daemon=True).start()

    def send(
        self, tensors: Iterable[tuple[str, torch.Tensor]], probe: torch.Tensor, version: int, dtype: torch.dtype
    ) -> dict[str, Any]:
        """Pack the weights (a copy: the caller may update its model at once) and queue their broadcast.

        Returns:
            The handle the rollout's ranks receive with: ``{"host", "port", "world", "version", "bytes"}`` (bytes:
            the weights', the probe left out).

        Raises:
            RuntimeError: an earlier broadcast failed (the rollout's ranks gone or out of step); the run resumes
            from its last checkpoint with fresh groups.
        """
        if self._failure is not None:
            raise RuntimeError(
                f"the weight broadcast to the rollout pool failed ({self._failure}); resume the run (hf resume)"
            ) from self._failure
        push = pack(tensors, probe, version, dtype, self._bucket_bytes)
        self._pushes.put(push)
        return {**self.address, "version": version, "bytes": push.weight_bytes}

    def _serve(self) -> None:
        """The sending thread: join the group (when the rollout's ranks first receive), then broadcast each push."""
        try:
            group = _group(self._store, 0, self.address["world"], self._timeout)
            while True:
                push = self._pushes.get()
                started = time.perf_counter()
                _broadcast(group, torch.tensor([len(push.header)], dtype=torch.int64))
                _broadcast(group, torch.frombuffer(bytearray(push.header), dtype=torch.uint8))
                _broadcast(group, push.probe)
                for bucket in push.buckets:
                    _broadcast(group, bucket)
                logger.info(
                    "weights v%d sent by gloo broadcast: %.1f MB in %d bucket(s), %.2f s",
                    push.version,
                    push.weight_bytes / 1e6,
                    len(push.buckets),
                    time.perf_counter() - started,
                )
        except BaseException as error:  # noqa: BLE001 - the next send raises it in the actor's call
            self._failure = error


class WeightReceiver:
    """A rollout rank's end of the group `address` names (a `WeightSender.send` handle).

    Args:
        address: ``{"host", "port", "world"}`` of the sender.
        rank: this rank in the rollout's pool (its rank in the group is rank + 1).
        timeout: how long a broadcast waits.
    """

    def __init__(self, address: dict[str, Any], rank: int, timeout: timedelta = TIMEOUT) -> None:
        self.address = (address["host"], address["port"])
        self.rank = rank
        store = dist.TCPStore(address["host"], address["port"], address["world"], is_master=False, timeout=timeout)
        self._group = _group(store, rank + 1, address["world"], timeout)

    def receive(self, version: int) -> tuple[Iterator[tuple[str, torch.Tensor]], torch.Tensor]:
        """The next push: its weights as (name, tensor) pairs, one bucket received at a time as they are read, and
        its probe log-probabilities float32 [V]. Read every pair (a reader that stops early has the rest received
        and dropped, so the next push stays in step).

        Raises:
            RuntimeError: the push is not version `version` (pushes and loads out of order).
        """
        length = torch.zeros(1, dtype=torch.int64)
        _broadcast(self._group, length)
        raw = torch.empty(int(length.item()), dtype=torch.uint8)
        _broadcast(self._group, raw)
        header = json.loads(raw.numpy().tobytes())
        probe = torch.empty(header["probe"], dtype=torch.float32)
        _broadcast(self._group, probe)
        if header["version"] != version:
            raise RuntimeError(
                f"received weights v{header['version']} where v{version} was due: every push must be loaded, in "
                "the order pushed"
            )
        return self._weights(header), probe

    def _weights(self, header: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive the header's buckets one at a time, yielding each tensor as a view of its bucket; the buckets
        not read are received and dropped when the reader stops."""
        dtype = getattr(torch, header["dtype"])
        element = torch.empty((), dtype=dtype).element_size()
        sizes = header["buckets"]
        by_bucket: list[list[dict[str, Any]]] = [[] for _ in sizes]
        for entry in header["tensors"]:
            by_bucket[entry["bucket"]].append(entry)
        received, started = 0, time.perf_counter()
        try:
            for size, entries in zip(sizes, by_bucket, strict=True):
                bucket = torch.empty(size, dtype=torch.uint8)
                _broadcast(self._group, bucket)
                received += 1
                for entry in entries:
                    count = 1
                    for dim in entry["shape"]:
                        count *= dim
                    start = entry["offset"]
                    view = bucket[start : start + count * element].view(dtype).view(entry["shape"])
                    yield entry["name"], view
        finally:
            for size in sizes[received:]:  # a reader that stopped early: keep the group in step
                _broadcast(self._group, torch.empty(size, dtype=torch.uint8))
        logger.info(
            "rank %d: weights v%d received by gloo broadcast from %s:%d: %.1f MB in %d bucket(s), %.2f s",
            self.rank,
            header["version"],
            *self.address,
            header["bytes"] / 1e6,
            len(sizes),
            time.perf_counter() - started,
        )
