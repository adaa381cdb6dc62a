"""The RLHF iteration in one process: the reference path that the distributed flow reproduces stage by stage.

`SingleProcessTrainer.step` is one iteration of PPO-family training, with the same stage names the Prefect flow
uses (generate, reward, old_log_prob, ref, values, adv, update_critic, update_actor). The algorithm (GRPO, RLOO,
PPO with GAE) is configuration: it only decides which stages run and which estimator computes advantages.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridflow.engine.actor import Actor, RefPolicy
from hybridflow.engine.advantage import build_kl_controller, compute_advantage
from hybridflow.engine.config import DataConfig, HybridFlowConfig
from hybridflow.engine.core_algos import masked_mean, uses_critic
from hybridflow.engine.critic import Critic
from hybridflow.engine.data import PromptDataset, PromptSampler, collate_prompts, load_rows, reasoning_gym_rows
from hybridflow.engine.embedded_models import resolve_model_path
from hybridflow.engine.metrics import Timer, compute_data_metrics
from hybridflow.engine.models import load_critic, load_model, load_tokenizer, pick_device, pick_dtype
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rewards import RewardManager, load_reward_function
from hybridflow.engine.rollout import HFRollout

logger = logging.getLogger(__name__)


def build_prompt_rows(data: DataConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and validation rows from ``data.train_files`` / ``data.val_files`` and ``data.reasoning_gym``.

    reasoning-gym: one dataset of ``train_size + val_size`` items is generated; the first ``val_size`` are held
    out for validation, and training items whose question also appears among them are dropped, so validation
    measures prompts the actor never trained on.
    """
    train = [row for path in data.train_files for row in load_rows(path)]
    val = [row for path in data.val_files for row in load_rows(path)]
    if data.reasoning_gym is not None:
        rg = data.reasoning_gym
        kwargs = {"instruction": rg.instruction} if rg.instruction is not None else {}
        rows = reasoning_gym_rows(rg.name, rg.train_size + rg.val_size, rg.seed, rg.config, **kwargs)
        held_out = rows[: rg.val_size]
        seen = {row["prompt"][-1]["content"] for row in held_out}
        train += [row for row in rows[rg.val_size :] if row["prompt"][-1]["content"] not in seen]
        val += held_out
    return train, val


class SingleProcessTrainer:
    """Builds the models, data and reward from a config and runs iterations in this process.

    Args:
        config: the validated run configuration.

    Raises:
        FileNotFoundError: the model is not prepared or a data file is missing (the message says which and how).
        ValueError: the data or reward configuration is unusable (the message names the config key).
    """

    def __init__(self, config: HybridFlowConfig):
        self.config = cfg = config
        torch.manual_seed(cfg.trainer.seed)
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        device = pick_device(cfg.trainer.device)
        dtype = pick_dtype(cfg.model.dtype, device)
        model_path = resolve_model_path(cfg.model.path)
        self.tokenizer = load_tokenizer(model_path)

        policy = load_model(model_path, dtype, device)
        self.actor = Actor(policy, cfg.actor, cfg.rollout.n, cfg.trainer.seed)
        self.rollout = HFRollout(policy, self.tokenizer, cfg.rollout)  # shares the actor's weights (colocated)
        self.ref = None
        if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            self.ref = RefPolicy(load_model(model_path, dtype, device), cfg.ref.log_prob_micro_batch_size)
        self.critic = None
        if uses_critic(cfg.algorithm.adv_estimator):
            critic_path = resolve_model_path(cfg.critic.model_path or cfg.model.path)
            self.critic = Critic(load_critic(critic_path, dtype, device), cfg.critic, cfg.rollout.n, cfg.trainer.seed)
        self.kl_ctrl = build_kl_controller(cfg.algorithm) if cfg.algorithm.use_kl_in_reward else None

        custom = load_reward_function(cfg.reward.custom_function) if cfg.reward.custom_function else None
        self.reward_fn = RewardManager(self.tokenizer, custom)

        train_rows, val_rows = build_prompt_rows(cfg.data)
        self.train_dataset = PromptDataset(train_rows, self.tokenizer, cfg.data.max_prompt_length)
        self.val_dataset = PromptDataset(val_rows, self.tokenizer, cfg.data.max_prompt_length) if val_rows else None
        self.sampler = PromptSampler(self.train_dataset, cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle)
        self.global_steps = 0

    # ------------------------------------------------------------------ one iteration
    def step(self) -> dict[str, float]:
        """Run one iteration on the next batch of prompts; returns its metrics (field-standard names)."""
        cfg = self.config
        timer = Timer()
        metrics: dict[str, float] = {}
        with timer("step"):
            prompts = self.sampler.next_batch()
            prompts.meta_info["global_steps"] = self.global_steps
            with timer("gen"):
                data = self.rollout.generate_sequences(prompts)
            with timer("reward"):
                scores, _ = self.reward_fn(data)
                data.batch["token_level_scores"] = scores
            with timer("old_log_prob"):
                old = self.actor.compute_log_prob(data, calculate_entropy=True)
                entropys = old.pop(batch_keys=["entropys"]).batch["entropys"]
                metrics["actor/entropy"] = float(masked_mean(entropys, data.batch["response_mask"]))
                data = data.union(old)
            if self.ref is not None:
                with timer("ref"):
                    data = data.union(self.ref.compute_ref_log_prob(data))
            if self.critic is not None:
                with timer("values"):
                    data = data.union(self.critic.compute_values(data))
            with timer("adv"):
                advantages, kl_metrics = compute_advantage(data, cfg.algorithm, self.kl_ctrl)
                data = data.union(advantages)
                metrics.update(kl_metrics)
            if self.critic is not None:
                with timer("update_critic"):
                    metrics.update(self.critic.update_critic(data))
            with timer("update_actor"):
                metrics.update(self.actor.update_policy(data))
        metrics.update(compute_data_metrics(data, cfg.rollout.response_length))
        metrics.update(timer.metrics())
        metrics.update(_throughput(data, timer.seconds))
        self.global_steps += 1
        metrics["training/global_step"] = self.global_steps
        metrics["training/epoch"] = self.sampler.state_dict()["epoch"]
        return metrics

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Generate once per held-out prompt (``rollout.val_temperature``, greedy by default) and score it.

        Returns:
            ``val/<data_source>/score`` (mean reward) and ``val/<data_source>/acc`` (mean of the reward's ``acc``
            when it reports one, else of the score), per data source.
        """
        if self.val_dataset is None:
            return {}
        per_source: dict[str, dict[str, list[float]]] = {}
        size = self.config.data.val_batch_size
        for start in range(0, len(self.val_dataset), size):
            items = [self.val_dataset[i] for i in range(start, min(start + size, len(self.val_dataset)))]
            prompts = collate_prompts(items, self.tokenizer)
            out = self.rollout.generate_sequences(prompts, n=1, temperature=self.config.rollout.val_temperature)
            scores, extras = self.reward_fn(out)
            score = scores.sum(-1).tolist()
            acc = extras["acc"].tolist() if "acc" in extras else score
            for source, s, a in zip(out.non_tensor_batch["data_source"], score, acc, strict=True):
                bucket = per_source.setdefault(source, {"score": [], "acc": []})
                bucket["score"].append(s)
                bucket["acc"].append(a)
        return {
            f"val/{source}/{name}": float(np.mean(values))
            for source, bucket in per_source.items()
            for name, values in bucket.items()
        }

    # ------------------------------------------------------------------ the run
    def fit(self, log=print) -> list[dict[str, float]]:
        """Validate (``trainer.val_before_train``), run ``trainer.total_iterations`` iterations, validating every
        ``trainer.test_freq`` iterations and after the last; append every record to
        ``<trainer.output_dir>/<trainer.experiment_name>/metrics.jsonl``.

        Args:
            log: called with each record (a dict with ``step`` and the metrics).

        Returns:
            the records, in order.
        """
        cfg = self.config.trainer
        out_dir = Path(cfg.output_dir) / cfg.experiment_name
        out_dir.mkdir(parents=True, exist_ok=True)
        records = []

        def emit(metrics: dict[str, float]) -> None:
            record = {"step": self.global_steps, **metrics}
            records.append(record)
            with open(out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            log(record)

        if cfg.val_before_train and self.val_dataset is not None:
            emit(self.validate())
        for it in range(cfg.total_iterations):
            metrics = self.step()
            last = it == cfg.total_iterations - 1
            if self.val_dataset is not None and (last or (cfg.test_freq and self.global_steps % cfg.test_freq == 0)):
                metrics.update(self.validate())
            emit(metrics)
        return records


def _throughput(data: DataProto, seconds: dict[str, float]) -> dict[str, float]:
    """``perf/throughput``: all tokens (prompt + response) per second of the iteration; ``perf/gen_throughput``:
    response tokens per second of generation."""
    total = float(data.batch["attention_mask"].sum())
    response = float(data.batch["response_mask"].sum())
    return {
        "perf/total_num_tokens": total,
        "perf/throughput": total / seconds["step"],
        "perf/gen_throughput": response / seconds["gen"],
    }
