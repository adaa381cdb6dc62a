"""The warm process of `hybridflow.cli.warm_start`: imports the controller's stack once, then forks a controller for
each command (``hf run``, ``hf resume``, ...: `hybridflow.cli.warm_start.COMMANDS`) that a caller hands it over its
Unix socket (the caller's arguments, environment, working directory, umask and standard streams), and tells the
caller how it ended."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback

from hybridflow.cli import warm_start
from hybridflow.engine.fast_exit import exit_process
from hybridflow.flows.lease import record_controller_pid
from hybridflow.slurm import forked

PRELOAD = (
    "hybridflow.flows.preflight",
    "hybridflow.flows.store.run_store",
    "hybridflow.slurm.worker_group",
    "hybridflow.engine.algorithms.estimators",
    "hybridflow.engine.algorithms.losses",
    "transformers.models.auto.tokenization_auto",
    "reasoning_gym.factory",
    "alembic.command",  # the store's schema check (`RunStore.upgrade`), ~0.23 s
    "alembic.runtime.migration",
)
"""What a warm process imports before it serves (none imports Prefect: see `hybridflow.cli.warm_start`)."""


def serve(path: str) -> None:
    """A warm process on socket `path`: import `PRELOAD`, then fork a controller per request until idle for
    `hybridflow.cli.warm_start.idle_s` seconds. Returns at once when another warm process holds `path`."""
    lock = open(f"{path}.lock", "w")  # noqa: SIM115 (held for the process's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a socket left by a warm process that died
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    started = time.monotonic()
    # the ranks' fork server imports theirs beside ours (vLLM's engine too: many runs sample with it); our
    # controllers fork their ranks from it
    forked.warm_up(vllm=True)
    for module in PRELOAD:
        importlib.import_module(module)
    if "prefect" in sys.modules:
        raise RuntimeError("a warm process must not import prefect (it reads its settings when imported)")
    _log(f"listening on {path}: imported {len(PRELOAD)} modules in {time.monotonic() - started:.1f} s")
    children: dict[int, socket.socket] = {}
    inherited = [lock, listener]  # what a forked controller must not keep open (the lock would outlive us)
    last = time.monotonic()
    limit = warm_start.idle_s()
    try:
        while children or time.monotonic() - last < limit:
            ready, _, _ = select.select([listener], [], [], 0.2)
            if ready:
                conn, _ = listener.accept()
                pid = _fork_controller(conn, [*inherited, *children.values()])
                if pid:
                    children[pid] = conn
                last = time.monotonic()
            for pid in list(children):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    conn = children.pop(pid)
                    code = os.waitstatus_to_exitcode(status)
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"status": code}).encode() + b"\n")
                    conn.close()
                    last = time.monotonic()
    finally:
        os.unlink(path)
        _log("idle: exiting")


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} warm process {os.getpid()}: {message}", flush=True)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if len(data) < warm_start.HEADER.size:
        raise ConnectionError("a request without its header")
    size = warm_start.HEADER.unpack_from(data)[0]
    body = bytearray(data[warm_start.HEADER.size :])
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ConnectionError("a request cut short")
        body += more
    return json.loads(body), fds


def _fork_controller(conn: socket.socket, others: list) -> int:
    """Fork the controller of the request on `conn`; its pid (0 when the request was unreadable). The child closes
    `others` (the warm process's lock and listener, the connections of the other controllers' callers: a caller's
    end must close with the caller, for its controller to see it)."""
    try:
        request, fds = _receive(conn)
    except (OSError, ValueError) as e:
        _log(f"unreadable request: {e}")
        conn.close()
        return 0
    forked.restart_if_dead()  # the controller forks its ranks from it
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):  # a caller gone already: its controller sees it and ends
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _log(f"forked controller {pid} for hf {' '.join(request['argv'])} (caller pid {request['pid']})")
        return pid
    for other in others:
        other.close()
    _run_controller(request, fds, conn)  # never returns
    return 0


def _run_controller(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In the forked child: become the command (its streams, directory, environment, arguments), then run ``hf``."""
    warm_start.mark_forked()
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["hf", *request["argv"]]
        sys.path[:] = request["path"]
        record_controller_pid(request["pid"])
        forked.use_inherited_server()
        buffered = not os.environ.get("PYTHONUNBUFFERED")
        sys.stdout.reconfigure(line_buffering=buffered and os.isatty(1), write_through=not buffered)
        sys.stderr.reconfigure(line_buffering=True)
        random.seed()  # not the warm process's sequence, shared by every controller it forks
        threading.Thread(target=_die_with_caller, args=(conn,), name="warm-start-caller", daemon=True).start()
        from hybridflow.cli.main import main  # here: its console reads the command's environment when made

        main()
    except SystemExit as done:
        code = done.code
    except BaseException:
        traceback.print_exc()
        code = 1
    else:
        code = 0
    exit_process(code)


def _die_with_caller(conn: socket.socket) -> None:
    """Block until the caller's ``hf`` process closes its end (it ended: SIGKILL, or any other end while this
    controller runs), then SIGKILL this process, as the caller's own death would have ended it."""
    with contextlib.suppress(OSError):
        while conn.recv(1):
            pass
    os.kill(os.getpid(), signal.SIGKILL)
