"""The PPO policy loss on megatron-core's ``GPTModel`` (`hybridflow.engine.megatron_model`): response log-probs from
vocabulary-parallel logits and the clipped surrogate, run through megatron's forward/backward schedule, so the same
code trains with tensor, pipeline and data parallelism.

Batches use the rollout layout of `hybridflow.engine.rollout` (left-padded prompts, right-padded responses). The
attention mask given to megatron is causal and hides padding (megatron takes an explicit mask instead of its
causal default when one is passed; True = masked).
"""

from __future__ import annotations

import torch

from hybridflow.engine.config import ActorConfig
from hybridflow.engine.core_algos import agg_loss, compute_policy_loss, kl_penalty
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
    return model(batch["input_ids"], batch["position_ids"], attention_mask=causal_padding_mask(batch["attention_mask"]))


def response_log_probs(model, micro: DataProto, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each response token (differentiable; last pipeline stage only).

    Args:
        model: this rank's ``GPTModel`` (its logits are this TP rank's vocabulary slice).
        micro: ``input_ids``, ``attention_mask``, ``position_ids`` [b, P+T] and ``responses`` [b, T].
        temperature: the logits are divided by it, as in `hybridflow.engine.models.forward_response_logits`.

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


def policy_gradient(model, data: DataProto, config: ActorConfig, micro_batch_size: int) -> dict[str, float]:
    """Accumulate into ``.grad`` the gradient of the PPO loss (`compute_policy_loss`, plus the KL loss when
    ``actor.use_kl_loss``) of one mini-batch `data`, over micro-batches of `micro_batch_size` sequences through
    megatron's forward/backward schedule. The loss is averaged over micro-batches (each weighs the same).

    Args:
        data: `hybridflow.engine.actor.UPDATE_KEYS` (+ ``ref_log_prob``), ``meta_info["temperature"]``.

    Returns:
        ``actor/pg_loss`` and ``actor/ppo_kl`` averaged over micro-batches (last pipeline stage; empty elsewhere).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    last_stage = parallel_state.is_pipeline_last_stage()
    temperature = data.meta_info.get("temperature", 1.0) or 1.0
    micros = data.split(micro_batch_size)
    logged: list[dict[str, float]] = []  # per micro-batch, as computed (the schedule rescales what it returns)

    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        if not last_stage:  # hidden states for the next stage; megatron never calls this stage's loss_func
            return forward(model, micro), None
        log_prob = response_log_probs(model, micro, temperature)

        def loss_func(log_prob):
            batch = micro.batch
            pg_loss, _, ppo_kl, _ = compute_policy_loss(
                old_log_prob=batch["old_log_probs"],
                log_prob=log_prob,
                advantages=batch["advantages"],
                response_mask=batch["response_mask"],
                clip_ratio_low=config.clip_ratio_low,
                clip_ratio_high=config.clip_ratio_high,
                clip_ratio_c=config.clip_ratio_c,
                loss_agg_mode=config.loss_agg_mode,
            )
            loss = pg_loss
            if config.use_kl_loss:
                kl = kl_penalty(log_prob, batch["ref_log_prob"], config.kl_loss_type)
                loss = loss + config.kl_loss_coef * agg_loss(kl, batch["response_mask"], config.loss_agg_mode)
            logged.append({"pg_loss": float(pg_loss), "ppo_kl": float(ppo_kl)})
            return loss, {"pg_loss": pg_loss.detach()}

        return log_prob, loss_func

    sequence = data.batch["input_ids"].shape[1]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micros),
        model=[model],
        num_microbatches=len(micros),
        seq_length=sequence,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    _sync_tied_embedding_grads(model)
    if not logged:
        return {}
    return {f"actor/{k}": sum(m[k] for m in logged) / len(logged) for k in logged[0]}


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
