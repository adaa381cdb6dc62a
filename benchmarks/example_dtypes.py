"""Benchmark: the bf16 examples' first command in each dtype, as a new user runs them.

The examples that compute in bf16 where the hardware does (``model.dtype: native``; vLLM's ``rollout.vllm_dtype``
defaults to ``native``): the SFT warm-up of the calculator tutorial (``hf sft train
examples/tool_calc_sft_smollm2.yaml``, whole), and the first iterations of the agent-loop GRPO example and of the
asynchronous main job (``hf run``, `--iterations` iterations, no validation). Each runs with its dtypes as shipped
(``native``), forced to float32 (what ``native`` picks on a CPU without AVX512-BF16 or AMX) and forced to bfloat16,
one command at a time, each in a fresh process; printed: the wall seconds of each command and of its steps
(the run store's iteration times), what ``native`` resolved to on this CPU, and the ratios.

    .venv/bin/python benchmarks/example_dtypes.py [--iterations 3] [--only sft|letters|async]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HF = str(Path(sys.executable).with_name("hf"))

DTYPES = {
    "native": [],
    "float32": ["-o", "model.dtype=float32", "-o", "rollout.vllm_dtype=float32"],
    "bfloat16": ["-o", "model.dtype=bfloat16", "-o", "rollout.vllm_dtype=bfloat16"],
}


def commands(iterations: int) -> dict[str, list[str]]:
    """The first command of each bf16 example (its iterations cut to `iterations`, no validation)."""
    short = ["-o", f"trainer.total_iterations={iterations}", "-o", "trainer.val_before_train=false"]
    short += ["-o", "trainer.test_freq=0", "-o", "trainer.logger=[console]"]
    return {
        "sft": [HF, "sft", "train", str(ROOT / "examples" / "tool_calc_sft_smollm2.yaml")],
        "letters": [HF, "run", str(ROOT / "examples" / "tool_letters_smollm2.yaml"), *short],
        "async": [HF, "run", str(ROOT / "examples" / "grpo_async_smollm2.yaml"), *short],
    }


def iteration_seconds(db: str) -> list[float]:
    """The iteration times (seconds) of the one run in the run store `db`."""
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(db)
    [run] = store.list_runs()
    return [point.value for point in store.metrics(run.id, "timing_s/step") if point.step > 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--only", choices=["sft", "letters", "async"], action="append")
    args = parser.parse_args()

    import torch

    from hybridflow.engine.models import cpu_has_native_bf16, pick_dtype

    native = pick_dtype("native", torch.device("cpu"))
    print(f"CPU bf16 instructions: {cpu_has_native_bf16()}; native -> {native}; {torch.get_num_threads()} threads")
    rows = []
    for name, command in commands(args.iterations).items():
        if args.only and name not in args.only:
            continue
        for dtype, extra in DTYPES.items():
            if name == "sft":
                extra = extra[:2]  # no rollout section
            with tempfile.TemporaryDirectory() as tmp:
                db = f"sqlite:///{tmp}/runs.db"
                out = ["-o", f"trainer.output_dir={tmp}/out", "--db", db]
                began = time.monotonic()
                done = subprocess.run([*command, *extra, *out], capture_output=True, text=True)
                seconds = time.monotonic() - began
                if done.returncode != 0:
                    print(done.stdout[-3000:], done.stderr[-3000:])
                    raise SystemExit(f"{name} {dtype}: exit {done.returncode}")
                steps = iteration_seconds(db) if name != "sft" else []
            step = f"{statistics.median(steps):.1f}" if steps else "-"
            rows.append((name, dtype, seconds, step))
            print(f"{name:8} {dtype:9} {seconds:7.1f} s   median iteration {step} s", flush=True)
    print("\n| example | dtype | command s | median iteration s |\n| --- | --- | --- | --- |")
    for name, dtype, seconds, step in rows:
        print(f"| {name} | {dtype} | {seconds:.1f} | {step} |")


if __name__ == "__main__":
    main()
