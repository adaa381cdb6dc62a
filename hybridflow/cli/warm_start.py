"""Warm start: ``hf run``, ``hf resume`` (and every command that starts a run: `COMMANDS`) forked from a process
that has already imported the controller's stack.

A controller imports torch, tensordict, transformers, SQLAlchemy and HybridFlow's engine before its first stage:
~11 s of one core here (``python -X importtime``), paid again by every ``hf run``, ``hf resume``, ``hf verl``,
``hf sft train`` and ``hf rm train``. The first such command starts a warm process for its user
(`hybridflow.cli.warm_server`): a detached process that imports the controller's modules once
(``warm_server.PRELOAD``), starts the ranks' fork server, and then waits on a Unix socket.
Each later command (`forward`, called first thing by ``hf``) hands it its arguments, environment, working directory,
umask and standard streams (the file descriptors themselves, over the socket), and the warm process forks the
command's controller, which runs ``hf`` as the command would have, writing to the caller's terminal or pipes, its
local ranks forked from the warm fork server. The ``hf`` process stays as the command's face: it forwards the signals
it gets (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) to the controller and exits with its exit status (or is
killed by its signal); were it killed itself (SIGKILL), the controller kills itself at once, as the one process it
was. The run store records the ``hf`` process's pid as the controller's (what a user sees, and kills).

What the warm process imported was imported under its own environment. One warm process therefore serves only
commands of the same Python, ``sys.path``, HybridFlow source files (their sizes and modification times) and installed
packages, and the same environment variables that libraries read at import (`IMPORT_TIME_ENV`): its socket is named
after a hash of them, so a command that differs in any gets (and starts) its own. Prefect is not imported there: it
reads its settings when imported, which ``hf`` sets per command (``--prefect-api``, the home's server).

``HYBRIDFLOW_WARM_START_S``: how long a warm process waits for its next command before it exits (seconds; default
`IDLE_S`); 0 turns warm start off (each command imports for itself). Its log is ``<socket>.log`` beside its socket in
``$XDG_RUNTIME_DIR/hybridflow`` (else ``/tmp/hybridflow-<uid>``, owner only).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

COMMANDS = ("run", "resume", "verl", "sft", "rm", "dpo")
"""The ``hf`` commands a warm process serves: those that start a run's controller (``hf run``, ``hf resume``,
``hf verl``, ``hf sft train``, ``hf rm train``, ``hf dpo train``; the groups' other subcommands, such as
``--help``, too)."""

IMPORT_TIME_ENV = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "TORCH", "PYTORCH", "OMP_", "MKL_")
IMPORT_TIME_ENV += ("CUDA", "NCCL", "LD_", "SQLALCHEMY", "TENSORDICT", "VLLM", "MPL")
"""Prefixes of the environment variables a warm process must share with the commands it serves."""

IDLE_S = 600.0
"""How long a warm process waits for its next command before it exits, unless ``HYBRIDFLOW_WARM_START_S`` says."""

START_WAIT_S = 10.0
"""How long a command waits for a warm process it started to listen before it runs without one."""

MAX_FOLDER_CHARS = 70
"""The longest socket folder used; a longer ``$XDG_RUNTIME_DIR/hybridflow`` gives ``/tmp/hybridflow-<uid>``."""

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

HEADER = struct.Struct("!I")
_forked = False  # this process is a controller a warm process forked (`mark_forked`)


def mark_forked() -> None:
    """Say that this process is a controller a warm process forked: `forward` then runs nothing here."""
    global _forked
    _forked = True


def idle_s() -> float:
    """``HYBRIDFLOW_WARM_START_S`` (seconds; 0: warm start off), else `IDLE_S`.

    Raises:
        ValueError: the variable is not a number of seconds."""
    value = os.environ.get("HYBRIDFLOW_WARM_START_S", "")
    try:
        return float(value) if value else IDLE_S
    except ValueError:
        why = f"HYBRIDFLOW_WARM_START_S={value!r} is not a number of seconds (0 turns warm start off)"
        raise ValueError(why) from None


def socket_path() -> Path:
    """The socket of the warm process that serves this process's commands (see the module docstring)."""
    digest = hashlib.sha256()
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(IMPORT_TIME_ENV))
    digest.update(json.dumps([sys.executable, sys.path, env]).encode())
    for entry in sys.path:  # an installed or removed package changes its folder's mtime
        if entry.endswith(("site-packages", "dist-packages")):
            with contextlib.suppress(OSError):
                digest.update(f"{entry}:{os.stat(entry).st_mtime_ns}".encode())
    package = Path(__file__).resolve().parent.parent
    for source in sorted(package.rglob("*.py")):
        stat = source.stat()
        digest.update(f"{source}:{stat.st_mtime_ns}:{stat.st_size}".encode())
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) / "hybridflow" if runtime else Path(f"/tmp/hybridflow-{os.getuid()}")
    if len(str(folder)) > MAX_FOLDER_CHARS:  # a socket's path has at most 107 bytes
        folder = Path(f"/tmp/hybridflow-{os.getuid()}")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o077:
        raise PermissionError(f"{folder} is not this user's own folder (mode 0700): remove it")
    return folder / f"warm-{digest.hexdigest()[:20]}.sock"


def forward(argv: list[str]) -> int | None:
    """Run ``hf <argv>`` in a warm process (starting one when there is none) and return its exit status (negative:
    killed by that signal); None when it is not a warm command, warm start is off, or no warm process could serve
    it (the caller then runs the command itself)."""
    if _forked or not argv or argv[0] not in COMMANDS or idle_s() <= 0:
        return None  # (the first: this is a forked controller already)
    try:
        path = socket_path()
        conn = _connect(path)
        if conn is None:
            server = _start_server(path)
            deadline = time.monotonic() + START_WAIT_S
            while conn is None and time.monotonic() < deadline and server.poll() is None:
                time.sleep(0.05)
                conn = _connect(path)
    except OSError as e:  # no folder of our own for the socket: the command runs without a warm process
        print(f"hf: warm start unavailable ({e}); starting without it", file=sys.stderr)
        return None
    if conn is None:
        return None
    with conn:
        request = json.dumps(
            {
                "argv": argv,
                "env": dict(os.environ),
                "cwd": os.getcwd(),
                "umask": _umask(),
                "path": sys.path,
                "pid": os.getpid(),
            }
        ).encode()
        with _standard_streams() as fds:
            try:
                socket.send_fds(conn, [HEADER.pack(len(request)) + request], fds)
            except OSError:
                return None
        reader = conn.makefile("r")
        started = reader.readline()
        if not started:  # the warm process ended before it forked (its log says why)
            return None
        pid = json.loads(started)["pid"]
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, lambda signum, frame: _send(pid, signum))
        ended = reader.readline()
    if not ended:
        print(f"hf: the warm process that ran this command ended first; see {path}.log", file=sys.stderr)
        return 1
    return int(json.loads(ended)["status"])


def exit_like(status: int) -> None:
    """End this process as the forwarded command ended: with its exit status, or killed by its signal."""
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.stdout.flush()
    os._exit(status if status >= 0 else 128 - status)


def _send(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


@contextlib.contextmanager
def _standard_streams() -> Iterator[list[int]]:
    """File descriptors 0, 1 and 2, each /dev/null where this process has it closed."""
    fds, opened = [], []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            opened.append(os.open(os.devnull, os.O_RDWR))
            fds.append(opened[-1])
    try:
        yield fds
    finally:
        for fd in opened:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        return None
    return conn


def _start_server(path: Path) -> subprocess.Popen:
    """Start a warm process on `path`, detached (its own session; output to ``<path>.log``, never the caller's)."""
    with open(f"{path}.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-c", f"from hybridflow.cli.warm_server import serve; serve({str(path)!r})"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            cwd="/",
        )
