"""Benchmark (simulated): the asynchronous rollout's expected speedup at scale, by staleness bound.

No cluster is needed: the planner's cost model (`hybridflow.flows.placement.cost.estimate`, the one ``hf plan``
ranks placements with) gives each stage's seconds for a 7B actor and its ref (``llama-7b`` shape, bf16, FSDP) on
H100s, and a discrete-event simulation of the flow's rollout queue (`hybridflow.engine.iteration.admit`) plays
``--iterations`` iterations with the per-batch generation time drawn from a log-normal spread (``--spread``: the
sigma of log(gen time), for the batch-to-batch variation of the longest response; the training side scales with its
square root, as a batch's mean length varies less than its longest):

- ``sync``, colocated: every stage on all ``--gpus`` devices, one after another (the 3D-HybridEngine's sync loop;
  the actor reshards for generation in place, no weight push);
- staleness k (``trainer.mode: async``, ``rollout.max_staleness: k``, a push every update), split: the rollout on
  G devices, the actor and the ref on the rest, G chosen per k as the best multiple of 8. The rollout's pool runs
  its queue in order: generations admitted at the start of an iteration while t - e <= k (e: the last push queued),
  the loads of pushed weights between them; the training pool trains each batch once it is generated, then
  publishes (the weights' bytes over the inter-node bandwidth), and the load on the rollout's pool costs as much.

Prints, per staleness bound, the best split, seconds per iteration (mean of the iterations after the first 10),
speedup over colocated sync, the mean staleness of trained batches and each pool's busy share; then the published
speedups of other systems' asynchronous modes for comparison (their own models, workloads and hardware).

    .venv/bin/python benchmarks/async_simulation.py [--gpus 64] [--prompts 256] [--n 8] [--response-length 4096]
        [--spread 0.25] [--iterations 200] [--seed 0]
"""

import argparse
import random
import statistics
from dataclasses import dataclass

from hybridflow.engine.shapes import PRESETS
from hybridflow.flows.placement.cost import Strategy, Workload, estimate
from hybridflow.flows.placement.hardware import hardware_profile

GPUS_PER_NODE = 8
PUBLISHED = [
    ("AReaL (boba, 1.5B/7B math; async vs its sync mode, equal accuracy)", "2.77x / 2.27x"),
    ("verl fully-async trainer (Qwen2.5-7B, 32-128 GPUs)", "1.9-2.7x"),
    ("ROLL Flash (RLVR / agentic)", "up to 2.2x / 2.7x"),
]


@dataclass
class Stages:
    """Seconds of one iteration's stages at the mean batch (gen on the rollout's devices; the rest on the
    training devices), and of one weight push (publish on the training side, load on the rollout's)."""

    gen: float
    train: float
    push: float


def stage_seconds(gen_devices: int, train_devices: int, workload: Workload) -> Stages:
    """The cost model's seconds: the actor's gen on `gen_devices`, its old_log_prob and update and the ref's pass on
    `train_devices` (FSDP over each pool), and a push of the bf16 weights over the inter-node bandwidth."""
    hw = hardware_profile("h100-80gb")
    shape = PRESETS["llama-7b"]
    gen = estimate("actor", shape, Strategy("fsdp", dp=gen_devices), workload, hw, GPUS_PER_NODE).stage_s["gen"]
    actor = estimate("actor", shape, Strategy("fsdp", dp=train_devices), workload, hw, GPUS_PER_NODE).stage_s
    ref = estimate("ref", shape, Strategy("fsdp", dp=train_devices), workload, hw, GPUS_PER_NODE).stage_s
    train = sum(v for k, v in actor.items() if k != "gen") + sum(ref.values())
    push = shape.params("lm") * hw.dtype_bytes / hw.inter_node_bandwidth
    return Stages(gen, train, push)


def factors(iterations: int, spread: float, seed: int) -> list[float]:
    """Each batch's generation-time factor: log-normal with sigma `spread` and mean 1."""
    rng = random.Random(seed)
    return [rng.lognormvariate(-spread * spread / 2, spread) for _ in range(iterations)]


def sync_colocated(stages: Stages, scale: list[float]) -> list[float]:
    """End time of each iteration of the synchronous loop on all devices: gen, then training."""
    ends, now = [], 0.0
    for x in scale:
        now += stages.gen * x + stages.train * x**0.5
        ends.append(now)
    return ends


def async_split(stages: Stages, scale: list[float], k: int) -> tuple[list[float], float, float, float]:
    """Simulate the rollout queue with staleness bound `k` (a push every update). Returns each iteration's end time,
    the mean staleness of trained batches and the rollout's and the training pool's busy time."""
    n = len(scale)
    gen_end = [0.0] * n
    rollout_free = 0.0  # when the rollout's pool finishes the last item queued on it
    rollout_busy = train_busy = 0.0
    admitted = 0  # generations queued so far (batches 0 .. admitted - 1)
    engine_version = 0  # the version of the last push queued on the rollout's pool
    version_of = [0] * n
    ends: list[float] = []
    start = 0.0  # the start of the current iteration (after the previous publish)
    for s in range(n):
        while admitted < n and admitted - engine_version <= k:  # admission at the iteration's start
            t = admitted
            begin = max(rollout_free, start)
            rollout_free = begin + stages.gen * scale[t]
            rollout_busy += stages.gen * scale[t]
            gen_end[t], version_of[t] = rollout_free, engine_version
            admitted += 1
        begin = max(start, gen_end[s])
        end = begin + stages.train * scale[s] ** 0.5 + stages.push  # train, then publish
        train_busy += end - begin
        ends.append(end)
        start = end
        load_begin = max(rollout_free, end)  # the load queued behind the generations admitted so far
        rollout_free = load_begin + stages.push
        rollout_busy += stages.push
        engine_version = s + 1
    staleness = statistics.mean(s - version_of[s] for s in range(n))
    return ends, staleness, rollout_busy, train_busy


def per_iteration(ends: list[float], warmup: int = 10) -> float:
    """Mean seconds per iteration after the first `warmup`."""
    return (ends[-1] - ends[warmup - 1]) / (len(ends) - warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=256, help="data.train_batch_size")
    parser.add_argument("--n", type=int, default=8, help="rollout.n")
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--response-length", type=int, default=4096, help="the longest response (tokens)")
    parser.add_argument("--spread", type=float, default=0.25, help="sigma of log(generation time) per batch")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-staleness", type=int, default=4)
    args = parser.parse_args()
    workload = Workload(
        sequences=args.prompts * args.n,
        prompt_length=args.prompt_length,
        response_length=args.response_length,
        actor_steps=4,
        critic_steps=0,
        samples=args.n,
        response_mean=args.response_length / 2,
        gen_micro_batch=256,
    )
    scale = factors(args.iterations, args.spread, args.seed)
    colocated = stage_seconds(args.gpus, args.gpus, workload)
    base = per_iteration(sync_colocated(colocated, scale))
    print(
        f"llama-7b actor + ref, FSDP, {args.gpus} x H100 (cost model); {workload.sequences} sequences of up to "
        f"{args.response_length} tokens per iteration; generation-time spread sigma {args.spread}; "
        f"{args.iterations} iterations"
    )
    print(f"colocated stages: gen {colocated.gen:.1f} s, training {colocated.train:.1f} s; push {colocated.push:.2f} s")
    print(f"{'mode':>22} {'split (gen+train)':>17} {'s/it':>7} {'speedup':>8} {'staleness':>9}  busy (gen, train)")
    print(f"{'sync, colocated':>22} {f'{args.gpus} shared':>17} {base:>7.1f} {1.0:>7.2f}x {0.0:>9.2f}  100 %")
    for k in range(args.max_staleness + 1):
        best = None
        for gen_devices in range(GPUS_PER_NODE, args.gpus, GPUS_PER_NODE):
            stages = stage_seconds(gen_devices, args.gpus - gen_devices, workload)
            ends, staleness, rollout_busy, train_busy = async_split(stages, scale, k)
            seconds = per_iteration(ends)
            if best is None or seconds < best[0]:
                best = (seconds, gen_devices, staleness, rollout_busy / ends[-1], train_busy / ends[-1])
        seconds, gen_devices, staleness, gen_busy, train_busy = best
        split = f"{gen_devices}+{args.gpus - gen_devices}"
        print(
            f"{f'async, staleness {k}':>22} {split:>17} {seconds:>7.1f} {base / seconds:>7.2f}x {staleness:>9.2f}  "
            f"{gen_busy:.0%}, {train_busy:.0%}"
        )
    print("\npublished speedups of asynchronous over synchronous RL (their models, workloads and hardware):")
    for system, speedup in PUBLISHED:
        print(f"  {system}: {speedup}")


if __name__ == "__main__":
    main()
