"""Model FLOPs utilisation (MFU): the FLOPs a pass needs, over the seconds it took and the device's peak.

The FLOPs are `needed_flops` (the planner's cost model charges the same): over each sequence's real tokens, padding
excluded, each prompt once for its samples, and the output head only where it is read: what the work needs. The peak
is the device's dense matmul rate: on a GPU named in `DATASHEET_BF16_FLOPS` its datasheet's BF16 figure, elsewhere (CPU,
other GPUs) a matmul measured once per process (on CPU in the compute dtype with the
process's torch threads, bf16 on a GPU)."""

from __future__ import annotations

import functools
import time

import torch

from hybridflow.engine.protocol import DataProto
from hybridflow.engine.shapes import ModelShape, model_shape

DATASHEET_BF16_FLOPS = {"a100": 312e12, "h100": 989e12, "h200": 989e12}
"""Dense BF16 tensor-core FLOP/s of the GPUs we know, from NVIDIA's datasheets (SXM parts): MFU's peak on them, and
the planner's built-in hardware profiles (`hybridflow.flows.placement.hardware`)."""


def needed_flops(shape: ModelShape, groups: list[tuple[float, list[float]]], head: str) -> float:
    """FLOPs one forward pass over a batch needs, each prompt computed once for its samples: `groups` holds, per
    prompt, its tokens and each of its samples' response tokens (padding excluded; a row counted alone is a group
    of one). The blocks cost 2 per weight per token (an MoE block's active weights: its top-k experts); causal
    attention 2·L²·h per layer over a sequence of L tokens (QK^T and AV over half the context on average), so a
    prompt of P tokens costs P² once and a response of R tokens (P+R)² - P²; the output head runs only where it is
    read, at the response positions (``lm``: 2·V·h per token; ``value``: 2·h)."""
    out = shape.vocab * shape.hidden if head == "lm" else shape.hidden
    tokens = sum(prompt + sum(responses) for prompt, responses in groups)
    squares = sum(prompt**2 + sum((prompt + r) ** 2 - prompt**2 for r in responses) for prompt, responses in groups)
    response_tokens = sum(sum(responses) for _, responses in groups)
    return 2 * shape.layers * (shape.active_layer_params * tokens + shape.hidden * squares) + 2 * out * response_tokens


def matmul_flops(threads: int | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Measured dense matmul rate (FLOP/s) of one 1,024 x 1,024 x 1,024 product, best of 10 after one warm-up, on
    `device` in `dtype`; on CPU with `threads` torch threads (None: the process's). Every training rank measures it
    once: 0.45 s on 2 AMD EPYC cores (best of 20: 0.9 s)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(1024, 1024, device=device, dtype=dtype)
        b = torch.randn(1024, 1024, device=device, dtype=dtype)
        best = float("inf")
        for _ in range(11):
            if device != "cpu":
                torch.cuda.synchronize()
            started = time.perf_counter()
            torch.mm(a, b)
            if device != "cpu":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return 2 * 1024**3 / best


@functools.cache
def device_peak_flops(device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """The peak FLOP/s MFU divides by for `device` (``cpu`` or ``cuda``) computing in `dtype` (the compute dtype,
    ``model.dtype``): a known GPU's datasheet BF16 figure, else the measured `matmul_flops` in `dtype` (bf16 on a
    GPU; cached for the process)."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name().lower()
        for gpu, flops in DATASHEET_BF16_FLOPS.items():
            if gpu in name:
                return flops
        return matmul_flops(device=device, dtype=torch.bfloat16)
    return matmul_flops(dtype=dtype)


def update_mfu(
    model_path: str,
    data: DataProto,
    epochs: int,
    seconds: float,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> float:
    """``perf/mfu/actor`` of one rank's policy update: `epochs` training passes (3 x a forward's FLOPs each, Kaplan
    et al. 2020, eq. 2.1) over the rank's rows `data` in `seconds`, as a share of `device_peak_flops` for the
    compute `dtype`. The FLOPs are those the update needs: each prompt once for its neighbouring samples
    (`hybridflow.engine.packing.prompt_groups`, as the passes compute it), every real token, no padding; verl counts
    each row with its own prompt, which would put a shared-prompt update above 100 %.

    Args:
        data: ``input_ids``, ``attention_mask`` [B, P+T], ``responses``, ``response_mask`` [B, T].
    """
    from hybridflow.engine.packing import prompt_groups

    responses = data.batch["response_mask"].sum(-1).tolist()
    prompts = [total - r for total, r in zip(data.batch["attention_mask"].sum(-1).tolist(), responses, strict=True)]
    groups, first = [], 0
    for count in prompt_groups(data).tolist():
        groups.append((prompts[first], responses[first : first + count]))
        first += count
    flops = 3 * epochs * needed_flops(_shape(model_path), groups, "lm")
    return flops / (seconds * device_peak_flops(device, dtype))


@functools.cache
def _shape(model_path: str):
    return model_shape(model_path)
