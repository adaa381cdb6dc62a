"""Benchmark: the training-rollout mismatch of the mixture-of-experts main job with router replay off, R2 and R3
(HybridFlow issue 86).

Runs ``hf run examples/grpo_smollm2_moe.yaml`` on ``smollm2-moe`` (SmolLM2 upcycled into 8 experts, top 2) once per
``actor.router_replay.mode``, in bfloat16 (``model.dtype=bfloat16``: the rollout and the training forwards then
round differently, as on GPUs, where the field sees the drift; in float32 they choose the same experts) and with two
optimizer steps per iteration (``actor.ppo_mini_batch_size=4``: the second step's forwards run on weights the
first moved, where R2 matters). Prints, per mode, the medians over the iterations of:

- ``rollout/log_prob_diff_mean`` and ``rollout/kl``: the hf rollout's log-probs of its sampled tokens against the
  old_log_prob stage's (R3 replays the rollout's routes there);
- ``actor/ppo_kl`` and ``actor/pg_clipfrac``: the update's ratio against the old policy (R2 and R3 replay the old
  policy's routes there);
- ``actor/moe/replay_agreement``: the share of the replayed (token, layer) routes the routers would have chosen.

    .venv/bin/python benchmarks/moe_router_replay_mismatch.py [--iterations 4]

Needs ``hf models prepare smollm2-moe`` and a CPU with AVX512-BF16 or AMX (else bf16 is emulated, 23x slower), and a
quiet machine.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from hf_runs import hf_run, metric_medians

MODES = ("disabled", "R2", "R3")
METRICS = (
    "rollout/log_prob_diff_mean",
    "rollout/kl",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/moe/replay_agreement",
)


def run(mode: str, iterations: int, folder: Path) -> dict[str, float]:
    """Medians of `METRICS` over `iterations` GRPO iterations with ``actor.router_replay.mode`` `mode`."""
    overrides = [
        f"actor.router_replay.mode={mode}",
        "model.dtype=bfloat16",
        "actor.ppo_mini_batch_size=4",
        f"trainer.total_iterations={iterations}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        f"trainer.output_dir={folder / 'outputs'}",
        "trainer.logger=[console]",
    ]
    db, run_id = hf_run("grpo_smollm2_moe.yaml", overrides, folder, mode)
    return metric_medians(db, run_id, list(METRICS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4, help="iterations per mode")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moe-replay-bench-") as tmp:
        results = {mode: run(mode, args.iterations, Path(tmp) / mode) for mode in MODES}
    print(f"medians over {args.iterations} iterations, smollm2-moe, bfloat16, 2 optimizer steps per iteration")
    print(f"{'metric':<30}" + "".join(f"{mode:>12}" for mode in MODES))
    for name in METRICS:
        cells = [f"{results[m][name]:>12.3g}" if name in results[m] else f"{'-':>12}" for m in MODES]
        print(f"{name:<30}" + "".join(cells))


if __name__ == "__main__":
    main()
