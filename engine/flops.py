"""Model FLOPs utilisation (MFU): the FLOPs a pass needs, over the seconds it took and the device's peak.

The FLOPs are the cost model's (`hybridflow.mapping.cost.needed_flops`): over each sequence's real tokens, padding
excluded, and the output head only where it is read; what the work needs, not what a padded kernel runs. The peak
is the device's dense matmul rate: on a GPU named in `hybridflow.mapping.hardware.BUILTIN` its datasheet's BF16
figure, elsewhere (CPU, other GPUs) a matmul measured once per process (fp32 on CPU with the process's torch
threads, bf16 on a GPU)."""

from __future__ import annotations

import functools
import time

import torch

from hybridflow.engine.protocol import DataProto


def matmul_flops(threads: int | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Measured dense matmul rate (FLOP/s) of one 1,024 x 1,024 x 1,024 product, best of 20, on `device` in
    `dtype`; on CPU with `threads` torch threads (None: the process's)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(1024, 1024, device=device, dtype=dtype)
        b = torch.randn(1024, 1024, device=device, dtype=dtype)
        best = float("inf")
        for _ in range(21):
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
def device_peak_flops(device: str = "cpu") -> float:
    """The peak FLOP/s MFU divides by for `device` (``cpu`` or ``cuda``): a known GPU's datasheet figure, else the
    measured `matmul_flops` (cached for the process)."""
    if device.startswith("cuda"):
        from hybridflow.mapping.hardware import BUILTIN

        name = torch.cuda.get_device_name().lower()
        for profile in BUILTIN.values():
            if profile.name.split("-")[0] in name:
                return profile.flops
        return matmul_flops(device=device, dtype=torch.bfloat16)
    return matmul_flops()


def update_mfu(model_path: str, data: DataProto, epochs: int, seconds: float, device: str = "cpu") -> float:
    """``perf/mfu/actor`` of one rank's policy update: `epochs` training passes (3 x a forward's FLOPs each, Kaplan
    et al. 2020, eq. 2.1) over the rank's rows `data` (``attention_mask`` and ``response_mask`` [B, *]: the real
    tokens and the response tokens of each row, each row counted with its own prompt, as verl counts it) in
    `seconds`, as a share of `device_peak_flops`."""
    from hybridflow.mapping.cost import needed_flops

    responses = data.batch["response_mask"].sum(-1).tolist()
    prompts = [total - r for total, r in zip(data.batch["attention_mask"].sum(-1).tolist(), responses, strict=True)]
    rows = [(prompt, [response]) for prompt, response in zip(prompts, responses, strict=True)]
    flops = 3 * epochs * needed_flops(_shape(model_path), rows, "lm")
    return flops / (seconds * device_peak_flops(device))


@functools.cache
def _shape(model_path: str):
    from hybridflow.mapping.shapes import model_shape

    return model_shape(model_path)
