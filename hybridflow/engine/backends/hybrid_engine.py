"""The 3D-HybridEngine: move the actor's weights from its training layout to its generation layout on the same
devices and back (HybridFlow, arXiv 2409.19256, section 5.2; Table 2 gives the costs this module is measured
against in ``benchmarks/hybrid_engine.py``).

Each rank holds its training shard of every parameter of its pipeline stage: a TP-split parameter is split along
its `ShardSpec.dim` into ``t`` equal chunks, a replicated one (norms) is whole. `HybridEngine` goes between the
layouts of a `hybridflow.engine.parallel_layout.HybridLayout`:

``mode="hybridflow"`` (zero redundancy). For each parameter of its generation stage, a rank allocates the
generation shard (``s_t`` training chunks, where ``s_t = t / t_g``), copies its own training chunk into its slot,
re-points the training parameter at that slot (the old storage is freed: the training weights are reused in place,
never held twice) and fills the other slots with broadcasts inside its micro-DP group. Peak parameter memory in
generation is the generation shard, ``M / (t_g p_g)``; the bytes received are ``M / (t_g p_g) - M / (t p)``. Going
back, each parameter gets a fresh storage of its training chunk, copied out of the slot, and the generation
buffers are dropped.

``mode="naive"`` (the paper's HybridFlow-V). Every parameter of the model is all-gathered over the whole training
model-parallel group (``M`` per rank), the generation shard is cut out of it, and the training shard stays where it
was: redundancy ``M / (t p)``, ``(t p - 1) / (t p) M`` bytes received.

Storage layout. A generation shard is one tensor made of training shards, stacked along the split dimension, so
a buffer is kept with its split dimension first: for a parameter split along dim 1 (a row-parallel weight,
``[out, in / t]``) it is ``[in / t_g, out]`` and the parameter is its transposed view. `to_stored` / `from_stored`
convert. Training shards are ordinary contiguous tensors: megatron-core's own (`megatron_shard_specs` names them),
or `shard_parameters`'. A shard stacked this way is megatron's layout for ``s_t`` consecutive TP ranks, which for
the fused QKV and gate/up weights is not yet the generation model's: the engine's ``regroup`` reorders them in place
(`hybridflow.engine.backends.megatron_bridge.generation_order`) and back.

Memory. During a transition a rank holds at most one parameter's training shard besides the generation buffers
(its copy into the slot, before the old storage is freed) and, with ``regroup``, one parameter's generation shard
(the reordering's source).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.engine.parallel_layout import HybridLayout

MODES = ("hybridflow", "naive")


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is laid out in training.

    Attributes:
        shape: the full (unsharded) shape.
        dim: the tensor-parallel split dimension (0: column-parallel and vocab-parallel, 1: row-parallel), or None
            for a parameter every TP rank holds whole.
        stage: the training pipeline stage that holds it.
        stack: a routed expert's weight: the name of its layer's stacked generation tensor ([E, ...], every expert
            of the layer, the layout Hugging Face's MoE layers read), else None.
        expert: the expert's index in that stack.
        ep_owner: the expert-parallel rank that trains it (0 without expert parallelism).
    """

    shape: tuple[int, ...]
    dim: int | None
    stage: int
    stack: str | None = None
    expert: int = 0
    ep_owner: int = 0


def megatron_shard_specs(hf_config, p: int, ep: int = 1, whole_experts: bool = False) -> dict[str, ShardSpec]:
    """The `ShardSpec` of every parameter of megatron-core's ``GPTModel`` for a Hugging Face Llama-family config,
    keyed by full-model megatron names (``decoder.layers.<global layer>...``): the split dimensions are
    `hybridflow.engine.backends.megatron_bridge.tp_dim`'s, the stages `stage_names`'.

    With tied embeddings and ``p > 1`` the last stage's ``output_layer.weight`` (megatron's copy of the embedding)
    has no spec: the generation model ties its output layer to the gathered embedding, and that copy stays where it
    is during generation.

    A routed expert's weight (``...local_experts.<e>...``, e global) is a slot of its layer's stack
    (`hybridflow.engine.backends.megatron_bridge.expert_stack`), trained by EP rank ``e // (E / ep)``; with
    `whole_experts` (``actor.etp: 1``: each expert whole on its rank in training) it is not TP-split (dim None),
    and generation keeps it whole too.

    Raises:
        ValueError: layers do not split evenly into `p` stages.
    """
    from transformers import AutoModelForCausalLM

    from hybridflow.engine.backends.megatron_bridge import expert_stack, hf_to_mcore, stage_names, tp_dim
    from hybridflow.engine.moe import moe_spec

    layers = hf_config.num_hidden_layers
    if layers % p:
        raise ValueError(f"{layers} layers do not split into actor.pp={p} equal pipeline stages")
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    full = hf_to_mcore(dict(hf_model.named_parameters()), hf_config)
    moe = moe_spec(hf_config)
    specs = {}
    for name, t in full.items():
        stack, expert = expert_stack(name)
        owner = expert // (moe.num_experts // ep) if stack else 0
        dim = None if stack and whole_experts else tp_dim(name)
        specs[name] = ShardSpec(tuple(t.shape), dim, stage_names(name, layers, p)[0], stack, expert, owner)
    return specs


def to_stored(tensor: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The tensor with its TP split dimension first (a view: dim-1 splits are transposed)."""
    return tensor.t() if spec.dim == 1 else tensor


def from_stored(stored: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Inverse of `to_stored` (a view)."""
    return stored.t() if spec.dim == 1 else stored


def shard_parameters(
    full: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec], layout: HybridLayout, rank: int
) -> dict[str, torch.nn.Parameter]:
    """This rank's training shards of a full megatron-core state dict (every parameter of its stage, keyed by
    full-model names), cut as megatron cuts them (`hybridflow.engine.backends.megatron_bridge.shard`), each a contiguous
    tensor of its own. Raises ValueError when a split dimension is not divisible by ``t``."""
    from hybridflow.engine.backends.megatron_bridge import shard

    c = layout.coords(rank)
    return {
        name: torch.nn.Parameter(shard(name, full[name], c.tp, layout.t))
        for name, spec in specs.items()
        if spec.stage == c.pp
    }


@dataclass
class TransitionStats:
    """What one transition to the generation layout cost this rank.

    Attributes:
        seconds: wall time of the transition (s).
        received_bytes: bytes this rank received in collectives.
        gen_param_bytes: parameter bytes held for generation (the generation weights) once it is done.
        peak_gathered_bytes: most bytes of gathered (generation-side) buffers alive at once during it.
        training_copy_bytes: bytes of training-shard storage held besides the generation weights (redundancy).
    """

    seconds: float = 0.0
    received_bytes: int = 0
    gen_param_bytes: int = 0
    peak_gathered_bytes: int = 0
    training_copy_bytes: int = 0


class HybridEngine:
    """Switch one rank's actor weights between training and generation layouts.

    Args:
        params: this rank's training shards (name -> Parameter, from `shard_parameters` or a training backend);
            trained in place between transitions. Their Parameter objects are kept across transitions (an optimizer
            holding them stays valid); only their storage moves.
        specs: every parameter's `ShardSpec` (all stages).
        layout: the training and generation layouts.
        mode: ``"hybridflow"`` (zero redundancy) or ``"naive"`` (HybridFlow-V).
        regroup: ``regroup(name, stored, blocks, inverse=...)`` reorders a gathered generation shard (stored layout,
            made of ``blocks = s_t`` consecutive training shards) in place into the layout the generation model
            reads, and back with ``inverse=True`` (`hybridflow.engine.backends.megatron_bridge.generation_order`); None
            keeps the training shards' layout.
        expert_group: with expert parallelism, ``(group, ep rank)``: this rank's expert-parallel group (the ranks
            of one pipeline stage and TP rank whose experts together make every layer's) and its index in it.
            ``params`` then holds only this rank's experts; each generation rank gets every expert (its TP slice),
            the missing ones broadcast from their owners in the group into their slots of the layer's stacked
            buffer (`ShardSpec.stack`), the rank's own re-pointed into theirs: still no weight held twice.

    Must be constructed on every rank of the world at the same time (it creates process groups: a collective).

    Raises:
        ValueError: an unknown mode, the world size is not the layout's, or expert parallelism with the naive mode.
    """

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        specs: Mapping[str, ShardSpec],
        layout: HybridLayout,
        mode: str = "hybridflow",
        regroup: Callable[[str, torch.Tensor, int, bool], None] | None = None,
        expert_group: tuple[dist.ProcessGroup, int] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"unknown resharding mode {mode!r}; choose one of {MODES}")
        if expert_group is not None and dist.get_world_size(expert_group[0]) > 1 and mode != "hybridflow":
            raise ValueError(
                "expert parallelism (actor.ep > 1) reshards only with rollout.reshard=hybridflow: the naive "
                "all-gather over the model-parallel group does not reach the other ranks' experts"
            )
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(f"the layout needs {layout.world_size} ranks (p*t*d), the world has {world}")
        self.params = dict(params)
        self.specs = dict(specs)
        self.layout = layout
        self.mode = mode
        self.regroup = regroup
        self.expert_group = expert_group
        self.rank = dist.get_rank()
        self.coords = layout.coords(self.rank)
        self._micro = self._new_groups(layout.micro_dp_groups())
        self._model_parallel = self._new_groups(layout.model_parallel_groups())
        self._gen_tp = self._new_groups(layout.gen_tp_groups())
        self.gen_weights: dict[str, torch.Tensor] | None = None
        self._gathered: dict[str, torch.Tensor] = {}  # name -> generation shard, stored layout
        self._stacks: dict[str, torch.Tensor] = {}  # stack name -> every expert's generation shard, stored layout
        self._stack_sizes = collections.Counter(s.stack for s in self.specs.values() if s.stack is not None)

    def _new_groups(self, groups: list[list[int]]) -> tuple[list[int], dist.ProcessGroup]:
        mine = None
        for ranks in groups:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = (ranks, group)
        assert mine is not None
        return mine

    @property
    def gen_tp_group(self) -> dist.ProcessGroup:
        """This rank's generation tensor-parallel group (for `hybridflow.engine.backends.tp_generation`)."""
        return self._gen_tp[1]

    # ------------------------------------------------------------------ which parameters a generation rank holds
    def gen_names(self) -> list[str]:
        """Parameters of this rank's generation stage (training stages ``gen_pp * s_p ..``), in a fixed order."""
        stages = range(self.coords.gen_pp * self.layout.s_p, (self.coords.gen_pp + 1) * self.layout.s_p)
        return [n for n, s in self.specs.items() if s.stage in stages]

    # ------------------------------------------------------------------ transitions
    @torch.no_grad()
    def to_generation(self) -> TransitionStats:
        """Build the generation weights (``self.gen_weights``: name -> this rank's generation shard, its
        parameter's orientation, 1/t_g of it along the split dimension) from the training
        shards. Returns this rank's `TransitionStats`. Raises RuntimeError when already in generation layout."""
        if self.gen_weights is not None:
            raise RuntimeError("already in the generation layout: call to_training() first")
        start = time.perf_counter()
        stats = TransitionStats()
        if self.mode == "hybridflow":
            self._gather_micro_dp(stats)
        else:
            self._gather_model_parallel(stats)
        self._regroup(inverse=False)
        experts = {n for n in self._gathered if self.specs[n].stack is not None}
        self.gen_weights = {n: from_stored(t, self.specs[n]) for n, t in self._gathered.items() if n not in experts}
        for n in experts:  # the stacked tensor in the parameters' orientation: [E, out, in / t_g] for dim 1
            stack, spec = self.specs[n].stack, self.specs[n]
            self.gen_weights[stack] = self._stacks[stack].transpose(1, 2) if spec.dim == 1 else self._stacks[stack]
        stats.gen_param_bytes = sum(t.numel() * t.element_size() for t in self._gathered.values())
        stats.training_copy_bytes = self._bytes_outside_gathered()
        stats.seconds = time.perf_counter() - start
        return stats

    @torch.no_grad()
    def to_training(self) -> float:
        """Free the generation weights; training shards own their storage again. Returns the seconds taken.

        Drop every reference to ``gen_weights`` (e.g. a generation model built on them) first, or their buffers
        outlive the call. Raises RuntimeError when not in generation layout."""
        if self.gen_weights is None:
            raise RuntimeError("not in the generation layout: call to_generation() first")
        start = time.perf_counter()
        self.gen_weights = None
        if self.mode == "hybridflow":  # training shards live inside the generation buffers: copy each out
            self._regroup(inverse=True)
            for name, param in self.params.items():
                if self.specs[name].dim is not None or self.specs[name].stack is not None:
                    param.data = param.data.clone(memory_format=torch.contiguous_format)
                self._gathered.pop(name, None)  # free that parameter's buffer before the next copy
        self._gathered.clear()
        self._stacks.clear()
        return time.perf_counter() - start

    def _regroup(self, inverse: bool) -> None:
        if self.regroup is None:
            return
        for name, stored in self._gathered.items():
            if self.specs[name].dim is not None:
                self.regroup(name, stored, self.layout.s_t, inverse=inverse)

    def _gather_micro_dp(self, stats: TransitionStats) -> None:
        """Generation shard of each parameter from the training chunks of the micro-DP group (see module doc)."""
        layout, c = self.layout, self.coords
        members, group = self._micro
        live = 0
        for name in self.gen_names():
            spec = self.specs[name]
            owner_pp = spec.stage - c.gen_pp * layout.s_p  # the micro-DP stage index that trains it
            owners = [members[owner_pp * layout.s_t + b] for b in range(layout.s_t)]
            if spec.dim is None and spec.stack is None:  # replicated over TP: the owning stage's first member sends
                mine = c.micro_pp == owner_pp  # it to the other stages
                buffer = (
                    self.params[name].data
                    if mine
                    else torch.empty(spec.shape, dtype=self._dtype(), device=self._device())
                )
                slots, owners = ([buffer], owners[:1]) if layout.s_p > 1 else ([], [])
            else:  # TP-split, or a routed expert (whole on its rank when the experts are not TP-split: dim None)
                stored_shape = list(to_stored(torch.empty(spec.shape, device="meta"), spec).shape)
                stored_shape[0] //= layout.t_g if spec.dim is not None else 1
                buffer = self._buffer(name, stored_shape)
                slots = list(buffer.chunk(layout.s_t, dim=0)) if spec.dim is not None else [buffer]
                own = slots[c.micro_tp] if spec.dim is not None else buffer
                if c.micro_pp == owner_pp and name in self.params:  # the training shard becomes a slot, in place
                    param = self.params[name]
                    own.copy_(to_stored(param.data, spec))
                    param.data = from_stored(own, spec)  # its old storage is freed here
                if c.micro_pp == owner_pp and spec.stack is not None and self.expert_group is not None:
                    experts, _ = self.expert_group  # another EP rank's expert: its owner sends this rank's part
                    if dist.get_world_size(experts) > 1:
                        dist.broadcast(own, group_src=spec.ep_owner, group=experts)
                    if name not in self.params:
                        stats.received_bytes += own.numel() * own.element_size()
                if spec.dim is None:  # a whole expert: the owning stage's first member sends it to other stages
                    slots, owners = ([buffer], owners[:1]) if layout.s_p > 1 else ([], [])
            if spec.stack is None or spec.expert == 0:  # a layer's stack is counted once
                live += (self._stacks[spec.stack] if spec.stack else buffer).numel() * buffer.element_size()
            for slot, src in zip(slots, owners, strict=True):
                if len(members) > 1:
                    dist.broadcast(slot, src=src, group=group)
                if src != self.rank:
                    stats.received_bytes += slot.numel() * slot.element_size()
            self._gathered[name] = buffer
        stats.peak_gathered_bytes = max(stats.peak_gathered_bytes, live)

    def _buffer(self, name: str, stored_shape: list[int]) -> torch.Tensor:
        """A new generation buffer of `stored_shape` for parameter `name`; a routed expert's is its slot of the
        layer's stacked buffer (allocated with the layer's first expert, `ShardSpec.stack`)."""
        spec = self.specs[name]
        if spec.stack is None:
            return torch.empty(stored_shape, dtype=self._dtype(), device=self._device())
        if spec.stack not in self._stacks:
            experts = self._stack_sizes[spec.stack]
            self._stacks[spec.stack] = torch.empty([experts, *stored_shape], dtype=self._dtype(), device=self._device())
        return self._stacks[spec.stack][spec.expert]

    def _gather_model_parallel(self, stats: TransitionStats) -> None:
        """HybridFlow-V: the full model on every rank of the model-parallel group, then cut the generation shard."""
        layout, c = self.layout, self.coords
        members, group = self._model_parallel
        full: dict[str, torch.Tensor] = {}
        for name, spec in self.specs.items():
            stored_shape = to_stored(torch.empty(spec.shape, device="meta"), spec).shape
            buffer = torch.empty(stored_shape, dtype=self._dtype(), device=self._device())
            parts = 1 if spec.dim is None else layout.t
            slots = list(buffer.chunk(parts, dim=0))
            for tp, slot in enumerate(slots):
                src = members[spec.stage * layout.t + tp]
                if src == self.rank:
                    slot.copy_(to_stored(self.params[name].data, spec))
                if len(members) > 1:
                    dist.broadcast(slot, src=src, group=group)
                if src != self.rank:
                    stats.received_bytes += slot.numel() * slot.element_size()
            full[name] = buffer
        stats.peak_gathered_bytes = sum(t.numel() * t.element_size() for t in full.values())
        for name in self.gen_names():  # keep the generation shard (a copy), free the rest with `full`
            spec = self.specs[name]
            stored = full[name]
            if spec.dim is not None:
                stored = stored.chunk(layout.t_g, dim=0)[c.gen_tp]
            self._gathered[name] = stored.clone()
        full.clear()

    # ------------------------------------------------------------------ accounting
    def _bytes_outside_gathered(self) -> int:
        """Bytes of training-shard storage not inside any generation buffer (redundant copies)."""
        spans = []
        for t in self._gathered.values():
            begin = t.untyped_storage().data_ptr()
            spans.append((begin, begin + t.untyped_storage().nbytes()))
        total = 0
        for param in self.params.values():
            ptr = param.data.data_ptr()
            if not any(b <= ptr < e for b, e in spans):
                total += param.numel() * param.element_size()
        return total

    def _dtype(self) -> torch.dtype:
        return next(iter(self.params.values())).dtype

    def _device(self) -> torch.device:
        return next(iter(self.params.values())).device


def table2(layout: HybridLayout, model_bytes: float) -> dict[str, dict[str, float]]:
    """The paper's Table 2 per-rank transition costs for `layout` and a model of `model_bytes`:
    ``{"naive" | "hybridflow": {"received_bytes", "peak_gathered_bytes", "redundancy_bytes"}}``."""
    p, t, p_g, t_g = layout.p, layout.t, layout.p_g, layout.t_g
    m = float(model_bytes)
    return {
        "naive": {
            "received_bytes": (t * p - 1) / (t * p) * m,
            "peak_gathered_bytes": m,
            "redundancy_bytes": m / (t * p),
        },
        "hybridflow": {
            "received_bytes": (t * p - t_g * p_g) / (t_g * p_g * t * p) * m,
            "peak_gathered_bytes": m / (t_g * p_g),
            "redundancy_bytes": 0.0,
        },
    }


def model_bytes(specs: Iterable[ShardSpec], element_size: int) -> int:
    """Bytes of the whole model (every parameter once), ``M`` in Table 2."""
    total = 0
    for spec in specs:
        n = 1
        for s in spec.shape:
            n *= s
        total += n * element_size
    return total
