"""Benchmark: the iteration time of the mixture-of-experts main job against the dense model of the same active
parameters (HybridFlow issue 86).

Runs ``hf run examples/grpo_smollm2_moe.yaml`` for a few iterations on ``smollm2-moe`` (SmolLM2 upcycled into 8
experts, top 2: 692 M parameters, 186 M active per token) and on ``smollm2-wide`` (SmolLM2 with MLPs twice as wide:
214 M parameters, the same active weights less the routers; router replay and the router loss off, as a dense model
has neither), one after the other, each in a run store of its own, validation cut to 8 prompts at the end. Prints
each run's median seconds per stage over the iterations after the first (the first warms up), and the MoE's over
the dense model's, stage by stage.

    .venv/bin/python benchmarks/moe_iteration_time.py [--iterations 5]

Needs the embedded models prepared (``hf models prepare smollm2-moe``, ``hf models prepare smollm2-wide``) and a
quiet machine: run nothing heavy beside it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from hf_runs import hf_run, metric_medians

STAGES = ("gen", "old_log_prob", "ref", "adv", "update_actor", "step")


def run(model: str, iterations: int, folder: Path) -> dict[str, float]:
    """Median seconds per stage (``timing_s/<stage>``) of `iterations` GRPO iterations on `model`, first dropped."""
    overrides = [
        f"model.path={model}",
        f"trainer.total_iterations={iterations}",
        "trainer.val_before_train=false",
        "data.reasoning_gym.val_size=8",
        f"trainer.output_dir={folder / 'outputs'}",
        "trainer.logger=[console]",
    ]
    if model != "smollm2-moe":
        overrides += ["actor.router_replay.mode=disabled", "actor.moe.aux_loss_coeff=0"]
    db, run_id = hf_run("grpo_smollm2_moe.yaml", overrides, folder, model)
    medians = metric_medians(db, run_id, [f"timing_s/{stage}" for stage in STAGES], first_step=2)
    return {name.removeprefix("timing_s/"): value for name, value in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5, help="iterations per run (the first is dropped)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        times = {model: run(model, args.iterations, Path(tmp) / model) for model in ("smollm2-moe", "smollm2-wide")}
    moe, dense = times["smollm2-moe"], times["smollm2-wide"]
    print(f"median seconds per stage, iterations 2-{args.iterations}")
    print(f"{'stage':<14}{'smollm2-moe':>13}{'smollm2-wide':>14}{'ratio':>8}")
    for stage in STAGES:
        if stage in moe and stage in dense:
            print(f"{stage:<14}{moe[stage]:>13.2f}{dense[stage]:>14.2f}{moe[stage] / dense[stage]:>8.2f}")


if __name__ == "__main__":
    main()
