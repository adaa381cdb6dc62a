"""Benchmark: what activation checkpointing (``model.gradient_checkpointing``) saves and costs in the actor's update.

One PPO update of SmolLM2-135M (the embedded model, fp32 on CPU) on a fixed batch of B sequences of P prompt and T
response tokens (random tokens, random advantages; one mini-batch, micro-batches of M sequences), with and without
checkpointing, each in a fresh process. Printed for each: the peak bytes autograd keeps for the backward pass
(saved tensors alive at once, counted with ``torch.autograd.graph.saved_tensors_hooks``), the process's peak resident
memory (``ru_maxrss``), and the update's median seconds over R repeats (after one warm-up update); then the ratios.

    .venv/bin/python benchmarks/activation_checkpointing.py [--batch 8] [--prompt 128] [--response 256] [--micro 4]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time


class _Saved:
    def __init__(self, tensor, meter):
        self.tensor, self.meter, self.nbytes = tensor, meter, tensor.numel() * tensor.element_size()
        meter["live"] += self.nbytes
        meter["peak"] = max(meter["peak"], meter["live"])

    def __del__(self):
        self.meter["live"] -= self.nbytes


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One process's figures for ``args.checkpointing`` (run in a subprocess of its own)."""
    import torch

    from hybridflow.engine.backends.actor import Actor
    from hybridflow.engine.config import ActorConfig
    from hybridflow.engine.embedded_models import prepare_model
    from hybridflow.engine.models import checkpoint_layers, load_model
    from hybridflow.engine.protocol import DataProto
    from hybridflow.engine.rollout.hf import assemble_rollout

    torch.manual_seed(0)
    model = load_model(prepare_model("smollm2"))
    if args.checkpointing:
        checkpoint_layers(model)
    vocab, b = model.config.vocab_size, args.batch
    prompts = torch.randint(10, vocab, (b, args.prompt))
    responses = torch.randint(10, vocab, (b, args.response))
    tensors = assemble_rollout(prompts, torch.ones_like(prompts), responses, [0], 0, args.response)
    tensors["old_log_probs"] = torch.full((b, args.response), -10.0)
    tensors["advantages"] = torch.randn(b, args.response)
    data = DataProto.from_dict(tensors, meta_info={"temperature": 1.0}, non_tensors={"uid": [str(i) for i in range(b)]})
    config = ActorConfig(ppo_mini_batch_size=b, ppo_micro_batch_size=args.micro, optim={"lr": 1e-6}, shuffle=False)
    actor = Actor(model, config, rollout_n=1)
    meter = {"live": 0, "peak": 0}
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(t, meter), lambda saved: saved.tensor)
    seconds = []
    for repeat in range(args.repeats + 1):
        with hooks if repeat == 0 else contextlib.nullcontext():
            start = time.perf_counter()
            actor.update_policy(data)
            if repeat:
                seconds.append(time.perf_counter() - start)
    return {
        "saved_peak_bytes": meter["peak"],
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "update_s": statistics.median(seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args)))
        return
    shape = ["--batch", str(args.batch), "--prompt", str(args.prompt), "--response", str(args.response)]
    shape += ["--micro", str(args.micro), "--repeats", str(args.repeats)]
    results = {}
    for checkpointing in (False, True):
        command = [sys.executable, __file__, "--one", *shape, *(["--checkpointing"] if checkpointing else [])]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[checkpointing] = json.loads(out.strip().splitlines()[-1])
        r = results[checkpointing]
        print(
            f"gradient_checkpointing={str(checkpointing).lower():5}  saved activations peak "
            f"{r['saved_peak_bytes'] / 2**20:8.1f} MiB  peak RSS {r['max_rss_bytes'] / 2**20:8.1f} MiB  "
            f"update {r['update_s']:6.2f} s"
        )
    off, on = results[False], results[True]
    print(
        f"with checkpointing: saved activations x{on['saved_peak_bytes'] / off['saved_peak_bytes']:.2f}, peak RSS "
        f"x{on['max_rss_bytes'] / off['max_rss_bytes']:.2f}, update time x{on['update_s'] / off['update_s']:.2f} "
        f"(B={args.batch}, P={args.prompt}, T={args.response}, micro-batches of {args.micro})"
    )


if __name__ == "__main__":
    main()
