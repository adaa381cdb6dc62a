"""Build a preference set from the embedded SmolLM2 and reasoning-gym, offline: for training prompts of the main
job's task, sample several responses, score them with the task's exact-answer check, and pair a correct response
(chosen) with a wrong one (rejected).

Only the run config's *training* prompts are used (its held-out prompts stay unseen by the reward model); the pairs
of the first ``--train-share`` of the prompts go to ``train.jsonl``, the rest to ``val.jsonl`` (held out by prompt,
so no prompt is in both). Rows are in the preference layout ``hf rm train`` reads: ``prompt`` (the chat list),
``chosen``, ``rejected`` (the responses as text), plus ``data_source`` and ``ground_truth``.

    .venv/bin/python examples/smollm2_preferences.py --prompts 800 --samples 8 --out outputs/preferences
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hybridflow.engine.config import load_config
from hybridflow.engine.data import collate_prompts
from hybridflow.engine.worker import build_roles
from hybridflow.flows.preflight import prompt_sets

ROOT = Path(__file__).resolve().parent


def sample_pairs(config: Path, prompts: int, samples: int, pairs_per_prompt: int, batch: int) -> list[list[dict]]:
    """Per prompt (the first `prompts` of the config's training set), its (correct, wrong) pairs."""
    cfg = load_config(config, [f"rollout.n={samples}", "rollout.temperature=1.0"])
    sets = prompt_sets(cfg)
    roles = build_roles(cfg, ["actor", "rollout", "reward"])
    tokenizer = roles.tokenizer
    items = [sets.train[i] for i in range(min(prompts, len(sets.train)))]
    out: list[list[dict]] = []
    for start in range(0, len(items), batch):
        chunk = items[start : start + batch]
        batch_prompts = collate_prompts(chunk, tokenizer)
        batch_prompts.meta_info["global_steps"] = start  # the sampling seed: (trainer.seed, stream, step)
        rollout = roles.rollout.generate_sequences(batch_prompts, n=samples, stream="preferences")
        _, extras = roles.reward_fn(rollout)
        responses, mask = rollout.batch["responses"], rollout.batch["response_mask"].bool()
        for p, item in enumerate(chunk):
            correct, wrong = [], []
            for row in range(p * samples, (p + 1) * samples):
                text = tokenizer.decode(responses[row][mask[row]].tolist(), skip_special_tokens=True).strip()
                bucket = correct if extras["acc"][row] >= 1.0 else wrong
                if text and text not in bucket:
                    bucket.append(text)
            ground_truth = item["reward_model"]["ground_truth"]
            out.append(
                [
                    {"prompt": item["prompt"], "chosen": c, "rejected": w, "data_source": item["data_source"],
                     "ground_truth": ground_truth}
                    for c, w in list(zip(correct, wrong, strict=False))[:pairs_per_prompt]
                ]
            )  # fmt: skip
        print(f"prompts {start + len(chunk)}/{len(items)}: {sum(map(len, out))} pairs", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "grpo_smollm2.yaml", help="the task (its data section)")
    parser.add_argument("--prompts", type=int, default=800, help="training prompts to sample from")
    parser.add_argument("--samples", type=int, default=8, help="responses sampled per prompt")
    parser.add_argument("--pairs-per-prompt", type=int, default=2)
    parser.add_argument("--train-share", type=float, default=0.8, help="share of the prompts whose pairs train")
    parser.add_argument("--batch", type=int, default=32, help="prompts per generate call")
    parser.add_argument("--out", type=Path, default=Path("outputs/preferences"))
    args = parser.parse_args()
    start = time.perf_counter()
    per_prompt = sample_pairs(args.config, args.prompts, args.samples, args.pairs_per_prompt, args.batch)
    cut = int(len(per_prompt) * args.train_share)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", per_prompt[:cut]), ("val", per_prompt[cut:])):
        rows = [pair for pairs in part for pair in pairs]
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{args.out / name}.jsonl: {len(rows)} pairs from {len(part)} prompts")
    print(f"took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
