"""The authenticated control channel between the controller and every worker rank (pyzmq).

Every message is three frames: the protocol tag, a JSON body, and HMAC-SHA256(secret, tag + body). The receiver
checks the tag and compares the MAC in constant time *before* parsing anything: a forged, truncated or
unauthenticated message is dropped without being deserialised, and nothing is ever unpickled (bodies are JSON;
bulk data travels as files, see `handles`). The body names its sender, and the controller checks that it matches
the socket identity the message arrived from, so a signed message cannot be replayed under another rank's name;
bodies older than `MAX_AGE_S` or seen before are dropped too.

The secret is 32 random bytes per run, in a file created with mode 0600 in the run folder.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

TAG = b"hybridflow-ctl/1"
MAX_AGE_S = 300.0
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # control messages are small JSON; batches travel as files


def create_secret(path: str | Path) -> Path:
    """Create the run's secret file (mode 0600, never overwritten). Raises FileExistsError if it exists."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def read_secret(path: str | Path) -> bytes:
    """Read a secret file, refusing one that other users can read.

    Raises:
        PermissionError: if the file is group- or world-accessible (fix: ``chmod 600 <path>``).
    """
    path = Path(path)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(
            f"secret file {path} has mode {oct(mode)}; it must be readable by its owner only (chmod 600 {path})"
        )
    return bytes.fromhex(path.read_text().strip())


class Signer:
    """Signs and verifies channel messages with the run's secret.

    Args:
        key: the shared secret (bytes).
    """

    def __init__(self, key: bytes):
        self._key = key
        self._seen: dict[str, float] = {}  # nonce -> expiry, in arrival order (oldest first)
        self.dropped = 0

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, TAG + body, hashlib.sha256).digest()

    def pack(self, message: dict[str, Any]) -> list[bytes]:
        """Frames for `message` (a JSON-serialisable dict); adds a timestamp and a nonce."""
        body = json.dumps({**message, "ts": time.time(), "nonce": secrets.token_hex(8)}).encode()
        return [TAG, body, self._mac(body)]

    def unpack(self, frames: list[bytes]) -> dict[str, Any] | None:
        """The message in `frames`, or None (counted in `dropped`) if it is not authentic, stale or a replay."""
        if len(frames) != 3 or frames[0] != TAG or not hmac.compare_digest(self._mac(frames[1]), frames[2]):
            self.dropped += 1
            return None
        message = json.loads(frames[1])  # authenticated: safe to parse
        now = time.time()
        nonce = message.get("nonce")
        ts = float(message.get("ts", 0.0))
        if abs(now - ts) > MAX_AGE_S or nonce in self._seen:
            self.dropped += 1
            return None
        # remember each nonce until its own timestamp is too old to be accepted again (clock skew included);
        # arrival order is close to timestamp order, so expired nonces are dropped from the front (O(1) per message)
        self._seen[nonce] = ts + MAX_AGE_S
        while self._seen:
            oldest = next(iter(self._seen))
            if self._seen[oldest] >= now - MAX_AGE_S:
                break
            del self._seen[oldest]
        return message


class DropLog:
    """Rate-limited warnings about dropped messages: the first is logged in full, later ones are counted and
    summed up in at most one line per `interval_s` seconds (a flood of forged messages must not flood the log).

    Args:
        interval_s: the least time between two summary lines (seconds).
    """

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self._unreported = 0
        self._last = -float("inf")

    def drop(self, reason: str) -> None:
        """Note one dropped message; log it now if nothing was logged for `interval_s`, else count it."""
        now = time.monotonic()
        self._unreported += 1
        if now - self._last < self.interval_s:
            return
        if self._unreported == 1:
            logger.warning("dropped %s", reason)
        else:
            logger.warning(
                "dropped %d messages in the last %.0f s (unauthenticated, stale, replayed or misaddressed); the "
                "latest: %s",
                self._unreported,
                now - self._last,
                reason,
            )
        self._unreported, self._last = 0, now


class ControllerEndpoint:
    """The controller's ROUTER socket: workers connect to it; messages are addressed by worker identity.

    Args:
        signer: the run's `Signer`.
        bind_host: the address to listen on (``127.0.0.1`` for local groups; on Slurm the controller host's address
            on the cluster network, see `hybridflow.slurm.network.host_address`); workers are told to connect to it.
    """

    def __init__(self, signer: Signer, bind_host: str = "127.0.0.1"):
        self.signer = signer
        self._drops = DropLog()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # an unauthenticated peer cannot exhaust memory
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        advertised = socket.gethostname() if bind_host in ("0.0.0.0", "*") else bind_host
        self.address = f"tcp://{advertised}:{self.port}"

    def send(self, identity: str, message: dict[str, Any]) -> None:
        """Send to one worker. Raises zmq.ZMQError (EHOSTUNREACH) if that identity is not connected."""
        self._sock.send_multipart([identity.encode(), *self.signer.pack(message)])

    def recv(self, timeout_s: float) -> tuple[str, dict[str, Any]] | None:
        """The next authentic message as (sender identity, body), or None after `timeout_s` with none."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if not self._sock.poll(int(remaining * 1000) + 1 if remaining > 0 else 0):  # 0 s: one look, no wait
                return None
            identity, *frames = self._sock.recv_multipart()
            message = self.signer.unpack(frames)
            if message is None:
                self._drops.drop(f"an unauthenticated, stale or replayed message from {identity!r}")
                continue
            if message.get("from") != identity.decode(errors="replace"):
                self.signer.dropped += 1
                sender = message.get("from")
                self._drops.drop(f"a message whose sender {sender!r} does not match its socket {identity!r}")
                continue
            return identity.decode(), message

    def close(self) -> None:
        self._sock.close(linger=0)


class WorkerConnection:
    """A worker's DEALER socket to the controller, identified as `identity`; `watched`: its connection's events are
    read by `lost_s`."""

    def __init__(self, address: str, identity: str, signer: Signer, watched: bool = False):
        self.identity = identity
        self.signer = signer
        self._drops = DropLog()
        self._lost_since: float | None = None
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._monitor = None
        if watched:  # before connecting, so that no event is missed
            events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            self._monitor = self._sock.get_monitor_socket(events)
        self._sock.setsockopt(zmq.IDENTITY, identity.encode())
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        # ZMTP pings: a controller whose host vanished (no FIN) still shows up as a disconnect
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        self._sock.connect(address)

    def send(self, message: dict[str, Any]) -> None:
        self._sock.send_multipart(self.signer.pack({**message, "from": self.identity}))

    def recv(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The next authentic message from the controller (forged ones are dropped); None on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(wait):
                return None
            message = self.signer.unpack(self._sock.recv_multipart())
            if message is not None:
                return message
            self._drops.drop(f"an unauthenticated message to worker {self.identity}")

    def lost_s(self) -> float:
        """Seconds this connection has been disconnected from the controller (0.0 while connected), read from its
        socket's events (connected, disconnected, handshake succeeded) that arrived since the last call.

        Raises:
            RuntimeError: the connection was made without ``watched=True``."""
        if self._monitor is None:
            raise RuntimeError(f"{self.identity}'s connection is not watched: make it with watched=True")
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._lost_since = self._lost_since or time.monotonic()
            elif event in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
                self._lost_since = None
        return 0.0 if self._lost_since is None else time.monotonic() - self._lost_since

    def close(self, linger_ms: int | None = None) -> None:
        """Close the socket; messages not yet sent are kept for up to `linger_ms` (None: 1 s)."""
        self._sock.close(linger=linger_ms)
