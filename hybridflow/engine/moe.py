"""Mixture-of-experts models as transformers builds them: which architectures run here, what their routers chose in a
forward, and the router's auxiliary losses.

A transformers MoE model (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, OLMoE) computes each MoE layer's
router logits in a router module (``Qwen3MoeTopKRouter``, ...) that the model names in its own
``_can_record_outputs["router_logits"]``; `RouterRecorder` hooks exactly those modules, so the training forward
(packed rows, FSDP2 shards and all) yields every layer's router logits [N, E] for N packed tokens without asking the
model to compute its own loss. The losses are megatron-core's definitions, so verl's megatron keys mean the same here:

- load balancing (Switch Transformer, Fedus et al. 2022, eqs. 4-6, scaled as megatron-core's
  ``switch_load_balancing_loss_func`` scales it): per layer ``E / k * sum_i f_i * P_i``, f_i the share of the N
  tokens' k choices that went to expert i (summing to k) and P_i the mean router probability of expert i; 1.0 when
  perfectly balanced, E / k at worst;
- router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): per layer ``mean_tokens(logsumexp(logits)^2)``.

Both are summed over the MoE layers when added to the loss, each times its coefficient (``actor.moe.aux_loss_coeff``,
``actor.moe.z_loss_coeff``: megatron-core's ``moe_aux_loss_coeff`` / ``moe_z_loss_coeff``), and reported as the mean
over layers, as megatron-core's MoE metrics are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# architecture -> (config attribute of the routed expert count, of the shared expert count or width)
MOE_ARCHITECTURES: dict[str, tuple[str, str | None]] = {
    "Qwen3MoeForCausalLM": ("num_experts", None),
    "Qwen2MoeForCausalLM": ("num_experts", "shared_expert_intermediate_size"),
    "MixtralForCausalLM": ("num_local_experts", None),
    "OlmoeForCausalLM": ("num_experts", None),
}
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class MoeSpec:
    """What the router of an MoE model does: `num_experts` routed experts per layer, each token sent to `top_k` of
    them, plus `shared_experts` that every token passes through (Qwen2-MoE: 1)."""

    architecture: str
    num_experts: int
    top_k: int
    shared_experts: int


def moe_spec(config) -> MoeSpec | None:
    """The `MoeSpec` of a transformers config (``config.json``), or None for a dense model.

    Raises:
        ValueError: the config has routed experts but its architecture is not one `MOE_ARCHITECTURES` runs (names
            the architecture and the ones that run).
    """
    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    experts = next((getattr(config, key) for key in _EXPERT_COUNT_KEYS if getattr(config, key, None)), None)
    if architecture not in MOE_ARCHITECTURES:
        if experts and int(experts) > 1:
            raise ValueError(
                f"{architecture} is a mixture-of-experts model ({experts} experts) that HybridFlow does not run yet: "
                f"the MoE architectures it trains are {', '.join(MOE_ARCHITECTURES)}; pick a model of one of them"
            )
        return None
    count_key, shared_key = MOE_ARCHITECTURES[architecture]
    shared = int(bool(getattr(config, shared_key, 0))) if shared_key else 0
    return MoeSpec(architecture, int(getattr(config, count_key)), int(config.num_experts_per_tok), shared)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # DDP wraps the model; FSDP2 shards it in place


class RouterRecorder:
    """Forward hooks on every router module of a transformers MoE model (the class its
    ``_can_record_outputs["router_logits"]`` names): inside `recording`, each router call appends its logits.

    Args:
        model: the transformers MoE model (or a DDP wrapper of it; FSDP2-sharded is fine).

    Raises:
        ValueError: the model names no router output to record (not a transformers MoE model).
    """

    def __init__(self, model: torch.nn.Module):
        inner = _unwrapped(model)
        recorder = getattr(inner, "_can_record_outputs", {}).get("router_logits")
        if recorder is None:
            raise ValueError(f"{type(inner).__name__} names no router outputs: it is not a transformers MoE model")
        self.index = recorder.index
        self.routers = [m for m in inner.modules() if isinstance(m, recorder.target_class)]
        self.logits: list[torch.Tensor] = []
        self._on = False
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        if self._on:
            self.logits.append(output[self.index] if isinstance(output, tuple) else output)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Record the router logits of the forwards inside: a list, one float [N, E] tensor per MoE layer call, in
        call order (layer 0 first), carrying their gradient."""
        self.logits, self._on = [], True
        try:
            yield self.logits
        finally:
            self._on = False


def load_balancing_loss(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's load-balancing loss (module docstring) and its tokens per expert.

    Args:
        logits: float [N, E], the router's logits for N tokens.
        top_k: experts per token.

    Returns:
        (loss 0-dim float32, 1.0 when balanced, carrying the gradient of `logits`; tokens per expert float32 [E],
        summing to N * top_k).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    chosen = probs.topk(top_k, dim=-1).indices
    counts = torch.bincount(chosen.reshape(-1), minlength=probs.shape[-1]).float()
    tokens = probs.shape[0]
    loss = (probs.sum(0) * counts).sum() * probs.shape[-1] / (top_k * tokens * tokens)
    return loss, counts


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """One layer's router z-loss (ST-MoE eq. 5): mean over the N tokens of logsumexp(logits)^2, 0-dim float32,
    carrying the gradient of `logits` float [N, E]."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def router_losses(layers: list[torch.Tensor], top_k: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Both losses of one forward's routers, summed over its MoE layers, and its metrics.

    Args:
        layers: `RouterRecorder.recording`'s logits, one float [N, E] per MoE layer.

    Returns:
        (load-balancing loss summed over layers, z-loss summed over layers, metrics): ``moe/load_balancing_loss``
        and ``moe/z_loss`` (means over the layers), and ``moe/max_load/layer_<i>``: the busiest expert's tokens over
        the balanced share N * top_k / E (1.0 when balanced).
    """
    balance, z, metrics = [], [], {}
    for i, logits in enumerate(layers):
        loss, counts = load_balancing_loss(logits, top_k)
        balance.append(loss)
        z.append(z_loss(logits))
        metrics[f"moe/max_load/layer_{i}"] = float(counts.max() / counts.mean())
    aux, zl = torch.stack(balance).sum(), torch.stack(z).sum()
    metrics.update(
        {"moe/load_balancing_loss": float(aux.detach()) / len(layers), "moe/z_loss": float(zl.detach()) / len(layers)}
    )
    return aux, zl, metrics
