"""Benchmark helper: one of our GRPO configs run through TRL's GRPOTrainer, like for like, timed per step.

Maps the config onto `trl.GRPOConfig` so that each TRL optimizer step is one of our iterations: the same model
(fp32 weights; ``model.dtype: bfloat16`` -> ``bf16=True``, bf16 autocast on CPU as ours), the same prompts
(`build_prompt_rows`: chat messages, the chat template applied by TRL) and reward (`default_compute_score`'s
``score``), ``data.train_batch_size`` x ``rollout.n`` completions per step in micro-batches of
``actor.ppo_micro_batch_size`` (gradient accumulation up to one optimizer step), ``rollout.response_length`` new
tokens at ``rollout.temperature``, ``beta = actor.kl_loss_coef`` (TRL's k3 estimator: our ``low_var_kl``), clip
``[1 - clip_ratio_low, 1 + clip_ratio_high]``, token-mean loss (TRL's ``dapo``), ``actor.optim.lr`` with
``warmup_steps`` then constant, dropout off, no gradient checkpointing (ours has none), on-policy (no old log-prob
pass, as ours skips it). Generation: HF ``generate`` by default, ``--vllm`` TRL's colocated vLLM engine.

Prints one JSON object: per optimizer step, seconds and completion tokens.

    .venv/bin/python benchmarks/trl_grpo.py CONFIG [--iterations 4] [--vllm] [-o key=value ...]

Needs ``pip install trl==1.16.0`` (``.[bench]``).
"""

import argparse
import json
import os
import tempfile
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from hybridflow.engine.config import load_config
from hybridflow.engine.data import build_prompt_rows
from hybridflow.engine.embedded_models import resolve_model_path
from hybridflow.engine.reward.rewards import default_compute_score


def reward(completions, data_source, reward_model, extra_info, **_) -> list[float]:
    """Our built-in score of each completion (the text of its one assistant message)."""
    return [
        default_compute_score(src, c[0]["content"], rm["ground_truth"], json.loads(info))["score"]
        for c, src, rm, info in zip(completions, data_source, reward_model, extra_info, strict=True)
    ]


class StepClock(TrainerCallback):
    """Wall-clock seconds of each optimizer step and the completion tokens TRL logged for it."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._started = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({"seconds": time.perf_counter() - self._started})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs and self.steps:
            self.steps[-1]["mean_length"] = float(logs["completions/mean_length"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--vllm", action="store_true", help="TRL's colocated vLLM engine instead of HF generate")
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    from trl import GRPOConfig, GRPOTrainer  # imported late: its vLLM probe prints warnings

    cfg = load_config(args.config, args.override)
    torch.set_num_threads(cfg.trainer.num_threads or torch.get_num_threads())
    path = str(resolve_model_path(cfg.model.path))
    train_rows, _ = build_prompt_rows(cfg.data)
    columns = ("prompt", "data_source", "reward_model")
    dataset = Dataset.from_list(
        [{**{k: row[k] for k in columns}, "extra_info": json.dumps(row.get("extra_info", {}))} for row in train_rows]
    )
    completions = cfg.data.train_batch_size * cfg.rollout.n
    micro = cfg.actor.ppo_micro_batch_size
    bf16 = cfg.model.dtype == "bfloat16"
    trl_args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"),
        use_cpu=not torch.cuda.is_available(),
        bf16=bf16,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=completions // micro,
        num_generations=cfg.rollout.n,
        max_completion_length=cfg.rollout.response_length,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        beta=cfg.actor.kl_loss_coef if cfg.actor.use_kl_loss else 0.0,
        epsilon=cfg.actor.clip_ratio_low,
        epsilon_high=cfg.actor.clip_ratio_high,
        loss_type="dapo",
        learning_rate=cfg.actor.optim.lr,
        warmup_steps=cfg.actor.optim.warmup_steps,
        lr_scheduler_type="constant_with_warmup",
        gradient_checkpointing=False,
        disable_dropout=True,
        max_steps=args.iterations,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=cfg.trainer.seed,
        use_vllm=args.vllm,
        **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3} if args.vllm else {}),
    )
    if args.vllm:  # TRL's colocate mode starts vLLM under torch.distributed's external launcher: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    clock = StepClock()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=reward,
        args=trl_args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(path, padding_side="left"),
        callbacks=[clock],
    )
    trainer.train()
    steps = [{**s, "tokens": s.get("mean_length", float("nan")) * completions} for s in clock.steps]
    print(json.dumps({"completions": completions, "bf16": bf16, "vllm": args.vllm, "steps": steps}))


if __name__ == "__main__":
    main()
