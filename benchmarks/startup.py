"""Benchmark: time from `hf run` to the first generate, worker groups on Slurm vs local processes.

Runs ``hf run`` (a fresh process, as a user would) on a one-iteration config and reads from the run store when
iteration 1 started (its first stage is generate; validation before training is off). The Prefect server is
started once beforehand and shared, so its own start-up (~10-20 s, once per machine) is not counted; the figure
covers importing the stack, recording the run, submitting the worker groups (sbatch or local processes),
torch.distributed rendezvous, loading the models and reading the data. ``cold``: without a warm process
(``HYBRIDFLOW_WARM_START_S=0``: the controller and the ranks' fork server import for themselves); ``warm``: forked from
a warm process (`hybridflow.cli.warm_start`) that one untimed run started first.

    .venv/bin/python benchmarks/startup.py [--executor local|slurm|both] [--start cold|warm|both] [--repeats 3]

Slurm needs a cluster (``bash hybridflow/slurm/dev_cluster.sh start`` as root gives a one-node one).
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC
from pathlib import Path

from hybridflow.cli import server
from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent
HF = str(Path(sys.executable).parent / "hf")


def one_run(config: Path, executor: str, api: str, tmp: Path, extra: list[str], env: dict) -> tuple[float, float]:
    """Seconds from launching `hf run` to iteration 1's start, and to the process's exit."""
    db = f"sqlite:///{tmp / 'runs.db'}"
    overrides = ["trainer.total_iterations=1", "trainer.val_before_train=false", f"trainer.output_dir={tmp}", *extra]
    args = [HF, "run", str(config), "--executor", executor, "--db", db, "--prefect-api", api]
    for item in overrides:
        args += ["-o", item]
    log = tmp / f"{executor}.log"
    launched = time.time()
    with log.open("wb") as out:
        code = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    finished = time.time()
    if code != 0:
        raise SystemExit(f"hf run failed ({code}):\n{log.read_text()}")
    store = RunStore(db)
    run = store.list_runs()[0]
    first = next(i for i in store.iterations(run.id) if i.step == 1)
    return first.started_at.replace(tzinfo=UTC).timestamp() - launched, finished - launched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executor", choices=["local", "slurm", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--start", choices=["cold", "warm", "both"], default="both", help="without or with a warm process"
    )
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "grpo_tiny.yaml")
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as home:
        user_home = os.environ.get("HYBRIDFLOW_HOME")
        os.environ["HYBRIDFLOW_HOME"] = home  # the server's database and state file only: models stay where they are
        info = server.start(port=port)
        _restore("HYBRIDFLOW_HOME", user_home)
        try:
            for executor in ["local", "slurm"] if args.executor == "both" else [args.executor]:
                for start in ["cold", "warm"] if args.start == "both" else [args.start]:
                    label = f"[{executor}, {start}]"
                    with tempfile.TemporaryDirectory(prefix="hf-bench-") as runtime:  # short: a socket's path
                        env = {**os.environ, "XDG_RUNTIME_DIR": runtime, "HYBRIDFLOW_WARM_START_S": "60"}
                        if start == "cold":
                            env["HYBRIDFLOW_WARM_START_S"] = "0"
                        else:  # a run that starts the warm process (its controller waits for its imports)
                            first, total = _timed(args, executor, info.api_url, env)
                            print(f"{label} run that started the warm process: first generate after {first:.1f} s")
                        firsts = []
                        for attempt in range(args.repeats):
                            first, total = _timed(args, executor, info.api_url, env)
                            firsts.append(first)
                            timing = f"first generate after {first:.1f} s, exit after {total:.1f} s"
                            print(f"{label} run {attempt + 1}: {timing}")
                    print(f"{label} hf run -> first generate: median {statistics.median(firsts):.1f} s")
        finally:
            os.environ["HYBRIDFLOW_HOME"] = home
            server.stop()
            _restore("HYBRIDFLOW_HOME", user_home)


def _timed(args: argparse.Namespace, executor: str, api: str, env: dict) -> tuple[float, float]:
    (ROOT / ".cache").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ROOT / ".cache") as tmp:
        return one_run(args.config, executor, api, Path(tmp), args.override, env)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


if __name__ == "__main__":
    main()
