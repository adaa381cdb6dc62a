"""Benchmark: a worker group's start-up, first and after it lost a rank, locally and on Slurm.

The group of the tiny GRPO run's pool (``RLHFWorker``, 2 ranks): seconds from creating it to its models loaded
(``WorkerGroup`` + ``init_model``), for a first start (a new Slurm job, whose node agent imports the engine once) and
for a relaunch after a rank was SIGKILLed mid-call (as the run's recovery relaunches it: on Slurm in the job the
lost group kept, its agents forking the new ranks from the fork server that already imported the engine). Prints
each try and the medians.

    .venv/bin/python benchmarks/relaunch.py [--executor local|slurm|both] [--repeats 3]

Slurm needs a cluster (``bash hybridflow/slurm/dev_cluster.sh start`` as root gives a one-node one).
"""

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from hybridflow.engine.config import load_config
from hybridflow.engine.embedded_models import prepare_model
from hybridflow.slurm.channel import create_secret
from hybridflow.slurm.worker_group import WorkerGroup, WorkerGroupError

# A local rank is forked by a fork server that imports this script again (multiprocessing's __mp_main__): what it
# imports at its top is paid by every rank, hence the controller's modules (Prefect) are imported where used.

ROOT = Path(__file__).resolve().parent.parent


def _started(cfg, pool, run_dir: Path) -> tuple[WorkerGroup, float]:
    from hybridflow.flows.groups import group_spec

    began = time.monotonic()
    group = WorkerGroup(
        group_spec(cfg, pool),
        run_dir=run_dir,
        data_dir=run_dir / "data",
        secret_path=run_dir.parent / "secret",
        worker_kwargs={"config": cfg.model_dump(mode="json"), "roles": list(pool.roles)},
    )
    group.init_model()
    return group, time.monotonic() - began


def measure(executor: str, repeats: int) -> None:
    model = prepare_model("tiny")
    with tempfile.TemporaryDirectory(dir=ROOT / ".cache") as tmp_dir:
        tmp = Path(tmp_dir)
        cfg = load_config(
            ROOT / "examples" / "grpo_tiny.yaml",
            [f"model.path={model}", f"placement.executor={executor}", "placement.tasks_per_node=2",
             f"trainer.output_dir={tmp}"],
        )  # fmt: skip
        [pool] = cfg.pools().values()
        create_secret(tmp / "secret")
        firsts, relaunches = [], []
        for attempt in range(repeats):
            group, first = _started(cfg, pool, tmp / f"first{attempt}")
            group.shutdown()
            run_dir = tmp / f"try{attempt}"
            run_dir.mkdir()
            group, _ = _started(cfg, pool, run_dir)
            os.kill(group.pids[1], signal.SIGKILL)
            try:
                group.init_model()
            except WorkerGroupError as error:
                assert error.lost, error
            group.shutdown()
            group, again = _started(cfg, pool, run_dir)  # the same run folder: the same placement
            job = group.job_id
            group.shutdown()
            firsts.append(first)
            relaunches.append(again)
            print(f"[{executor}] try {attempt + 1}: first start {first:.2f} s, relaunch {again:.2f} s (job {job})")
        print(
            f"[{executor}] start-up to models loaded, medians of {repeats}: first {statistics.median(firsts):.2f} s, "
            f"relaunch after a killed rank {statistics.median(relaunches):.2f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executor", choices=["local", "slurm", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    (ROOT / ".cache").mkdir(exist_ok=True)
    for executor in ["local", "slurm"] if args.executor == "both" else [args.executor]:
        measure(executor, args.repeats)


if __name__ == "__main__":
    main()
