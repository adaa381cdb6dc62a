"""The actor: the policy being trained. Computes response log-probs and runs the PPO policy update.

Each rank of a worker group holds one `Actor`; with several ranks the update is data-parallel (see `training`).
The update follows PPO (Schulman et al. 2017, Alg. 1): for ``ppo_epochs`` passes, split the batch into
mini-batches (one optimizer step each), each accumulated over micro-batches (one forward/backward each).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist

from hybridflow.engine.algorithms.distillation import (
    clamped,
    distillation_loss,
    top_k_forward_kl,
    top_k_reverse_kl,
)
from hybridflow.engine.algorithms.kl import kl_penalty
from hybridflow.engine.algorithms.losses import get_policy_loss_fn
from hybridflow.engine.algorithms.rollout_correction import batch_mean_weight, bypass_policy_loss, rollout_is_weights
from hybridflow.engine.backends.training import (
    MaskedMeans,
    MetricLog,
    build_optimizer,
    data_parallel,
    dp_world,
    optimizer_step,
    sync_gradients,
    update_random_stream,
    update_steps,
)
from hybridflow.engine.config import ActorConfig, RolloutCorrectionConfig, TeacherConfig
from hybridflow.engine.models import compute_token_stats, response_token_stats
from hybridflow.engine.moe import RouterRecorder, moe_spec, old_log_prob_routing, router_losses
from hybridflow.engine.packing import pack_rows
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.torch_ops import agg_loss

UPDATE_KEYS = [
    "input_ids",
    "attention_mask",
    "position_ids",
    "responses",
    "response_mask",
    "old_log_probs",
    "advantages",
]


def policy_loss(
    config: ActorConfig,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy loss ``actor.policy_loss.loss_mode`` names (`losses.get_policy_loss_fn`) with the section's
    clip ratios and ``loss_agg_mode``: ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, 0-dim tensors, over
    float [b, T] inputs (``log_prob`` carries the gradient), and the loss's own ``actor.policy_loss`` keys (those its
    signature names). Both training engines (this one and megatron's) call it."""
    fn = get_policy_loss_fn(config.policy_loss.loss_mode)
    params = inspect.signature(fn).parameters
    own = {k: v for k, v in config.policy_loss.model_dump(exclude={"loss_mode"}).items() if k in params}
    return fn(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.clip_ratio_c,
        loss_agg_mode=config.loss_agg_mode,
        is_weights=is_weights,
        **own,
    )


def actor_loss(
    config: ActorConfig,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    batch,
    entropy: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    pg: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    teacher: TeacherConfig | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """The actor's loss on one micro-batch, as both training engines (this one and megatron's) assemble it: the
    `policy_loss`, minus ``actor.entropy_coeff`` x the entropy bonus when `entropy` [b, T] is given (its
    ``loss_agg_mode`` aggregate), plus ``actor.kl_loss_coef`` x the KL loss to ``ref_log_prob`` when
    ``actor.use_kl_loss`` (``actor.kl_loss_type``, aggregated alike), plus ``teacher.kl_coef`` x the KL loss to
    ``teacher_log_prob`` with a `teacher` (``teacher.use_as: loss``,
    `hybridflow.engine.algorithms.distillation.distillation_loss`; with ``teacher.top_k`` a KL over the teacher's
    support, `hybridflow.engine.algorithms.distillation.top_k_reverse_kl` or, ``top_k_kl: forward``,
    `hybridflow.engine.algorithms.distillation.top_k_forward_kl`).

    Args:
        batch: the micro-batch's tensors (``advantages``, ``response_mask`` [b, T], ``ref_log_prob`` for the KL loss,
            ``teacher_log_prob`` for the distillation loss; with ``teacher.top_k`` ``teacher_top_k_log_probs`` and
            ``support_log_probs`` [b, T, k], the teacher's and the policy's at the teacher's support).
        pg: the policy loss's four terms when computed already (bypass mode's, `corrected_actor_loss`).

    Returns:
        The loss (0-dim, carrying the gradient of `log_prob` and `entropy`) and its terms for the metrics, named as
        ``actor/<name>``: ``entropy``, ``kl_loss``, ``kl_coef``, ``distill_loss`` where they apply, then ``pg_loss``,
        ``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower``.
    """
    mask = batch["response_mask"]
    if pg is None:
        pg = policy_loss(config, old_log_prob, log_prob, batch["advantages"], mask, is_weights)
    pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = pg
    loss, terms = pg_loss, {}
    if entropy is not None:
        entropy_loss = agg_loss(entropy, mask, config.loss_agg_mode)
        loss = loss - config.entropy_coeff * entropy_loss
        terms["entropy"] = entropy_loss
    if config.use_kl_loss:
        kl_loss = agg_loss(kl_penalty(log_prob, batch["ref_log_prob"], config.kl_loss_type), mask, config.loss_agg_mode)
        loss = loss + config.kl_loss_coef * kl_loss
        terms.update(kl_loss=kl_loss, kl_coef=config.kl_loss_coef)
    if teacher is not None and teacher.top_k:
        support, teachers = batch["support_log_probs"], batch["teacher_top_k_log_probs"]
        if teacher.top_k_kl == "forward":
            kl = clamped(top_k_forward_kl(support, teachers, mask, teacher.log_prob_floor), teacher.kl_clamp)
        else:
            kl = top_k_reverse_kl(support, teachers, mask)
        distill = agg_loss(kl, mask, config.loss_agg_mode)
        loss = loss + teacher.kl_coef * distill
        terms["distill_loss"] = distill
    elif teacher is not None:
        distill = distillation_loss(
            log_prob, batch["teacher_log_prob"], mask, teacher.kl_loss_type, config.loss_agg_mode, teacher.kl_clamp
        )
        loss = loss + teacher.kl_coef * distill
        terms["distill_loss"] = distill
    terms.update(pg_loss=pg_loss, pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)
    return loss, terms


def corrected_actor_loss(
    config: ActorConfig,
    correction: RolloutCorrectionConfig | None,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    batch,
    entropy: torch.Tensor | None = None,
    is_factor: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    teacher: TeacherConfig | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float], dict[str, torch.Tensor]]:
    """`actor_loss` with ``algorithm.rollout_correction`` applied to one micro-batch, as both training engines run
    it (`hybridflow.engine.algorithms.rollout_correction`):

    - bypass mode: `rollout_correction.bypass_policy_loss` against ``rollout_log_probs`` (weights, rejection and
      ``rollout_is_batch_normalize`` over `group` from the current policy);
    - decoupled: each token's policy term weighted by `rollout_is_weights` of `old_log_prob` against the rollout's,
      divided by `is_factor` (``rollout_is_batch_normalize``: the batch's mean weight, `batch_mean_weight`);
      rejection already applied to ``response_mask`` before the advantages;
    - `correction` None: `actor_loss` as it is.

    `teacher`: the distillation loss's (``teacher.use_as: loss``), added by `actor_loss`.

    Args:
        old_log_prob: float [b, T], the proximal policy's (the batch's ``old_log_probs``, or on-policy this
            forward's, detached); unused in bypass mode.
        batch: the micro-batch's tensors (``rollout_log_probs`` [b, T] with a correction).

    Returns:
        (loss, `actor_loss`'s terms, the correction's stats named without the ``rollout_corr/`` prefix).
    """
    if correction is None:
        return (*actor_loss(config, old_log_prob, log_prob, batch, entropy, teacher=teacher), {})
    rollout_log_prob = batch["rollout_log_probs"]
    if correction.bypass_mode:
        pg, stats = bypass_policy_loss(
            config, correction, log_prob, rollout_log_prob, batch["advantages"], batch["response_mask"], group
        )
        return (*actor_loss(config, rollout_log_prob, log_prob, batch, entropy, pg=pg, teacher=teacher), stats)
    is_weights, stats = None, {}
    if correction.rollout_is is not None:
        level, threshold = correction.rollout_is, correction.rollout_is_threshold
        is_weights, stats = rollout_is_weights(old_log_prob, rollout_log_prob, batch["response_mask"], level, threshold)
        if is_factor is not None:
            is_weights, stats["rollout_is_batch_norm_factor"] = is_weights / is_factor, is_factor
    return (*actor_loss(config, old_log_prob, log_prob, batch, entropy, is_weights, teacher=teacher), stats)


def batch_is_factor(
    correction: RolloutCorrectionConfig | None, data: DataProto, group: dist.ProcessGroup | None
) -> torch.Tensor | None:
    """Decoupled mode's ``rollout_is_batch_normalize``: the mean truncated weight of the whole update batch (its
    ``old_log_probs`` against ``rollout_log_probs``) over the data-parallel ranks of `group`, once before the
    update, as verl's driver computes it per batch; None when it does not apply. A collective over `group`."""
    if correction is None or correction.bypass_mode or not correction.rollout_is_batch_normalize:
        return None
    batch = data.batch
    mask, level = batch["response_mask"], correction.rollout_is
    weights, _ = rollout_is_weights(
        batch["old_log_probs"], batch["rollout_log_probs"], mask, level, correction.rollout_is_threshold
    )
    return batch_mean_weight(weights, mask, level, group)


class Actor:
    """PPO actor around a Hugging Face causal LM.

    Args:
        model: the policy (trained in place; the rollout may share it).
        config: the ``actor`` config section.
        rollout_n: responses per prompt, to turn ``ppo_mini_batch_size`` (prompts) into sequences.
        seed: seeds the mini-batch shuffling (with the iteration number from ``meta_info["global_steps"]``).
        compute_dtype: dtype of the forwards (``torch.bfloat16``: under autocast, weights and gradients stay as
            loaded, fp32 with ``load_model(..., trainable=True)``); None or float32: no autocast.
        lora: the `hybridflow.engine.backends.lora.LoraAdapter` injected into `model` (``model.lora_rank`` > 0):
            only its parameters require gradients, so the optimizer and the gradient sync cover the adapter alone,
            and checkpoints save it instead of the weights; None: every weight is trained.
        rollout_correction: the ``algorithm.rollout_correction`` section (`corrected_actor_loss`); None or a section
            that corrects nothing: off.

    Under torch.distributed (a worker group of D ranks) the model is wrapped in DDP or sharded with FSDP2 here
    (``actor.strategy``; with ``actor.tp`` FSDP2 runs over D / tp data-parallel replicas of tp tensor-parallel
    ranks), a collective: every rank constructs its `Actor` together; ``ppo_mini_batch_size x rollout_n`` must be a
    multiple of the data-parallel size.
    """

    def __init__(
        self,
        model,
        config: ActorConfig,
        rollout_n: int,
        seed: int = 0,
        compute_dtype: torch.dtype | None = None,
        lora=None,
        rollout_correction: RolloutCorrectionConfig | None = None,
        teacher: TeacherConfig | None = None,
    ):
        self.model = model
        self.teacher = teacher  # teacher.use_as: loss (the distillation loss in every micro-batch's), else None
        self.correction = rollout_correction if rollout_correction and rollout_correction.enabled() else None
        self.lora = lora  # the LoRA adapter injected into `model` (`hybridflow.engine.backends.lora`), or None
        self.config = config
        self.seed = seed
        self.compute_dtype = compute_dtype
        # a mixture-of-experts policy: its routers' logits are recorded in the update's forwards, for their losses
        self.moe = moe_spec(model.config)
        self.routers = RouterRecorder(model) if self.moe is not None else None
        # DDP or FSDP2 across the group's ranks (see `training`), else `model`; FSDP shards the parameters, so the
        # optimizer is built on them afterwards
        self.train_module, self.dp_group = data_parallel(model, config.strategy, getattr(config, "tp", 1))
        dp = dist.get_world_size(self.dp_group) if self.dp_group is not None else dp_world()[1]
        # sequences per rank per optimizer step: the global mini-batch is split over the data-parallel ranks
        self.mini_batch_size = config.ppo_mini_batch_size * rollout_n // dp
        self.optimizer, self.lr_scheduler = build_optimizer(model, config.optim)

    def compute_log_prob(self, data: DataProto, calculate_entropy: bool = False) -> DataProto:
        """Log-probs of the responses under the current weights.

        Args:
            data: rollout output (``input_ids``, ``attention_mask``, ``position_ids``, ``responses``);
                ``meta_info["temperature"]`` (sampling temperature, default 1.0) divides the logits.

        Returns:
            DataProto with ``old_log_probs`` float32 [B, T] (and ``entropys`` float32 [B, T] if asked, and
            ``sum_pi_squared`` float32 [B, T] with ``actor.calculate_sum_pi_squared``).
        """
        self.model.eval()
        temperature = data.meta_info.get("temperature", 1.0) or 1.0
        cfg = self.config
        stats = compute_token_stats(
            self.model,
            data,
            cfg.log_prob_micro_batch_size,
            temperature,
            calculate_entropy,
            self.compute_dtype,
            cfg.shares_prompts,
            cfg.calculate_sum_pi_squared,
            routers=self.routers,
            routing=self._routing(data),
        )
        names = {"log_probs": "old_log_probs", "entropy": "entropys", "sum_pi_squared": "sum_pi_squared"}
        names["routed_experts"] = "routed_experts"
        return DataProto.from_dict({names[name]: value for name, value in stats.items()})

    def _routing(self, data: DataProto) -> str | None:
        """What the old-policy forward does with the routers (`hybridflow.engine.moe.old_log_prob_routing`)."""
        return old_log_prob_routing(self.config.router_replay.mode if self.moe is not None else "disabled", data)

    def update_policy(self, data: DataProto) -> dict[str, float]:
        """PPO update on a batch with advantages.

        Each mini-batch is one optimizer step; its loss is accumulated over micro-batches weighted by
        `training.micro_batch_weights`, so the gradient equals that of the mini-batch loss in one piece (for
        ``token-mean``: every response token of the mini-batch weighs the same).

        Args:
            data: needs the keys in `UPDATE_KEYS` (and ``ref_log_prob`` [B, T] when ``actor.use_kl_loss``,
                ``teacher_log_prob`` [B, T] with the distillation loss,
                ``rollout_log_probs`` [B, T] with the rollout correction on). Without ``old_log_probs`` the update is
                on-policy (HybridFlowConfig.skips_old_log_prob): one optimizer step, whose ratio's denominator is its
                own forward's log-probs, detached; in bypass mode (``algorithm.rollout_correction.bypass_mode``) the
                old log-probs are ``rollout_log_probs``, for any number of steps.

        Returns:
            metrics averaged over micro-batches: ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``,
            ``actor/pg_clipfrac_lower``, ``actor/entropy``, ``actor/kl_loss``, ``actor/distill_loss`` (if used),
            ``actor/moe/load_balancing_loss``, ``actor/moe/z_loss``, ``actor/moe/max_load/layer_<i>`` (an MoE policy,
            `hybridflow.engine.moe.router_losses`; its losses added times ``actor.moe.*_coeff``),
            ``rollout_corr/*`` (with the
            rollout correction: `corrected_actor_loss`'s statistics), and per optimizer step ``actor/grad_norm``,
            ``actor/lr``; on-policy also the old_log_prob stage's token means (`_micro_step`).

        Raises:
            KeyError: the rollout correction is on and the batch has no ``rollout_log_probs`` (an engine that reports
                none).
            ValueError: no ``old_log_probs`` and more than one optimizer step (outside bypass mode).
        """
        cfg = self.config
        bypass = self.correction is not None and self.correction.bypass_mode
        on_policy = "old_log_probs" not in data.keys and not bypass
        keys = [k for k in UPDATE_KEYS if k != "old_log_probs" or ("old_log_probs" in data.keys and not bypass)]
        keys += ["ref_log_prob"] if cfg.use_kl_loss else []
        keys += ["teacher_log_prob"] if self.teacher is not None else []
        keys += ["teacher_top_k_ids", "teacher_top_k_log_probs"] if self.teacher and self.teacher.top_k else []
        replay = self.moe is not None and cfg.router_replay.mode != "disabled" and "routed_experts" in data.keys
        keys += ["routed_experts"] if replay else []  # R2: the old-policy forward's choices; R3: the rollout's
        if self.correction is not None and "rollout_log_probs" not in data.keys:
            raise KeyError(
                "algorithm.rollout_correction needs the rollout engine's log-probs (rollout_log_probs), which this "
                "batch lacks: use rollout.name=vllm or remove algorithm.rollout_correction's rollout_is, rollout_rs "
                "and bypass_mode"
            )
        if "rollout_log_probs" in data.keys and (self.correction is not None or on_policy):
            keys.append("rollout_log_probs")
        data = data.select(batch_keys=keys)
        temperature = data.meta_info.get("temperature", 1.0) or 1.0
        steps = list(update_steps(data, self.mini_batch_size, cfg, self.seed, 0, self.dp_group, self.lr_scheduler))
        if on_policy and len(steps) != 1:
            raise ValueError(
                f"the batch has no old_log_probs, which only an update of one optimizer step may do without; this one "
                f"takes {len(steps)} (actor.ppo_epochs x data.train_batch_size / actor.ppo_mini_batch_size): run the "
                "old_log_prob stage first (actor.recompute_log_prob=true)"
            )
        self.model.train()
        log, corrections = MetricLog(), MetricLog()
        measured = MaskedMeans() if on_policy else None
        is_factor = batch_is_factor(self.correction, data, self.dp_group)
        with update_random_stream(self.seed, data, self.dp_group):  # Clip-Cov's draws: the same on a resumed run
            for micros, weights in steps:
                for i, (micro, loss_scale) in enumerate(zip(micros, weights, strict=True)):
                    with sync_gradients(self.train_module, sync=i == len(micros) - 1):
                        self._micro_step(micro, temperature, loss_scale, log, corrections, measured, is_factor)
                clip = cfg.optim.grad_clip
                log.add(**optimizer_step(self.model, self.optimizer, self.lr_scheduler, clip, "actor", log))
        metrics = {**log.mean("actor"), **corrections.mean("rollout_corr")}
        return {**metrics, **(measured.means() if measured is not None else {})}

    def _micro_step(
        self,
        micro: DataProto,
        temperature: float,
        loss_scale: float,
        log: MetricLog,
        corrections: MetricLog,
        measured: MaskedMeans | None,
        is_factor: torch.Tensor | None = None,
    ) -> None:
        """One micro-batch's forward and backward. With `measured` (an on-policy update: the batch has no
        ``old_log_probs``), the old log-probs are this forward's, detached (the weights have not moved yet: one
        optimizer step, after every micro-batch), and `measured` gets what the skipped old_log_prob stage reports
        from the same numbers: ``actor/entropy`` (unless the entropy bonus logs its own) and the rollout engine's
        drift (``rollout/log_prob_diff_mean``, ``rollout/kl``, as `hybridflow.engine.metrics.rollout_mismatch`)."""
        cfg = self.config
        batch = micro.batch
        mask = batch["response_mask"]
        calculate_entropy = cfg.entropy_coeff != 0
        top_k = self.teacher is not None and self.teacher.top_k
        packed = pack_rows(micro, cfg.shares_prompts)
        routes = packed.gather(batch["routed_experts"]) if "routed_experts" in batch else None
        moe = self.routers is not None
        replay = self.routers.replaying(routes) if moe else contextlib.nullcontext()
        with replay:  # through the backward too: activation checkpointing re-runs the forward there
            with self.routers.recording() if moe else contextlib.nullcontext() as router_logits:
                stats = self._forward(micro, packed, temperature, calculate_entropy or measured is not None)
            log_prob, entropy = stats["log_probs"], stats.get("entropy")
            if top_k:  # the policy at the teacher's support, for the distillation loss (`actor_loss`)
                batch = batch.clone(recurse=False)
                batch["support_log_probs"] = stats["support_log_probs"]
            old_log_prob = batch["old_log_probs"] if "old_log_probs" in batch else log_prob.detach()
            if measured is not None:
                if not calculate_entropy:
                    measured.add("actor/entropy", entropy, mask)
                if "rollout_log_probs" in batch:
                    drift = batch["rollout_log_probs"] - old_log_prob
                    measured.add("rollout/log_prob_diff_mean", drift.abs(), mask)
                    measured.add("rollout/kl", drift, mask)
            loss, terms, stats = corrected_actor_loss(
                cfg,
                self.correction,
                old_log_prob,
                log_prob,
                batch,
                entropy if calculate_entropy else None,
                is_factor,
                self.dp_group,
                self.teacher,
            )
            if self.moe is not None:  # the routers' losses over this forward's packed tokens (`hybridflow.engine.moe`)
                balance, z, moe_metrics = router_losses(router_logits, self.moe.top_k)
                loss = loss + cfg.moe.aux_loss_coeff * balance + cfg.moe.z_loss_coeff * z
                agreement = self.routers.agreement()
                if agreement is not None:
                    moe_metrics["moe/replay_agreement"] = agreement
                log.add(**moe_metrics)
            (loss * loss_scale).backward()
        log.add(**terms)
        corrections.add(**stats)

    def _forward(self, micro: DataProto, packed, temperature: float, entropy: bool) -> dict[str, torch.Tensor]:
        """The update's forward of `micro` over `packed` (`hybridflow.engine.models.response_token_stats`)."""
        cfg = self.config
        top_k = self.teacher is not None and self.teacher.top_k
        return response_token_stats(
            self.train_module,
            micro,
            temperature,
            entropy,
            self.compute_dtype,
            entropy_grad=cfg.entropy_coeff != 0,
            share_prompts=cfg.shares_prompts,
            support=micro.batch["teacher_top_k_ids"] if top_k else None,
            packed=packed,
        )


class RefPolicy:
    """A frozen policy that only scores: the reference (log-probs for the KL term) or the distillation teacher.

    Args:
        model: a copy of the initial policy, or the teacher (never updated; may be stored in bf16,
            ``load_model(trainable=False)``).
        micro_batch_size: sequences per forward (``ref.log_prob_micro_batch_size``,
            ``teacher.log_prob_micro_batch_size``).
        compute_dtype: dtype of the forwards, as for `Actor` (pass the actor's, so both see the same numerics).
        share_prompts: compute a repeated prompt once (`hybridflow.engine.packing.pack_rows`).
        column: the name of the log-probs it returns (``ref_log_prob``, the teacher's ``teacher_log_prob``).
        top_k: > 0 (the teacher's ``teacher.top_k``): also each position's `top_k` likeliest tokens,
            ``<column stem>_top_k_ids`` int64 [B, T, k] and ``<column stem>_top_k_log_probs`` float32 [B, T, k]
            (``teacher_top_k_ids``, ``teacher_top_k_log_probs``).
    """

    def __init__(
        self,
        model,
        micro_batch_size: int,
        compute_dtype: torch.dtype | None = None,
        share_prompts: bool = True,
        column: str = "ref_log_prob",
        top_k: int = 0,
    ):
        self.model = model.eval().requires_grad_(False)
        self.top_k = top_k
        self.micro_batch_size = micro_batch_size
        self.compute_dtype = compute_dtype
        self.share_prompts = share_prompts
        self.column = column

    @torch.no_grad()
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """Returns DataProto with `column` (``ref_log_prob``) float32 [B, T] of each response token (logits divided by
        the rollout temperature), and with `top_k` the support's ids and log-probs [B, T, k]."""
        temperature = data.meta_info.get("temperature", 1.0) or 1.0
        stats = compute_token_stats(
            self.model,
            data,
            self.micro_batch_size,
            temperature,
            compute_dtype=self.compute_dtype,
            share_prompts=self.share_prompts,
            top_k=self.top_k,
        )
        stem = self.column.removesuffix("_log_prob")
        out = {self.column: stats["log_probs"]}
        if self.top_k:
            out.update({f"{stem}_top_k_ids": stats["top_k_ids"], f"{stem}_top_k_log_probs": stats["top_k_log_probs"]})
        return DataProto.from_dict(out)
