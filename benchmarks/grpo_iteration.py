"""Benchmark: GRPO iterations of the single-process trainer on SmolLM2-135M-Instruct.

8 prompts x 4 samples, up to 64 new tokens (sampled, temperature 1.0), KL loss against the reference policy.
Prints per-stage seconds (gen, reward, old_log_prob, ref, adv, update_actor) and tokens/s for each iteration.
The first iteration includes one-off warm-up costs (allocator, kernel selection); the later ones are steady state.

    .venv/bin/python benchmarks/grpo_iteration.py [--iterations 3] [--threads 0] [-o key=value ...]

Needs the embedded model: `hf models prepare smollm2` (done by .ci/setup).
"""

import argparse
import time
from pathlib import Path

import torch

from hybridflow.engine.config import load_config
from hybridflow.engine.trainer import SingleProcessTrainer

STAGES = ["gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    example = Path(__file__).resolve().parent.parent / "examples" / "grpo_smollm2.yaml"
    overrides = [
        "data.train_batch_size=8",
        "rollout.n=4",
        "rollout.response_length=64",
        "data.reasoning_gym.val_size=0",
        "trainer.output_dir=/tmp/hybridflow-bench",
        f"trainer.num_threads={args.threads}",
        *args.override,
    ]
    cfg = load_config(example, overrides)
    t0 = time.perf_counter()
    trainer = SingleProcessTrainer(cfg)
    print(
        f"model {cfg.model.path}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"set-up {time.perf_counter() - t0:.1f} s"
    )
    print(
        f"batch: {cfg.data.train_batch_size} prompts x {cfg.rollout.n} samples, "
        f"up to {cfg.rollout.response_length} new tokens\n"
    )
    header = (
        f"{'iter':>4} " + " ".join(f"{s:>13}" for s in STAGES) + f" {'resp tok':>9} {'gen tok/s':>10} {'all tok/s':>10}"
    )
    print(header + "\n" + "-" * len(header))
    for i in range(args.iterations):
        m = trainer.step()
        stages = " ".join(f"{m.get('timing_s/' + s, 0.0):>12.2f}s" for s in STAGES)
        response_tokens = m["perf/gen_throughput"] * m["timing_s/gen"]
        print(
            f"{i:>4} {stages} {response_tokens:>9.0f} {m['perf/gen_throughput']:>10.1f} {m['perf/throughput']:>10.1f}"
        )
    print("\ngen tok/s = response tokens / generation seconds; all tok/s = prompt+response tokens / iteration seconds")


if __name__ == "__main__":
    main()
