"""What reaches the terminal, and the log file of a run's controller.

`hf` prints warnings and errors on the terminal through one handler (`TERMINAL`, installed by `setup_terminal`).
While a run trains (`run_log`), every log line of the controller process at INFO and above also goes to the run's
log file, ``$HYBRIDFLOW_HOME/logs/<run_id>.log``: the controller's and the workers' lines (as the flow run's logs
in the Prefect UI show them) and Prefect's own. The terminal then shows our lines only: Prefect's client records
(connection errors while its server is down, retries), its background services' (`PREFECT_INTERNAL_LOGGER`) and
the errors of its log shipping, which Prefect writes straight to stderr without ending the line
(`hybridflow.flows.reporting.ship_api_logs_to`), go to the file alone; so do the reporting lines about a Prefect
server that the CLI's `ServerWatch` restarts by itself (it says so in a line of its own).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from hybridflow.engine.embedded_models import hybridflow_home

FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

REPORTING_LOGGER = "hybridflow.flows.reporting"
"""The logger of the Prefect UI's reporting (artifacts, iteration subflows): its lines about a server that does not
answer stay off the terminal while a `ServerWatch` handles the outage."""


PREFECT_INTERNAL_LOGGER = "prefect._internal"
"""Prefect's logger of its background services (the ``EventsWorker`` of its event-loop thread, ...): Prefect's
logging config gives it a stderr handler of its own and no propagation, so its errors while the server is down
would bypass `TERMINAL`'s filter; during a run it writes to the run's log file instead."""


class _TerminalFilter(logging.Filter):
    """Which records `TERMINAL` prints: outside a run, all but Prefect's ERROR records of a failed task or flow run
    (each with the whole traceback; `hf run` prints the failure once, its first line and its cause); inside
    `run_log`, none of Prefect's below CRITICAL, and none of `REPORTING_LOGGER`'s when `quiet_reporting`."""

    def __init__(self) -> None:
        super().__init__()
        self.in_run = False
        self.quiet_reporting = False

    def filter(self, record: logging.LogRecord) -> bool:
        prefects = record.name == "prefect" or record.name.startswith("prefect.")
        if not self.in_run:
            return not (record.name in ("prefect.task_runs", "prefect.flow_runs") and record.levelno >= logging.ERROR)
        if prefects and record.levelno < logging.CRITICAL:
            return False
        return not (self.quiet_reporting and record.name == REPORTING_LOGGER)


TERMINAL = logging.StreamHandler()
"""The handler that prints log records on the terminal (stderr), WARNING and above."""
_FILTER = _TerminalFilter()


def setup_terminal() -> None:
    """Warnings and errors on the terminal (`TERMINAL`); INFO lines (the controller's and the workers') go to the
    flow run's logs in the Prefect UI (`hybridflow.flows.reporting.FlowLogs`) and, during a run, to its log file."""
    TERMINAL.setLevel(logging.WARNING)
    TERMINAL.addFilter(_FILTER)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", handlers=[TERMINAL])


def run_log_path(run_id: str) -> Path:
    """``$HYBRIDFLOW_HOME/logs/<run_id>.log``: the controller's log file of run `run_id` (appended by each
    session)."""
    return hybridflow_home() / "logs" / f"{run_id}.log"


@contextlib.contextmanager
def run_log(run_id: str, quiet_reporting: bool) -> Iterator[Path]:
    """While a run trains: its log file (`run_log_path`) takes every record at INFO and above, the terminal only
    ours (see `_TerminalFilter`), and the errors of Prefect's log shipping go to the file (`ship_api_logs_to`).
    `quiet_reporting`: the CLI watches (and restarts) the local Prefect server itself. Yields the file's path."""
    from hybridflow.flows.reporting import ship_api_logs_to

    path = run_log_path(run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    internal = logging.getLogger(PREFECT_INTERNAL_LOGGER)
    internal_handlers, internal.handlers = internal.handlers, [handler]
    _FILTER.in_run, _FILTER.quiet_reporting = True, quiet_reporting
    try:
        with ship_api_logs_to(logging.getLogger("prefect.hybridflow.api_logs")):
            yield path
    finally:
        _FILTER.in_run = _FILTER.quiet_reporting = False
        internal.handlers = internal_handlers
        root.removeHandler(handler)
        handler.close()
