"""Benchmark: the 3D-HybridEngine's training -> generation transition against the paper's Table 2.

4 processes (torch.distributed: gloo on CPU by default; --device cuda puts rank r's tensors on GPU r mod the GPU
count, with --backend nccl or gloo, since NCCL refuses two ranks on one GPU) hold a 125 M-parameter
Llama (hidden 768, 12 layers, 32k vocabulary, untied embeddings; fp32 weights, random), cut into megatron-core's
training shards (fused QKV and gate/up, `hybridflow.engine.backends.megatron_bridge`), in training layouts t=4 and
p=2,t=2, and move it to generation layouts t_g in {1, 2} (p_g = 1) and back, in ``hybridflow`` mode (micro-DP
all-gathers, training shards reused in place) and ``naive`` mode (the paper's HybridFlow-V). Per layout and mode it
prints, for the rank with the largest figure: bytes received, peak bytes of gathered (generation-side) parameters,
bytes of training shards held besides them (redundancy), each next to Table 2's value, and the transition seconds
(median of --repeats, there and back). On CUDA it adds the allocator's peak during the transition
(``torch.cuda.max_memory_allocated``: every byte the process held, training shards included), taken as the
training shards' bytes plus what the transition allocated beyond them.

    .venv/bin/python benchmarks/hybrid_engine.py [--repeats 3] [--layers 12] [--device cpu|cuda] [--backend gloo|nccl]
"""

import argparse
import functools
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from hybridflow.engine.backends.hybrid_engine import (
    HybridEngine,
    megatron_shard_specs,
    model_bytes,
    shard_parameters,
    table2,
)
from hybridflow.engine.backends.megatron_bridge import generation_order, hf_to_mcore
from hybridflow.engine.parallel_layout import HybridLayout

WORLD = 4
LAYOUTS = [(1, 4, 1, 1), (1, 4, 1, 2), (2, 2, 1, 1), (2, 2, 1, 2)]  # (p, t, p_g, t_g)


def full_weights(layers: int, device: torch.device) -> tuple[dict[str, torch.Tensor], LlamaConfig]:
    """The model's parameters, the same on every rank (seeded per parameter), built without the HF module."""
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in LlamaForCausalLM(config).named_parameters()}
    weights = {}
    for i, (name, shape) in enumerate(shapes.items()):
        generator = torch.Generator().manual_seed(i)
        weights[name] = (torch.randn(shape, generator=generator) * 0.02).to(device)
    return weights, config


def worker(rank: int, store: str, args: argparse.Namespace, out: dict) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"file://{store}", rank=rank, world_size=WORLD)
    full_hf, config = full_weights(args.layers, device)
    full = hf_to_mcore(full_hf, config)  # megatron-core's names and fused QKV / gate-up layout
    del full_hf
    rows = []
    for p, t, p_g, t_g in LAYOUTS:
        layout = HybridLayout(p=p, t=t, d=1, p_g=p_g, t_g=t_g)
        specs = megatron_shard_specs(config, p)
        regroup = functools.partial(generation_order, config=config)  # fused QKV / gate-up into HF order
        for mode in ("hybridflow", "naive"):
            params = shard_parameters(full, specs, layout, rank)
            engine = HybridEngine(params, specs, layout, mode, regroup=regroup)
            there, back, stats, allocator_peak = [], [], None, 0
            for _ in range(args.repeats):
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                    shards = sum(x.numel() * x.element_size() for x in engine.params.values())
                stats = engine.to_generation()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    # parameter bytes held at the peak: the training shards plus what the transition allocated
                    allocator_peak = torch.cuda.max_memory_allocated(device) - before + shards
                dist.barrier()
                there.append(stats.seconds)
                back.append(engine.to_training())
            rows.append(
                {
                    "layout": (p, t, p_g, t_g),
                    "mode": mode,
                    "received": stats.received_bytes,
                    "peak": stats.peak_gathered_bytes,
                    "redundancy": stats.training_copy_bytes,
                    "there_s": statistics.median(there),
                    "back_s": statistics.median(back),
                    "allocator_peak": allocator_peak,
                }
            )
            del engine
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        out["rows"] = gathered
        out["M"] = model_bytes(megatron_shard_specs(config, 1).values(), 4)
        out["params"] = sum(x.numel() for x in full.values())
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(os.path.join(tmp, "store"), args, out), nprocs=WORLD, join=True)
        result = dict(out)
    m = result["M"]
    mb = 2**20
    print(
        f"model: {result['params'] / 1e6:.1f} M parameters, M = {m / mb:.1f} MiB (fp32); {WORLD} ranks, {args.backend}"
        f" on {args.device}"
    )
    print(
        f"{'train -> gen':<16}{'mode':<12}{'received MiB':>22}{'peak gathered MiB':>24}{'redundancy MiB':>20}"
        f"{'to gen s':>10}{'back s':>8}" + (f"{'allocator peak MiB':>20}" if args.device == "cuda" else "")
    )
    per_rank = result["rows"]
    for i, row in enumerate(per_rank[0]):
        p, t, p_g, t_g = row["layout"]
        formula = table2(HybridLayout(p=p, t=t, d=1, p_g=p_g, t_g=t_g), m)[row["mode"]]
        keys = ("received", "peak", "redundancy", "there_s", "back_s", "allocator_peak")
        worst = {k: max(r[i][k] for r in per_rank) for k in keys}

        def cell(key: str, formula_key: str, worst=worst, formula=formula) -> str:
            want = formula[formula_key]
            dev = "" if want == 0 else f" {100 * (worst[key] - want) / want:+.1f}%"
            return f"{worst[key] / mb:.1f} / {want / mb:.1f}{dev}"

        print(
            f"{f'{p}-{t} -> {p_g}-{t_g}':<16}{row['mode']:<12}{cell('received', 'received_bytes'):>22}"
            f"{cell('peak', 'peak_gathered_bytes'):>24}{cell('redundancy', 'redundancy_bytes'):>20}"
            f"{worst['there_s']:>10.3f}{worst['back_s']:>8.3f}"
            + (f"{worst['allocator_peak'] / mb:>20.1f}" if args.device == "cuda" else "")
        )
    print("cells: measured (largest over ranks) / Table 2 formula, and the deviation")


if __name__ == "__main__":
    main()
