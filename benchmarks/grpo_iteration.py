"""Benchmark: where a GRPO iteration of the main job goes, stage by stage, against this machine's matmul peak.

Runs the main job's settings (examples/grpo_smollm2.yaml: SmolLM2-135M-Instruct, 8 prompts x 4 samples, up to 24
response tokens, KL loss, vLLM rollout where installed) through the flow (`hf run`, no validation) and prints, for
each stage, the median over iterations 2..N of: seconds, real tokens processed (padding excluded, each prompt once
for its samples), the FLOPs the stage needs (`hybridflow.flows.placement.cost.needed_flops` at the iteration's mean
prompt and
response lengths: each prompt once for its samples, the blocks over every token, the LM head over response tokens
only, 3x for a training pass; generation: the same forward), the achieved rate of needed FLOPs per second and its
share of the matmul peak this script measures in the run's compute dtype (``model.dtype``) with the workers' torch
threads.
Then the run's own ``perf/mfu/actor`` and ``perf/throughput`` (median) and the iteration.

    .venv/bin/python benchmarks/grpo_iteration.py [--iterations 8] [--keep DIR [--reuse]] [-o key=value ...]

Needs the embedded model: `hf models prepare smollm2` (done by .ci/setup).
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridflow.engine.config import validate_config
from hybridflow.engine.flops import matmul_flops
from hybridflow.engine.models import pick_dtype
from hybridflow.engine.shapes import model_shape
from hybridflow.flows.placement.cost import needed_flops
from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
# stage -> (model head, passes over the batch: 1 forward, 3 a training pass); None: no model FLOPs
STAGES = {
    "gen": ("lm", 1),
    "reward": None,
    "old_log_prob": ("lm", 1),
    "ref": ("lm", 1),
    "adv": None,
    "update_actor": ("lm", 3),
    "weight_sync": None,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--keep", type=Path, help="keep the run store and outputs here")
    parser.add_argument("--reuse", action="store_true", help="with --keep: print the table of the run kept there")
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    tmp = args.keep or Path(tempfile.mkdtemp())
    tmp.mkdir(parents=True, exist_ok=True)
    db = f"sqlite:///{tmp / 'runs.db'}"
    overrides = [
        f"trainer.total_iterations={args.iterations}",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.save_freq=0",
        f"trainer.output_dir={tmp / 'out'}",
        *args.override,
    ]
    command = [HF, "run", str(ROOT / "examples" / "grpo_smollm2.yaml"), "--db", db]
    for item in overrides:
        command += ["-o", item]
    started = time.monotonic()
    if not (args.reuse and (tmp / "runs.db").exists()):
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - started
    store = RunStore(db)
    run = store.list_runs()[0]
    cfg = validate_config(run.config)
    series: dict[str, list[float]] = {}
    for point in sorted(store.metrics(run.id), key=lambda p: p.step):
        if point.step >= 2 and point.value is not None:  # iteration 1 warms caches up
            series.setdefault(point.name, []).append(point.value)

    def median(name: str) -> float:
        return statistics.median(series[name]) if name in series else float("nan")

    threads = cfg.trainer.num_threads or torch.get_num_threads()
    dtype = pick_dtype(cfg.model.dtype, torch.device("cpu"))
    peak = matmul_flops(threads, dtype=dtype)
    shape = model_shape(cfg.model.path)
    sequences = cfg.data.train_batch_size * cfg.rollout.n
    prompt, response = median("prompt_length/mean"), median("response_length/mean")
    groups = [(prompt, [response] * cfg.rollout.n)] * cfg.data.train_batch_size
    forward = needed_flops(shape, groups, "lm")  # each prompt once for its samples
    print(
        f"run {run.id}: {sequences} sequences of {prompt:.0f} + {response:.1f} tokens (means), rollout "
        f"{cfg.rollout.name}, {threads} torch threads, hf run {wall:.0f} s; {str(dtype).removeprefix('torch.')} "
        f"matmul peak {peak / 1e9:.0f} GFLOP/s"
    )
    header = f"{'stage':>13} {'seconds':>8} {'tokens':>7} {'GFLOP':>7} {'GFLOP/s':>8} {'of peak':>8}"
    print(header + "\n" + "-" * len(header))
    for stage, work in STAGES.items():
        seconds = median(f"timing_s/{stage}")
        if seconds != seconds:  # nan: the stage did not run (skipped, or another rollout)
            print(f"{stage:>13} {'skipped':>8}")
            continue
        if work is None:
            print(f"{stage:>13} {seconds:>8.2f}")
            continue
        flops = work[1] * forward
        rate = flops / seconds
        tokens = cfg.data.train_batch_size * prompt + sequences * response  # each prompt once, no padding
        print(f"{stage:>13} {seconds:>8.2f} {tokens:>7.0f} {flops / 1e9:>7.1f} {rate / 1e9:>8.1f} {rate / peak:>8.1%}")
    step = median("timing_s/step")
    print(
        f"{'iteration':>13} {step:>8.2f}   perf/mfu/actor {median('perf/mfu/actor'):.1%}, "
        f"perf/throughput {median('perf/throughput'):.0f} tokens/s"
    )


if __name__ == "__main__":
    main()
