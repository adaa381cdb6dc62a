"""Runs started from Prefect: ``hf deploy`` serves the ``hybridflow-launch`` deployment; a run triggered through
Prefect's API (as the UI's Run button and ``prefect deployment run`` do) is recorded and trained as ``hf run`` would,
listed by ``hf runs list``, and continued by ``hf resume`` after its controller is SIGKILLed."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from tiny_runs import wait_inside_iteration, write_reward

from hybridflow.engine.config import load_config
from hybridflow.flows.store.run_store import RunStore

HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
ROOT = Path(__file__).resolve().parents[1]
COMPARED = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss"]


def _config(tmp_path: Path, tiny_model_dir: Path) -> Path:
    cfg = load_config(
        ROOT / "examples" / "grpo_tiny.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"trainer.output_dir={tmp_path / 'out'}",
            f"reward.custom_function={write_reward(tmp_path)}",
            "trainer.num_threads=1",
            "trainer.save_freq=1",
            "trainer.val_before_train=false",
        ],
    )
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def _wait_for_deployment(name: str, serve: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            try:
                client.read_deployment_by_name(name)
                return
            except Exception:
                assert serve.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)


def test_a_run_started_through_prefects_api_is_recorded_trained_and_resumed_after_sigkill(
    prefect_api, tmp_path, tiny_model_dir
):
    """``hf deploy`` on this host; ``run_deployment`` with a config file (a path relative to the folder hf deploy
    runs in) and an override: the run is in the store (the override applied), hf runs list shows it; its
    controller (the flow run's process) SIGKILLed inside iteration 2, hf resume takes it over and completes it
    with the metrics of the same run started by hf run."""
    from prefect.deployments import run_deployment

    config = _config(tmp_path, tiny_model_dir)
    db = f"sqlite:///{tmp_path / 'deployed.db'}"
    log = tmp_path / "deploy.log"
    with log.open("ab") as out:
        serve = subprocess.Popen(
            [HF, "deploy", "--name", "test", "--db", db, "--prefect-api", prefect_api],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ},
            cwd=tmp_path,  # the run's config is given relative to it
        )
    try:
        _wait_for_deployment("hybridflow-launch/test", serve, log)
        flow_run = run_deployment(
            "hybridflow-launch/test",
            parameters={"config": config.name, "overrides": ["actor.optim.lr=5.0e-5"]},
            timeout=0,  # triggered, not awaited: the deployment's process trains it
        )
        store = RunStore(db)
        run_id = wait_inside_iteration(serve, store, 2, log)
        record = store.get_run(run_id)
        assert record.config["actor"]["optim"]["lr"] == 5.0e-5  # the override reached the recorded config
        os.kill(record.lease_pid, signal.SIGKILL)  # the controller: the flow run's process under hf deploy
        listed = subprocess.run([HF, "runs", "list", "--db", db], capture_output=True, text=True, timeout=120)
        assert run_id in listed.stdout and "crashed" in listed.stdout, listed.stdout + listed.stderr
        resumed = subprocess.run(
            [HF, "resume", run_id, "--db", db, "--prefect-api", prefect_api],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
    assert store.get_run(run_id).status == "completed"
    deployed = {(m.step, m.name): m.value for m in store.metrics(run_id) if m.name in COMPARED}

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # Prefect's side: the triggered flow run did not complete
        assert client.read_flow_run(flow_run.id).state.type.value in ("CRASHED", "FAILED", "CANCELLED")

    direct_db = f"sqlite:///{tmp_path / 'direct.db'}"
    direct = subprocess.run(
        [HF, "run", str(config), "-o", "actor.optim.lr=5.0e-5", "--db", direct_db, "--prefect-api", prefect_api],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert direct.returncode == 0, direct.stdout + direct.stderr
    direct_store = RunStore(direct_db)
    (direct_run,) = direct_store.list_runs()
    expected = {(m.step, m.name): m.value for m in direct_store.metrics(direct_run.id) if m.name in COMPARED}
    assert {step for step, _ in deployed} == {1, 2}
    assert deployed == expected
