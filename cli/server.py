"""A local Prefect server for HybridFlow runs: started once, reused, its SQLite database under the user's data folder.

`hf run` calls `start` (which reuses a server that is already healthy) and points the Prefect client at it; the same
server serves the Prefect UI. Settings keep it offline: analytics off, no telemetry.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from hybridflow.engine.embedded_models import hybridflow_home

DEFAULT_PORT = 4200
START_TIMEOUT_S = 120.0

OFFLINE_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
}


def prefect_home() -> Path:
    """``$HYBRIDFLOW_HOME/prefect``: the server's database, logs and pid file."""
    return hybridflow_home() / "prefect"


@dataclass
class ServerInfo:
    """A running (or expected) local server: its API URL, UI URL and process id."""

    port: int
    pid: int | None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _state_file() -> Path:
    return prefect_home() / "server.json"


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    """True if a Prefect server answers ``GET <api_url>/health``."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def status() -> ServerInfo | None:
    """The local server started by `start`, if it is running and healthy."""
    try:
        state = json.loads(_state_file().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    info = ServerInfo(int(state["port"]), int(state["pid"]))
    return info if healthy(info.api_url) else None


def start(port: int = DEFAULT_PORT, timeout_s: float = START_TIMEOUT_S) -> ServerInfo:
    """Start ``prefect server start`` in the background (its own session, survives this process) and wait until
    it is healthy.

    Raises:
        RuntimeError: if it does not become healthy within `timeout_s` (the tail of its log is included), or the
            port is taken by something that is not a Prefect server.
    """
    running = status()
    if running is not None:
        return running
    home = prefect_home()
    home.mkdir(parents=True, exist_ok=True)
    info = ServerInfo(port, None)
    if healthy(info.api_url):
        _state_file().write_text(json.dumps({"port": port, "pid": 0}))
        return info  # someone else's Prefect server on this port: reuse it
    env = {**os.environ, **OFFLINE_ENV, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "ab")  # noqa: SIM115 - handed to the child process
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log.close()  # the server process has its own copy
    info = ServerInfo(port, process.pid)
    deadline = time.monotonic() + timeout_s
    while not healthy(info.api_url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            tail = (home / "server.log").read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(
                f"Prefect server did not start on port {port} (log {home / 'server.log'}):\n" + "\n".join(tail)
            )
        time.sleep(0.5)
    _state_file().write_text(json.dumps({"port": port, "pid": process.pid}))
    return info


def stop(timeout_s: float = 20.0) -> bool:
    """Stop the server started by `start`. Returns False if none was running."""
    try:
        state = json.loads(_state_file().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    pid = int(state.get("pid") or 0)
    _state_file().unlink(missing_ok=True)
    if pid <= 0 or not _is_prefect_server(pid):  # not started by us, or the pid was reused by another program
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)
    return True


def _is_prefect_server(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"prefect" in cmdline and b"server" in cmdline


def use_server(api_url: str) -> None:
    """Point this process's Prefect client at `api_url` (call before importing prefect). Prefect's own per-task
    INFO lines are turned down to warnings; the live display shows progress and the UI has the details."""
    os.environ.update(OFFLINE_ENV)
    os.environ["PREFECT_API_URL"] = api_url
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
