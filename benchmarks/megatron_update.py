"""Benchmark: one PPO update of the megatron-core actor against the Hugging Face actor, on one device.

One process (torch.distributed world of 1: gloo on CPU with `hybridflow.engine.backends.megatron_cpu`, NCCL on CUDA)
builds
a random Llama (GQA, SwiGLU, tied embeddings; --hidden/--layers), the `Actor` (HF) and the `MegatronActor`
(megatron-core GPTModel, TP=PP=1) from the same weights, and runs the same PPO updates on a random batch of
--sequences x (64 prompt + 64 response) tokens. Prints per update: seconds (median of --repeats after one warm-up),
response tokens per second, and the largest weight difference between the two actors after every update (fp32: a
check of megatron's path on this device, not only of its speed), plus the device's peak allocated memory on CUDA.

    .venv/bin/python benchmarks/megatron_update.py [--device cpu|cuda] [--hidden 512] [--layers 8] [--sequences 32]
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from hybridflow.engine.backends.actor import Actor
from hybridflow.engine.backends.megatron_bridge import mcore_to_hf
from hybridflow.engine.config import ActorConfig
from hybridflow.engine.protocol import DataProto

PROMPT, RESPONSE = 64, 64


def batch(vocab: int, sequences: int, device: torch.device) -> DataProto:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (sequences, PROMPT + RESPONSE), generator=g)
    lengths = torch.randint(8, RESPONSE + 1, (sequences,), generator=g)
    response_mask = (torch.arange(RESPONSE)[None] < lengths[:, None]).long()
    attention_mask = torch.cat([torch.ones(sequences, PROMPT, dtype=torch.long), response_mask], 1)
    tensors = {
        "input_ids": ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, PROMPT:],
        "response_mask": response_mask,
        "old_log_probs": -torch.rand(sequences, RESPONSE, generator=g) * 5,
        "advantages": torch.randn(sequences, RESPONSE, generator=g),
    }
    return DataProto.from_dict({k: v.to(device) for k, v in tensors.items()}, meta_info={"temperature": 1.0})


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    else:
        from hybridflow.engine.backends.megatron_cpu import install

        install()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from hybridflow.engine.backends.megatron_actor import MegatronActor
    from hybridflow.engine.backends.megatron_model import build_gpt_model, load_hf_weights

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        tie_word_embeddings=True,
        max_position_embeddings=PROMPT + RESPONSE,
    )
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(config).to(device)
    actor_cfg = ActorConfig(ppo_mini_batch_size=args.sequences, ppo_micro_batch_size=8, optim={"lr": 1e-5})
    hf_actor = Actor(hf_model, actor_cfg, rollout_n=1)
    mc_model = build_gpt_model(config).to(device)
    load_hf_weights(mc_model, {n: p.detach() for n, p in hf_model.named_parameters()}, config)
    mc_actor = MegatronActor(mc_model, actor_cfg, rollout_n=1)
    data = batch(config.vocab_size, args.sequences, device)
    tokens = int(data.batch["response_mask"].sum())
    params = sum(p.numel() for p in hf_model.parameters())
    print(f"model: {params / 1e6:.1f} M parameters; {args.sequences} sequences, {tokens} response tokens; {device}")
    seconds: dict[str, list[float]] = {"hf": [], "megatron": []}
    for step in range(args.repeats + 1):
        data.meta_info["global_steps"] = step
        for name, actor in (("hf", hf_actor), ("megatron", mc_actor)):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            took = timed(lambda actor=actor: actor.update_policy(data), device)
            if step:
                seconds[name].append(took)
        with torch.no_grad():
            mc = {n: p.detach() for n, p in mc_model.named_parameters()}
            converted = mcore_to_hf(mc, config)
            diff = max((converted[n] - p).abs().max().item() for n, p in hf_model.named_parameters())
        print(f"after update {step}: largest |megatron - hf| weight difference {diff:.2e}")
    for name, runs in seconds.items():
        median = statistics.median(runs)
        print(f"{name:>9}: {median:.3f} s per update, {tokens / median:.0f} response tokens/s")
    if device.type == "cuda":
        print(f"peak allocated: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
