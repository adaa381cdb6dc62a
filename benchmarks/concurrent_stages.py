"""Benchmark: what running the stages of different resource pools at the same time buys.

Runs one config twice with ``hf run`` (each run its own store): with ``placement.concurrent: true`` (stages of
different pools at once) and ``false`` (the same pools, one stage after another), then prints, for each, the median
iteration time (``timing_s/step``, iterations after the first), each iteration's stage work and wall seconds
(``hf runs timeline``'s figures: busy = the sum of the stages' durations, wall = first start to last end), the
median per-stage seconds and the last iteration's timeline. The metrics of both runs must agree (the script checks
``critic/score/mean`` and ``actor/pg_loss``).

    .venv/bin/python benchmarks/concurrent_stages.py [--config examples/ppo_pools_smollm2.yaml] [-o key=value ...]
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from hybridflow.cli.timeline import overlap, timeline_table
from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
STAGES = ["gen", "reward", "old_log_prob", "ref", "values", "rm_score", "adv", "update_critic", "update_actor"]


def run(config: str, overrides: list[str], concurrent: bool, tmp: Path) -> tuple[RunStore, str, float]:
    db = f"sqlite:///{tmp / f'concurrent-{concurrent}.db'}"
    args = [HF, "run", config, "--db", db, "-o", f"placement.concurrent={str(concurrent).lower()}"]
    args += ["-o", f"trainer.output_dir={tmp / 'out'}"]
    for item in overrides:
        args += ["-o", item]
    start = time.monotonic()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    store = RunStore(db)
    (record,) = store.list_runs()
    return store, record.id, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "examples" / "ppo_pools_smollm2.yaml"))
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for concurrent in (True, False):
            store, run_id, wall = run(args.config, args.override, concurrent, Path(tmp))
            metrics = {(p.step, p.name): p.value for p in store.metrics(run_id)}
            steps = sorted({s.step for s in store.stage_times(run_id)})
            label = "concurrent" if concurrent else "sequential"
            print(f"{label}: run {run_id}, hf run {wall:.0f} s")
            step_s = [metrics[(k, "timing_s/step")] for k in steps[1:]]
            print(f"  iteration median {statistics.median(step_s):.2f} s over iterations {steps[1:]}")
            for k in steps:
                busy, span = overlap(store.stage_times(run_id, k))
                print(f"  iteration {k}: stages {busy:.2f} s of work in {span:.2f} s ({busy / span:.2f}x)")
            per_stage = {
                name: statistics.median(metrics[(k, f"timing_s/{name}")] for k in steps[1:])
                for name in STAGES
                if (steps[-1], f"timing_s/{name}") in metrics
            }
            print("  median stage seconds: " + ", ".join(f"{n} {v:.2f}" for n, v in per_stage.items()))
            Console(width=150).print(timeline_table(steps[-1], store.stage_times(run_id, steps[-1])))
            results[concurrent] = metrics, steps
    (on, steps), (off, _) = results[True], results[False]
    for name in ("critic/score/mean", "actor/pg_loss"):
        same = all(on[(k, name)] == off[(k, name)] for k in steps)
        print(f"{name} equal in every iteration: {same}")


if __name__ == "__main__":
    main()
