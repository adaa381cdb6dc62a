"""Benchmark: the actor -> vLLM weight sync against a plain copy of the same bytes.

Starts a `VLLMRollout` on a model (default the embedded SmolLM2-135M-Instruct, fp32 actor, bf16 engine), then
``--repeats`` times: perturbs the actor's weights (as an optimizer step would), times `VLLMRollout.update_weights`
(seconds, bytes streamed, GB/s) and, inside it, the engine's load and the probe; and times a plain copy of every
actor tensor into a bf16 buffer of its size (the floor: read the fp32 weights once, write bf16 once); and the path of
a rollout pool of its own: the actor's side publishes the weights in bf16 to shared memory
(`hybridflow.engine.rollout.published.publish`), the engine loads that file (`VLLMRollout.load_published`; here in
the same process, as each rollout rank does in its own). Prints the medians.

    .venv/bin/python benchmarks/weight_sync.py [--model smollm2] [--repeats 5]
"""

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.engine.config import RolloutConfig
from hybridflow.engine.embedded_models import resolve_model_path
from hybridflow.engine.rollout.published import probe_prompt, publish
from hybridflow.engine.rollout.vllm import VLLMRollout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    path = resolve_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rollout = VLLMRollout(model, tokenizer, str(path), RolloutConfig(vllm_kv_cache_gb=0.25), 128)
    params = [p for p in model.parameters()]
    floors = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    syncs, copies, publishes, loads, streamed = [], [], [], [], 0.0
    folder = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    prompt = probe_prompt(tokenizer, rollout.eos_token_ids)
    for _ in range(args.repeats):
        with torch.no_grad():
            for p in params:
                p.mul_(1.0 + 1e-4)
        started = time.perf_counter()
        metrics = rollout.update_weights()
        syncs.append(time.perf_counter() - started)
        streamed = metrics["rollout/weight_sync_bytes"]
        started = time.perf_counter()
        for p, buffer in zip(params, floors, strict=True):
            buffer.copy_(p)
        copies.append(time.perf_counter() - started)
        started = time.perf_counter()
        published = publish(model, prompt, folder, len(copies), torch.bfloat16)
        publishes.append(time.perf_counter() - started)
        started = time.perf_counter()
        rollout.load_published(published["path"])
        loads.append(time.perf_counter() - started)
        Path(published["path"]).unlink()
    shutil.rmtree(folder)
    sync, copy = statistics.median(syncs), statistics.median(copies)
    fp32 = sum(p.numel() * 4 for p in params)
    print(
        f"{args.model}: {sum(p.numel() for p in params) / 1e6:.0f} M parameters; update_weights {sync:.3f} s "
        f"({streamed / 1e6:.0f} MB streamed, {streamed / sync / 1e9:.2f} GB/s); plain fp32 -> bf16 copy of every "
        f"parameter {copy:.3f} s ({fp32 * 1.5 / copy / 1e9:.2f} GB/s read + written); sync / copy {sync / copy:.1f}x\n"
        f"rollout pool of its own: publish to {folder.parent} {statistics.median(publishes):.3f} s "
        f"({published['bytes'] / 1e6:.0f} MB of bf16 weights), the engine's load_published "
        f"{statistics.median(loads):.3f} s"
    )


if __name__ == "__main__":
    main()
