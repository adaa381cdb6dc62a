"""The database under the run store: its URL (``$HYBRIDFLOW_DB_URL`` or SQLite under ``$HYBRIDFLOW_HOME``), the code
version a run records, Alembic's configuration, and engines (SQLite pragmas, private files)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    create_engine,
    event,
)
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError

from hybridflow.flows.store.constants import _WRITE_OPTION, MIGRATIONS_DIR, SQLITE_BUSY_TIMEOUT_S

if TYPE_CHECKING:
    from alembic.config import Config

logger = logging.getLogger(__name__)

STORE_RETRY_ENV = "HYBRIDFLOW_STORE_RETRY_S"
STORE_RETRY_S = 120.0
"""Seconds a store server (PostgreSQL) that answered before may stay unreachable before its callers see the error
(``$HYBRIDFLOW_STORE_RETRY_S`` sets it): a run waits out a restart or a network blip rather than dies."""


# ----------------------------------------------------------------------------------------------- URLs and versions


def normalize_db_url(url: str) -> str:
    """Return ``url`` with a bare ``postgresql://`` or ``postgres://`` scheme rewritten to ``postgresql+psycopg://``.

    SQLAlchemy's default driver for the bare scheme is psycopg2, which HybridFlow does not install; psycopg 3 is a
    dependency. Other URLs (``sqlite:///...``, ``postgresql+psycopg2://...``) are returned unchanged.
    """
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def default_db_url() -> str:
    """The run store URL: ``$HYBRIDFLOW_DB_URL`` if set and non-empty (normalised by `normalize_db_url`), else
    ``sqlite:///<$HYBRIDFLOW_HOME or ~/.cache/hybridflow>/runs.db`` (an absolute path; the folder is created)."""
    url = os.environ.get("HYBRIDFLOW_DB_URL", "").strip()
    if url:
        return normalize_db_url(url)
    # The rule of hybridflow.engine.embedded_models.hybridflow_home, not imported: the store stays clear of the
    # worker-side engine package (the `hf runs` commands and the controller need no torch).
    home = Path(os.environ.get("HYBRIDFLOW_HOME", Path.home() / ".cache" / "hybridflow")).expanduser().absolute()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'runs.db'}"


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(root), *args],  # read-only: never rewrites the index
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@lru_cache(maxsize=1)
def code_version() -> str:
    """The running code's version: the package version, plus ``+g<12-hex commit>`` (and ``.dirty`` if tracked files
    differ from it) when this module runs from a git checkout, e.g. ``0.1.0+g0825a05c1d2e.dirty``. Without git, or
    from an installed wheel, just the package version (``unknown`` if the package metadata is missing)."""
    try:
        version = metadata.version("hybridflow")
    except metadata.PackageNotFoundError:
        version = "unknown"
    root = Path(__file__).resolve().parent.parent
    if not ((root / "pyproject.toml").is_file() and (root / ".git").exists()):
        return version  # an installed copy: a git repository around site-packages says nothing about this code
    commit = _git(root, "rev-parse", "--short=12", "HEAD")
    if not commit:
        return version
    changes = _git(root, "status", "--porcelain", "--untracked-files=no")
    return f"{version}+g{commit}{'.dirty' if changes else ''}"


def alembic_config(url: str) -> Config:
    """An Alembic config for the run store's migrations (`MIGRATIONS_DIR`) against ``url``, for `RunStore.upgrade`
    and for writing new revisions by hand (``alembic.command.revision(alembic_config(url), ...)``)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("path_separator", "os")
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # ConfigParser interpolates '%'
    return config


# --------------------------------------------------------------------------------------------------------- engines


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # the driver emits no BEGIN of its own; `_sqlite_on_begin` does
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        _set_wal(cursor)
        cursor.execute("PRAGMA synchronous = NORMAL")  # safe with WAL: a crash loses at most the last commits
        cursor.execute("PRAGMA foreign_keys = ON")
    finally:
        cursor.close()


def _set_wal(cursor: Any) -> None:
    """``PRAGMA journal_mode = WAL`` (persistent in the file; several processes read and write). Two processes
    opening a new file at once may both convert it, and SQLite answers the loser "database is locked" without
    waiting its busy timeout: try again, for up to `SQLITE_BUSY_TIMEOUT_S`."""
    import sqlite3

    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _sqlite_on_begin(connection: Connection) -> None:
    immediate = connection.get_execution_options().get(_WRITE_OPTION, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _parse_url(url: str | URL) -> URL:
    try:
        parsed = make_url(normalize_db_url(url) if isinstance(url, str) else url)
    except ArgumentError as err:
        raise ValueError(
            f"cannot parse the run store URL {url!r} ({err}); use sqlite:////abs/path/runs.db or "
            "postgresql://user:password@host:5432/dbname (e.g. in HYBRIDFLOW_DB_URL)"
        ) from None
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise ValueError(
            f"unsupported database {parsed.get_backend_name()!r} in the run store URL "
            f"{parsed.render_as_string(hide_password=True)!r}; the run store supports sqlite:///path/runs.db and "
            "postgresql://user:password@host:5432/dbname"
        )
    return parsed


def _private_sqlite_file(path: Path) -> None:
    """Create the SQLite file (and its folder) readable by its owner only (0600: SQLite gives its ``-wal`` and
    ``-shm`` files the same mode); an existing one of this user's that others can read is made 0600 too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # O_EXCL: an existing file is never opened here, since closing any descriptor of a SQLite file drops the POSIX
    # locks this process's connections hold on it (and another store in this process may be writing)
    with contextlib.suppress(FileExistsError, PermissionError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))  # an empty file: an empty database
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            info = file.stat()
            if info.st_uid == os.getuid() and info.st_mode & 0o077:
                file.chmod(0o600)
        except OSError:
            continue


def _create_engine(url: URL) -> Engine:
    if url.get_backend_name() == "sqlite":
        database = url.database
        if database and database != ":memory:" and not database.startswith("file:"):
            _private_sqlite_file(Path(database))
        engine = create_engine(url)
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    engine = create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 10})
    event.listen(engine, "do_connect", _OutageRetry(url))
    return engine


class _OutageRetry:
    """The engine's ``do_connect``: once the server has answered, a connection refused or timed out is retried
    (0.5 s, doubling to 5 s) for up to `STORE_RETRY_S` seconds, with one warning naming the server and one when it
    answers again. Each session checks a connection out of the pool first (``pool_pre_ping`` replaces one the
    outage broke, through here), so writes and reads wait for the server. A server that never answered fails at
    once: a wrong URL is said at once."""

    def __init__(self, url: URL) -> None:
        self.where = url.render_as_string(hide_password=True)
        self.answered = False

    def __call__(self, dialect: Any, record: Any, cargs: tuple, cparams: dict) -> Any:
        window = float(os.environ.get(STORE_RETRY_ENV, STORE_RETRY_S))
        deadline = time.monotonic() + window
        delay, waited = 0.5, False
        while True:
            try:
                connection = dialect.connect(*cargs, **cparams)
            except dialect.loaded_dbapi.OperationalError as e:
                if not self.answered or time.monotonic() + delay > deadline:
                    raise
                if not waited:
                    reason = (str(e).strip().splitlines() or [""])[0]
                    logger.warning(
                        "the run store %s does not answer (%s): the run waits, retrying for up to %.0f s (%s)",
                        self.where,
                        reason,
                        window,
                        STORE_RETRY_ENV,
                    )
                    waited = True
                time.sleep(delay)
                delay = min(2 * delay, 5.0)
                continue
            if waited:
                logger.warning("the run store %s answers again", self.where)
            self.answered = True
            return connection
