"""One Prefect server per HybridFlow home (`hybridflow.cli.server`, `hf server ...`), with real Prefect servers: a
second home never attaches to the first home's server, sees only its own and stops only its own."""

import json
import os
import signal

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
        assert json.loads(home_b.joinpath("prefect", "server.json").read_text()) == {"port": b.port, "pid": b.pid}

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
