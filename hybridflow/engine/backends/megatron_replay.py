"""Router replay on megatron-core (``actor.router_replay.mode`` R2 / R3 with ``actor.strategy=megatron``): the
megatron actor's routers record the experts they choose, or route each token to the experts recorded for it, with
the semantics of `hybridflow.engine.moe.RouterRecorder` on the Hugging Face actors (module docstring of
`hybridflow.engine.moe`).

megatron-core's ``TopKRouter`` takes its top-k through the object in its ``router_replay`` attribute when there is one
(``topk_routing_with_score_function(..., router_replay=...)`` calls its ``get_replay_topk``; verl's R2/R3 on megatron
use that hook with megatron's own ``RouterReplay``). `MegatronRouterReplay` puts a `LayerReplay` there in each MoE
layer, which
differs from megatron's ``RouterReplay`` where the batch layout needs it: a token recorded as -1 (padding, a response's
last token no rollout forward read) routes as its router chooses, and the share of replayed routes the router would
have chosen itself is counted (``actor/moe/replay_agreement``).

A router sees its layer's tokens in megatron's order, sequence-major: token ``s * b + i`` is position s of row i of
the (left-padded, `hybridflow.engine.backends.megatron_actor.forward`) micro-batch, and under sequence parallelism
each TP rank holds the contiguous 1/t of the positions (megatron's ``scatter_to_sequence_parallel_region``). The
batch's ``routed_experts`` int16 [B, P+T, M, k] is cut into that layout for a replay, and a recording is gathered
back from it. Pipeline parallelism is refused before work (`hybridflow.flows.preflight`): a stage's routes would
have to reach the last stage, and 1F1B interleaves the micro-batches' forwards and recomputations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class LayerReplay:
    """One MoE layer's replay state, in megatron-core's ``router_replay`` hook (module docstring).

    Attributes:
        target: int64 [N, k], the experts each of the layer's next N tokens goes to (-1 rows: its router chooses),
            or None (no replay).
        recording: whether to keep the experts chosen (``recorded``, int64 [N, k], after any replay).
        replayed, agreed: (token) routes replayed, and those the router's own top-k equals as a set.
    """

    def __init__(self, layer: int):
        self.layer = layer
        self.target: torch.Tensor | None = None
        self.recording = False
        self.recorded: torch.Tensor | None = None
        self.replayed = self.agreed = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """megatron-core's hook: (gate scores [N, k], experts int64 [N, k]) for the router's `scores` [N, E] (the
        softmax probabilities with ``moe_router_pre_softmax``, else the logits, whose top-k megatron then
        softmaxes): the router's own top-k, or the target experts with the scores gathered there, so the gate
        weights stay the router's own and carry its gradient.

        Raises:
            ValueError: the target does not have the call's tokens and top-k (routes of another model or batch)."""
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        chosen = own
        if self.target is not None:
            target = self.target.to(own.device)
            if target.shape != own.shape:
                raise ValueError(
                    f"router replay: MoE layer {self.layer} routes {tuple(own.shape)} (tokens, top-k), the recorded "
                    f"routes are {tuple(target.shape)}: the batch's routed_experts do not belong to this model or batch"
                )
            recorded = target[:, 0] >= 0
            with torch.no_grad():
                same = (own.sort(-1).values == target.sort(-1).values).all(-1)
                self.replayed += int(recorded.sum())
                self.agreed += int((same & recorded).sum())
            chosen = torch.where(recorded[:, None], target, own)
            probs = scores.gather(1, chosen)
        if self.recording:
            self.recorded = chosen.detach()
        return probs, chosen


class MegatronRouterReplay:
    """The `LayerReplay` of every MoE layer of one megatron ``GPTModel`` (all its layers: one pipeline stage), and
    the conversions between the batch's ``routed_experts`` and megatron's token order.

    Args:
        model: the ``GPTModel`` (`hybridflow.engine.backends.megatron_model.build_gpt_model`) of an MoE config.

    Raises:
        ValueError: the model has no MoE router.
    """

    def __init__(self, model):
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ValueError("router replay: the megatron model has no MoE router (a dense model)")
        self.layers = []
        for i, router in enumerate(routers):
            router.router_replay = LayerReplay(i)
            self.layers.append(router.router_replay)
        self.sequence_parallel = bool(model.config.sequence_parallel)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.mode: str | None = None  # "record" / "replay" inside `routing`
        self.collect = False
        self.recorded: list[torch.Tensor] = []

    @contextlib.contextmanager
    def routing(self, mode: str | None, collect: bool = True) -> Iterator[list[torch.Tensor]]:
        """Inside, `before` / `after` around each forward: ``"replay"``: route each micro-batch's tokens to its
        ``routed_experts`` (when it has them); ``"record"``: route freely; either way, with `collect`, the experts
        chosen are collected, one int16 [b, L, M, k] per micro-batch in forward order, into the list yielded (-1
        at padding); None: route freely and collect nothing."""
        self.mode, self.collect, self.recorded = mode, collect, []
        try:
            yield self.recorded
        finally:
            self.mode = None
            for layer in self.layers:
                layer.target, layer.recording, layer.recorded = None, False, None

    def before(self, batch, pad: int) -> None:
        """Set up one forward of a micro-batch whose ``input_ids`` megatron gets left-padded by `pad` columns."""
        routes = batch["routed_experts"] if self.mode == "replay" and "routed_experts" in batch else None
        if routes is not None and routes.shape[2] != len(self.layers):
            raise ValueError(
                f"router replay: the batch's routed_experts have {routes.shape[2]} MoE layers, the model "
                f"{len(self.layers)}: they were recorded with another model"
            )
        tokens = None
        if routes is not None:  # [b, L, M, k] -> [S, b, M, k] -> this rank's positions, sequence-major
            routes = torch.nn.functional.pad(routes.long(), (0, 0, 0, 0, pad, 0), value=-1).transpose(0, 1)
            if self.sequence_parallel:
                routes = routes.chunk(self.tp)[self.tp_rank]
            tokens = routes.reshape(-1, *routes.shape[2:])
        for i, layer in enumerate(self.layers):
            layer.target = None if tokens is None else tokens[:, i]
            layer.recording, layer.recorded = self.mode is not None and self.collect, None

    def after(self, batch, pad: int) -> None:
        """After the forward `before` set up: append the micro-batch's routes (gathered over the TP ranks under
        sequence parallelism) to the recording."""
        if self.mode is None or not self.collect:
            return
        rows = batch["input_ids"].shape[0]
        routes = torch.stack([layer.recorded for layer in self.layers], dim=1)  # [S_local * b, M, k]
        routes = routes.view(-1, rows, *routes.shape[1:])
        if self.sequence_parallel:
            parts = [torch.empty_like(routes) for _ in range(self.tp)]
            torch.distributed.all_gather(parts, routes.contiguous(), group=self.tp_group)
            routes = torch.cat(parts)
        routes = routes.transpose(0, 1)[:, pad:].to(torch.int16)  # [b, L, M, k]
        routes[batch["attention_mask"] == 0] = -1
        self.recorded.append(routes.cpu())

    def agreement(self, group=None) -> float | None:
        """The share of the (token, layer) routes replayed since the last call, over the ranks of `group` (each
        rank's tokens are its own), that the routers would have chosen themselves; None when none was replayed.
        Resets the counts. Collective over `group`."""
        counts = torch.tensor([sum(r.agreed for r in self.layers), sum(r.replayed for r in self.layers)])
        torch.distributed.all_reduce(counts, group=group)
        for layer in self.layers:
            layer.replayed = layer.agreed = 0
        agreed, replayed = counts.tolist()
        return agreed / replayed if replayed else None
