"""The planner on the HybridFlow paper's placement study, simulated: PPO (actor, critic, ref, reward model of one
size) on Llama 7B / 13B / 34B / 70B over 16 to 128 A100-80GB (8 per node), 1,024-token prompts and responses, the
paper's testbed (section 8.1: 8 A100-80GB per machine on NVLink, 200 Gb/s between machines).

For each model and cluster it prints the estimated seconds per iteration of the best plan of three fixed placements
the paper compares (colocate: all four models on every device; split: actor + ref on one set, critic + reward model
on the other; standalone: each model its own set), which of them wins, and the planner's choice over all 15
placements, with the strategies it picked; then the planner's strong-scaling efficiency from 16 to 128 GPUs beside
the paper's measured one. Strategy space: the paper's (3D for every model). No GPU is needed: nothing runs.

Workload defaults, each a flag: 1,024 sequences per iteration in 4 optimizer steps (verl's PPO examples:
data.train_batch_size=1024, actor.ppo_mini_batch_size=256), micro-batches of 2 (training) and 8 (forward), a rollout
allowed 1,024 sequences at once (verl's rollout.max_num_seqs default) and cut to what its pool's memory leaves the KV
cache.

    .venv/bin/python benchmarks/paper_placements.py [--sequences 1024] [--mini-batches 4] [--gen-batch 1024]
        [--inter-node-gbps 200]
"""

import argparse
import time

from rich.console import Console
from rich.table import Table

from hybridflow.engine.shapes import PRESETS
from hybridflow.flows.placement.cost import Workload
from hybridflow.flows.placement.hardware import BUILTIN, GB
from hybridflow.flows.placement.planner import PlanError, Planner

GPUS_PER_NODE = 8
PAPER_STRONG_SCALING = 0.668  # HybridFlow section 8.3: strong-scaling efficiency, 16 -> 128 GPUs, measured
FIXED = {
    "colocate": (("actor", "critic", "ref", "reward_model"),),
    "split": (("actor", "ref"), ("critic", "reward_model")),
    "standalone": (("actor",), ("critic",), ("ref",), ("reward_model",)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=1024, help="sequences per iteration (prompts x n)")
    parser.add_argument("--mini-batches", type=int, default=4, help="optimizer steps per iteration (actor, critic)")
    parser.add_argument("--gen-batch", type=int, default=1024, help="most sequences a replica decodes at once")
    parser.add_argument(
        "--inter-node-gbps", type=float, default=200, help="network per machine, Gb/s, shared by its 8 GPUs"
    )
    args = parser.parse_args()
    workload = Workload(
        sequences=args.sequences, prompt_length=1024, response_length=1024, actor_steps=args.mini_batches,
        critic_steps=args.mini_batches, train_micro_batch=2, critic_micro_batch=2, infer_micro_batch=8,
        gen_micro_batch=args.gen_batch,
    )  # fmt: skip
    per_gpu = args.inter_node_gbps / 8 * 1e9 / GPUS_PER_NODE  # bytes/s
    hardware = BUILTIN["a100-80gb"].model_copy(update={"inter_node_bandwidth": per_gpu})
    console = Console(width=230)
    table = Table(
        title=f"PPO, A100-80GB, {args.inter_node_gbps:g} Gb/s per machine ({per_gpu / GB:.3g} GB/s per GPU), "
        "seconds per iteration (estimated); best plan of each placement"
    )
    for column in ("model", "GPUs", *FIXED, "best of 3", "planner's choice", "devices", "s/iter", "strategies"):
        table.add_column(column, justify="left" if column in ("model", "planner's choice", "strategies") else "right")
    scaling: dict[str, dict[int, float]] = {}
    started = time.perf_counter()
    for size in ("llama-7b", "llama-13b", "llama-34b", "llama-70b"):
        shape = PRESETS[size]
        models = dict.fromkeys(("actor", "critic", "ref", "reward_model"), shape)
        for nodes in (2, 4, 8, 12, 16):
            gpus = nodes * GPUS_PER_NODE
            planner = Planner(models, workload, hardware, nodes, GPUS_PER_NODE, space="all")
            try:
                result = planner.search()
            except PlanError as e:
                table.add_row(size, str(gpus), "", "", "", "", str(e).splitlines()[0][:90], "", "", "")
                continue
            best = {name: min((c.seconds for c in result.candidates if c.placement == p), default=None)
                    for name, p in FIXED.items()}  # fmt: skip
            winner = min((name for name in best if best[name] is not None), key=lambda name: best[name])
            chosen = result.best
            scaling.setdefault(size, {})[gpus] = chosen.seconds
            table.add_row(
                size,
                str(gpus),
                *[f"{s:.1f}" if s is not None else "does not fit" for s in best.values()],
                winner,
                " | ".join("+".join(m) for m in chosen.placement),
                " | ".join(map(str, chosen.devices)),
                f"{chosen.seconds:.1f}",
                ", ".join(f"{m} {s.label()}" for m, s in chosen.strategies.items()),
            )
    console.print(table)
    for size, seconds in scaling.items():
        low, high = min(seconds), max(seconds)
        efficiency = seconds[low] / seconds[high] / (high / low)
        console.print(
            f"{size}: strong-scaling efficiency {low} -> {high} GPUs {efficiency:.1%} "
            f"(the paper, measured, 16 -> 128: {PAPER_STRONG_SCALING:.1%})"
        )
    console.print(f"searched in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
