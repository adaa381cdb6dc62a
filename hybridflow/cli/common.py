"""What every command group of ``hf`` shares: the console, the ``--db`` and ``--prefect-api`` options, and opening
the run store and a run in it with a one-line error."""

from __future__ import annotations

import os
import re
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

# markup off: what the CLI prints holds text it did not write (error messages, paths, prompts and samples), whose
# [...] rich would read as tags (gloo's "[/__w/pytorch/...]" raised MarkupError); styles go by `styled` and style=
console = Console(soft_wrap=True, markup=False, width=None if sys.stdout.isatty() else 200)  # piped: no truncation


_CAUSE = re.compile(r"^\s*((?:[\w.]+\.)?\w*(?:Error|Exception)): (.+)$")


def error_cause(message: str) -> str | None:
    """The last ``SomeError: text`` line of a (worker's) traceback inside an error message, or None."""
    found = [m for line in message.splitlines() if (m := _CAUSE.match(line))]
    return f"{found[-1].group(1).rsplit('.', 1)[-1]}: {found[-1].group(2)}" if found else None


def styled(*parts: str | tuple[str, str]) -> Text:
    """One line of plain text with styled parts, e.g. ``styled("run ", (run_id, "bold"), " recorded")``."""
    return Text.assemble(*parts)


DbOption = Annotated[
    str | None,
    typer.Option(
        "--db", help="SQLAlchemy URL of the run store (default: $HYBRIDFLOW_DB_URL or SQLite under $HYBRIDFLOW_HOME)"
    ),
]
PrefectOption = Annotated[
    str | None,
    typer.Option(
        "--prefect-api", help="use this Prefect API instead of starting a local server, e.g. http://host:4200/api"
    ),
]
OverrideOption = Annotated[list[str] | None, typer.Option("-o", "--override", help="key.sub=value (repeatable)")]
ExecutorOption = Annotated[
    str | None, typer.Option(help="where the worker group runs: local or slurm (-o placement.executor=...)")
]
DryRunOption = Annotated[
    bool,
    typer.Option("--dry-run", help="check everything, print the resolved config and exit without recording a run"),
]


def _store(db: str | None):
    """The run store (`--db` or the default); an unreachable or unusable one: its one-line message, exit 2."""
    from hybridflow.flows.store.run_store import RunStore, RunStoreError

    if db:  # the flow (and its workers) read the same variable; a URL never goes into flow parameters
        os.environ["HYBRIDFLOW_DB_URL"] = db
    try:
        return RunStore(db)
    except (RunStoreError, ValueError) as e:
        console.print(f"{e}", style="red")
        raise typer.Exit(2) from None


def _get_run(store, run_id: str):
    """The run record, or exit 2 with the store's message (which names the id and `hf runs list`)."""
    from hybridflow.flows.store.run_store import UnknownRunError

    try:
        return store.get_run(run_id)
    except UnknownRunError as e:
        console.print(f"{e}", style="red")
        raise typer.Exit(2) from None


def _status_text(record) -> str:
    """The run's status, with ``running`` told apart: ``running`` (its controller heartbeats) or ``crashed`` (its
    controller died: last heartbeat time)."""
    from hybridflow.flows.store.run_store import controller_state

    if record.status != "running" or controller_state(record) == "live":
        return record.status
    beat = f"{record.heartbeat_at:%Y-%m-%d %H:%M:%S}" if record.heartbeat_at else "none"
    return f"crashed (last heartbeat {beat})"
