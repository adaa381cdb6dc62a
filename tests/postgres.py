"""A throwaway PostgreSQL server for tests (no mocks: the real server binaries).

`postgres_server()` runs ``initdb`` into a fresh temporary folder, starts the server with ``pg_ctl`` on
127.0.0.1 and a free port (its Unix socket in that folder too, with ``trust`` authentication and durability off for
speed), yields a `PostgresServer`, and stops it (``pg_ctl stop -m immediate``) and deletes the folder on exit.
PostgreSQL refuses to run as root, so when the tests run as root every server command runs as the ``postgres``
user (``runuser -u postgres --``) in a folder owned by that user.

The binaries are looked up in ``$PG_BIN``, then next to ``pg_ctl`` on ``PATH``, then in the newest
``/usr/lib/postgresql/<version>/bin``; `unavailable_reason` says why a server cannot be started here (tests skip).
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from hybridflow.slurm.network import free_port

SERVER_SETTINGS = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=50"


def find_bin_dir() -> Path | None:
    """The folder holding ``initdb`` and ``pg_ctl``, or None."""
    candidates = []
    if os.environ.get("PG_BIN"):
        candidates.append(Path(os.environ["PG_BIN"]))
    if shutil.which("pg_ctl"):
        candidates.append(Path(shutil.which("pg_ctl")).resolve().parent)

    def version(path: Path) -> float:
        try:
            return float(path.parent.name)
        except ValueError:
            return 0.0

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file():
            return folder
    return None


def unavailable_reason() -> str | None:
    """Why no test server can be started here (None if one can)."""
    if find_bin_dir() is None:
        return "PostgreSQL server binaries (initdb, pg_ctl) not found; install postgresql or set PG_BIN"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the PostgreSQL server as"
        if shutil.which("runuser") is None:
            return "running as root and runuser(1) is missing, needed to run the server as 'postgres'"
    return None


@dataclass
class PostgresServer:
    """A running test server: ``host``:``port``, superuser ``postgres`` with trust authentication."""

    bin_dir: Path
    base: Path
    port: int
    host: str = "127.0.0.1"
    user: str = "postgres"
    _counter: itertools.count = field(default_factory=itertools.count, repr=False)

    def url(self, dbname: str = "postgres") -> str:
        """A ``postgresql://`` URL for database ``dbname`` (the bare scheme, as a user would write it)."""
        return f"postgresql://{self.user}@{self.host}:{self.port}/{dbname}"

    def stop(self) -> None:
        """Stop the server (``pg_ctl stop -m fast``: clients disconnected), keeping its data for `start`."""
        _run(
            [str(self.bin_dir / "pg_ctl"), "-D", str(self.base / "data"), "-m", "fast", "-w", "stop"], self.base, "stop"
        )

    def start(self) -> None:
        """Start the server `stop` stopped, on the same port with the same data."""
        options = f"-h {self.host} -p {self.port} -k {self.base} {SERVER_SETTINGS}"
        data, log = self.base / "data", self.base / "server.log"
        start = [str(self.bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "30"]
        _run([*start, "start"], self.base, "pg_ctl start")

    def create_database(self) -> str:
        """Create a new, empty database with a unique name and return its name."""
        name = f"test_{next(self._counter)}"
        with psycopg.connect(host=self.host, port=self.port, user=self.user, dbname="postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return name


def _as_server_user(args: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args


def _run(args: list[str], cwd: Path, what: str) -> None:
    done = subprocess.run(_as_server_user(args), cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {done.stdout}\n{done.stderr}")


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """Start a throwaway server (see the module docstring) and stop and delete it on exit.

    Raises RuntimeError (with the server log) if it cannot be started; check `unavailable_reason` first to skip.
    """
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise RuntimeError(unavailable_reason())
    base = Path(tempfile.mkdtemp(prefix="hybridflow-pg-"))
    data, log = base / "data", base / "server.log"
    started = False
    try:
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(base, entry.pw_uid, entry.pw_gid)
        initdb_options = ["-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"]
        _run([str(bin_dir / "initdb"), "-D", str(data), *initdb_options], base, "initdb")
        for attempt in range(3):  # the free port may be taken between finding and binding it
            port = free_port()
            options = f"-h 127.0.0.1 -p {port} -k {base} {SERVER_SETTINGS}"
            try:
                start = [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "30"]
                _run([*start, "start"], base, "pg_ctl start")
                started = True
                break
            except RuntimeError as err:
                if attempt == 2:
                    server_log = log.read_text(errors="replace") if log.exists() else "(no log)"
                    raise RuntimeError(f"{err}\nserver log:\n{server_log[-4000:]}") from None
        yield PostgresServer(bin_dir=bin_dir, base=base, port=port)
    finally:
        if started:
            _run([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], base, "pg_ctl stop")
        shutil.rmtree(base, ignore_errors=True)
