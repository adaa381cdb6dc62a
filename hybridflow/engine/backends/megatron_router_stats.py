"""The router metrics of a megatron-core MoE actor's update, as the Hugging Face actors log them
(`hybridflow.engine.moe.router_losses`): ``actor/moe/load_balancing_loss`` and ``actor/moe/z_loss`` (means over
the MoE layers, logged whatever ``actor.moe.*_coeff`` is) and ``actor/moe/max_load/layer_<i>`` (the busiest
expert's tokens over the balanced share, 1.0 when balanced), each the mean over the update's micro-batches.

A forward hook on every ``TopKRouter`` sums, for the tokens of the call that are not padding (megatron's
``padding_mask``, True at padding), each expert's router probability (the softmax of its logits), the tokens its
own top-k would send to each expert, the token count and the squared logsumexp of the logits. Only forwards with
autograd on count: the update's own forwards, and under activation recompute the recomputation (megatron runs the
first forward of a recomputed layer without autograd), so each micro-batch counts once. Under sequence parallelism
each TP rank routes 1/t of the positions, so the sums are added over the TP group before the metrics are taken;
the losses are then those of the whole micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hybridflow.engine.moe import balance_from_sums


class MegatronRouterStats:
    """The router sums of one megatron ``GPTModel``'s MoE layers (module docstring), collected inside `collecting`.

    Args:
        model: a ``GPTModel`` of an MoE config (all its layers: one pipeline stage).
        top_k: experts per token (``moe_router_topk``).

    Raises:
        ValueError: the model has no MoE router.
    """

    def __init__(self, model, top_k: int):
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ValueError("router metrics: the megatron model has no MoE router (a dense model)")
        self.top_k = top_k
        self.layers = len(routers)
        self.sequence_parallel = bool(model.config.sequence_parallel)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.active = False
        # per MoE layer, per counted call: float64 [2E + 2], prob sums, counts, tokens, lse^2 (recomputations run
        # in the backward, the layers in reverse order: grouped by layer, a layer's calls in micro-batch order)
        self.calls: list[list[torch.Tensor]] = [[] for _ in routers]
        for i, router in enumerate(routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):
        def hook(module, args, output):
            if not (self.active and torch.is_grad_enabled()):
                return
            hidden, padding = args[0], args[1] if len(args) > 1 else None
            with torch.no_grad():
                logits = module.gating(hidden).reshape(-1, module.config.num_moe_experts).double()
                if padding is not None:
                    logits = logits[~padding.reshape(-1)]
                probs = torch.softmax(logits, dim=-1)
                chosen = probs.topk(self.top_k, dim=-1).indices.reshape(-1)
                counts = torch.bincount(chosen, minlength=probs.shape[-1]).double()
                lse = torch.logsumexp(logits, dim=-1).square().sum()
                tokens = torch.tensor([float(probs.shape[0])], dtype=torch.float64, device=probs.device)
                self.calls[layer].append(torch.cat([probs.sum(0), counts, tokens, lse[None]]).cpu())

        return hook

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Count the forwards run inside (the update's); `metrics` reads them."""
        self.active, self.calls = True, [[] for _ in self.calls]
        try:
            yield
        finally:
            self.active = False

    def metrics(self) -> dict[str, float]:
        """``moe/load_balancing_loss``, ``moe/z_loss`` and ``moe/max_load/layer_<i>`` over the micro-batches
        counted by the last `collecting` (module docstring); {} when none ran. Collective over the TP group under
        sequence parallelism."""
        if not self.calls[0]:
            return {}
        sums = torch.stack([torch.stack(calls) for calls in self.calls], dim=1)  # [micro-batches, M, 2E + 2]
        if self.sequence_parallel:
            torch.distributed.all_reduce(sums, group=self.tp_group)
        experts = (sums.shape[-1] - 2) // 2
        prob_sums, counts = sums[..., :experts], sums[..., experts : 2 * experts]
        tokens, lse2 = sums[..., -2], sums[..., -1]
        balance = torch.stack(
            [
                balance_from_sums(prob_sums[m, i], counts[m, i], tokens[m, i], self.top_k)
                for m in range(sums.shape[0])
                for i in range(self.layers)
            ]
        )
        max_load = (counts.amax(-1) / counts.mean(-1)).mean(0)  # [M]
        out = {"moe/load_balancing_loss": float(balance.mean()), "moe/z_loss": float((lse2 / tokens).mean())}
        out.update({f"moe/max_load/layer_{i}": float(load) for i, load in enumerate(max_load)})
        return out
