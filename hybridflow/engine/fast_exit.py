"""Ending a process that imported torch without the interpreter's teardown of its modules.

A Python process that imported torch, transformers and tensordict spends 2.0 s in its own exit here (AMD EPYC,
2 cores; ``benchmarks/process_exit.py``, median of 3), after its last line ran: the interpreter's final garbage
collection walks the millions of objects those modules made. Every rank of every run and every ``hf run`` paid it,
and a controller waits for its ranks' exits. :func:`exit_process` does what an orderly exit does that anything
relies on (threads joined, exit hooks run, logs and output flushed), then ends the process at once: 0.12 s.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int | str | None) -> NoReturn:
    """End this process with `code` (an exit status; None is 0; a string is printed to stderr and ends with 1, as
    ``sys.exit`` does), skipping the interpreter's teardown of its modules.

    First, in the interpreter's own order: ``threading``'s exit hooks (Prefect drains its queues of logs and events
    to its server there) and a join of every non-daemon thread, then the ``atexit`` functions (``weakref.finalize``
    clean-ups, trackers' ends), then the logging handlers and stdout/stderr are flushed. What is left undone is only
    the release of memory and of objects whose ``__del__`` the interpreter might have run: callers end only after
    closing what they opened (a rank's process group, a group's sockets). Off the main thread (or on an interpreter
    without ``threading._shutdown``) it raises SystemExit(code) instead: the usual exit."""
    shutdown_threads = getattr(threading, "_shutdown", None)  # what the interpreter calls first at its exit
    if shutdown_threads is None or threading.current_thread() is not threading.main_thread():
        raise SystemExit(code)  # an interpreter without it, or a caller off the main thread: the usual exit
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    shutdown_threads()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing more can be written
            stream.flush()
    os._exit(status)
