"""Warm start (`hybridflow.cli.warm_start`): `hf run` / `hf resume` forked from a warm process, as real processes."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from procs import alive, children, cmdline, parent

from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
IDLE_S = 10


def test_runs_are_forked_from_a_warm_process_that_dies_with_them_and_exits_when_idle(tmp_path, prefect_api):
    """The first `hf run` starts a warm process for its user (a private XDG_RUNTIME_DIR here); later commands are
    forked from it: their output reaches the caller's pipes, their exit status is the caller's, the run store records
    the caller's pid as the controller's, and a caller SIGKILLed takes its controller with it (the run then shows as
    crashed and `hf resume`, forked too, completes it). A bad value of HYBRIDFLOW_WARM_START_S is refused naming
    it; 0 runs the command without the warm process. `hf sft train`, `hf rm train` and `hf verl` are forked too.
    Idle for HYBRIDFLOW_WARM_START_S, the warm process exits and removes its socket. Its fork server killed between
    two commands, the next command's ranks come from a new one."""
    runtime = Path(tempfile.mkdtemp(prefix="hf-warm-"))  # short: a socket's path has at most 107 bytes
    try:
        _check_warm_start(runtime, tmp_path, prefect_api)
    finally:
        shutil.rmtree(runtime)


def _check_warm_start(runtime: Path, tmp_path: Path, prefect_api: str) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "HYBRIDFLOW_WARM_START_S": str(IDLE_S)}
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    common = ["--db", db, "--prefect-api", prefect_api, "-o", "trainer.val_before_train=false"]

    def hf(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([HF, *args], capture_output=True, text=True, env=env | extra, cwd=ROOT, timeout=300)

    first = hf("run", "examples/grpo_tiny.yaml", *common, "-o", f"trainer.output_dir={tmp_path / 'a'}")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "completed" in first.stdout  # the forked controller wrote to the caller's pipe
    (log,) = runtime.glob("hybridflow/warm-*.sock.log")
    warm_pid = int(re.search(r"warm process (\d+): listening", log.read_text())[1])
    forked = re.findall(r"forked controller (\d+) for hf run .* \(caller pid (\d+)\)", log.read_text())
    assert len(forked) == 1, log.read_text()

    refused = hf("run", "examples/grpo_tiny.yaml", *common, "-o", "trainer.bogus=1")
    assert refused.returncode == 2 and "trainer.bogus" in refused.stdout + refused.stderr, refused.stdout
    assert log.read_text().count("forked controller") == 2  # the refusal came from a forked controller too
    for command in (
        ["sft", "train", "examples/tool_calc_sft_smollm2.yaml"],
        ["rm", "train", "examples/rm_smollm2.yaml"],
    ):
        refused = hf(*command, "--db", db, "-o", "trainer.bogus=1")
        assert refused.returncode == 2 and "trainer.bogus" in refused.stdout + refused.stderr, refused.stdout
    refused = hf("verl", "trainer.bogus=1", "--db", db)
    assert refused.returncode == 2 and "trainer.bogus" in refused.stdout + refused.stderr, refused.stdout
    for command in ("sft train", "rm train", "verl"):  # every command that starts a run's controller
        assert f"for hf {command} " in log.read_text(), log.read_text()
    assert log.read_text().count("forked controller") == 5

    (server,) = [p for p in children(warm_pid) if b"multiprocessing.forkserver" in cmdline(p)]
    os.kill(server, signal.SIGKILL)  # the warm fork server lost: the next command's ranks need a new one
    proc = subprocess.Popen(
        [HF, "run", "examples/grpo_tiny.yaml", *common, "-o", f"trainer.output_dir={tmp_path / 'b'}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
    )
    store = RunStore(db)
    run_id = None
    deadline = time.monotonic() + 120
    while run_id is None:  # the second run of the store (the first completed)
        runs = [r for r in store.list_runs() if r.status == "running"]
        run_id = runs[0].id if runs else None
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
        time.sleep(0.05)
    mine = rf"forked controller (\d+) for hf run .* \(caller pid {proc.pid}\)"
    controller = int(re.findall(mine, log.read_text())[0])
    assert parent(controller) == warm_pid
    wait_inside_iteration_of(proc, store, run_id, 1)
    assert store.get_run(run_id).lease_pid == proc.pid  # the pid a user sees and signals
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while alive(controller) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(controller), "the forked controller outlived its SIGKILLed caller"
    listed = hf("runs", "list", "--db", db)
    assert "crashed" in listed.stdout, listed.stdout
    resumed = hf("resume", run_id, "--db", db, "--prefect-api", prefect_api)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert store.get_run(run_id).status == "completed"
    assert log.read_text().count("forked controller") == 7

    bad = hf("run", "examples/grpo_tiny.yaml", *common, HYBRIDFLOW_WARM_START_S="soon")
    assert bad.returncode == 2 and "HYBRIDFLOW_WARM_START_S='soon'" in bad.stdout, bad.stdout + bad.stderr
    cold = hf("run", "examples/grpo_tiny.yaml", *common, "-o", "trainer.bogus=1", HYBRIDFLOW_WARM_START_S="0")
    assert cold.returncode == 2 and "trainer.bogus" in cold.stdout + cold.stderr
    assert log.read_text().count("forked controller") == 7  # neither reached the warm process

    deadline = time.monotonic() + IDLE_S + 10
    while alive(warm_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(warm_pid), f"the warm process did not exit after {IDLE_S} s idle"
    assert not list(runtime.glob("hybridflow/warm-*.sock")), "the idle warm process left its socket"


def wait_inside_iteration_of(proc: subprocess.Popen, store: RunStore, run_id: str, step: int) -> None:
    """Wait until run `run_id` of `store` is inside iteration `step` (started, not ended)."""
    deadline = time.monotonic() + 120
    while True:
        started = {i.step: i for i in store.iterations(run_id)}
        if step in started and started[step].ended_at is None:
            return
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
        time.sleep(0.05)
