"""The planner on the HybridFlow paper's placement study, simulated: PPO (actor, critic, ref, reward model of one
size) on Llama 7B / 13B / 34B / 70B over 16 to 128 A100-80GB (8 per node), 1,024-token prompts and responses.

For each model and cluster it prints the estimated seconds per iteration of the best plan of three fixed placements
the paper compares (colocate: all four models on every device; split: actor + ref on one set, critic + reward model
on the other; standalone: each model its own set) and the planner's choice over all 15 placements, with the
strategies it picked. Strategy space: the paper's (3D for every model). No GPU is needed: nothing runs.

    .venv/bin/python benchmarks/paper_placements.py [--sequences 1024] [--gen-micro-batch 64]
"""

import argparse
import time

from rich.console import Console
from rich.table import Table

from hybridflow.engine.shapes import PRESETS
from hybridflow.flows.placement.cost import Workload
from hybridflow.flows.placement.hardware import BUILTIN
from hybridflow.flows.placement.planner import PlanError, Planner

FIXED = {
    "colocate": (("actor", "critic", "ref", "reward_model"),),
    "split": (("actor", "ref"), ("critic", "reward_model")),
    "standalone": (("actor",), ("critic",), ("ref",), ("reward_model",)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=1024, help="sequences per iteration (prompts x n)")
    parser.add_argument("--gen-micro-batch", type=int, default=64, help="sequences a replica decodes at once")
    args = parser.parse_args()
    workload = Workload(
        sequences=args.sequences, prompt_length=1024, response_length=1024, actor_steps=1, critic_steps=1,
        train_micro_batch=2, critic_micro_batch=2, infer_micro_batch=8, gen_micro_batch=args.gen_micro_batch,
    )  # fmt: skip
    console = Console(width=220)
    table = Table(title="PPO, A100-80GB, seconds per iteration (estimated); best plan of each placement")
    for column in ("model", "GPUs", *FIXED, "planner's choice", "devices", "s/iter", "strategies", "search s"):
        table.add_column(column, justify="left" if column in ("model", "planner's choice", "strategies") else "right")
    for size in ("llama-7b", "llama-13b", "llama-34b", "llama-70b"):
        shape = PRESETS[size]
        models = dict.fromkeys(("actor", "critic", "ref", "reward_model"), shape)
        for nodes in (2, 4, 8, 16):
            planner = Planner(models, workload, BUILTIN["a100-80gb"], nodes, 8, space="all")
            started = time.perf_counter()
            try:
                result = planner.search()
            except PlanError as e:
                table.add_row(size, str(nodes * 8), "", "", "", str(e).splitlines()[0][:90], "", "", "", "")
                continue
            search_s = time.perf_counter() - started
            best = {name: min((c.seconds for c in result.candidates if c.placement == p), default=None)
                    for name, p in FIXED.items()}  # fmt: skip
            chosen = result.best
            table.add_row(
                size,
                str(nodes * 8),
                *[f"{s:.1f}" if s is not None else "does not fit" for s in best.values()],
                " | ".join("+".join(m) for m in chosen.placement),
                " | ".join(map(str, chosen.devices)),
                f"{chosen.seconds:.1f}",
                ", ".join(f"{m} {s.label()}" for m, s in chosen.strategies.items()),
                f"{search_s:.2f}",
            )
    console.print(table)


if __name__ == "__main__":
    main()
