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

Storage layout. A generation shard must be one tensor made of training chunks without copying them, so every
TP-split parameter is stored with its split dimension first: a parameter split along dim 1 (a row-parallel
weight, ``[out, in / t]``) is the transposed view of a contiguous ``[in / t, out]`` tensor. `to_stored` /
`from_stored` convert; `shard_parameters` builds training shards this way.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
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
    """

    shape: tuple[int, ...]
    dim: int | None
    stage: int


_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def llama_shard_specs(shapes: Mapping[str, tuple[int, ...]], num_layers: int, p: int) -> dict[str, ShardSpec]:
    """Megatron-style TP split and PP stage of each parameter of a Hugging Face Llama / Qwen2 / Mistral model.

    q/k/v/gate/up projections (and q/k/v biases) split on dim 0, o/down on dim 1, the embedding and ``lm_head``
    on the vocabulary (dim 0); norms are replicated. Layers go to stages in equal consecutive blocks; the embedding
    to the first stage, the final norm and ``lm_head`` to the last.

    Args:
        shapes: parameter name -> full shape (``{n: tuple(p.shape) for n, p in model.named_parameters()}``).
        num_layers: ``config.num_hidden_layers``.
        p: pipeline stages.

    Raises:
        ValueError: layers do not split evenly into `p` stages, tied embeddings with ``p > 1`` (each end stage would
            need its own copy), or a parameter name this mapping does not know.
    """
    if num_layers % p:
        raise ValueError(f"{num_layers} layers do not split into actor.pp={p} equal pipeline stages")
    if p > 1 and "lm_head.weight" not in shapes:
        raise ValueError("tied input/output embeddings are not supported with actor.pp > 1 yet; use actor.pp=1")
    per_stage = num_layers // p
    specs = {}
    for name, shape in shapes.items():
        layer = _LAYER.match(name)
        if layer:
            stage = int(layer.group(1)) // per_stage
            dim = 0 if _COLUMN.search(name) else 1 if _ROW.search(name) else None
            if dim is None and not name.endswith("layernorm.weight"):
                raise ValueError(f"no tensor-parallel rule for parameter {name!r}")
        elif name == "model.embed_tokens.weight":
            stage, dim = 0, 0
        elif name == "lm_head.weight":
            stage, dim = p - 1, 0
        elif name == "model.norm.weight":
            stage, dim = p - 1, None
        else:
            raise ValueError(f"no tensor-parallel rule for parameter {name!r}")
        specs[name] = ShardSpec(tuple(shape), dim, stage)
    return specs


def to_stored(tensor: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The tensor with its TP split dimension first (a view: dim-1 splits are transposed)."""
    return tensor.t() if spec.dim == 1 else tensor


def from_stored(stored: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """Inverse of `to_stored` (a view)."""
    return stored.t() if spec.dim == 1 else stored


def chunk_of(full: torch.Tensor, spec: ShardSpec, index: int, parts: int) -> torch.Tensor:
    """Chunk `index` of `parts` of a full parameter along its split dimension (the whole tensor if replicated),
    in the parameter's own orientation (a view)."""
    if spec.dim is None:
        return full
    size = spec.shape[spec.dim] // parts
    return full.narrow(spec.dim, index * size, size)


def shard_parameters(
    full: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec], layout: HybridLayout, rank: int
) -> dict[str, torch.nn.Parameter]:
    """This rank's training shards of `full` (every parameter of its stage), each in its own storage laid out as
    `to_stored` says. Raises ValueError when a split dimension is not divisible by ``t``."""
    c = layout.coords(rank)
    out = {}
    for name, spec in specs.items():
        if spec.stage != c.pp:
            continue
        if spec.dim is not None and spec.shape[spec.dim] % layout.t:
            raise ValueError(f"{name} {list(spec.shape)}: dim {spec.dim} does not split into actor.tp={layout.t}")
        stored = to_stored(chunk_of(full[name], spec, c.tp, layout.t), spec).clone(
            memory_format=torch.contiguous_format
        )
        out[name] = torch.nn.Parameter(from_stored(stored, spec))
    return out


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

    Must be constructed on every rank of the world at the same time (it creates process groups: a collective).

    Raises:
        ValueError: an unknown mode, or the world size is not the layout's.
    """

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        specs: Mapping[str, ShardSpec],
        layout: HybridLayout,
        mode: str = "hybridflow",
    ):
        if mode not in MODES:
            raise ValueError(f"unknown resharding mode {mode!r}; choose one of {MODES}")
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(f"the layout needs {layout.world_size} ranks (p*t*d), the world has {world}")
        self.params = dict(params)
        self.specs = dict(specs)
        self.layout = layout
        self.mode = mode
        self.rank = dist.get_rank()
        self.coords = layout.coords(self.rank)
        self._micro = self._new_groups(layout.micro_dp_groups())
        self._model_parallel = self._new_groups(layout.model_parallel_groups())
        self._gen_tp = self._new_groups(layout.gen_tp_groups())
        self.gen_weights: dict[str, torch.Tensor] | None = None
        self._gathered: dict[str, torch.Tensor] = {}  # name -> generation shard, stored layout

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
        """This rank's generation tensor-parallel group (for `hybridflow.engine.tp_generation`)."""
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
        self.gen_weights = {n: from_stored(t, self.specs[n]) for n, t in self._gathered.items()}
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
            for name, param in self.params.items():
                spec = self.specs[name]
                if spec.dim is not None:
                    param.data = from_stored(to_stored(param.data, spec).clone(), spec)
                self._gathered.pop(name, None)  # free that parameter's buffer before the next copy
        self._gathered.clear()
        return time.perf_counter() - start

    def _gather_micro_dp(self, stats: TransitionStats) -> None:
        """Generation shard of each parameter from the training chunks of the micro-DP group (see module doc)."""
        layout, c = self.layout, self.coords
        members, group = self._micro
        live = 0
        for name in self.gen_names():
            spec = self.specs[name]
            owner_pp = spec.stage - c.gen_pp * layout.s_p  # the micro-DP stage index that trains it
            owners = [members[owner_pp * layout.s_t + b] for b in range(layout.s_t)]
            if spec.dim is None:  # replicated across TP: the owning stage's first member sends it to other stages
                mine = c.micro_pp == owner_pp
                buffer = (
                    self.params[name].data
                    if mine
                    else torch.empty(spec.shape, dtype=self._dtype(), device=self._device())
                )
                slots, owners = ([buffer], owners[:1]) if layout.s_p > 1 else ([], [])
            else:
                stored_shape = list(to_stored(torch.empty(spec.shape, device="meta"), spec).shape)
                stored_shape[0] //= layout.t_g
                buffer = torch.empty(stored_shape, dtype=self._dtype(), device=self._device())
                slots = list(buffer.chunk(layout.s_t, dim=0))
                if c.micro_pp == owner_pp:  # reuse the training shard in place: it becomes a slot of the buffer
                    param = self.params[name]
                    slots[c.micro_tp].copy_(to_stored(param.data, spec))
                    param.data = from_stored(slots[c.micro_tp], spec)  # its old storage is freed here
            live += buffer.numel() * buffer.element_size()
            for slot, src in zip(slots, owners, strict=True):
                if len(members) > 1:
                    dist.broadcast(slot, src=src, group=group)
                if src != self.rank:
                    stats.received_bytes += slot.numel() * slot.element_size()
            self._gathered[name] = buffer
        stats.peak_gathered_bytes = max(stats.peak_gathered_bytes, live)

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
