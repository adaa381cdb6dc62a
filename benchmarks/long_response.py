"""Benchmark: GRPO with long worked answers, ours against TRL like for like and against the vLLM engine alone.

One command, its parts alternating (``--rounds`` times: ours, TRL, the engine alone), each in its own process:

1. **ours**: ``hf run CONFIG`` (default `benchmarks/long_response.yaml`: SmolLM2-135M-Instruct, reasoning-gym
   arithmetic of 4-5 two-digit terms asking for each step before ``<answer>``, up to 512 response tokens, 8 prompts
   x 4 samples, KL loss, vLLM rollout, bf16), ``--iterations`` iterations; per stage the median over iterations
   2..N of seconds, tokens, the FLOPs the stage needs (`needed_flops`: each prompt once for its samples, no padding,
   the LM head at response positions; x3 for the update) and their rate against the bf16 (``model.dtype``) matmul
   peak measured here; for generation also the bytes decoding must read (every step: the weights once, and each
   live sequence's keys and values) and their rate against the memory bandwidth measured here (a 1 GiB copy,
   bytes read + written).
2. **TRL**: `benchmarks/trl_grpo.py`: TRL 1.16's GRPOTrainer on the same config (HF generate; ``--trl-vllm`` adds
   TRL's colocated vLLM mode), seconds per optimizer step (= one of our iterations) and completion tokens/s.
3. **engine alone**: `benchmarks/vllm_standalone.py`: the vLLM engine generating the run's first batches alone,
   and our `VLLMRollout` around it on the same batches, tokens/s.

Then the comparison: completion tokens per second of a whole iteration, ours / TRL's, and generation tokens/s of the
flow's ``gen`` stage and of our rollout against the engine alone.

    .venv/bin/python benchmarks/long_response.py [--config CONFIG] [--iterations 4] [--rounds 1] [--trl-vllm]
        [--skip-trl] [-o key=value ...]

``--config examples/grpo_smollm2.yaml`` measures the main job the same way. Needs the embedded model (`.ci/setup`)
and TRL (``pip install -e .[bench]``).
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

import torch

from hybridflow.engine.config import load_config
from hybridflow.engine.flops import matmul_flops
from hybridflow.engine.models import pick_dtype
from hybridflow.engine.shapes import model_shape
from hybridflow.flows.placement.cost import needed_flops
from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
PASSES = {"gen": 1, "old_log_prob": 1, "ref": 1, "update_actor": 3}
"""Stages that run the model over the batch: forward passes' worth of FLOPs (a training pass: 3)."""
OTHER = ("reward", "adv", "weight_sync")


def memory_bandwidth(threads: int, gib: float = 1.0) -> float:
    """Bytes/s of a `gib` GiB tensor copy (bytes read + written), best of 5, with `threads` torch threads."""
    torch.set_num_threads(threads)
    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.numel() * 4 / best


def run_ours(config: str, iterations: int, overrides: list[str]) -> dict[str, list[float]]:
    """``hf run`` of `config` in a fresh store, without validation, checkpoints or trackers; every metric of
    iterations 2..N (the first warms caches up)."""
    tmp = Path(tempfile.mkdtemp(prefix="long-response-"))
    db = f"sqlite:///{tmp / 'runs.db'}"
    command = [HF, "run", config, "--db", db]
    plain = ["trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.logger=[console]"]
    for item in [f"trainer.total_iterations={iterations}", f"trainer.output_dir={tmp / 'out'}", *plain, *overrides]:
        command += ["-o", item]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    store = RunStore(db)
    series: dict[str, list[float]] = {}
    for point in sorted(store.metrics(store.list_runs()[0].id), key=lambda p: p.step):
        if point.step >= 2 and point.value is not None:
            series.setdefault(point.name, []).append(point.value)
    shutil.rmtree(tmp, ignore_errors=True)
    return series


def run_helper(script: str, config: str, iterations: int, overrides: list[str], *flags: str) -> dict:
    """A helper script's JSON (its last stdout line)."""
    command = [sys.executable, str(HERE / script), config, "--iterations", str(iterations), *flags]
    for item in overrides:
        command += ["-o", item]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(HERE / "long_response.yaml"))
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--trl-vllm", action="store_true", help="also TRL's colocated vLLM mode")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    cfg = load_config(args.config, args.override)
    threads = cfg.trainer.num_threads or torch.get_num_threads()
    ours: dict[str, list[float]] = {}
    trl: dict[str, list[dict]] = {}
    alone: list[dict] = []
    for _ in range(args.rounds):
        for name, values in run_ours(args.config, args.iterations, args.override).items():
            ours.setdefault(name, []).extend(values)
        if not args.skip_trl:
            for mode in ("hf", "vllm") if args.trl_vllm else ("hf",):
                flags = ("--vllm",) if mode == "vllm" else ()
                try:
                    steps = run_helper("trl_grpo.py", args.config, args.iterations, args.override, *flags)["steps"]
                    trl.setdefault(mode, []).extend(steps[1:])
                except subprocess.CalledProcessError as e:
                    print(f"TRL ({mode} generation) failed: {(e.stderr or '').strip().splitlines()[-1:]}")
        alone += run_helper("vllm_standalone.py", args.config, args.iterations, args.override)["batches"]

    dtype = pick_dtype(cfg.model.dtype, torch.device("cpu"))
    peak, bandwidth = matmul_flops(threads, dtype=dtype), memory_bandwidth(threads)
    shape = model_shape(cfg.model.path)
    prompts, n = cfg.data.train_batch_size, cfg.rollout.n
    sequences = prompts * n
    prompt, response = median(ours["prompt_length/mean"]), median(ours["response_length/mean"])
    longest = median(ours["response_length/max"])
    forward = needed_flops(shape, [(prompt, [response] * n)] * prompts, "lm")
    tokens = prompts * prompt + sequences * response  # each prompt once, no padding
    # decoding reads, every step, the weights (bf16 engine; tied LM head = the embedding) and each live sequence's
    # keys and values (2 x layers x kv heads x head dim x 2 bytes per token of context)
    weight_bytes = 2 * (shape.layers * shape.layer_params + shape.vocab * shape.hidden)
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
    decode_bytes = longest * weight_bytes + sequences * (prompt * response + response**2 / 2) * kv_per_token
    print(
        f"{args.config}: {sequences} sequences of {prompt:.0f} + {response:.0f} tokens (means; longest {longest:.0f}),"
        f" {threads} threads, {str(dtype).removeprefix('torch.')} matmul peak {peak / 1e9:.0f} GFLOP/s, memory "
        f"bandwidth {bandwidth / 1e9:.1f} GB/s; medians of iterations 2..{args.iterations} x {args.rounds} round(s)"
    )
    header = f"{'stage':>13} {'seconds':>8} {'tokens':>7} {'GFLOP':>7} {'GFLOP/s':>8} {'of peak':>8}  decode"
    print(header + "\n" + "-" * len(header))
    for stage in [*PASSES, *OTHER]:
        seconds = median(ours.get(f"timing_s/{stage}", []))
        if seconds != seconds:
            continue
        line = f"{stage:>13} {seconds:>8.2f}"
        if stage in PASSES:
            flops = PASSES[stage] * forward
            line += f" {tokens:>7.0f} {flops / 1e9:>7.1f} {flops / seconds / 1e9:>8.1f} {flops / seconds / peak:>8.1%}"
        if stage == "gen":
            rate = decode_bytes / seconds
            line += f"  {decode_bytes / 1e9:.1f} GB read, {rate / 1e9:.2f} GB/s = {rate / bandwidth:.0%} of bandwidth"
        print(line)
    step = median(ours["timing_s/step"])
    ours_rate = sequences * response / step
    print(
        f"{'iteration':>13} {step:>8.2f}   {ours_rate:.0f} completion tokens/s, perf/mfu/actor "
        f"{median(ours.get('perf/mfu/actor', [])):.1%}"
    )

    engine = [b["engine"]["tokens"] / b["engine"]["seconds"] for b in alone]
    rollout = [b["rollout"]["tokens"] / b["rollout"]["seconds"] for b in alone]
    flow = sequences * response / median(ours["timing_s/gen"])
    print(
        f"\ngeneration tokens/s (medians): engine alone {median(engine):.0f}, our rollout around it "
        f"{median(rollout):.0f} (engine alone / rollout {median(engine) / median(rollout):.2f}), the flow's gen stage "
        f"{flow:.0f} (engine alone / gen stage {median(engine) / flow:.2f})"
    )
    # the engine alone serves the untrained weights, the flow's later iterations trained ones that may answer shorter:
    # per-step and prefill costs then weigh more per token, so seconds per batch of like lengths compare too
    per_batch = median([b["engine"]["seconds"] for b in alone])
    alone_length = median([b["engine"]["tokens"] for b in alone]) / sequences
    print(
        f"seconds per batch: engine alone {per_batch:.2f} ({alone_length:.1f} response tokens per sequence), "
        f"the flow's gen stage {median(ours['timing_s/gen']):.2f} ({response:.1f})"
    )
    for mode, steps in trl.items():
        seconds = median([s["seconds"] for s in steps])
        rate = median([s["tokens"] / s["seconds"] for s in steps])
        print(
            f"TRL GRPOTrainer ({mode} generation, bf16={cfg.model.dtype == 'bfloat16'}): {seconds:.2f} s per step, "
            f"{rate:.0f} completion tokens/s; ours {step:.2f} s, {ours_rate:.0f} tokens/s: {ours_rate / rate:.2f}x"
        )


if __name__ == "__main__":
    main()
