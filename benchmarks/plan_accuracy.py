"""Benchmark: the planner's cost model against measurement on this machine.

1. Calibrates a CPU profile (`hf plan --calibrate`'s fit) from three colocated one-device runs of PPO (actor,
   critic, ref): SmolLM2 at 8 and 16 prompts per iteration, and the tiny model at 16 (two model sizes keep a fixed
   per-stage overhead apart from work).
2. Runs the placements below with ``hf run`` (SmolLM2 and the tiny model; colocated vs split pools; 1 and 2 ranks;
   one torch thread per rank, so a rank is one of this machine's cores) and compares, for each, the measured median
   seconds per iteration and per stage (iterations after the first) with the cost model's prediction for that
   config (`hybridflow.flows.placement.calibrate.predict`, with the run's measured longest prompt and response).
3. Prints the table, each iteration's error and the Spearman rank correlation of the placements' iteration times.

    .venv/bin/python benchmarks/plan_accuracy.py [--iterations 4] [--keep DIR [--reuse]]
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hybridflow.flows.placement.calibrate import MODEL_STAGES, Measured, fit_profile, measure_device
from hybridflow.flows.placement.hardware import HardwareProfile
from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
SMOLLM2 = str(ROOT / "examples" / "ppo_pools_smollm2.yaml")
COMMON = [
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "trainer.save_freq=0",
    "trainer.num_threads=1",
    "placement={}",
]
SETTLE_S = 15  # before each run: the previous run's workers exit and its last checkpoint reaches the disk
TINY = ["model.path=tiny", "data.train_batch_size=8", "rollout.response_length=16", "data.max_prompt_length=128"]


def pools(*sets: tuple[list[str], int]) -> list[str]:
    """``-o`` items placing each list of roles on a pool of that many ranks."""
    out = []
    for index, (roles, ranks) in enumerate(sets):
        out += [
            f"placement.pools.p{index}.roles=[{','.join(roles)}]",
            f"placement.pools.p{index}.tasks_per_node={ranks}",
        ]
    return out


PLACEMENTS = {
    "smollm2 colocated x1": [],
    "smollm2 colocated x2": ["placement.tasks_per_node=2"],
    "smollm2 actor+ref | critic": pools((["actor", "rollout", "ref"], 1), (["critic"], 1)),
    "smollm2 actor | critic+ref": pools((["actor", "rollout"], 1), (["critic", "ref"], 1)),
    "smollm2 actor+critic | ref": pools((["actor", "rollout", "critic"], 1), (["ref"], 1)),
    "tiny colocated x1": TINY,
    "tiny colocated x2": [*TINY, "placement.tasks_per_node=2"],
    "tiny actor+ref | critic": [*TINY, *pools((["actor", "rollout", "ref"], 1), (["critic"], 1))],
}


def hf_run(name: str, overrides: list[str], iterations: int, tmp: Path, reuse: bool) -> tuple[RunStore, str, float]:
    path = tmp / (name.replace(" ", "_").replace("|", "").replace("+", "_") + ".db")
    db = f"sqlite:///{path}"
    if reuse and path.exists():
        store = RunStore(db)
        (record,) = store.list_runs()
        if record.status == "completed":
            return store, record.id, 0.0
        for stale in path.parent.glob(path.name + "*"):  # the store and its SQLite journal files
            stale.unlink()
    args = [HF, "run", SMOLLM2, "--db", db, "-o", f"trainer.output_dir={tmp / 'out'}"]
    for item in [*COMMON, f"trainer.total_iterations={iterations}", *overrides]:
        args += ["-o", item]
    time.sleep(SETTLE_S)
    started = time.monotonic()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    store = RunStore(db)
    (record,) = store.list_runs()
    return store, record.id, time.monotonic() - started


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (no ties expected)."""

    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, index in enumerate(order):
            out[index] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--keep", type=Path, help="keep the stores and outputs here")
    parser.add_argument("--reuse", action="store_true", help="with --keep: reuse the completed runs found there")
    args = parser.parse_args()
    console = Console(width=200)
    tmp = args.keep or Path(tempfile.mkdtemp())
    tmp.mkdir(parents=True, exist_ok=True)
    calibration = []
    for name, overrides in {
        "smollm2 8 prompts": ["data.train_batch_size=8"],
        "smollm2 16 prompts": ["data.train_batch_size=16"],
        "tiny 16 prompts": [*TINY, "data.train_batch_size=16"],
        "tiny 16 prompts x2": [*TINY, "data.train_batch_size=16", "placement.tasks_per_node=2"],
    }.items():
        store, run_id, wall = hf_run(f"calibrate {name}", overrides, 3, tmp, args.reuse)
        calibration.append(Measured.from_store(store, run_id))
        console.print(f"calibration run {run_id}: {name}, hf run {wall:.0f} s")
    peaks = measure_device(threads=1)
    base = HardwareProfile(name="cpu-core", memory_bytes=12e9, dtype_bytes=4, inter_node_bandwidth=1e9, **peaks)
    profile = fit_profile(base, calibration, "cpu-core")
    console.print("fitted profile:", profile.model_dump())
    table = Table(title="predicted vs measured seconds (median of iterations 2..N; prediction / measurement)")
    for column in ("placement", "s/iter predicted", "s/iter measured", "error", *MODEL_STAGES):
        table.add_column(column, justify="left" if column == "placement" else "right")
    predicted, measured = [], []
    for name, overrides in PLACEMENTS.items():
        store, run_id, wall = hf_run(name, overrides, args.iterations, tmp, args.reuse)
        run = Measured.from_store(store, run_id)
        estimate = run.predict(profile)
        predicted.append(estimate.seconds)
        measured.append(run.step_s)
        error = (estimate.seconds - run.step_s) / run.step_s
        stages = [
            f"{estimate.stage_s[s]:.3g}/{run.stage_s[s]:.3g}" if s in run.stage_s and s in estimate.stage_s else ""
            for s in MODEL_STAGES
        ]
        table.add_row(name, f"{estimate.seconds:.3g}", f"{run.step_s:.3g}", f"{error:+.0%}", *stages)
        console.print(
            f"{name}: run {run_id}, hf run {wall:.0f} s, predicted {estimate.seconds:.3g} s, "
            f"measured {run.step_s:.3g} s ({error:+.0%})"
        )
    console.print(table)
    worst = max(abs(p - m) / m for p, m in zip(predicted, measured, strict=True))
    console.print(f"largest iteration error {worst:.0%}; Spearman rank correlation {spearman(predicted, measured):.2f}")


if __name__ == "__main__":
    main()
