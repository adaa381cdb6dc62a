"""The RLHF iteration in one process: the reference path that the distributed flow reproduces stage by stage.

`SingleProcessTrainer.step` is one iteration of PPO-family training, with the same stage names the Prefect flow
uses (generate, gen_max, reward, filter_groups, old_log_prob, ref, values, adv, update_critic, update_actor). The
algorithm is configuration: it only decides which stages run (PPO's critic, ReMax's greedy generation, DAPO's
repeated draws) and which estimator computes advantages.

`fit` saves checkpoints (``trainer.save_freq``, and after the last iteration) and resumes from one
(``trainer.resume_from``) exactly: weights, optimizer and LR-scheduler states, the prompt sampler's cursor and the
in-reward KL coefficient are restored, so a resumed run produces the same iterations as an uninterrupted one.
Mini-batch shuffling needs nothing saved (a pure function of the seed and the iteration number). The global RNG
states (torch, CUDA, numpy, python) are saved and restored too, for anything that draws from them (e.g. a custom
reward function); `validate` runs under a forked torch RNG so that it never shifts the training's random stream.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from hybridflow.engine.advantage import build_kl_controller, build_lagrangian, compute_advantage, reward_shaping
from hybridflow.engine.checkpoint import (
    CheckpointInfo,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    role_states,
    save_checkpoint,
)
from hybridflow.engine.config import HybridFlowConfig
from hybridflow.engine.core_algos import masked_mean, uses_greedy_baseline
from hybridflow.engine.data import PromptDataset, build_prompt_rows, collate_prompts, train_sampler
from hybridflow.engine.dynamic_sampling import DrawCount, kept_rows
from hybridflow.engine.metrics import Timer, compute_data_metrics, rollout_mismatch
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollouts import awake, rollout_spec
from hybridflow.engine.tracking import Tracking, mlflow_tracking_uri
from hybridflow.engine.workers import build_roles

logger = logging.getLogger(__name__)


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
        roles = build_roles(cfg, cfg.roles())
        self.tokenizer, self.actor, self.rollout = roles.tokenizer, roles.actor, roles.rollout
        self.ref, self.critic, self.reward_fn = roles.ref, roles.critic, roles.reward_fn
        self.cost_critic, self.cost_fn = roles.cost_critic, roles.cost_fn
        self.critics = roles.critics()  # the critic and Safe-RLHF's cost critic, those configured
        self.scorers = roles.scorers()  # the reward model and Safe-RLHF's cost model, those configured
        self.kl_ctrl = build_kl_controller(cfg.algorithm) if cfg.algorithm.use_kl_in_reward else None
        self.lagrangian = build_lagrangian(cfg.algorithm)  # Safe-RLHF's multiplier (None without a cost limit)

        train_rows, val_rows = build_prompt_rows(cfg.data)
        self.train_dataset = PromptDataset(train_rows, self.tokenizer, cfg.data.max_prompt_length)
        self.val_dataset = PromptDataset(val_rows, self.tokenizer, cfg.data.max_prompt_length) if val_rows else None
        self.sampler = train_sampler(self.train_dataset, cfg)
        self.global_steps = 0
        self.checkpoints: list[CheckpointInfo] = []  # saved by this trainer, in order

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
                data = self._generate(prompts)
            greedy = None
            if uses_greedy_baseline(cfg.algorithm.adv_estimator):  # ReMax: each prompt's greedy response
                with timer("gen_max"):
                    greedy = self._generate(prompts, n=1, temperature=0.0, stream="greedy")
            data = self._scored(data, timer)
            greedy = greedy if greedy is None else self._scored(greedy, timer, extras=False)
            if cfg.algorithm.filter_groups.enable:  # DAPO: only the varied groups, of as many draws as needed
                data, metrics["train/num_gen_batches"] = self._dynamic_sampling(data, timer)
            if not cfg.skips_old_log_prob():  # else the on-policy update uses and reports its own
                with timer("old_log_prob"):
                    old = self.actor.compute_log_prob(data, calculate_entropy=True)
                    entropys = old.pop(batch_keys=["entropys"]).batch["entropys"]
                    metrics["actor/entropy"] = float(masked_mean(entropys, data.batch["response_mask"]))
                    data = data.union(old)
                    if "rollout_log_probs" in data.keys:
                        metrics.update(rollout_mismatch(data))
            if self.ref is not None:
                with timer("ref"):
                    data = data.union(self.ref.compute_ref_log_prob(data))
            if self.critics:
                with timer("values"):
                    for critic in self.critics:
                        data = data.union(critic.compute_values(data))
            with timer("adv"):
                advantages, kl_metrics = compute_advantage(
                    data, cfg.algorithm, self.kl_ctrl, **reward_shaping(cfg), greedy=greedy, lagrangian=self.lagrangian
                )
                data = data.union(advantages)
                metrics.update(kl_metrics)
            if self.critics:
                with timer("update_critic"):
                    for critic in self.critics:
                        metrics.update(critic.update_critic(data))
            with timer("update_actor"):
                metrics.update(self.actor.update_policy(data))
            if rollout_spec(cfg.rollout.name).syncs_weights:  # a rollout with weights of its own (vLLM)
                with timer("weight_sync"):
                    metrics.update(self.rollout.update_weights())
        metrics.update(compute_data_metrics(data, cfg.rollout.response_length))
        metrics.update(timer.metrics())
        metrics.update(_throughput(data, timer.seconds))
        self.global_steps += 1
        metrics["training/global_step"] = self.global_steps
        metrics["training/epoch"] = self.sampler.state_dict()["epoch"]
        return metrics

    def _generate(self, prompts: DataProto, **kwargs) -> DataProto:
        """The rollout's `generate_sequences` (same arguments), woken for the call (`rollouts.awake`)."""
        with awake(self.rollout):
            return self.rollout.generate_sequences(prompts, **kwargs)

    def _scored(self, data: DataProto, timer: Timer, extras: bool = True) -> DataProto:
        """`data` with the score function's ``token_level_scores`` float32 [B, T] and, with `extras`, one
        ``reward_extra/<key>`` float64 [B] column per extra it reports; with a reward model, its ``rm_scores``;
        with ``reward.cost_function`` (Safe-RLHF), ``token_level_costs`` float32 [B, T]."""
        with timer("reward"):
            scores, extra = self.reward_fn(data)
            data.batch["token_level_scores"] = scores
            if self.cost_fn is not None:
                data.batch["token_level_costs"] = self.cost_fn(data)[0]
            for key, values in extra.items() if extras else ():  # -> reward_extra/<key>/mean
                data.batch[f"reward_extra/{key}"] = torch.from_numpy(np.asarray(values, dtype=np.float64))
        if self.scorers:
            with timer("rm_score"):
                for scorer in self.scorers:
                    data = data.union(scorer.compute_rm_score(data))
        return data

    def _dynamic_sampling(self, data: DataProto, timer: Timer) -> tuple[DataProto, int]:
        """DAPO's dynamic sampling (`hybridflow.engine.dynamic_sampling`): keep the varied groups of the scored
        first draw `data`, and draw, generate and score ``data.gen_batch_size`` more prompts (each draw its own
        random stream) until ``data.train_batch_size`` prompts are kept. Returns the first ``train_batch_size``
        kept groups and the number of draws.

        Raises:
            DynamicSamplingError: ``algorithm.filter_groups.max_num_gen_batches`` draws kept too few prompts.
        """
        cfg = self.config
        count, kept = DrawCount(cfg), []
        while True:
            with timer("filter_groups"):
                rows = kept_rows(data, cfg.algorithm.filter_groups.metric, **reward_shaping(cfg))
            kept.append(data[rows])
            if count.add(len(rows)):
                return DataProto.concat(kept)[: count.rows()], count.draws
            prompts = self.sampler.next_batch()
            prompts.meta_info["global_steps"] = self.global_steps
            with timer("gen"):
                data = self._generate(prompts, stream=f"train-{count.draws}")
            data = self._scored(data, timer)

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
        for batch_index, start in enumerate(range(0, len(self.val_dataset), size)):
            items = [self.val_dataset[i] for i in range(start, min(start + size, len(self.val_dataset)))]
            prompts = collate_prompts(items, self.tokenizer)
            prompts.meta_info["global_steps"] = self.global_steps
            # its own random stream: sampled validation never shifts training's samples
            out = self._generate(
                prompts, n=1, temperature=self.config.rollout.val_temperature, stream=f"val-{batch_index}"
            )
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

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_dir(self) -> Path:
        """``trainer.checkpoint_dir``, by default ``<output_dir>/<experiment_name>/checkpoints``."""
        cfg = self.config.trainer
        if cfg.checkpoint_dir:
            return Path(cfg.checkpoint_dir)
        return Path(cfg.output_dir) / cfg.experiment_name / "checkpoints"

    def save_checkpoint(self) -> CheckpointInfo:
        """Save ``<checkpoint_dir>/global_step_<global_steps>/`` atomically (`hybridflow.engine.checkpoint`):
        actor (and critic, and Safe-RLHF's cost critic) weights in Hugging Face layout with their optimizer and
        scheduler states, the tokenizer, the sampler cursor, the KL coefficient, Safe-RLHF's multiplier (log lambda
        and its cost window) and the RNG states. The frozen reference policy is not saved: it is
        rebuilt from ``model.path``.

        Returns:
            The new checkpoint's `CheckpointInfo` (also appended to ``self.checkpoints``).

        Raises:
            FileExistsError: that checkpoint folder already exists.
        """
        trainer_state = {
            "global_steps": self.global_steps,
            "sampler": self.sampler.state_dict(),
            "kl_ctrl_value": self.kl_ctrl.value if self.kl_ctrl is not None else None,
            "lagrange_multiplier": self.lagrangian.state_dict() if self.lagrangian is not None else None,
        }
        critic = self.critic
        info = save_checkpoint(
            self.checkpoint_dir,
            self.global_steps,
            actor_model=self.actor.model,
            actor_optimizer=self.actor.optimizer,
            actor_scheduler=self.actor.lr_scheduler,
            tokenizer=self.tokenizer,
            trainer_state=trainer_state,
            critic_model=critic.model if critic else None,
            critic_optimizer=critic.optimizer if critic else None,
            critic_scheduler=critic.lr_scheduler if critic else None,
            cost_critic=self.cost_critic,
        )
        self.checkpoints.append(info)
        logger.info("saved checkpoint %s (%d bytes, manifest sha256 %s)", info.path, info.bytes, info.sha256)
        return info

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore the state saved by `save_checkpoint` from folder `path` (verified against its manifest first):
        weights, optimizer and scheduler states, RNG states, ``global_steps``, the sampler cursor, the KL
        coefficient and Safe-RLHF's multiplier. The next `step` then produces what the interrupted run's next
        iteration would have.

        Raises:
            FileNotFoundError: `path` does not exist.
            hybridflow.engine.checkpoint.CheckpointError: the checkpoint is incomplete or corrupt, or does not fit
                this configuration (other model, or a critic the checkpoint lacks); the message says which.
        """
        state = load_checkpoint(path, **role_states(self.actor, self.critic, self.cost_critic))
        self.global_steps = int(state["global_steps"])
        self.sampler.load_state_dict(state["sampler"])
        kl_value = state.get("kl_ctrl_value")
        if self.kl_ctrl is not None:
            if kl_value is None:
                logger.warning("checkpoint %s has no KL coefficient; keeping %s", path, self.kl_ctrl.value)
            else:
                self.kl_ctrl.value = float(kl_value)
        if self.lagrangian is not None and state.get("lagrange_multiplier") is not None:
            self.lagrangian.load_state_dict(state["lagrange_multiplier"])
        logger.info("resumed from %s at global step %d", path, self.global_steps)

    def _resume_path(self) -> Path | None:
        resume_from = self.config.trainer.resume_from
        if resume_from is None:
            return None
        if resume_from == "auto":
            path = latest_checkpoint(self.checkpoint_dir)
            if path is None:
                logger.info("trainer.resume_from=auto: no checkpoint in %s; starting from scratch", self.checkpoint_dir)
            return path
        return Path(resume_from)

    # ------------------------------------------------------------------ the run
    def fit(self, log=print) -> list[dict[str, float]]:
        """Resume (``trainer.resume_from``) or validate (``trainer.val_before_train``; skipped when resuming), run
        iterations until ``global_steps`` reaches ``trainer.total_iterations``, validating every ``trainer.test_freq``
        iterations and after the last, and saving a checkpoint every ``trainer.save_freq`` iterations and after the
        last (`save_checkpoint`; logged, and listed in ``self.checkpoints``). Every record goes to the trackers of
        ``trainer.logger`` (`hybridflow.engine.tracking`; ``jsonl``: ``<trainer.output_dir>/<trainer.experiment_name>
        /metrics.jsonl``) before the checkpoint of its iteration is written, so after a crash and resume the
        iterations past the checkpoint appear there twice.

        Args:
            log: called with each record (a dict with ``step`` and the metrics) when ``trainer.logger`` has
                ``console``.

        Returns:
            the records of this call, in order.

        Raises:
            FileExistsError: ``trainer.checkpoint_dir`` already holds checkpoints past the starting step (another
                run's, or this one's when resuming from an older checkpoint); checked before any iteration runs.
            hybridflow.engine.checkpoint.CheckpointError: the checkpoint to resume from is incomplete or corrupt.
        """
        cfg = self.config.trainer
        out_dir = Path(cfg.output_dir) / cfg.experiment_name
        records = []
        tracking = Tracking(
            [b for b in cfg.logger if b != "console"],
            out_dir,
            project_name=cfg.project_name,
            experiment_name=cfg.experiment_name,
            run_id=cfg.experiment_name,
            config=self.config.model_dump(mode="json"),
            mlflow_uri=mlflow_tracking_uri(cfg.mlflow_tracking_uri, cfg.output_dir),
            mlflow_artifacts=Path(cfg.output_dir).resolve() / "mlartifacts",
        )

        def emit(metrics: dict[str, float]) -> None:
            record = {"step": self.global_steps, **metrics}
            records.append(record)
            tracking.log(metrics, self.global_steps)
            if "console" in cfg.logger:
                log(record)

        try:
            self._fit(emit)
        finally:
            tracking.finish()
        return records

    def _fit(self, emit) -> None:
        """`fit`'s body: resume or validate, then iterate; `emit` records each step's metrics."""
        cfg = self.config.trainer
        resume = self._resume_path()
        if resume is not None:
            self.load_checkpoint(resume)
        later = [str(path) for step, path in list_checkpoints(self.checkpoint_dir) if step > self.global_steps]
        if later:
            hint = "set trainer.resume_from=auto to continue from the latest" if resume is None else "move them away"
            raise FileExistsError(
                f"{self.checkpoint_dir} already holds checkpoints past step {self.global_steps} ({', '.join(later)}), "
                f"which this run would mix with its own: {hint}, or choose another trainer.checkpoint_dir or "
                "trainer.experiment_name"
            )
        if resume is None and cfg.val_before_train and self.val_dataset is not None:
            emit(self.validate())
        while self.global_steps < cfg.total_iterations:
            metrics = self.step()
            last = self.global_steps == cfg.total_iterations
            if self.val_dataset is not None and (last or (cfg.test_freq and self.global_steps % cfg.test_freq == 0)):
                metrics.update(self.validate())
            emit(metrics)
            if last or (cfg.save_freq and self.global_steps % cfg.save_freq == 0):
                self.save_checkpoint()  # logged, and listed in self.checkpoints (records stay metrics only)


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
