"""RLHF training in one process, with no Prefect server or worker groups: every role in this process.

`SingleProcessTrainer.step` runs the flow's iteration (`hybridflow.engine.iteration.run_iteration`), its stages
calls of an in-process `hybridflow.engine.worker.RLHFWorker` (`LocalStages`): the same stages, worker methods and
metrics as a flow run on one rank.

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
from typing import Any

import torch

from hybridflow.engine.advantage import (
    advantage_stage,
    build_kl_controller,
    build_lagrangian,
    policy_filtration,
    reward_shaping,
)
from hybridflow.engine.agent.rollout import prompt_tools
from hybridflow.engine.checkpoint import (
    CheckpointInfo,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    role_states,
    save_checkpoint,
)
from hybridflow.engine.config import HybridFlowConfig
from hybridflow.engine.data import PromptDataset, build_prompt_rows, collate_prompts, train_sampler
from hybridflow.engine.dynamic_sampling import kept_rows
from hybridflow.engine.iteration import STAGE_METHODS, TIMING, Call, run_iteration
from hybridflow.engine.metrics import Timer, ValidationTally
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.tracking import Tracking, mlflow_tracking_uri
from hybridflow.engine.worker import RLHFWorker

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
        if config.trainer.mode != "sync":
            raise ValueError(
                f"trainer.mode={config.trainer.mode} overlaps generation and training on two pools: run it with "
                "hf run (the Prefect flow); the single-process trainer runs trainer.mode=sync"
            )
        self.config = cfg = config
        torch.manual_seed(cfg.trainer.seed)
        self.worker = RLHFWorker(0, 1, "", cfg.model_dump(mode="json"), sorted(cfg.roles()))
        self.worker.init_model()  # every role in this process (build_roles)
        worker = self.worker
        self.tokenizer, self.actor, self.rollout = worker.tokenizer, worker.actor, worker.rollout
        self.ref, self.critic, self.reward_fn = worker.ref, worker.critic, worker.reward_fn
        self.cost_critic, self.cost_fn = worker.cost_critic, worker.cost_fn
        self.critics, self.scorers = worker.critics, worker.scorers
        self.kl_ctrl = build_kl_controller(cfg.algorithm) if cfg.algorithm.use_kl_in_reward else None
        self.lagrangian = build_lagrangian(cfg.algorithm)  # Safe-RLHF's multiplier (None without a cost limit)

        train_rows, val_rows = build_prompt_rows(cfg.data)
        length, tools = cfg.data.max_prompt_length, prompt_tools(cfg)
        self.train_dataset = PromptDataset(train_rows, self.tokenizer, length, tools=tools)
        self.val_dataset = PromptDataset(val_rows, self.tokenizer, length, tools=tools) if val_rows else None
        self.sampler = train_sampler(self.train_dataset, cfg)
        self.global_steps = 0
        self.checkpoints: list[CheckpointInfo] = []  # saved by this trainer, in order

    # ------------------------------------------------------------------ one iteration
    def step(self) -> dict[str, float]:
        """Run one iteration on the next batch of prompts (`hybridflow.engine.iteration.run_iteration`, the flow's
        iteration, its stages called in this process: `LocalStages`); returns its metrics (field-standard names)."""
        timer = Timer()
        metrics = run_iteration(self.config, LocalStages(self, timer), self.global_steps, timer).metrics
        self.global_steps += 1
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
        tally = ValidationTally()
        size = self.config.data.val_batch_size
        for batch_index, start in enumerate(range(0, len(self.val_dataset), size)):
            items = [self.val_dataset[i] for i in range(start, min(start + size, len(self.val_dataset)))]
            prompts = collate_prompts(items, self.tokenizer)
            prompts.meta_info["global_steps"] = self.global_steps
            # its own random stream: sampled validation never shifts training's samples
            out = self.worker.generate_sequences(
                prompts, n=1, temperature=self.config.rollout.val_temperature, stream=f"val-{batch_index}"
            )
            tally.add(out.union(self.worker.compute_reward(out, costs=False)))  # validation reports no cost
        return tally.metrics()

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
            actor_model=getattr(self.actor, "lora", None) or self.actor.model,  # a LoRA actor saves its adapter
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
        self.worker.version = self.worker.rollout_version = self.global_steps  # the rows' recorded weight version
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


class LocalStages:
    """The single-process trainer's `hybridflow.engine.iteration.Stages`: each stage a call of the trainer's
    in-process `RLHFWorker` (the method `iteration.STAGE_METHODS` names, as the flow's worker groups run it), on
    `DataProto` batches, timed in `timer`."""

    def __init__(self, trainer: SingleProcessTrainer, timer: Timer):
        self.trainer, self.timer, self.cfg = trainer, timer, trainer.config

    def __call__(self, *calls: Call) -> list[Any]:
        out = []
        for call in calls:
            if not call.when:
                out.append(None)
                continue
            spec = STAGE_METHODS[call.stage]
            args, kwargs = spec.bind(call.args)
            with self.timer(TIMING.get(call.stage, call.stage)):
                out.append(getattr(self.trainer.worker, spec.method)(*args, **kwargs))
        return out

    def next_prompts(self, step: int) -> DataProto:
        prompts = self.trainer.sampler.next_batch()
        prompts.meta_info["global_steps"] = step
        return prompts

    def filter_groups(self, scored: DataProto, step: int) -> list[int]:
        with self.timer("filter_groups"):
            return kept_rows(scored, self.cfg.algorithm.filter_groups.metric, **reward_shaping(self.cfg))

    def advantage(self, batch: DataProto, greedy: DataProto | None, step: int) -> tuple[DataProto, dict]:
        trainer = self.trainer
        with self.timer(TIMING["advantage"]):
            shaping = reward_shaping(self.cfg)
            teacher = self.cfg.teacher if self.cfg.teacher.enabled else None
            algorithm, lagrangian = self.cfg.algorithm, trainer.lagrangian
            return advantage_stage(batch, greedy, algorithm, trainer.kl_ctrl, shaping, lagrangian, teacher)

    def policy_filtration(self, batch: DataProto, step: int) -> tuple[list[int], dict[str, float]]:
        with self.timer(TIMING["advantage"]):
            return policy_filtration(batch, self.cfg.algorithm, self.cfg.trainer.seed, step)

    def view(self, batch: DataProto) -> DataProto:
        return batch

    def submit(self, call: Call, after: Any | None = None) -> Any:
        """Run `call` now (one process: nothing to overlap with, `after` has ended); `result` hands its result
        back."""
        [out] = self(call)
        return out

    def result(self, pending: Any) -> Any:
        return pending
