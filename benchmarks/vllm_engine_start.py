"""Benchmark: seconds a rank takes to build its first vLLM engine, forked from a fork server that preloaded vLLM's
engine modules (`hybridflow.engine.rollout.vllm_modules`) or not.

Each measurement is a fresh process that imports what the fork server imports (`hybridflow.slurm.forked.PRELOAD`,
and `VLLM_PRELOAD` for ``preloaded``), untimed, then times ``vllm.LLM(...)`` on the tiny test model as
`hybridflow.engine.rollout.vllm.VLLMRollout` builds it on CPU (enforce_eager, chunked prefill off). The seconds of
the preload itself are printed beside: the fork server pays them once, each rank the engine's.

    .venv/bin/python benchmarks/vllm_engine_start.py [--repeats 3]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ONE = """
import importlib, json, sys, time
from hybridflow.slurm.forked import PRELOAD, VLLM_PRELOAD
start = time.perf_counter()
for name in [*PRELOAD, *([VLLM_PRELOAD] if sys.argv[2] == "preloaded" else [])]:
    importlib.import_module(name)
preload = time.perf_counter() - start
from hybridflow.engine.rollout.vllm import import_vllm
vllm = import_vllm()
start = time.perf_counter()
vllm.LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=96,
         logprobs_mode="processed_logprobs", kv_cache_memory_bytes=2**26, enable_chunked_prefill=False)
print(json.dumps({"preload_s": preload, "engine_s": time.perf_counter() - start}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from hybridflow.engine.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny", seed=0)
        for mode in ("plain", "preloaded"):
            runs = []
            for _ in range(args.repeats):
                out = subprocess.run(
                    [sys.executable, "-c", ONE, str(model), mode], capture_output=True, text=True, check=True
                ).stdout
                runs.append(json.loads(out.splitlines()[-1]))
            engine = statistics.median(r["engine_s"] for r in runs)
            preload = statistics.median(r["preload_s"] for r in runs)
            n = len(runs)
            print(f"{mode:>9}: first engine {engine:.2f} s (fork server's preload {preload:.2f} s), medians of {n}")


if __name__ == "__main__":
    main()
