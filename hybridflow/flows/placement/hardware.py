"""Hardware profiles: what one device of a cluster can do, as the cost model needs it.

The built-in GPU profiles carry datasheet figures (dense BF16 tensor-core FLOP/s, HBM bandwidth, NVLink bandwidth per
direction, InfiniBand bandwidth per GPU of the vendor's reference node) and efficiency factors that say which share of
those peaks training, inference and decoding reach. `hf plan --calibrate` fits the factors of a profile for the
machine it runs on (see `hybridflow.flows.placement.calibrate`)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from hybridflow.engine.flops import DATASHEET_BF16_FLOPS

GB = 1e9  # datasheets count memory and bandwidth in decimal gigabytes

GPU_LAYER_CALL_OVERHEAD_S = 0.6e-3
"""Fixed seconds per layer per forward call on a GPU, measured on an H100 80GB HBM3 (2026-11-27, torch 2.11,
transformers 5.17, BF16, SDPA, eager: `benchmarks/gpu_efficiency.py`): forward time against FLOPs over calls of
128-16,384 tokens is a line whose intercept is 0.59 ms per layer for all 32 blocks of Llama 7B (0.30-0.66 ms for 4
blocks of the 7B, 13B and 70B widths), its slope 0.48-0.59 of the BF16 peak. So a call reaches half its best
efficiency at 900 tokens (7B) to 160 tokens (70B width) per device: Hockney and Jesshope's n_1/2 ("Parallel
Computers 2", 1988, section 1.3.3). The same eager host dispatch on an A100 is taken to cost the same."""


H100_TRAIN_EFFICIENCY = 0.55
"""Training MFU of an H100 on calls of thousands of tokens, measured with `GPU_LAYER_CALL_OVERHEAD_S` (the slope of
time against FLOPs of forward + backward passes: 0.57 for all 32 blocks of Llama 7B, 0.48-0.57 for 4 blocks of the 7B
to 70B widths); Hopper's H200 has the same tensor cores."""


H100_HOST_BANDWIDTH = 55 * GB
"""Pinned host <-> H100 copies, measured each way on an H100 80GB HBM3's PCIe Gen5 link (55 GB/s of the 64 GB/s per
direction the link carries; `benchmarks/gpu_efficiency.py`, 2026-11-27); the H200 has the same link."""


class HardwareProfile(BaseModel):
    """One device (a GPU, or a CPU core on a CPU-only machine) and the links between devices.

    Units: bytes, bytes/s, FLOP/s, seconds. Efficiencies are shares of the peak (0-1]."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    memory_bytes: float = Field(gt=0, description="memory per device")
    flops: float = Field(gt=0, description="peak dense FLOP/s per device in the compute dtype")
    memory_bandwidth: float = Field(gt=0, description="device memory bandwidth, bytes/s")
    intra_node_bandwidth: float = Field(gt=0, description="bytes/s per device to a device of the same node, one way")
    inter_node_bandwidth: float = Field(gt=0, description="bytes/s per device to a device of another node, one way")
    host_bandwidth: float = Field(
        0.0,
        ge=0,
        description="bytes/s per device to pinned host memory, one way (what a sleeping rollout engine's weights "
        "cross); 0: the device is the host, nothing moves",
    )
    collective_latency_s: float = Field(1e-5, ge=0, description="fixed cost of one collective (all-reduce, ...)")
    train_efficiency: float = Field(0.4, gt=0, le=1, description="achieved / peak FLOP/s in training (MFU)")
    infer_efficiency: float = Field(0.5, gt=0, le=1, description="achieved / peak FLOP/s in a forward pass")
    decode_efficiency: float = Field(0.6, gt=0, le=1, description="achieved / peak memory bandwidth when decoding")
    comm_efficiency: float = Field(0.7, gt=0, le=1, description="achieved / peak link bandwidth in collectives")
    stage_overhead_s: float = Field(0.0, ge=0, description="fixed seconds per stage call (dispatch, data handles)")
    iteration_overhead_s: float = Field(
        0.0, ge=0, description="fixed seconds per iteration outside the models' stages (controller, reward function)"
    )
    usable_memory: float = Field(0.9, gt=0, le=1, description="share of memory_bytes the models may take")
    decode_step_overhead_s: float = Field(0.0, ge=0, description="fixed seconds per generated token (launches, ...)")
    layer_token_overhead_s: float = Field(
        0.0,
        ge=0,
        description="seconds per token per layer of a forward pass beyond its matmuls (norms, activations, attention's "
        "softmax and their launches: what a small model pays over its FLOPs); a backward pass pays it twice more",
    )
    layer_call_overhead_s: float = Field(
        0.0,
        ge=0,
        description="fixed seconds one layer of one forward call costs whatever its tokens (kernel launches, the "
        "host's dispatch; a training call pays it 4 times: cost.TRAIN_CALL_OVERHEADS): why the achieved share of the "
        "peak falls as the tokens per device per call shrink (Hockney's n_1/2)",
    )
    host_cores: int = Field(
        0, ge=0, description="on a CPU machine, its cores (the devices are cores the controller shares); 0 on GPUs"
    )
    contended_stage_s: float = Field(
        0.0, ge=0, description="extra seconds of a stage that runs while ranks busy every one of host_cores"
    )
    dtype_bytes: int = Field(2, description="bytes per weight in the compute dtype: 2 (bf16 on GPUs), 4 (fp32 on CPU)")
    source: str = ""

    @property
    def capacity_bytes(self) -> float:
        """Bytes per device the models may use: memory_bytes x usable_memory."""
        return self.memory_bytes * self.usable_memory


BUILTIN: dict[str, HardwareProfile] = {
    profile.name: profile
    for profile in (
        HardwareProfile(
            name="a100-80gb",
            memory_bytes=80 * GB,
            flops=DATASHEET_BF16_FLOPS["a100"],
            memory_bandwidth=2039 * GB,
            intra_node_bandwidth=300 * GB,
            inter_node_bandwidth=25 * GB,
            host_bandwidth=32 * GB,
            layer_call_overhead_s=GPU_LAYER_CALL_OVERHEAD_S,
            source="NVIDIA A100 datasheet (SXM4 80GB): BF16 312 TFLOPS dense, HBM2e 2,039 GB/s, NVLink 600 GB/s "
            "(300 GB/s each way), PCIe Gen4 x16 to the host (32 GB/s each way); DGX A100: 8 x 200 Gb/s HDR InfiniBand "
            "(25 GB/s per GPU). Layer call overhead: "
            "GPU_LAYER_CALL_OVERHEAD_S, measured on an H100. Training efficiency 0.4: assumed, below the 52 % of "
            "the peak Megatron-LM reached training a 1T-parameter GPT on 3,072 A100s (Narayanan et al. 2021, "
            "abstract), for RLHF's micro-batches of few sequences",
        ),
        HardwareProfile(
            name="h100-80gb",
            memory_bytes=80 * GB,
            flops=DATASHEET_BF16_FLOPS["h100"],
            memory_bandwidth=3350 * GB,
            intra_node_bandwidth=450 * GB,
            inter_node_bandwidth=50 * GB,
            host_bandwidth=H100_HOST_BANDWIDTH,
            train_efficiency=H100_TRAIN_EFFICIENCY,
            layer_call_overhead_s=GPU_LAYER_CALL_OVERHEAD_S,
            source="NVIDIA H100 datasheet (SXM5): BF16 989 TFLOPS dense, HBM3 3.35 TB/s, NVLink 900 GB/s (450 GB/s "
            "each way); DGX H100: 8 x 400 Gb/s NDR InfiniBand (50 GB/s per GPU). Training efficiency and layer call "
            "overhead measured on an H100 (benchmarks/gpu_efficiency.py); there decoding's weight reads reached "
            "0.48-0.78 of the HBM bandwidth (decode_efficiency 0.6)",
        ),
        HardwareProfile(
            name="h200",
            memory_bytes=141 * GB,
            flops=DATASHEET_BF16_FLOPS["h200"],
            memory_bandwidth=4800 * GB,
            intra_node_bandwidth=450 * GB,
            inter_node_bandwidth=50 * GB,
            host_bandwidth=H100_HOST_BANDWIDTH,
            train_efficiency=H100_TRAIN_EFFICIENCY,
            layer_call_overhead_s=GPU_LAYER_CALL_OVERHEAD_S,
            source="NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, BF16 989 TFLOPS dense, NVLink 900 GB/s; "
            "DGX H200: 8 x 400 Gb/s NDR InfiniBand (50 GB/s per GPU)",
        ),
    )
}


class UnknownHardware(ValueError):
    """A hardware name with no built-in or calibrated profile."""


def profiles_dir() -> Path:
    """Where calibrated profiles are kept: ``$HYBRIDFLOW_HOME/hardware``."""
    from hybridflow.engine.embedded_models import hybridflow_home

    return hybridflow_home() / "hardware"


def save_profile(profile: HardwareProfile) -> Path:
    """Write `profile` as ``<profiles_dir>/<name>.json`` (atomically); returns the path."""
    folder = profiles_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{profile.name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(profile.model_dump(), indent=2))
    tmp.replace(path)
    return path


def calibrated_profiles() -> dict[str, HardwareProfile]:
    """The profiles `hf plan --calibrate` saved (`profiles_dir`), by name."""
    folder = profiles_dir()
    if not folder.is_dir():
        return {}
    return {p.stem: HardwareProfile.model_validate_json(p.read_text()) for p in sorted(folder.glob("*.json"))}


def hardware_profile(name: str | None, memory_gb: float | None = None) -> HardwareProfile:
    """The profile called `name` (built-in, or calibrated: `calibrated_profiles`), with its memory replaced by
    `memory_gb` when given. With no name, `memory_gb` is required and the a100-80gb speeds are used with that memory.

    Raises:
        UnknownHardware: `name` has no profile and no `memory_gb` was given (the message lists the known names)."""
    known = {**BUILTIN, **calibrated_profiles()}
    if name is None or name not in known:
        if memory_gb is None:
            what = f"no hardware profile named {name!r}" if name else "no hardware given"
            raise UnknownHardware(
                f"{what}; known: {', '.join(sorted(known))}. Pass --gpu with one of them, --gpu-memory-gb Q to plan "
                "by memory with the a100-80gb speeds, or fit a profile for this machine with hf plan --calibrate"
            )
        base = BUILTIN["a100-80gb"]
        return base.model_copy(
            update={
                "name": f"{name or 'device'} ({memory_gb:g} GB, a100-80gb speeds)",
                "memory_bytes": memory_gb * GB,
            }
        )
    profile = known[name]
    if memory_gb is not None:
        profile = profile.model_copy(update={"memory_bytes": memory_gb * GB})
    return profile
