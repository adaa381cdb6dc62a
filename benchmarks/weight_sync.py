"""Benchmark: the actor -> vLLM weight sync against a plain copy of the same bytes.

Starts a `VLLMRollout` on a model (default the embedded SmolLM2-135M-Instruct, fp32 actor, bf16 engine), then
``--repeats`` times: perturbs the actor's weights (as an optimizer step would), times `VLLMRollout.update_weights`
(seconds, bytes streamed, GB/s) and, inside it, the engine's load and the probe; and times a plain copy of every
actor tensor into a bf16 buffer of its size (the floor: read the fp32 weights once, write bf16 once); and the path of
a rollout pool of its own: the actor's side publishes the weights in bf16 to shared memory
(`hybridflow.engine.rollout.published.publish`), the engine loads that file (`VLLMRollout.load_weights`; here in
the same process, as each rollout rank does in its own); and ``rollout.checkpoint_engine.backend: gloo``: the
actor's side packs the weights for a broadcast (`hybridflow.engine.rollout.broadcast.WeightSender.send`, all the
actor waits for) and a receiving process reads every tensor of each push (`WeightReceiver.receive`, the transfer
alone: no engine there). Prints the medians.

    .venv/bin/python benchmarks/weight_sync.py [--model smollm2] [--repeats 5]
"""

import argparse
import multiprocessing
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.engine.config import RolloutConfig
from hybridflow.engine.embedded_models import resolve_model_path
from hybridflow.engine.rollout.broadcast import WeightReceiver, WeightSender
from hybridflow.engine.rollout.published import full_weights, probe_prompt, publish, published_tensors
from hybridflow.engine.rollout.vllm import VLLMRollout


def _receive(address: dict, repeats: int, seconds: multiprocessing.Queue) -> None:
    """The receiving process: each push's weights read tensor by tensor, timed from the first header byte."""
    receiver = WeightReceiver(address, 0)
    for version in range(1, repeats + 1):
        started = time.perf_counter()
        weights, _ = receiver.receive(version)
        for _, tensor in weights:
            tensor.sum()  # every byte read, as an engine's load would
        seconds.put(time.perf_counter() - started)


def broadcast_times(model: torch.nn.Module, prompt_probe: torch.Tensor, repeats: int) -> tuple[float, float, int]:
    """Median seconds the actor's side spends in `WeightSender.send` and a receiving process in reading a push, and
    the bytes of one push, over `repeats` pushes of `model`'s weights in bf16 (buckets of the default 512 MiB)."""
    sender = WeightSender(receivers=1, bucket_bytes=512 * 2**20)
    spawn = multiprocessing.get_context("spawn")
    seconds = spawn.Queue()
    receiver = None
    sends, receives = [], []
    for version in range(1, repeats + 1):
        started = time.perf_counter()
        handle = sender.send(full_weights(model), prompt_probe, version, torch.bfloat16)
        sends.append(time.perf_counter() - started)
        if receiver is None:
            receiver = spawn.Process(target=_receive, args=(handle, repeats, seconds))
            receiver.start()
        receives.append(seconds.get(timeout=600))  # one push at a time: the transfer alone, nothing queued
    receiver.join(60)
    return statistics.median(sends), statistics.median(receives), handle["bytes"]


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
        rollout.load_weights(*published_tensors(published["path"]))
        loads.append(time.perf_counter() - started)
        Path(published["path"]).unlink()
    shutil.rmtree(folder)
    send, receive, sent = broadcast_times(model, torch.zeros(len(tokenizer)), args.repeats)
    sync, copy = statistics.median(syncs), statistics.median(copies)
    fp32 = sum(p.numel() * 4 for p in params)
    print(
        f"{args.model}: {sum(p.numel() for p in params) / 1e6:.0f} M parameters; update_weights {sync:.3f} s "
        f"({streamed / 1e6:.0f} MB streamed, {streamed / sync / 1e9:.2f} GB/s); plain fp32 -> bf16 copy of every "
        f"parameter {copy:.3f} s ({fp32 * 1.5 / copy / 1e9:.2f} GB/s read + written); sync / copy {sync / copy:.1f}x\n"
        f"rollout pool of its own: publish to {folder.parent} {statistics.median(publishes):.3f} s "
        f"({published['bytes'] / 1e6:.0f} MB of bf16 weights), the engine's load_weights "
        f"{statistics.median(loads):.3f} s\n"
        f"gloo broadcast ({sent / 1e6:.0f} MB of bf16 weights) to one receiving process: send (pack) {send:.3f} s, "
        f"receive and read {receive:.3f} s ({sent / receive / 1e9:.2f} GB/s)"
    )


if __name__ == "__main__":
    main()
