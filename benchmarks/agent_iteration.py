"""Benchmark: what a multi-turn (tool-using) GRPO iteration costs per generated token, against a single-turn one.

Runs a tool example (--config: examples/tool_calc_smollm2.yaml, the calculator, or examples/tool_python_smollm2.yaml,
the sandboxed Python interpreter; SmolLM2-135M, 8 prompts x 4 samples, vLLM rollout where installed) from a model that
calls its tool (that example's `hf sft train` output, --model) in the single-process trainer, three ways, N
iterations each, nothing else running:

- ``tool_agent``: the agent loop with the tool (call, tool turn, answer: 2 engine calls per row);
- ``single_turn``: the same prompts (tools offered) and the same agent-loop rollout, one turn, no tool turn;
- ``plain``: ``rollout.multi_turn.enable=false``, the rollout without agent loops (prompts without tools).

For each it prints the median over iterations 2..N of the iteration's seconds, the model tokens generated (the
``response_mask`` tokens: what the policy wrote and trains on), the tool tokens, and seconds per generated token; then
the ratio of tool_agent's seconds per generated token to single_turn's (targets: at most 1.3 for the calculator,
issue 31; 1.2 for the interpreter, issue 54).

    .venv/bin/python benchmarks/agent_iteration.py --model DIR [--config YAML] [--iterations 6] [-o key=value ...]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from hybridflow.engine.config import load_config
from hybridflow.engine.trainer import SingleProcessTrainer

ROOT = Path(__file__).resolve().parent.parent
WAYS = {
    "tool_agent": [],
    "single_turn": ["rollout.multi_turn.default_agent_loop=single_turn"],
    "plain": ["rollout.multi_turn.enable=false"],
}


def run(way: str, config: Path, model: str, iterations: int, extra: list[str], out: Path) -> dict[str, float]:
    overrides = [
        f"model.path={model}",
        f"trainer.total_iterations={iterations}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={out / way}",
        *WAYS[way],
        *extra,
    ]
    cfg = load_config(config, overrides)
    cfg.trainer.val_before_train = False
    trainer = SingleProcessTrainer(cfg)
    started = time.monotonic()
    records = [r for r in trainer.fit(log=lambda r: None) if "timing_s/step" in r][1:]  # iteration 1 warms up
    wall = time.monotonic() - started
    rows = cfg.data.train_batch_size * cfg.rollout.n

    def median(name: str) -> float:
        values = [r[name] for r in records if name in r]
        return statistics.median(values) if values else 0.0

    generated = median("response_length/mean") * rows
    tool = median("response_length/tool_tokens/mean") * rows
    step = median("timing_s/step")
    return {"step_s": step, "gen_s": median("timing_s/gen"), "generated": generated, "tool": tool,
            "s_per_token": step / generated, "turns": median("num_turns/mean"), "wall": wall}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model that calls the tool (hf sft train's output)")
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "tool_calc_smollm2.yaml")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp())
    results = {way: run(way, args.config, args.model, args.iterations, args.override, out) for way in WAYS}
    header = f"{'rollout':>12} {'step s':>7} {'gen s':>7} {'turns':>6} {'model tok':>10} {'tool tok':>9}"
    header += f" {'ms/model tok':>13}"
    print(header + "\n" + "-" * len(header))
    for way, r in results.items():
        print(
            f"{way:>12} {r['step_s']:>7.2f} {r['gen_s']:>7.2f} {r['turns']:>6.2f} {r['generated']:>10.0f} "
            f"{r['tool']:>9.0f} {1000 * r['s_per_token']:>13.1f}"
        )
    ratio = results["tool_agent"]["s_per_token"] / results["single_turn"]["s_per_token"]
    print(f"tool_agent / single_turn, seconds per generated token: {ratio:.2f}")
    print(f"tool_agent / plain: {results['tool_agent']['s_per_token'] / results['plain']['s_per_token']:.2f}")


if __name__ == "__main__":
    main()
