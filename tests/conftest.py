"""Shared fixtures: the tiny random model folder (built once per test session, real files on disk)."""

import os

import pytest

from hybridflow.cli import server
from hybridflow.slurm import network

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items):
    """The suite runs on two pytest-xdist workers (pyproject's addopts: ``-n 2 --dist loadgroup``); each test goes to
    whichever worker is free, except those of one group, which run in one worker, one after another:

    - ``slurm``: every test on the one-node Slurm cluster (the `slurm_cluster` fixture, or a parameter naming
      slurm): two at once would queue each other's jobs, and some drain the node or preempt its jobs;
    - ``<module>``: a module's tests that share one of its module-scoped fixtures (a reference run, worker groups
      trained test after test): set up once, in the order the module gives.
    ``-n 0`` runs the suite in this process, in the same order."""
    for item in items:
        params = getattr(item, "callspec", None)
        on_slurm = "slurm_cluster" in item.fixturenames or (
            params is not None and any("slurm" in str(value) for value in params.params.values())
        )
        scopes = {d.scope for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs}
        if on_slurm:
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif "module" in scopes:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


# Prefect reads its settings once, when it is first imported (here: while test modules are collected), so the
# session server's URL is set now, before that, and the `prefect_api` fixture starts the server on this port; set
# later, the in-process flows would quietly run on an ephemeral server of Prefect's own instead.
PREFECT_PORT = network.free_port()
server.use_server(f"http://127.0.0.1:{PREFECT_PORT}/api")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Folder with a random tiny LlamaForCausalLM + byte-level BPE tokenizer (see hybridflow.engine.tiny)."""
    from hybridflow.engine.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real Prefect server for the session, started and stopped by `hybridflow.cli.server` (as `hf run` does),
    on `PREFECT_PORT` with its database in a temporary HYBRIDFLOW_HOME; the test process's client points at it."""
    from prefect.settings import PREFECT_API_URL

    home = tmp_path_factory.mktemp("prefect_home")
    mp = pytest.MonkeyPatch()
    mp.setenv("HYBRIDFLOW_HOME", str(home))
    info = server.start(port=PREFECT_PORT)
    assert server.status() is not None, "hf server status does not see the server it started"
    mp.undo()  # the rest of the session keeps its own HYBRIDFLOW_HOME (e.g. the prepared SmolLM2)
    assert info.port == PREFECT_PORT, f"port {PREFECT_PORT} was taken meanwhile: {info.describe()}"
    assert PREFECT_API_URL.value() == info.api_url, "Prefect's client settings do not point at the session server"
    yield info.api_url
    mp.setenv("HYBRIDFLOW_HOME", str(home))
    assert server.stop()
    mp.undo()


# `dev_cluster.sh start` takes ~60 s when it installs the Debian packages and ~4 s once they are there; a bound well
# above that turns a hang (a daemon holding the script's pipes, a daemon that never answers) into an error that
# shows the daemons' logs instead of a silent wait.
SLURM_START_TIMEOUT_S = 300


def start_dev_cluster(timeout_s: float = SLURM_START_TIMEOUT_S) -> str | None:
    """Run ``hybridflow/slurm/dev_cluster.sh start`` with its output captured through pipes (as a fresh machine's first
    test
    run does). Returns None when the cluster is up, else why not: the script's output and the tail of every daemon
    log under ``$HYBRIDFLOW_SLURM_DIR/log``."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "hybridflow" / "slurm" / "dev_cluster.sh"
    try:
        done = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        return (
            f"{script} start did not return within {timeout_s:.0f} s{_text(e.stdout)}{_text(e.stderr)}{_slurm_logs()}"
        )
    if done.returncode != 0:
        return f"{script} start failed (exit {done.returncode}):\n{done.stdout}{done.stderr}{_slurm_logs()}"
    return None


def _text(output: bytes | str | None) -> str:
    if not output:
        return ""
    return "\n" + (output.decode(errors="replace") if isinstance(output, bytes) else output)


def _slurm_logs(lines: int = 20) -> str:
    from pathlib import Path

    log_dir = Path(os.environ.get("HYBRIDFLOW_SLURM_DIR", "/var/lib/hybridflow-slurm")) / "log"
    parts = []
    for log in sorted(log_dir.glob("*")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n" + "\n".join(parts) if parts else f"\n(no daemon logs in {log_dir})"


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real one-node Slurm cluster, started by the project's `hybridflow/slurm/dev_cluster.sh` (munge, MariaDB +
    slurmdbd,
    slurmctld, slurmd; installed from Debian when missing). Needs root; CI (CI=true) fails rather than skips."""
    import shutil
    import socket

    why = "starting the development Slurm cluster needs root" if os.geteuid() != 0 else start_dev_cluster()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    assert shutil.which("sbatch"), "the cluster started but sbatch is not on PATH"
    return {"node": socket.gethostname().split(".")[0]}
