"""How much of a GPU's peak a training or forward pass reaches as the tokens per device per call shrink, measured:
the data behind the planner's efficiency curve (`hybridflow.flows.placement.hardware.HardwareProfile.efficiency`).

For Llama-7B, 13B and 70B widths (the paper's models; `--layers` blocks of each, random weights, the output head
kept), it times forward and forward+backward passes in BF16 (SDPA attention) over micro-batches of 512 to 16,384
tokens, and a decode step's weight reads (one token for each of `wave` sequences through every projection of the
blocks) for waves of 1 to 256 sequences. MFU counts the model's FLOPs as the cost model does (2 per weight per token,
causal attention 2·s·h per layer per token; a backward pass twice the forward) against the datasheet's dense BF16
peak. It then fits Hockney's half-performance model, efficiency(n) = peak_efficiency · n / (n + n_half) (R. Hockney,
C. Jesshope, "Parallel Computers 2", 1988, section 1.3.3: r_inf and n_1/2), to each width's points and prints the
constants. Medians of `--repeats` timed calls after two warm-ups (CUDA events).

    python3 benchmarks/gpu_efficiency.py [--layers 4] [--repeats 5] [--json results.json]
    .venv/bin/python benchmarks/gpu_efficiency.py --tiny    # the same code on CPU, small shapes, a smoke check
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridflow.engine.shapes import PRESETS, ModelShape  # noqa: E402 (shapes.py imports no torch)

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense BF16, NVIDIA datasheets (SXM)
# (sequence length, sequences) of each timed call
CALLS = [(128, 1), (256, 1), (512, 1), (512, 2), (1024, 2), (2048, 2), (2048, 4), (2048, 8)]
WAVES = [1, 8, 32, 64, 128, 256]


def forward_flops(shape: ModelShape, layers: int, tokens: int, seq: int) -> float:
    """FLOPs of one forward pass over `tokens` tokens in sequences of `seq` through `layers` blocks and the output
    head: 2 per weight per token, causal attention 2·s·h per layer per token (as `cost.forward_flops`)."""
    weights = layers * shape.layer_params + shape.vocab * shape.hidden
    return tokens * (2 * weights + 2 * layers * seq * shape.hidden)


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of `fn()` over `repeats` calls after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def build(shape: ModelShape, layers: int, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
        max_position_embeddings=4096, attn_implementation="sdpa",
    )  # fmt: skip
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)


def _forward(model, ids: torch.Tensor) -> None:
    with torch.no_grad():
        model(input_ids=ids, logits_to_keep=ids.shape[1])


def _train(model, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()


def _decode_step(x: torch.Tensor, weights: list[list[torch.Tensor]]) -> None:
    for q, k, v, o, gate, up, down in weights:
        h = (x @ q + (x @ k).sum() + (x @ v).sum()) @ o
        (torch.nn.functional.silu(h @ gate) * (h @ up)) @ down


def passes(shape: ModelShape, layers: int, device: torch.device, dtype, peak: float, repeats: int, calls) -> list:
    """MFU of forward and forward+backward passes for each (sequence length, sequences) in `calls`."""
    model = build(shape, layers, device, dtype)
    rows = []
    for seq, batch in calls:
        ids = torch.randint(0, shape.vocab, (batch, seq), device=device)
        flops = forward_flops(shape, layers, batch * seq, seq)

        for mode, fn, factor in (("forward", _forward, 1), ("train", _train, 3)):
            try:
                seconds = timed(functools.partial(fn, model, ids), repeats, device)
            except torch.OutOfMemoryError:
                print(f"{shape.name} {mode} {batch * seq} tokens: out of memory, skipped")
                model.zero_grad(set_to_none=True)
                continue
            rows.append({"model": shape.name, "mode": mode, "tokens": batch * seq, "seq": seq,
                         "seconds": seconds, "mfu": factor * flops / seconds / peak})  # fmt: skip
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def decode(shape: ModelShape, layers: int, device: torch.device, dtype, bandwidth: float, repeats: int, waves):
    """A decode step's projections (q, k, v, o, gate, up, down of `layers` blocks, one token for each of `wave`
    sequences; attention over the KV cache left out): the share of the memory bandwidth its weight reads reach."""
    kv = shape.kv_heads * shape.head_dim
    h, i = shape.hidden, shape.intermediate
    dims = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q, k, v, o, gate, up, down
    weights = [[torch.randn(i, o, device=device, dtype=dtype) for i, o in dims] for _ in range(layers)]
    read = sum(w.numel() * w.element_size() for block in weights for w in block)
    rows = []
    for wave in waves:
        x = torch.randn(wave, shape.hidden, device=device, dtype=dtype)

        seconds = timed(functools.partial(_decode_step, x, weights), repeats, device)
        rows.append({"model": shape.name, "mode": "decode", "wave": wave, "seconds": seconds,
                     "bandwidth_share": read / seconds / bandwidth})  # fmt: skip
    return rows


def host_link(device: torch.device, gib: float, repeats: int) -> list:
    """Seconds and bytes/s of copying `gib` GiB between pinned host memory and the device, each way: what
    offloading optimizer states or a KV cache to the host (colocation's context switch) moves at."""
    size = int(gib * 2**30)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    on_device = torch.empty(size, dtype=torch.uint8, device=device)
    rows = []
    for way, fn in (("to_host", lambda: host.copy_(on_device, non_blocking=True)),
                    ("to_device", lambda: on_device.copy_(host, non_blocking=True))):  # fmt: skip
        seconds = timed(fn, repeats, device)
        rows.append({"mode": "host_link", "way": way, "bytes": size, "seconds": seconds, "bytes_per_s": size / seconds})
    return rows


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (peak_efficiency, n_half) of efficiency(n) = peak · n / (n + n_half) over (n, efficiency)
    points: a grid over n_half, the peak in closed form for each."""
    best = (float("inf"), 0.0, 0.0)
    for n_half in [2 ** (k / 16) for k in range(0, 16 * 18)]:
        basis = [n / (n + n_half) for n, _ in points]
        peak = sum(b * e for b, (_, e) in zip(basis, points, strict=True)) / sum(b * b for b in basis)
        error = sum((peak * b - e) ** 2 for b, (_, e) in zip(basis, points, strict=True))
        best = min(best, (error, peak, n_half))
    return best[1], best[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="blocks of each model (the widths are the paper's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="CPU, small shapes: a smoke check of this script")
    parser.add_argument("--full-depth", default="llama-7b", help="a preset also timed with all its blocks")
    parser.add_argument("--json", type=Path, help="write every measured point and the fits here")
    args = parser.parse_args()
    if args.tiny:
        device, dtype, peak, bandwidth = torch.device("cpu"), torch.float32, 1e11, 1e10
        shapes = [ModelShape("tiny", layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=512)]
        calls, waves = [(32, 1), (64, 2)], [1, 8]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (--tiny runs a CPU smoke check)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        name = torch.cuda.get_device_name()
        peak = next((flops for key, flops in PEAK_BF16.items() if key in name), None)
        if peak is None:
            raise SystemExit(f"no datasheet BF16 peak for {name!r}: add it to PEAK_BF16")
        bandwidth = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.039e12}[next(k for k in PEAK_BF16 if k in name)]
        shapes = [PRESETS["llama-7b"], PRESETS["llama-13b"], PRESETS["llama-70b"]]
        calls, waves = CALLS, WAVES
        print(f"{name}: peak {peak / 1e12:.0f} TFLOP/s BF16, {bandwidth / 1e12:.2f} TB/s; torch {torch.__version__}")
    rows = []
    for shape in shapes:
        rows += passes(shape, args.layers, device, dtype, peak, args.repeats, calls)
        rows += decode(shape, args.layers, device, dtype, bandwidth, args.repeats, waves)
        for row in rows:
            if row["model"] == shape.name and "printed" not in row:
                row["printed"] = True
                if row["mode"] == "decode":
                    print(f"{shape.name:10} decode  wave {row['wave']:6} {row['seconds'] * 1e3:9.3f} ms "
                          f"{row['bandwidth_share']:.3f} of bandwidth")  # fmt: skip
                else:
                    print(f"{shape.name:10} {row['mode']:7} {row['tokens']:6} tokens (seq {row['seq']:5}) "
                          f"{row['seconds'] * 1e3:9.2f} ms  MFU {row['mfu']:.3f}")  # fmt: skip
    full = [] if args.tiny else [c for c in calls if c[0] * c[1] <= 4096]  # activations of all blocks must fit
    if full:
        shape = PRESETS[args.full_depth]
        for row in passes(shape, shape.layers, device, dtype, peak, args.repeats, full):
            row["model"] = f"{shape.name}-all-{shape.layers}-layers"
            rows.append(row)
            print(f"{row['model']:10} {row['mode']:7} {row['tokens']:6} tokens (seq {row['seq']:5}) "
                  f"{row['seconds'] * 1e3:9.2f} ms  MFU {row['mfu']:.3f}")  # fmt: skip
    for row in host_link(device, 0.01 if args.tiny else 4.0, args.repeats):
        rows.append(row)
        print(f"host link {row['way']:9} {row['bytes'] / 2**30:.2f} GiB in {row['seconds'] * 1e3:.1f} ms: "
              f"{row['bytes_per_s'] / 1e9:.1f} GB/s")  # fmt: skip
    fits = {}
    for model in dict.fromkeys(r["model"] for r in rows if "mfu" in r):
        for mode in ("forward", "train"):
            mine = [r for r in rows if "mfu" in r and r["model"] == model and r["mode"] == mode]
            points = [(r["tokens"], r["mfu"]) for r in mine]
            fits[f"{model}/{mode}"] = dict(zip(("peak_efficiency", "n_half_tokens"), fit(points), strict=True))
    for key, value in fits.items():
        peak_efficiency, n_half = value["peak_efficiency"], value["n_half_tokens"]
        print(f"fit {key:32} peak_efficiency {peak_efficiency:.3f}  n_half {n_half:.0f} tokens")
    if args.json:
        for row in rows:
            row.pop("printed", None)
        args.json.write_text(json.dumps({"device": str(device), "rows": rows, "fits": fits}, indent=1))


if __name__ == "__main__":
    main()
