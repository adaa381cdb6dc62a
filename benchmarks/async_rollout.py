"""Benchmark: the rollout overlapped with training (``trainer.mode: one_step_off | async``) against the synchronous
loop.

Runs ``hf run CONFIG`` (default the main job, `examples/grpo_smollm2.yaml`) once per mode and seed, one after
another, each in a fresh store, with validation before and after training:

- ``sync``: the config as it is (every role in one pool: generate, then train, on all the cores);
- ``sync-1thread``: the same on one thread (``trainer.num_threads=1``): each stage's time on one core;
- ``sync-apart`` (not by default): the rollout in a pool of its own (`placement.pools`: ``train`` = actor, ref,
  reward; ``generate`` = rollout), still one stage after another: what the separate pool and the published weight
  sync cost;
- ``one_step_off``: those pools with one thread each (``placement.pools.<name>.num_threads: 1``: a core each on
  two), the next batch generated while the actor trains (staleness 1, truncated IS);
- ``one_step_off-shared`` (not by default): the same with every process on torch's default threads (all cores):
  the two pools then oversubscribe the cores;
- ``async``: the pools of ``one_step_off``, ``trainer.mode: async`` with ``rollout.max_staleness: 2`` (generation
  up to two batches ahead);
- ``async-push2``: the same with a weight push every second update (``trainer.weight_sync_every: 2``);
- ``async-push2-train2``: the same with the training pool on two threads, the generation pool on one (the cores
  shared by three threads, most of them training's).

Prints per run the mean over all N iterations of seconds per iteration (their total time / N: both modes generate
and train N batches; the first iteration of an overlapped mode generates ahead, and a burst of generations ahead
slows the iteration it runs beside), samples (sequences) per second, the ``gen``, ``update_actor`` and weight-sync
(``publish_weights`` + ``weight_sync``) seconds per iteration, each pool's busy share of the training time
(``perf/busy/<pool>``), and the held-out accuracy before and after; then each mode's medians over the seeds.

    .venv/bin/python benchmarks/async_rollout.py [--config CONFIG] [--iterations 20] [--seeds 0 1 2]
        [--modes sync sync-1thread sync-apart one_step_off one_step_off-shared async async-push2
        async-push2-train2] [-o key=value ...]
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
APART = {"train": {"roles": ["actor", "ref", "reward"]}, "generate": {"roles": ["rollout"]}}
SPLIT = {name: {**pool, "num_threads": 1} for name, pool in APART.items()}  # a core each, on two
LEAN = {"train": {**APART["train"], "num_threads": 2}, "generate": {**APART["generate"], "num_threads": 1}}
ASYNC = ["trainer.mode=async", "rollout.max_staleness=2"]
MODES = {
    "sync": [],
    "sync-1thread": ["trainer.num_threads=1"],
    "sync-apart": [f"placement.pools={json.dumps(APART)}"],
    "one_step_off": [f"placement.pools={json.dumps(SPLIT)}", "trainer.mode=one_step_off"],
    "one_step_off-shared": [f"placement.pools={json.dumps(APART)}", "trainer.mode=one_step_off"],
    "async": [f"placement.pools={json.dumps(SPLIT)}", *ASYNC],
    "async-push2": [f"placement.pools={json.dumps(SPLIT)}", *ASYNC, "trainer.weight_sync_every=2"],
    "async-push2-train2": [f"placement.pools={json.dumps(LEAN)}", *ASYNC, "trainer.weight_sync_every=2"],
}
DEFAULT_MODES = ["sync", "sync-1thread", "one_step_off"]


def run(config: str, iterations: int, seed: int, overrides: list[str]) -> dict[int, dict[str, float]]:
    """Every metric of an ``hf run`` of `config` by step (0: the validation before training)."""
    tmp = Path(tempfile.mkdtemp(prefix="async-rollout-"))
    db = f"sqlite:///{tmp / 'runs.db'}"
    command = [HF, "run", config, "--db", db]
    plain = ["trainer.test_freq=0", "trainer.val_before_train=true", "trainer.save_freq=0", "trainer.logger=[console]"]
    plain.append(f"trainer.seed={seed}")
    for item in [f"trainer.total_iterations={iterations}", f"trainer.output_dir={tmp / 'out'}", *plain, *overrides]:
        command += ["-o", item]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    store = RunStore(db)
    by_step: dict[int, dict[str, float]] = {}
    for point in store.metrics(store.list_runs()[0].id):
        by_step.setdefault(point.step, {})[point.name] = point.value
    shutil.rmtree(tmp, ignore_errors=True)
    return by_step


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary(metrics: dict[int, dict[str, float]], samples: int) -> dict[str, float]:
    """Means over every iteration 1..N (each mode generates and trains N batches, whenever it does so: a burst of
    generations ahead slows the iteration it overlaps, and a median over iterations would leave that out), each
    pool's busy share of the whole training time, and the held-out accuracy before and after."""
    steps = [m for step, m in sorted(metrics.items()) if step >= 1]
    seconds = sum(m["timing_s/step"] for m in steps)

    def mean(name: str) -> float:  # per iteration, over all N (0 where a stage did not run)
        return sum(m.get(name, 0.0) for m in steps) / len(steps)

    pools = sorted({k for m in steps for k in m if k.startswith("perf/busy/")})
    acc = sorted(k for k in metrics[0] if k.startswith("val/") and k.endswith("/acc"))
    last = max(metrics)
    return {
        "s_per_it": seconds / len(steps),
        "samples_per_s": samples * len(steps) / seconds,
        "gen": mean("timing_s/gen"),
        "update_actor": mean("timing_s/update_actor"),
        "weight_sync": mean("timing_s/weight_sync") + mean("timing_s/publish_weights"),
        "busy": {
            k.removeprefix("perf/busy/"): sum(m.get(k, 0.0) * m["timing_s/step"] for m in steps) / seconds
            for k in pools
        },
        "staleness": mean("off_policy/staleness_mean"),
        "acc_before": metrics[0][acc[0]] if acc else float("nan"),
        "acc_after": metrics[last][acc[0]] if acc else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "examples" / "grpo_smollm2.yaml"))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    from hybridflow.engine.config import load_config

    cfg = load_config(args.config, args.override)
    samples = cfg.data.train_batch_size * cfg.rollout.n
    results: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    print(f"{args.config}, {args.iterations} iterations, {samples} sequences per iteration; means over all iterations")
    print(
        f"{'mode':>18} {'seed':>4} {'s/it':>6} {'samples/s':>9} {'gen':>6} {'update':>6} {'sync':>6} "
        f"{'stale':>5} {'acc before -> after':>20}  busy share per pool"
    )
    for seed in args.seeds:
        for mode in args.modes:  # alternating, so a slow spell of the machine hits every mode
            s = summary(run(args.config, args.iterations, seed, [*MODES[mode], *args.override]), samples)
            results[mode].append(s)
            busy = ", ".join(f"{pool} {share:.0%}" for pool, share in s["busy"].items())
            print(
                f"{mode:>18} {seed:>4} {s['s_per_it']:>6.2f} {s['samples_per_s']:>9.2f} {s['gen']:>6.2f} "
                f"{s['update_actor']:>6.2f} {s['weight_sync']:>6.2f} {s['staleness']:>5.1f} "
                f"{s['acc_before']:>9.3f} -> {s['acc_after']:.3f}  {busy}",
                flush=True,
            )
    print("\nmedians over seeds:")
    base = median([s["samples_per_s"] for s in results.get("sync", [])])
    for mode, runs in results.items():
        rate = median([s["samples_per_s"] for s in runs])
        accs = ", ".join(f"{s['acc_after']:.3f}" for s in runs)
        print(
            f"{mode:>18}: {median([s['s_per_it'] for s in runs]):.2f} s/it, {rate:.2f} samples/s "
            f"({rate / base:.2f}x sync), held-out accuracy after training {accs}"
        )


if __name__ == "__main__":
    main()
