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

Router replay (verl's ``router_replay.mode``; Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning
Training and Inference Routers", R3). A token's experts are a discrete choice: the rollout engine, the old-policy
forward and the update's forward may each pick different experts for the same token (other kernels, other batch
shapes, weights moved by the previous mini-batch), so the PPO ratio of a token compares two different networks.
`RouterRecorder.choosing` records the experts each forward picks; `RouterRecorder.replaying` makes a forward pick
the recorded ones instead, keeping the gate weights its own router gives those experts (softmax over its logits,
gathered at the recorded experts and renormalised as the architecture does), so the gradient still reaches the
router. ``routed_experts`` int16 [B, P+T, M, k] carries the choices in the batch: for each column of ``input_ids``
and each of the M MoE layers, the k experts that token went to; -1 where none was recorded (padding; the last
response token, which no forward of the rollout reads), which a replaying forward routes as its router chooses.
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
    ``_can_record_outputs["router_logits"]`` names), in layer order: they record the routers' logits (`recording`),
    the experts they choose (`choosing`), or make them choose given experts (`replaying`).

    Every router of the four `MOE_ARCHITECTURES` returns ``(logits [N, E], gate weights [N, k], experts [N, k])``
    for the N tokens of its call; the experts are the top-k of softmax(logits) and the gate weights their
    probabilities, renormalised to sum to 1 where the config's ``norm_topk_prob`` says (Mixtral: always).

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
        self.layer_of = {id(router): i for i, router in enumerate(self.routers)}
        self.logits: list[torch.Tensor] = []
        self._choosing: list[list[torch.Tensor]] = []  # one list per open `choosing` (they may nest)
        self._on = False
        self._targets: torch.Tensor | None = None
        self.replayed = self.agreed = 0
        self.handles = [router.register_forward_hook(self._hook) for router in self.routers]

    def remove(self) -> None:
        """Take the hooks off the model (a recorder on a model lent for one call)."""
        for handle in self.handles:
            handle.remove()

    def _hook(self, module, inputs, output):
        if self._on:
            self.logits.append(output[self.index] if isinstance(output, tuple) else output)
        if self._targets is not None:
            output = self._replayed(module, output, self._targets[:, self.layer_of[id(module)]])
        for chosen in self._choosing:
            chosen.append(output[2].detach())
        return output

    def _replayed(self, module, output, target: torch.Tensor):
        logits, weights, experts = output
        if target.shape != experts.shape:
            raise ValueError(
                f"router replay: the forward routes {tuple(experts.shape)} (tokens, top-k) in a layer, the recorded "
                f"routes are {tuple(target.shape)}: the batch's routed_experts do not belong to this model or batch"
            )
        target = target.to(experts.device, torch.long)
        recorded = target[:, 0] >= 0  # -1: nothing recorded, the router chooses
        with torch.no_grad():
            same = (experts.sort(-1).values == target.sort(-1).values).all(-1)
            self.replayed += int(recorded.sum())
            self.agreed += int((same & recorded).sum())
        chosen = torch.where(recorded[:, None], target, experts)
        gate = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
        if getattr(module, "norm_topk_prob", True):  # Mixtral's router has no flag and always renormalises
            gate = gate / gate.sum(-1, keepdim=True)
        return logits, gate.to(weights.dtype), chosen

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Record the router logits of the forwards inside: a list, one float [N, E] tensor per MoE layer call, in
        call order (layer 0 first), carrying their gradient."""
        self.logits, self._on = [], True
        try:
            yield self.logits
        finally:
            self._on = False

    @contextlib.contextmanager
    def choosing(self) -> Iterator[list[torch.Tensor]]:
        """Record the experts the routers choose in the forwards inside (after any replay): a list, one int64
        [N, k] tensor per MoE layer call, in call order. Nests: an inner `choosing` records into its own list too."""
        chosen: list[torch.Tensor] = []
        self._choosing.append(chosen)
        try:
            yield chosen
        finally:
            self._choosing = [other for other in self._choosing if other is not chosen]

    @contextlib.contextmanager
    def replaying(self, routes: torch.Tensor | None) -> Iterator[None]:
        """Inside, each router call over N tokens sends them to `routes` (int [N, M, k]: token, MoE layer, experts;
        rows of -1 route as the router chooses) instead of its own top-k; None: no replay. Counts the replayed
        (token, layer) routes and those the router would have chosen itself (`agreement`). Keep it open through
        the backward pass when activation checkpointing re-runs the forward there.

        Raises:
            ValueError: (at a router call) `routes` does not have that call's tokens and top-k.
        """
        if routes is not None and routes.shape[1] != len(self.routers):
            raise ValueError(
                f"router replay: the batch's routed_experts have {routes.shape[1]} MoE layers, the model "
                f"{len(self.routers)}: they were recorded with another model"
            )
        self._targets = routes
        try:
            yield
        finally:
            self._targets = None

    def agreement(self) -> float | None:
        """The share of the (token, layer) routes replayed since the last call that the router would have chosen
        itself (the same set of k experts); None when nothing was replayed. Resets the counts."""
        share = self.agreed / self.replayed if self.replayed else None
        self.replayed = self.agreed = 0
        return share


def old_log_prob_routing(mode: str, data) -> str | None:
    """What the old-policy forward (the old_log_prob stage) does with the routers under ``actor.router_replay.mode``
    `mode`: ``"record"`` under R2 (its choices become the batch's ``routed_experts``, which the update replays),
    ``"replay"`` under R3 (the rollout's), None when disabled.

    Raises:
        KeyError: R3 and `data` (a DataProto) has no ``routed_experts`` (the rollout recorded none)."""
    if mode == "R3" and "routed_experts" not in data.batch:
        raise KeyError(
            "actor.router_replay.mode=R3 replays the rollout's expert choices, but the batch has no "
            "routed_experts: this rollout engine records none (use rollout.name=hf, or router_replay.mode=R2)"
        )
    return {"R2": "record", "R3": "replay"}.get(mode)


def stack_routes(chosen: list[torch.Tensor]) -> torch.Tensor:
    """`RouterRecorder.choosing`'s experts of one forward (one int [N, k] tensor per MoE layer) as int16 [N, M, k]:
    token, MoE layer, experts."""
    return torch.stack(chosen, dim=1).to(torch.int16)


def generation_routes(
    chosen: list[torch.Tensor], layers: int, rows: int, prompt_length: int, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The experts a generation chose, in the batch's ``routed_experts`` layout (module docstring).

    Args:
        chosen: `RouterRecorder.choosing`'s list over one ``generate`` call of `rows` left-padded prompts of
            `prompt_length` tokens: the prefill's [rows * P, k] per MoE layer, then each decoding step's [rows, k]
            per layer (step j reads response token j - 1).
        layers: M, the model's MoE layers.
        attention_mask: int [rows, P+T] of the rollout's rows (0: padding).

    Returns:
        int16 [rows, P+T, M, k]; -1 at padding and at the last generated token (no forward read it).
    """
    calls = [torch.stack(chosen[i : i + layers], dim=1) for i in range(0, len(chosen), layers)]
    k = calls[0].shape[-1]
    out = torch.full((rows, attention_mask.shape[1], layers, k), -1, dtype=torch.int16)
    out[:, :prompt_length] = calls[0].view(rows, prompt_length, layers, k).cpu().to(torch.int16)
    for step, routes in enumerate(calls[1:]):
        if prompt_length + step < out.shape[1]:
            out[:, prompt_length + step] = routes.cpu().to(torch.int16)
    out[attention_mask.cpu() == 0] = -1
    return out


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
    return balance_from_sums(probs.sum(0), counts, probs.shape[0], top_k), counts


def balance_from_sums(prob_sums: torch.Tensor, counts: torch.Tensor, tokens, top_k: int) -> torch.Tensor:
    """The load-balancing loss of one layer (module docstring: ``E / k * sum_i f_i P_i``, Switch Transformer eqs.
    4-6 over k) from its sums over N `tokens`: `prob_sums` float [E], each expert's router probability summed over
    the tokens, and `counts` float [E], the tokens sent to each (summing to N k). 0-dim float32; 1.0 when
    balanced. Sums add over the parts of a batch, so parts held by different ranks give the whole batch's loss."""
    return (prob_sums * counts).sum() * prob_sums.shape[-1] / (top_k * tokens * tokens)


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
