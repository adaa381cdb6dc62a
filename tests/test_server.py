"""One Prefect server per HybridFlow home (`hybridflow.cli.server`, `hf server ...`), with real Prefect servers: a
second home never attaches to the first home's server, sees only its own and stops only its own."""

import json
import os
import shutil
import signal
import time

import pytest
from typer.testing import CliRunner

from hybridflow.cli import main, server, training
from hybridflow.slurm import network

runner = CliRunner()


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("DO_NOT_TRACK", "1")
    # `_connect_prefect` points this process's Prefect client at the server: restored after each test
    for name in ["PREFECT_API_URL", "PREFECT_LOGGING_LEVEL", *server.OFFLINE_ENV]:
        monkeypatch.delenv(name, raising=False)


def test_status_without_a_server_exits_1(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path))
    result = runner.invoke(main.app, ["server", "status"])
    assert result.exit_code == 1, result.output
    assert f"no Prefect server of {tmp_path} is running" in result.output
    assert server.stop() is False


def test_each_home_gets_its_own_server(tmp_path, monkeypatch, capsys):
    home_a, home_b = tmp_path / "a", tmp_path / "b"
    port = network.free_port()
    started = []  # (home, pid) of every server this test started: all stopped in `finally`

    def in_home(home):
        monkeypatch.setenv("HYBRIDFLOW_HOME", str(home))

    try:
        in_home(home_a)
        a = server.start(port=port)
        started.append((home_a, a.pid))
        assert (a.port, a.home, a.started, a.taken_port) == (port, home_a, True, None)

        in_home(home_b)
        assert server.status() is None  # A's server answers on `port`, but it is not B's
        # a record naming A's server (e.g. written by the old "reuse the server on this port" code) does not make it B's
        home_b.joinpath("prefect").mkdir(parents=True)
        home_b.joinpath("prefect", "server.json").write_text(json.dumps({"port": port, "pid": a.pid}))
        assert server.status() is None
        assert server.stop() is False
        assert server.healthy(a.api_url)

        b = server.start(port=port)  # the port is A's: B's own server on a free port
        started.append((home_b, b.pid))
        assert b.started and b.home == home_b and b.taken_port == port
        assert b.describe() == (  # the pid is the new server's, not the port holder's
            f"Prefect server of {home_b}: UI {b.ui_url} (started now, pid {b.pid}; port {port} is taken by something "
            "this home did not start, so a free port)"
        )
        assert b.port != port and b.pid != a.pid and server.healthy(b.api_url)
        recorded = json.loads(home_b.joinpath("prefect", "server.json").read_text())
        assert recorded == {"port": b.port, "pid": b.pid, "idle_stop_s": 60 * server.DEFAULT_IDLE_MINUTES}

        again = server.start(port=port)  # `hf run` again in B: reuses B's server
        assert (again.port, again.pid, again.started) == (b.port, b.pid, False)
        training.connect_prefect(None)
        out = capsys.readouterr().out
        assert f"Prefect server of {home_b}: UI {b.ui_url} (already running, pid {b.pid})" in out
        assert os.environ["PREFECT_API_URL"] == b.api_url

        status_b = server.status()
        assert (status_b.port, status_b.pid) == (b.port, b.pid)
        result = runner.invoke(main.app, ["server", "status"])
        assert result.exit_code == 0 and b.ui_url in result.output and f"pid {b.pid}" in result.output
        # every home's server on this machine is listed, with its home
        listed = result.output.split("Prefect servers on this machine", 1)[1]
        assert f"{home_b} (this home)" in listed and f"{home_a} " in listed and a.ui_url in listed, result.output
        in_home(home_a)
        status_a = server.status()
        assert (status_a.port, status_a.pid) == (a.port, a.pid)

        in_home(home_b)
        result = runner.invoke(main.app, ["server", "stop"])
        assert result.exit_code == 0 and f"stopped the Prefect server of {home_b}" in result.output
        assert server.status() is None and not server.healthy(b.api_url)
        assert server.healthy(a.api_url)  # B's stop left A's server alone
        monkeypatch.setattr(server, "DEFAULT_PORT", port)  # A's server where `hf server status` looks by default
        result = runner.invoke(main.app, ["server", "status"])
        assert result.exit_code == 1 and "was not started by this home" in result.output

        in_home(home_a)
        assert server.status().pid == a.pid
    finally:
        for home, pid in started:
            in_home(home)
            server.stop()
            if server._is_prefect_server(pid):  # stop() found it not to be this home's: kill it anyway
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    assert not server.healthy(a.api_url)


CHROMIUM = shutil.which("chromium")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/setup installs it)")
def test_a_server_no_run_or_ui_uses_stops_by_itself_and_an_open_ui_keeps_it(tmp_path, monkeypatch):
    """A home's server started to stop after 40 s unused (``hf server start --idle-minutes``): the Prefect UI open in
    headless Chromium (which polls the API about every 30 s) keeps it up past that; once the browser is closed the
    watcher stops it within the idle time and a few checks, and ``hf server status`` says it stopped by itself."""
    from playwright.sync_api import sync_playwright

    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path))
    idle_s = 40.0
    result = runner.invoke(main.app, ["server", "start", "--port", str(network.free_port()), "--idle-minutes", "0.667"])
    assert result.exit_code == 0, result.output
    assert "stops by itself once no run or UI has used it for 0.667 min" in result.output, result.output
    info = server.status()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
            )
            page = browser.new_page()
            page.goto(f"{info.ui_url}/runs", wait_until="networkidle")
            time.sleep(idle_s * 1.5)  # longer than the idle time: the page's polling is use
            assert server.status() is not None, (tmp_path / "prefect" / "server.log").read_text()[-2000:]
            browser.close()
        closed = time.monotonic()
        while server._is_own_server(info.pid):
            assert time.monotonic() - closed < idle_s + 30 + 15, "the unused server did not stop"
            time.sleep(0.5)
        # no sooner than the idle time after the page's last poll (at most ~30 s before the browser closed)
        assert time.monotonic() - closed > idle_s - 30
        result = runner.invoke(main.app, ["server", "status"])
        assert result.exit_code == 1 and "it stopped by itself at" in result.output, result.output
        log = tmp_path / "prefect" / "server.log"
        while "stopped the Prefect server" not in log.read_text():  # the watcher's line, once stop() has returned
            assert time.monotonic() - closed < idle_s + 30 + 45, log.read_text()[-2000:]
            time.sleep(0.2)
    finally:
        server.stop()


def test_log_lines_the_prefect_server_does_not_take_are_reported_not_written_to_stderr(capfd):
    """Prefect ships a flow run's log lines from a thread; when its server does not answer, its `APILogWorker`
    writes ``--- Error logging to API ---`` and the error to stderr without a newline (the next terminal line
    glued to it). Under `ship_api_logs_to` the same failure is one warning of the logger given, stderr untouched."""
    import logging

    from prefect.logging.handlers import APILogWorker, emit_api_log
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from hybridflow.flows.reporting import ship_api_logs_to

    class Kept(logging.Handler):
        records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    line = {"name": "hybridflow.test", "level": 20, "message": "a line", "timestamp": "2026-12-01T00:00:00Z"}
    errors = logging.getLogger("prefect.hybridflow.test_api_logs")
    errors.addHandler(kept := Kept())
    try:
        with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{network.free_port()}/api"}):  # nothing listens
            emit_api_log(dict(line))
            APILogWorker.drain_all(timeout=30)
            assert "--- Error logging to API ---" in capfd.readouterr().err  # Prefect's own way
            with ship_api_logs_to(errors):
                emit_api_log(dict(line))
                APILogWorker.drain_all(timeout=30)
    finally:
        errors.removeHandler(kept)
    assert "Error logging to API" not in capfd.readouterr().err
    [record] = kept.records
    assert "the Prefect server did not take 1 log lines: ConnectError" in record.getMessage()
