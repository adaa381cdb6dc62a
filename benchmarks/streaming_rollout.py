"""Benchmark: streaming and partial rollouts (``rollout.streaming``, ``rollout.partial_rollout``) against the async
mode's batch generation, on the long-response workload (`benchmarks/long_response.yaml`: up to 512 response
tokens) with the rollout in a pool of its own.

Runs ``hf run CONFIG`` once per mode, one after another, each in a fresh store, without validation or checkpoints;
every mode is ``trainer.mode: async`` at ``rollout.max_staleness`` 2 (``--staleness``) on two pools of one thread
each (``train``: actor, ref, reward; ``generate``: the vLLM rollout):

- ``batch``: one generation call per batch, admitted ahead (streaming off);
- ``stream``: the stream with partial rollouts (a push interrupts the samples in flight, which continue from their
  tokens under the new weights);
- ``stream-drain``: the stream without partial rollouts (a push waits for the samples in flight).

Prints per mode, over iterations 2..N (the first warms up): seconds per iteration, samples (sequences) per second,
the generation engine's idle seconds per iteration (batch: the iteration's time outside the rollout pool's calls,
``(1 - perf/busy/generate) x timing_s/step``; stream: ``rollout/stream_idle_s``, the time between two pushes
outside engine steps), the share of trained samples continued across a push (``rollout/partial_fraction``), the
samples interrupted per push, and the staleness of the oldest token and of the mean token.

    .venv/bin/python benchmarks/streaming_rollout.py [--config CONFIG] [--iterations 6] [--staleness 2]
        [--modes batch stream stream-drain] [-o key=value ...]
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridflow.flows.store.run_store import RunStore

HERE = Path(__file__).resolve().parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
POOLS = {
    "train": {"roles": ["actor", "ref", "reward"], "num_threads": 1},
    "generate": {"roles": ["rollout"], "num_threads": 1},
}
MODES = {
    "batch": [],
    "stream": ["rollout.streaming=true"],
    "stream-drain": ["rollout.streaming=true", "rollout.partial_rollout=false"],
}


def run(config: str, iterations: int, overrides: list[str]) -> tuple[float, dict[int, dict[str, float]], int]:
    """``hf run`` of `config` with `overrides` in a fresh store: its wall seconds, its metrics by step, and the
    sequences per iteration."""
    tmp = Path(tempfile.mkdtemp(prefix="streaming-"))
    db = f"sqlite:///{tmp / 'runs.db'}"
    plain = ["trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.logger=[console]"]
    command = [HF, "run", config, "--db", db]
    for item in [f"trainer.total_iterations={iterations}", f"trainer.output_dir={tmp / 'out'}", *plain, *overrides]:
        command += ["-o", item]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    store = RunStore(db)
    run_row = store.list_runs()[0]
    metrics: dict[int, dict[str, float]] = {}
    for point in store.metrics(run_row.id):
        metrics.setdefault(point.step, {})[point.name] = point.value
    config_of = run_row.config
    sequences = config_of["data"]["train_batch_size"] * config_of["rollout"]["n"]
    shutil.rmtree(tmp, ignore_errors=True)
    return wall, metrics, sequences


def summary(metrics: dict[int, dict[str, float]], sequences: int) -> dict[str, float]:
    """The figures of iterations 2..N (see the module docstring)."""
    steps = sorted(s for s in metrics if s >= 2)
    seconds = sum(metrics[s]["timing_s/step"] for s in steps)

    def mean(name: str) -> float:
        values = [metrics[s][name] for s in steps if name in metrics[s]]
        return statistics.mean(values) if values else float("nan")

    streaming = any("rollout/stream_idle_s" in metrics[s] for s in steps)
    if streaming:
        idle = mean("rollout/stream_idle_s")
    else:
        idle = statistics.mean(
            (1 - metrics[s].get("perf/busy/generate", 0.0)) * metrics[s]["timing_s/step"] for s in steps
        )
    return {
        "s_per_iter": seconds / len(steps),
        "samples_per_s": sequences * len(steps) / seconds,
        "gen_idle_s_per_iter": idle,
        "partial_fraction": mean("rollout/partial_fraction"),
        "interrupted_per_push": mean("rollout/stream_interrupted"),
        "staleness_oldest": mean("off_policy/staleness_mean"),
        "staleness_token": mean("off_policy/token_staleness_mean"),
        "response_length": mean("response_length/mean"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(HERE / "long_response.yaml"))
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    common = [
        "rollout.name=vllm",
        "trainer.mode=async",
        f"rollout.max_staleness={args.staleness}",
        f"placement.pools={json.dumps(POOLS)}",
    ]
    rows = {}
    for mode in args.modes:
        wall, metrics, sequences = run(args.config, args.iterations, [*common, *MODES[mode], *args.override])
        rows[mode] = {"wall_s": wall, **summary(metrics, sequences)}
        print(mode, json.dumps({k: round(v, 3) for k, v in rows[mode].items()}), flush=True)
    names = list(next(iter(rows.values())))
    print(f"{'mode':<14}" + "".join(f"{n:>22}" for n in names))
    for mode, row in rows.items():
        print(f"{mode:<14}" + "".join(f"{row[n]:>22.3f}" for n in names))
    if "batch" in rows:
        for mode in rows:
            if mode != "batch":
                ratio = rows[mode]["samples_per_s"] / rows["batch"]["samples_per_s"]
                print(f"{mode}: samples/s x{ratio:.2f} of batch")


if __name__ == "__main__":
    main()
