"""Calibration: fit a hardware profile's efficiencies and overheads to stage times measured on this machine.

`measure_device` times one device's peaks with torch (a matmul for FLOP/s, a copy for memory bandwidth, a gloo
all-reduce between two processes for the link); `fit_profile` then takes recorded runs (their configs and the stage
seconds in the run store, ``timing_s/<stage>``) and fits the cost model's efficiencies and overheads (`FITTED`) to
them by least squares. `predict` is the cost model's estimate of a run config's own placement, which the benchmark
compares with measurement."""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass

from hybridflow.engine.flops import matmul_flops
from hybridflow.engine.shapes import run_models
from hybridflow.flows.placement.cost import Strategy, Workload
from hybridflow.flows.placement.hardware import HardwareProfile
from hybridflow.flows.placement.planner import MODELS, Candidate, Planner

MODEL_STAGES = ("update_actor", "update_critic", "old_log_prob", "ref", "teacher", "values", "rm_score", "gen")
"""The stages a model runs (``timing_s/<name>``): the ones calibration fits and the benchmark compares."""


def measure_device(threads: int = 1) -> dict[str, float]:
    """This machine's device peaks with `threads` torch threads: ``flops`` (fp32 matmul of 1,024 x 1,024, FLOP/s),
    ``memory_bandwidth`` (copy of 256 MiB, bytes/s, read + write), ``intra_node_bandwidth`` (gloo all-reduce of
    64 MiB between two local processes, bytes/s of the ring's 2(n-1)/n volume), and ``host_cores`` (the cores this
    process may run on: a CPU machine's devices)."""
    import torch

    flops = matmul_flops(threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src, dst = torch.empty(64 * 2**20), torch.empty(64 * 2**20)  # 256 MiB each
        dst.copy_(src)
        bandwidth = 2 * src.numel() * 4 / _best(lambda: dst.copy_(src), repeat=5)
    finally:
        torch.set_num_threads(previous)
    return {
        "flops": flops,
        "memory_bandwidth": bandwidth,
        "intra_node_bandwidth": _gloo_bandwidth(),
        "host_cores": len(os.sched_getaffinity(0)),
    }


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def _all_reduce_rank(rank: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = torch.ones(16 * 2**20)  # 64 MiB
    dist.all_reduce(buffer)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        dist.all_reduce(buffer)
        times.append(time.perf_counter() - started)
    if rank == 0:
        out.put(buffer.numel() * 4 / min(times))  # ring volume 2(n-1)/n = 1 x the buffer for n = 2
    dist.destroy_process_group()


def _gloo_bandwidth() -> float:
    import torch.multiprocessing as mp

    from hybridflow.slurm.network import free_port

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    procs = [context.Process(target=_all_reduce_rank, args=(rank, port, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    value = queue.get(timeout=120)
    for proc in procs:
        proc.join(timeout=60)
    return float(value)


def run_mapping(cfg) -> tuple[tuple[tuple[str, ...], ...], tuple[int, ...], dict[str, Strategy]]:
    """A run config's own mapping: its pools' models (the actor for actor and rollout), their devices (ranks), and
    each model's strategy."""
    placement, devices = [], []
    for pool in cfg.pools().values():
        models = tuple(m for m in MODELS if m in pool.roles)
        if models:
            placement.append(models)
            devices.append(pool.world_size)
    strategies: dict[str, Strategy] = {}
    for models, size in zip(placement, devices, strict=True):
        for model in models:
            if model == "actor":
                a = cfg.actor
                dp = size // (a.tp * a.pp)
                gen_tp = cfg.rollout.gen_tp or a.tp
                megatron = a.strategy == "megatron"
                strategies[model] = Strategy(
                    a.strategy, a.tp, a.pp, dp, gen_tp if megatron else 1, ep=a.ep if megatron else 1
                )
            elif model == "critic":
                strategies[model] = Strategy(cfg.critic.strategy, dp=size)
            elif model == "reward_model":
                strategies[model] = Strategy(cfg.reward_model.strategy, dp=size)
            else:
                strategies[model] = Strategy("ddp", dp=size)
    return tuple(placement), tuple(devices), strategies


@dataclass
class Measured:
    """A recorded run: its config and, over its iterations, the median seconds of each stage and of the iteration,
    and the longest prompt and response (tokens) its batches held."""

    cfg: object
    stage_s: dict[str, float]
    step_s: float
    prompt_length: int
    response_length: int
    prompt_mean: float | None = None
    response_mean: float | None = None

    @classmethod
    def from_store(cls, store, run_id: str, skip_first: bool = True) -> Measured:
        """Read a run's timings from the store (the first iteration, which warms caches up, left out when there
        are others)."""
        from hybridflow.engine.config import validate_config

        run = store.get_run(run_id)
        series: dict[str, list[float]] = {}
        for m in store.metrics(run_id):
            if m.value is not None:
                series.setdefault(m.name, []).append((m.step, m.value))
        values = {name: [v for _, v in sorted(points)] for name, points in series.items()}
        if skip_first:
            values = {name: v[1:] if len(v) > 1 else v for name, v in values.items()}
        stage_s = {s: statistics.median(values[f"timing_s/{s}"]) for s in MODEL_STAGES if f"timing_s/{s}" in values}
        return cls(
            cfg=validate_config(run.config),
            stage_s=stage_s,
            step_s=statistics.median(values["timing_s/step"]),
            prompt_length=round(max(values["prompt_length/max"])),
            response_length=round(max(values["response_length/max"])),
            prompt_mean=statistics.median(values["prompt_length/mean"]),
            response_mean=statistics.median(values["response_length/mean"]),
        )

    def predict(self, profile: HardwareProfile) -> Candidate:
        """The cost model's estimate of this run under `profile`, at its measured lengths (`predict`)."""
        return predict(
            self.cfg, profile, self.prompt_length, self.response_length, None, self.prompt_mean, self.response_mean
        )


def predict(
    cfg,
    profile: HardwareProfile,
    prompt_length: int | None = None,
    response_length: int | None = None,
    gpus_per_node: int | None = None,
    prompt_mean: float | None = None,
    response_mean: float | None = None,
) -> Candidate:
    """The cost model's estimate of the run config `cfg` on its own placement: seconds per stage and iteration
    (``Candidate.stage_s``, ``seconds``, without ``profile.stage_overhead_s`` outside the models' stages). Lengths
    in tokens: the longest and mean prompt and response (`Workload.from_config`). The cluster: `gpus_per_node`
    devices per node (default: the most ranks a pool places on one node, ``tasks_per_node``), as many nodes as the
    largest pool spans (a pool of ``nodes`` > 1 pays the inter-node bandwidth)."""
    placement, devices, strategies = run_mapping(cfg)
    workload = Workload.from_config(cfg, prompt_length, response_length, prompt_mean, response_mean)
    per_node = gpus_per_node or max(pool.tasks_per_node for pool in cfg.pools().values())
    nodes = max(math.ceil(count / per_node) for count in devices)
    planner = Planner(run_models(cfg), workload, profile, nodes, per_node, "all", cfg.placement.concurrent)
    return planner.estimate_mapping(placement, devices, strategies)


FITTED = (
    "train_efficiency",
    "infer_efficiency",
    "decode_efficiency",
    "stage_overhead_s",
    "decode_step_overhead_s",
    "layer_token_overhead_s",
    "iteration_overhead_s",
    "contended_stage_s",
)
"""The profile fields calibration fits (the peaks are measured: `measure_device`); ``contended_stage_s`` only on a
CPU profile (``host_cores`` > 0), from runs whose ranks busy every core."""


def fit_profile(base: HardwareProfile, runs: list[Measured], name: str) -> HardwareProfile:
    """Fit `base`'s `FITTED` fields to the measured `runs`: nonlinear least squares (scipy) of the log ratio of the
    cost model's seconds (`predict`) to the measured ones, over every model stage and the iteration of every run,
    so that small and large models weigh alike; efficiencies in [0.01, 1], overheads >= 0.

    Raises:
        ValueError: fewer than two runs (one workload cannot separate a fixed overhead from work)."""
    from scipy.optimize import least_squares

    if len(runs) < 2:
        raise ValueError("calibration needs at least two runs of different sizes (overhead vs work)")

    fitted = [key for key in FITTED if key != "contended_stage_s" or base.host_cores]

    def profile(x) -> HardwareProfile:
        return base.model_copy(update={"name": name, **dict(zip(fitted, map(float, x), strict=True))})

    def residuals(x) -> list[float]:
        out = []
        for run in runs:
            estimate = run.predict(profile(x))
            out += [math.log(estimate.stage_s[s] / seconds) for s, seconds in run.stage_s.items()]
            out.append(math.log(estimate.seconds / run.step_s))
        return out

    start = [0.5, 0.5, 0.5, 0.01, 1e-4, 1e-7, 0.01, 0.01][: len(fitted)]
    bounds = ([0.01] * 3 + [0.0] * 5, [1.0] * 3 + [60.0, 10.0, 1.0, 600.0, 60.0])
    bounds = (bounds[0][: len(fitted)], bounds[1][: len(fitted)])
    return profile(least_squares(residuals, start, bounds=bounds, x_scale="jac").x)
