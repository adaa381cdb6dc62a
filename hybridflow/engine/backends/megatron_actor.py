"""The PPO policy loss on megatron-core's ``GPTModel`` (`hybridflow.engine.backends.megatron_model`): response log-probs
from
vocabulary-parallel logits and the clipped surrogate, run through megatron's forward/backward schedule, so the same
code trains with tensor, pipeline and data parallelism.

Batches use the rollout layout of `hybridflow.engine.rollout.hf` (left-padded prompts, right-padded responses). The
attention mask given to megatron is causal and hides padding (megatron takes an explicit mask instead of its
causal default when one is passed; True = masked).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from hybridflow.engine.backends.actor import UPDATE_KEYS, batch_is_factor, corrected_actor_loss
from hybridflow.engine.backends.training import (
    MetricLog,
    build_optimizer,
    optimizer_step,
    update_random_stream,
    update_steps,
)
from hybridflow.engine.config import ActorConfig
from hybridflow.engine.moe import old_log_prob_routing
from hybridflow.engine.protocol import DataProto


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """megatron's attention mask: True where query i must not see key j (j > i, or j is padding).
    int/bool [B, S] -> bool [B, 1, S, S]."""
    seq = attention_mask.shape[1]
    future = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).triu(1)
    return future[None, None] | ~attention_mask.bool()[:, None, None, :]


def forward(model, micro: DataProto) -> torch.Tensor:
    """One forward of this rank's stage: vocabulary-parallel logits [b, S, V/t] on the last pipeline stage, the
    hidden states megatron passes on elsewhere (the schedule feeds earlier stages' outputs in)."""
    batch = micro.batch
    ids, positions, mask = batch["input_ids"], batch["position_ids"], batch["attention_mask"]
    pad = padded_length(model.config, ids.shape[1]) - ids.shape[1]
    if pad:  # sequence parallelism splits the sequence over the TP ranks; padding on the left keeps the end in place
        ids, positions, mask = (torch.nn.functional.pad(t, (pad, 0)) for t in (ids, positions, mask))
    # an MoE model's routers (their auxiliary losses, token counts) skip padding: megatron's padding_mask, True = pad
    padding = {"padding_mask": ~mask.bool()} if getattr(model.config, "num_moe_experts", None) else {}
    replay = getattr(model, "router_replay", None)  # a `MegatronRouterReplay` under actor.router_replay.mode
    if replay is not None:
        replay.before(batch, pad)
    out = model(ids, positions, attention_mask=causal_padding_mask(mask), **padding)
    if replay is not None:
        replay.after(batch, pad)
    return out[:, pad:] if pad and parallel_last_stage() else out


def padded_length(config, length: int) -> int:
    """The sequence length megatron runs for `length` tokens: a multiple of the TP size under sequence parallelism
    (each TP rank holds 1/t of the sequence between the tensor-parallel blocks), else `length`."""
    tp = config.tensor_model_parallel_size
    return length + (-length % tp if config.sequence_parallel else 0)


def parallel_last_stage() -> bool:
    """Whether this rank is its model's last pipeline stage (it holds the logits)."""
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()


def response_log_probs(model, micro: DataProto, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each response token (differentiable; last pipeline stage only).

    Args:
        model: this rank's ``GPTModel`` (its logits are this TP rank's vocabulary slice).
        micro: ``input_ids``, ``attention_mask``, ``position_ids`` [b, P+T] and ``responses`` [b, T].
        temperature: the logits are divided by it, as in `hybridflow.engine.models.response_logits`.

    Returns:
        float32 [b, T]. Positions past the response end are meaningless; mask them with ``response_mask``.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    responses = micro.batch["responses"]
    logits = forward(model, micro)[:, -responses.shape[1] - 1 : -1].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    # megatron's cross entropy takes [s, b, v/t] and returns -log p [s, b]
    return -vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), responses.t().contiguous()).t()


def support_log_probs(logits: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Log-probabilities at given token ids from vocabulary-parallel logits (differentiable): ``logit(v) - log Z``,
    each rank's logit of v taken from the rank holding v's slice and log Z = logsumexp over the whole vocabulary,
    both summed over the tensor-parallel group with megatron's ``reduce_from_tensor_model_parallel_region`` (an
    all-reduce forward, the identity backward: each rank's gradient reaches its own slice).

    Args:
        logits: float [b, T, V/t], this rank's slice of the vocabulary (rank r holds ids [r V/t, (r + 1) V/t)).
        support: int64 [b, T, k], token ids (the teacher's top-k, ``teacher_top_k_ids``).

    Returns:
        float32 [b, T, k].
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    width = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    with torch.no_grad():  # the shift only steadies exp(); log Z does not depend on it
        peak = logits.max(-1, keepdim=True).values
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(
                peak, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
            )
    log_z = peak + reduce_from_tensor_model_parallel_region((logits - peak).exp().sum(-1, keepdim=True)).log()
    mine = (support >= start) & (support < start + width)
    picked = logits.gather(-1, (support - start).clamp(0, width - 1)) * mine
    return reduce_from_tensor_model_parallel_region(picked) - log_z


def response_and_support_log_probs(model, micro: DataProto, temperature: float = 1.0) -> torch.Tensor:
    """`response_log_probs` and, from the same logits, `support_log_probs` at the teacher's top-k
    (``teacher_top_k_ids`` [b, T, k]), as one float32 tensor [b, T, 1 + k] (the schedule passes one tensor on):
    ``[..., 0]`` the response tokens', ``[..., 1:]`` the support's (last pipeline stage only)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    responses = micro.batch["responses"]
    logits = forward(model, micro)[:, -responses.shape[1] - 1 : -1].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    log_probs = -vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), responses.t().contiguous()).t()
    return torch.cat([log_probs[..., None], support_log_probs(logits, micro.batch["teacher_top_k_ids"])], dim=-1)


def response_values(model, micro: DataProto, temperature: float = 1.0) -> torch.Tensor:
    """The critic's value for each response token, read at the position that predicts it, as
    `hybridflow.engine.models.response_values` does (last pipeline stage of a model built with ``value_head``).
    float32 [b, T], differentiable; `temperature` is ignored."""
    responses = micro.batch["responses"]
    return forward(model, micro)[:, -responses.shape[1] - 1 : -1, 0].float()


def run_schedule(model, micros: list[DataProto], loss_of, forward_only: bool, head=response_log_probs) -> None:
    """Run `micros` through megatron's forward(/backward) schedule: every stage forwards, the last stage turns its
    output into per-response-token values with ``head(model, micro, temperature)`` (default: response log-probs;
    temperature from ``meta_info``) and calls ``loss_of(index, values) -> (loss, dict)``; megatron divides each loss
    by ``len(micros)`` before backward.

    Without pipeline parallelism the micro-batches may differ in size (a smaller last one: megatron's schedule without
    pipelining ignores ``micro_batch_size``; the losses' weights make the sum exact). With ``pp > 1`` they must not:
    the stages exchange activations in buffers of one shape [seq, ``len(micros[0])``, hidden], and a smaller
    micro-batch crashes the last stage (the config refuses such sizes up front, `HybridFlowConfig`).

    Raises:
        ValueError: micro-batches of different sizes with pipeline parallelism (names the sizes)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    sizes = sorted({len(m) for m in micros}, reverse=True)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if len(sizes) > 1 and pp > 1:  # raised on every rank alike: each stage of a replica holds the same rows
        raise ValueError(
            f"micro-batches of {' and '.join(map(str, sizes))} sequences: megatron's pipeline schedule (actor.pp={pp}) "
            "needs one size; make the micro-batch size (actor.ppo_micro_batch_size, actor.log_prob_micro_batch_size, "
            "critic.ppo_micro_batch_size, critic.forward_micro_batch_size) divide each data-parallel rank's batch"
        )
    last_stage = parallel_state.is_pipeline_last_stage()
    temperature = micros[0].meta_info.get("temperature", 1.0) or 1.0

    def forward_step(data_iterator, model):
        index, micro = next(data_iterator)
        if not last_stage:  # hidden states for the next stage; megatron never calls this stage's loss function
            return forward(model, micro), None
        return head(model, micro, temperature), functools.partial(loss_of, index)

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(list(enumerate(micros))),
        model=[model],
        num_microbatches=len(micros),
        seq_length=padded_length(model.config, micros[0].batch["input_ids"].shape[1]),
        micro_batch_size=len(micros[0]),
        forward_only=forward_only,
    )


def policy_gradient(
    model,
    micros: list[DataProto],
    loss_scales: list[float],
    config: ActorConfig,
    correction=None,
    is_factor: torch.Tensor | None = None,
    teacher=None,
) -> dict[str, float]:
    """Accumulate into ``.grad`` the gradient of ``sum_i loss_scales[i] * loss_i`` over the micro-batches of one
    mini-batch, where ``loss_i`` is micro-batch i's actor loss (`hybridflow.engine.backends.actor.actor_loss`: the
    policy loss, plus the KL loss when ``actor.use_kl_loss``, plus the distillation loss with `teacher`, its top-k
    KL from `response_and_support_log_probs`), through megatron's forward/backward schedule.

    Args:
        micros: micro-batches (of one size with pipeline parallelism, see `run_schedule`) with
            `hybridflow.engine.backends.actor.UPDATE_KEYS` (+ ``ref_log_prob``) and ``meta_info["temperature"]``.
        loss_scales: one weight per micro-batch (`hybridflow.engine.backends.training.micro_batch_weights`).
        correction: ``algorithm.rollout_correction`` (`hybridflow.engine.backends.actor.corrected_actor_loss`, as
            `Actor` applies it; bypass mode without ``rollout_is_batch_normalize``); None: off.
        is_factor: decoupled ``rollout_is_batch_normalize``'s batch mean weight (`batch_is_factor`), or None.
        teacher: ``teacher`` with ``use_as: loss`` (the micro-batches then hold ``teacher_log_prob``, and with
            ``top_k`` ``teacher_top_k_ids`` / ``teacher_top_k_log_probs``), else None.

    Returns:
        ``actor/pg_loss``, ``actor/ppo_kl``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` and, with the KL
        loss, ``actor/kl_loss`` and ``actor/kl_coef``, with a correction ``rollout_corr/rollout_is_*``, averaged
        over micro-batches (last pipeline stage; empty elsewhere), as `hybridflow.engine.backends.actor.Actor`
        names them.
    """
    logged: list[dict[str, float]] = []  # per micro-batch, as computed (the schedule rescales what it returns)

    top_k = teacher is not None and teacher.top_k > 0

    def loss_func(index: int, values: torch.Tensor):
        batch = micros[index].batch
        log_prob = values[..., 0] if top_k else values
        if top_k:  # the policy at the teacher's support, for the distillation loss
            batch = {**dict(batch.items()), "support_log_probs": values[..., 1:]}
        # without old_log_probs: one optimizer step, the old log-probs are this forward's (or bypass mode's rollout's)
        old_log_prob = batch["old_log_probs"] if "old_log_probs" in batch else log_prob.detach()
        # (no entropy bonus on megatron yet)
        loss, terms, stats = corrected_actor_loss(
            config, correction, old_log_prob, log_prob, batch, None, is_factor, teacher=teacher
        )
        terms = {f"actor/{k}": v for k, v in terms.items()} | {f"rollout_corr/{k}": v for k, v in stats.items()}
        logged.append({k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in terms.items()})
        # the schedule divides each micro-batch's loss by their number: undo it, then weigh
        return loss * loss_scales[index] * len(micros), {"pg_loss": terms["actor/pg_loss"].detach()}

    head = response_and_support_log_probs if top_k else response_log_probs
    run_schedule(model, micros, loss_func, forward_only=False, head=head)
    _sync_tied_embedding_grads(model)
    if not logged:
        return {}
    return {k: sum(m[k] for m in logged) / len(logged) for k in logged[0]}


def clip_grad_norm(model, max_norm: float) -> float:
    """Clip the gradients to a global 2-norm of `max_norm`, the norm taken over the whole model: each tensor-parallel
    shard counted once, replicated parameters (norms) once per model, a tied output layer once; summed over the
    model-parallel group. Returns the norm before clipping (as ``torch.nn.utils.clip_grad_norm_``)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    # dense parameters once per model over the model-parallel group; routed experts (megatron marks them
    # allreduce=False) once each over the group holding distinct experts and shards (expert TP x EP x PP)
    squares = torch.zeros(2, dtype=torch.float64, device=device)  # on the GPU with NCCL
    for p in model.parameters():
        if p.grad is None or not param_is_not_shared(p) or not param_is_not_tensor_parallel_duplicate(p):
            continue
        squares[0 if getattr(p, "allreduce", True) else 1] += p.grad.double().pow(2).sum()
    torch.distributed.all_reduce(squares[:1], group=parallel_state.get_model_parallel_group())
    if getattr(model.config, "num_moe_experts", None):
        group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
        torch.distributed.all_reduce(squares[1:], group=group)
    total = float(squares.sum().sqrt())
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)
    return total


class MegatronRole:
    """What the megatron actor and critic share: the model shard, its AdamW optimizer and schedule, megatron's
    data-parallel group, the per-rank mini-batch size (``ppo_mini_batch_size x n / D`` sequences, D = megatron's
    data-parallel size) and forward-only passes through megatron's schedule.

    Args:
        model: this rank's ``GPTModel`` (`hybridflow.engine.backends.megatron_model.build_gpt_model`).
        config: the role's section (``actor`` or ``critic``).
        rollout_n: responses per prompt.
        seed: seeds the mini-batch shuffling (with ``meta_info["global_steps"]``).
    """

    def __init__(self, model, config, rollout_n: int, seed: int = 0):
        from megatron.core import parallel_state

        self.model = model
        self.config = config
        self.seed = seed
        self.dp_group = parallel_state.get_data_parallel_group()
        self.mini_batch_size = config.ppo_mini_batch_size * rollout_n // torch.distributed.get_world_size(self.dp_group)
        self.optimizer, self.lr_scheduler = build_optimizer(model, config.optim)

    @torch.no_grad()
    def forward_only(self, data: DataProto, micro_batch_size: int, head, key: str) -> DataProto | None:
        """``{key: head's output}`` float32 [B, T] over `data` in micro-batches, forward only through megatron's
        schedule, on the last pipeline stage; None on the others (the 3D transfer protocol collects from it)."""
        from megatron.core import parallel_state

        self.model.eval()
        collected: list[torch.Tensor] = []

        def keep(index: int, values: torch.Tensor):
            collected.append(values)
            return values.sum() * 0.0, {}

        run_schedule(self.model, data.split(micro_batch_size), keep, forward_only=True, head=head)
        if not parallel_state.is_pipeline_last_stage():
            return None
        return DataProto.from_dict({key: torch.cat(collected).float()})


class MegatronActor(MegatronRole):
    """The PPO actor on megatron-core, with the update semantics of `hybridflow.engine.backends.actor.Actor`:
    mini-batches
    of ``ppo_mini_batch_size x n / D`` sequences per data-parallel rank, each one AdamW step; micro-batch losses
    weighted by `micro_batch_weights` over megatron's data-parallel group; gradients averaged over it; the global
    grad norm clipped to ``actor.optim.grad_clip``. Arguments as `MegatronRole` (``config``: the ``actor`` section),
    ``correction``: ``algorithm.rollout_correction`` (truncated importance sampling when its ``rollout_is`` is
    set; `policy_gradient`), and ``teacher``: the ``teacher`` section with ``use_as: loss`` (the distillation loss in
    every micro-batch's, as `hybridflow.engine.backends.actor.Actor` adds it), else None.
    """

    def __init__(self, model, config, rollout_n: int, seed: int = 0, correction=None, teacher=None):
        super().__init__(model, config, rollout_n, seed)
        self.correction = correction if correction is not None and correction.enabled() else None
        self.teacher = teacher

    def compute_log_prob(self, data: DataProto) -> DataProto | None:
        """Log-probs of the responses under the current weights (``old_log_probs`` float32 [B, T]) in micro-batches
        of ``actor.log_prob_micro_batch_size``, the logits divided by ``meta_info["temperature"]``; last pipeline
        stage only (see `MegatronRole.forward_only`). Under ``actor.router_replay.mode`` R2 also the experts chosen
        (``routed_experts`` int16 [B, P+T, M, k]); under R3 the forward replays the batch's.

        Raises:
            KeyError: R3 and the batch has no ``routed_experts``."""
        replay = getattr(self.model, "router_replay", None)
        if replay is None:
            return self.forward_only(data, self.config.log_prob_micro_batch_size, response_log_probs, "old_log_probs")
        routing = old_log_prob_routing(self.config.router_replay.mode, data)
        with replay.routing(routing) as recorded:
            out = self.forward_only(data, self.config.log_prob_micro_batch_size, response_log_probs, "old_log_probs")
        if out is not None and routing == "record":
            out.batch["routed_experts"] = torch.cat(recorded)
        return out

    def update_policy(self, data: DataProto) -> dict[str, float]:
        """PPO update on this data-parallel rank's rows; returns ``actor/pg_loss``, ``actor/ppo_kl`` (last stage),
        ``actor/grad_norm``, ``actor/lr`` and with a correction ``rollout_corr/*`` (last stage), averaged as
        `Actor.update_policy` does; an MoE model's router metrics (``actor/moe/*``,
        `hybridflow.engine.backends.megatron_router_stats`) and under router replay
        ``actor/moe/replay_agreement``."""
        cfg = self.config
        bypass = self.correction is not None and self.correction.bypass_mode
        # none: on-policy (`Actor`); bypass mode: the rollout's
        keys = [k for k in UPDATE_KEYS if k != "old_log_probs" or ("old_log_probs" in data.keys and not bypass)]
        keys += ["ref_log_prob"] if cfg.use_kl_loss else []
        keys += ["teacher_log_prob"] if self.teacher is not None else []
        keys += ["teacher_top_k_ids", "teacher_top_k_log_probs"] if self.teacher and self.teacher.top_k else []
        replay = getattr(self.model, "router_replay", None)
        keys += ["routed_experts"] if replay is not None and "routed_experts" in data.keys else []
        data = data.select(batch_keys=keys + (["rollout_log_probs"] if self.correction else []))
        steps = list(update_steps(data, self.mini_batch_size, cfg, self.seed, 0, self.dp_group, self.lr_scheduler))
        if "old_log_probs" not in keys and not bypass and len(steps) != 1:
            raise ValueError(
                f"the batch has no old_log_probs, which only an update of one optimizer step may do without; this one "
                f"takes {len(steps)}: run the old_log_prob stage first (actor.recompute_log_prob=true)"
            )
        self.model.train()
        log, corrections = MetricLog(), MetricLog()
        is_factor = batch_is_factor(self.correction, data, self.dp_group)
        # the update reads no routes back: no gather of them over the TP ranks
        routing = replay.routing("replay", collect=False) if replay is not None else contextlib.nullcontext()
        stats = getattr(self.model, "router_stats", None)  # an MoE model's (`megatron_router_stats`)
        counting = stats.collecting() if stats is not None else contextlib.nullcontext()
        with update_random_stream(self.seed, data, self.dp_group), routing, counting:  # Clip-Cov: same on resume
            for micros, scales in steps:
                gradient = policy_gradient(self.model, micros, scales, cfg, self.correction, is_factor, self.teacher)
                for prefix, into in (("actor/", log), ("rollout_corr/", corrections)):
                    into.add(**{k.removeprefix(prefix): v for k, v in gradient.items() if k.startswith(prefix)})
                clip = cfg.optim.grad_clip
                step = averaged_optimizer_step(self.model, self.optimizer, self.lr_scheduler, self.dp_group, clip, log)
                log.add(**step)
        metrics = {**log.mean("actor"), **corrections.mean("rollout_corr")}
        if stats is not None:
            metrics.update({f"actor/{name}": value for name, value in stats.metrics().items()})
        agreement = replay.agreement() if replay is not None else None  # over every rank: each routes its own tokens
        if agreement is not None:
            metrics["actor/moe/replay_agreement"] = agreement
        return metrics


def averaged_optimizer_step(
    model, optimizer, scheduler, dp_group, grad_clip: float, log: MetricLog | None = None, role: str = "actor"
) -> dict[str, float]:
    """After a mini-batch's gradients are accumulated: average them over megatron's data-parallel group (the loss
    weights carry a factor D, see `micro_batch_weights`), then the shared step
    (`hybridflow.engine.backends.training.optimizer_step`) with the norm over the model-parallel group
    (`clip_grad_norm`).
    Returns ``grad_norm`` (before clipping) and ``lr`` (the rate this step used).

    Raises:
        NonFiniteError: the norm is NaN or infinite: the weights are not stepped.
    """
    from megatron.core import parallel_state

    _sum_tensor_parallel_partial_grads(model)
    dp = torch.distributed.get_world_size(dp_group)
    # a routed expert's gradient already holds every token routed to it from its EP group's ranks: summed over the
    # ranks holding the same experts (expert data parallel, D / ep of them) it has all D ranks' tokens, so / D too
    experts = (
        parallel_state.get_expert_data_parallel_group() if getattr(model.config, "num_moe_experts", None) else None
    )
    if dp > 1:
        for p in model.parameters():
            if p.grad is not None:
                dense = getattr(p, "allreduce", True)
                if dense or torch.distributed.get_world_size(experts) > 1:
                    torch.distributed.all_reduce(p.grad, group=dp_group if dense else experts)
                p.grad.div_(dp)
    return optimizer_step(model, optimizer, scheduler, grad_clip, role, log, clip=clip_grad_norm)


def _sum_tensor_parallel_partial_grads(model) -> None:
    """Weights every TP rank holds whole but computes from part of the work: under sequence parallelism the norms,
    routers and shared-expert gates (megatron marks them ``sequence_parallel``) see 1/t of the tokens, and Qwen3's
    q/k norms see 1/t of the heads; their gradients are summed over the TP group, as megatron-core's
    ``finalize_model_grads`` does."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return
    sequence_parallel = model.config.sequence_parallel
    for name, param in model.named_parameters():
        partial = (sequence_parallel and getattr(param, "sequence_parallel", False)) or (
            model.config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
        )
        if partial and param.grad is not None:
            torch.distributed.all_reduce(param.grad, group=group)


def _sync_tied_embedding_grads(model) -> None:
    """With tied input/output embeddings split over pipeline stages, the first stage's embedding and the last
    stage's output layer are one weight held twice: sum their gradients (megatron's embedding group)."""
    from megatron.core import parallel_state

    if not getattr(model, "share_embeddings_and_output_weights", False):
        return
    if parallel_state.get_pipeline_model_parallel_world_size() == 1 or not parallel_state.is_rank_in_embedding_group():
        return
    weight = model.shared_embedding_or_output_weight()
    if weight.grad is not None:
        torch.distributed.all_reduce(weight.grad, group=parallel_state.get_embedding_group())
