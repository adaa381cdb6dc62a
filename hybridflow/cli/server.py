"""A local Prefect server per HybridFlow home: started once, reused, its SQLite database under that home.

Each ``$HYBRIDFLOW_HOME`` (default ``~/.cache/hybridflow``) has at most one server of its own, described by
``$HYBRIDFLOW_HOME/prefect/server.json`` (``{"port": ..., "pid": ...}``) and started with
``PREFECT_HOME=$HYBRIDFLOW_HOME/prefect``. A server is *this home's* only if the recorded pid is alive, is a
``prefect server`` process whose ``PREFECT_HOME`` is this home's (when ``/proc/PID/environ`` is readable), and the
recorded port answers ``/health``. `hf run` calls `start`, which reuses this home's server or starts one; it never
attaches to a server that another home (or anybody) started: when the requested port is taken it starts this home's
server on a free port instead. `hf server status|stop` see and stop only this home's server; ``--prefect-api URL``
is the way to use any other server. The same server serves the Prefect UI. Settings keep it offline: analytics off,
no telemetry.

A server that no run and no UI has used for ``$HYBRIDFLOW_SERVER_IDLE_MINUTES`` (default 30; 0: never) stops by
itself (`hybridflow.cli.server_idle`, a watcher started beside it); `hf server status` lists every HybridFlow home's
server on this machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import typer

from hybridflow.cli.common import console
from hybridflow.engine.embedded_models import hybridflow_home
from hybridflow.slurm.network import free_port

DEFAULT_PORT = 4200
START_TIMEOUT_S = 120.0
IDLE_ENV = "HYBRIDFLOW_SERVER_IDLE_MINUTES"
DEFAULT_IDLE_MINUTES = 30.0
TOUCH_S = 30.0
"""How often a training run's `ServerWatch` touches `in_use_file` (its server's idle watcher leaves it up)."""

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
    """This home's running server: its port (API and UI URLs derive from it), process id and HybridFlow home.

    `started` is True when `start` started it just now (False: it was already running); `taken_port` is the
    requested port when something else held it and the server was started on `port` instead (else None);
    `idle_stop_s`: seconds unused after which it stops by itself (None: never).
    """

    port: int
    pid: int
    home: Path = field(default_factory=hybridflow_home)
    started: bool = False
    taken_port: int | None = None
    idle_stop_s: float | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def describe(self) -> str:
        """One line for the user: whose server it is, its UI and whether `start` started it just now."""
        how = f"{'started now' if self.started else 'already running'}, pid {self.pid}"
        if self.taken_port is not None:  # the pid is the new server's, not the holder's of the taken port
            how += f"; port {self.taken_port} is taken by something this home did not start, so a free port"
        return f"Prefect server of {self.home}: UI {self.ui_url} ({how})"

    def idle_note(self) -> str:
        """When the server stops by itself, for the end of a run."""
        if self.idle_stop_s is None:
            return f"the Prefect server of {self.home} stays up (UI {self.ui_url}; hf server stop stops it)"
        return (
            f"the Prefect server of {self.home} stays up for its UI ({self.ui_url}) and stops by itself once no run "
            f"or UI has used it for {self.idle_stop_s / 60:g} min ({IDLE_ENV}; hf server stop stops it now)"
        )


def _state_file() -> Path:
    return prefect_home() / "server.json"


def in_use_file(home: Path) -> Path:
    """The file a training run touches while it uses the server of the Prefect home `home`."""
    return home / "in_use"


def stopped_file(home: Path) -> Path:
    """``stopped.json``: when and why the idle watcher (`hybridflow.cli.server_idle`) stopped the server of the
    Prefect home `home`."""
    return home / "stopped.json"


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    """True if a Prefect server answers ``GET <api_url>/health``."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _read_state(state_file: Path | None = None) -> tuple[int, int] | None:
    """(port, pid) recorded in this home's ``server.json`` (or `state_file`), or None if there is no (readable)
    record."""
    try:
        state = json.loads((state_file or _state_file()).read_text())
        return int(state["port"]), int(state["pid"])
    except (OSError, ValueError, KeyError, TypeError):  # missing, not JSON, or not the expected fields
        return None


def _idle_stop_s(state_file: Path | None = None) -> float | None:
    """The idle time (seconds) after which the recorded server stops by itself; None: never, or no record."""
    try:
        idle = json.loads((state_file or _state_file()).read_text()).get("idle_stop_s")
    except (OSError, ValueError, AttributeError):
        return None
    return float(idle) if idle else None


def idle_minutes() -> float:
    """``$HYBRIDFLOW_SERVER_IDLE_MINUTES`` (default `DEFAULT_IDLE_MINUTES`; 0: a server never stops by itself).

    Raises:
        ValueError: the variable is not a number >= 0 (the message names it)."""
    value = os.environ.get(IDLE_ENV, "").strip() or str(DEFAULT_IDLE_MINUTES)
    try:
        minutes = float(value)
    except ValueError:
        minutes = -1.0
    if minutes < 0:
        raise ValueError(f"{IDLE_ENV}={value!r}: give minutes, a number >= 0 (0: the server never stops by itself)")
    return minutes


def status() -> ServerInfo | None:
    """This home's server, if it is running and healthy (see the module docstring); None otherwise, including when
    a server that this home did not start answers on the recorded or default port."""
    state = _read_state()
    if state is None:
        return None
    port, pid = state
    info = ServerInfo(port, pid, idle_stop_s=_idle_stop_s())
    return info if _is_own_server(pid) and healthy(info.api_url) else None


def start(
    port: int = DEFAULT_PORT, timeout_s: float = START_TIMEOUT_S, idle_stop_minutes: float | None = None
) -> ServerInfo:
    """This home's server: the running one (``started=False``, whatever its port), else a new ``prefect server
    start`` in the background (its own session, survives this process) once it is healthy (``started=True``).

    A new server listens on 127.0.0.1:`port`; if that port is taken (another home's server, anything else) it
    listens on a free port instead and `ServerInfo.taken_port` says so. Either way the port and pid go to this home's
    ``server.json``. `timeout_s` is in seconds. A new server stops by itself after `idle_stop_minutes` unused (default
    `idle_minutes`; 0: never), watched by `hybridflow.cli.server_idle`.

    Raises:
        RuntimeError: if the new server exits or is not healthy within `timeout_s` (the tail of its log is
            included).
        ValueError: ``$HYBRIDFLOW_SERVER_IDLE_MINUTES`` is not a number >= 0.
    """
    running = status()
    if running is not None:
        return running
    idle_s = 60 * (idle_minutes() if idle_stop_minutes is None else idle_stop_minutes)
    home = prefect_home()
    home.mkdir(parents=True, exist_ok=True)
    taken_port = None
    if not _port_free(port):
        taken_port, port = port, free_port()
    env = {**os.environ, **OFFLINE_ENV, "PREFECT_HOME": str(home.resolve())}
    env.pop("PREFECT_API_URL", None)
    # The UI's pages call the API at this URL; Prefect derives it from its port setting, not from --port, so a
    # server on any port but 4200 would serve a UI that asks port 4200 (another server, or nothing).
    env["PREFECT_UI_API_URL"] = f"http://127.0.0.1:{port}/api"
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
    info = ServerInfo(port, process.pid, started=True, taken_port=taken_port)
    deadline = time.monotonic() + timeout_s
    while not healthy(info.api_url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            tail = (home / "server.log").read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(
                f"Prefect server did not start on port {port} (log {home / 'server.log'}):\n" + "\n".join(tail)
            )
        time.sleep(0.5)
    info.idle_stop_s = idle_s or None
    _state_file().write_text(json.dumps({"port": port, "pid": process.pid, "idle_stop_s": info.idle_stop_s}))
    stopped_file(home).unlink(missing_ok=True)
    if idle_s:
        with open(home / "server.log", "ab") as log:  # the watcher's line goes after the server's own
            subprocess.Popen(
                [sys.executable, "-m", "hybridflow.cli.server_idle", str(process.pid), str(port), str(idle_s)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
    return info


def stop(timeout_s: float = 20.0) -> bool:
    """Stop this home's server (SIGTERM to its process group, SIGKILL after `timeout_s` seconds) and forget it.
    Returns False if this home had none running; a server that this home did not start is never touched."""
    state = _read_state()
    _state_file().unlink(missing_ok=True)
    if state is None:
        return False
    pid = state[1]
    if not _is_own_server(pid):  # not running any more, or the pid was reused by another program or home
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):  # reap it when this process started it (else: a zombie)
            os.waitpid(pid, os.WNOHANG)
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        if _zombie(pid):  # ended; its parent (or a PID 1 that does not reap) has not collected it
            return True
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)
    return True


class ServerWatch:
    """While a run trains, restart this home's Prefect server if its process ends (killed, crashed, the OOM killer):
    on the same port, so the run's Prefect client (whose API URL is fixed) reconnects, and with the same database
    under this home, so the flow run's history and state are kept. Checked every `interval_s` seconds; `say` gets
    one line per restart and one per failed attempt (with the server log's tail). A failed start is tried again at
    the next check, up to `MAX_FAILURES` in a row; when the run ends with the server still down (and the watch has
    not given up), one last start is tried, so the events the run queued meanwhile reach it. A server that is alive
    but slow to answer is left alone.

    Use as a context manager around the run (a daemon thread)."""

    MAX_FAILURES = 3

    PORT_RELEASE_S = 10.0
    """How long a restart waits for the ended server's port to be free: a process SIGKILLed reads as ended (its
    memory released) a moment before its sockets are closed, longer on a loaded machine (CI saw the port still
    taken right after)."""

    def __init__(self, info: ServerInfo, say: Callable[[str], None], interval_s: float = 1.0):
        self.info = info
        self.say = say
        self.interval_s = interval_s
        self.restarts = 0
        self._failures = 0  # failed starts in a row
        self._given_up = False  # port taken meanwhile (the run's client cannot follow), or MAX_FAILURES failed starts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="prefect-server-watch", daemon=True)

    def __enter__(self) -> ServerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=START_TIMEOUT_S + 5)
        if not self._thread.is_alive() and not self._given_up and not _is_own_server(self.info.pid):
            self._restart(last=True)

    def _watch(self) -> None:
        touched = 0.0
        while not self._stop.wait(self.interval_s) and not self._given_up:
            if not _is_own_server(self.info.pid):
                self._restart()
            if time.monotonic() - touched >= TOUCH_S:  # this run uses the server: its idle watcher leaves it up
                in_use_file(prefect_home()).touch()
                touched = time.monotonic()

    def _restart(self, last: bool = False) -> None:
        """Start this home's server on its port again; `last`: the run has ended (no later attempt)."""
        began = time.monotonic()
        while not _port_free(self.info.port) and time.monotonic() - began < self.PORT_RELEASE_S:
            time.sleep(0.1)
        try:
            info = start(self.info.port)
        except Exception as e:  # noqa: BLE001 - any failure is said; the watch tries again at its next check
            self._failures += 1
            self._given_up = self._failures >= self.MAX_FAILURES
            then = "" if last or self._given_up else f"; trying again in {self.interval_s:g} s"
            self.say(f"the local Prefect server (pid {self.info.pid}) ended and did not restart{then}: {e}")
            return
        if info.port != self.info.port:
            self._given_up = True
            self.say(
                f"the local Prefect server (pid {self.info.pid}) ended and port {self.info.port} is taken: the "
                f"run goes on without the UI (a new server is on port {info.port})"
            )
            return
        self.restarts += 1
        self._failures = 0
        self.say(
            f"the local Prefect server (pid {self.info.pid}) ended: restarted it on port {info.port} (pid "
            f"{info.pid}) in {time.monotonic() - began:.1f} s; the run went on meanwhile"
        )
        self.info = info


def _zombie(pid: int) -> bool:
    """True if process `pid` has ended and waits to be reaped (state Z in ``/proc/PID/stat``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _is_prefect_server(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"prefect" in cmdline and b"server" in cmdline


def _is_own_server(pid: int) -> bool:
    """True if `pid` is a live ``prefect server`` process started for this home: its ``PREFECT_HOME`` is this home's
    prefect folder (not checked when ``/proc/PID/environ`` cannot be read)."""
    if pid <= 0 or not _is_prefect_server(pid):
        return False
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return True
    return os.fsencode(f"PREFECT_HOME={prefect_home().resolve()}") in environ


def _port_free(port: int) -> bool:
    """True if a server could listen on 127.0.0.1:`port` now (bound the way ``prefect server start`` checks)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def use_server(api_url: str) -> None:
    """Point this process's Prefect client at `api_url` (call before importing prefect), retrying a failed call
    twice (``PREFECT_CLIENT_MAX_RETRIES``, unless set). Prefect's INFO lines (and
    the controller's and workers' log lines, `orchestration.reporting.FlowLogs`) go to the flow run's logs in the
    UI, not to the terminal: its console handler shows warnings only, as the live display shows the progress."""
    os.environ.update(OFFLINE_ENV)
    os.environ["PREFECT_API_URL"] = api_url
    # Prefect retries a call 5 times with doubling waits (~30 s a call): against a server that died mid-run, the
    # flow's last calls would hold `hf run` minutes after its training ended. Training never waits for these
    # calls (artifacts go from a thread, the run's record is the run store), so 2 retries are enough.
    os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", "2")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


# ---------------------------------------------------------------------------------------------------- commands
server_app = typer.Typer(help="The local Prefect server (UI and flow-run history).", no_args_is_help=True)


@server_app.command("start")
def server_start(
    port: int = DEFAULT_PORT,
    idle_minutes: float | None = typer.Option(
        None,
        min=0,
        help=f"stop by itself after this many minutes unused by any run or UI (default ${IDLE_ENV} or "
        f"{DEFAULT_IDLE_MINUTES:g}; 0: never)",
    ),
) -> None:
    """Start this home's Prefect server (or report the running one); a taken port means a free one instead."""
    try:
        with console.status("starting the Prefect server..."):
            info = start(port, idle_stop_minutes=idle_minutes)
    except (RuntimeError, ValueError) as e:
        console.print(f"{e}", style="red")
        raise typer.Exit(1) from None
    console.print(f"{info.describe()}  API {info.api_url}")
    console.print(info.idle_note())


@server_app.command("stop")
def server_stop() -> None:
    """Stop this home's Prefect server (started by `hf server start` or `hf run`); never another home's."""
    home = hybridflow_home()
    console.print(f"stopped the Prefect server of {home}" if stop() else f"no Prefect server of {home} was running")


@server_app.command("status")
def server_status() -> None:
    """Whether this home's Prefect server (the one `hf run` uses) is running, and where, then every HybridFlow
    home's Prefect server on this machine; exit 1 if this home's is not running."""
    info = status()
    if info is not None:
        console.print(f"running: Prefect server of {info.home}: API {info.api_url}  UI {info.ui_url}  (pid {info.pid})")
        console.print(info.idle_note())
    else:
        console.print(f"no Prefect server of {hybridflow_home()} is running (hf server start)")
        if (stopped := _stopped_idle()) is not None:
            console.print(stopped)
        default = ServerInfo(DEFAULT_PORT, 0)
        if healthy(default.api_url):
            console.print(
                f"the Prefect server at {default.ui_url} was not started by this home (another home's or someone "
                "else's): hf run does not use it (--prefect-api to use it)"
            )
    _list_servers()
    if info is None:
        raise typer.Exit(1)


def running_servers() -> list[tuple[Path, int, int | None]]:
    """Every Prefect server on this machine that a HybridFlow home started (its ``PREFECT_HOME`` is a home's
    ``prefect`` folder): ``(home, pid, port)``, the port from that home's ``server.json`` (None if it records
    another server), sorted by home."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or not _is_prefect_server(int(proc.name)):
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        homes = [e.removeprefix(b"PREFECT_HOME=") for e in environ if e.startswith(b"PREFECT_HOME=")]
        if not homes or Path(os.fsdecode(homes[0])).name != "prefect":
            continue
        prefect = Path(os.fsdecode(homes[0]))
        state = _read_state(prefect / "server.json")
        pid = int(proc.name)
        found.append((prefect.parent, pid, state[0] if state and state[1] == pid else None))
    return sorted(found)


def _list_servers() -> None:
    """Print `running_servers` as a table (nothing when there are none)."""
    from rich.table import Table

    servers = running_servers()
    if not servers:
        return
    table = Table("HybridFlow home", "pid", "UI", "stops by itself after", title="Prefect servers on this machine")
    for home, pid, port in servers:
        idle = _idle_stop_s(home / "prefect" / "server.json") if port is not None else None
        ui = f"http://127.0.0.1:{port}" if port is not None else "?"
        mine = " (this home)" if home.resolve() == hybridflow_home().resolve() else ""
        table.add_row(f"{home}{mine}", str(pid), ui, f"{idle / 60:g} min unused" if idle else "never")
    console.print(table)


def _stopped_idle() -> str | None:
    """The line saying this home's server stopped by itself, unused (`hybridflow.cli.server_idle`), or None."""
    try:
        record = json.loads(stopped_file(prefect_home()).read_text())
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record["stopped_at"])))
        return f"it stopped by itself at {at}: no run or UI had used it for {float(record['idle_s']) / 60:g} min"
    except (OSError, ValueError, KeyError, TypeError):
        return None
