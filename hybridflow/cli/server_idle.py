"""Stop a home's Prefect server that no run and no UI has used for a while.

`hybridflow.cli.server.start` starts this watcher beside each server it starts (a process of its own session, its
output appended to the server's log): ``python -m hybridflow.cli.server_idle PID PORT IDLE_S``. The server counts as
used while

- a TCP connection to its port is open, or was closed less than two checks ago (the UI a user is looking at polls
  the API about every 30 s; a run's Prefect client calls it at every stage), or
- a run of this home trains on it: the CLI's `ServerWatch` touches ``$HYBRIDFLOW_HOME/prefect/in_use`` every
  ``server.TOUCH_S`` seconds (a stage may run longer than the idle time without calling the API).

After `IDLE_S` seconds unused, the watcher stops the server as ``hf server stop`` does and records why in
``prefect/stopped.json``; it ends by itself when the server ends otherwise. An idle Prefect server costs 4-7 % of a
core (measured on this 2-core machine, 2026-12-01).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

TIME_WAIT_S = 60.0
"""Linux keeps a closed loopback connection in TIME_WAIT for 60 s (``TCP_TIMEWAIT_LEN``); /proc/net/tcp gives the
time it has left, in 1/100 s."""


def last_connection_ago(port: int) -> float | None:
    """Seconds since a TCP connection to or from 127.0.0.1:`port` was last open (0: one is open now), from
    ``/proc/net/tcp`` and ``tcp6``; None if no connection is open or in TIME_WAIT (the listening socket does not
    count)."""
    ago = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, timer = fields[1], fields[2], fields[3], fields[5]
            if port not in (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)) or state == "0A":
                continue  # another port's, or the server's listening socket
            # TIME_WAIT ("06"): closed TIME_WAIT_S minus the time left ago; any other state: open now
            closed = max(0.0, TIME_WAIT_S - int(timer.split(":")[1], 16) / 100) if state == "06" else 0.0
            ago = closed if ago is None else min(ago, closed)
    return ago


def check_interval(idle_s: float) -> float:
    """Seconds between two looks: a tenth of the idle time, between 0.5 and 10."""
    return min(10.0, max(0.5, idle_s / 10))


def watch(pid: int, port: int, idle_s: float) -> str:
    """Watch the server `pid` on `port` until it ends or has been unused for `idle_s` seconds (then stop it);
    returns what happened, one line."""
    from hybridflow.cli import server

    home = server.prefect_home()
    interval = check_interval(idle_s)
    last_used = time.monotonic()
    while True:
        time.sleep(interval)
        if (server._read_state() or (0, 0))[1] != pid or not server._is_own_server(pid):
            return f"the Prefect server (pid {pid}) ended or was replaced: nothing to watch"
        now = time.monotonic()
        connection = last_connection_ago(port)
        if connection is not None and connection <= 2 * interval:
            last_used = now - connection
        try:
            touched = time.time() - server.in_use_file(home).stat().st_mtime
        except OSError:
            touched = None
        if touched is not None and touched < 3 * server.TOUCH_S:
            last_used = now
        if now - last_used >= idle_s:
            record = {"pid": pid, "port": port, "idle_s": idle_s, "stopped_at": time.time()}
            server.stopped_file(home).write_text(json.dumps(record))
            server.stop()
            return f"stopped the Prefect server (pid {pid}, port {port}): no run or UI used it for {idle_s:g} s"


def main(argv: list[str]) -> None:
    """``python -m hybridflow.cli.server_idle PID PORT IDLE_S``."""
    pid, port, idle_s = int(argv[0]), int(argv[1]), float(argv[2])
    outcome = watch(pid, port, idle_s)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {outcome}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
