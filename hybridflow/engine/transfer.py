"""Transfer protocols, as a worker class declares them: each method the controller may call is marked with
`register` and its mode (and, for ``DP_COMPUTE_PROTO``, the mesh its rows split over). The worker group's dispatch
and collect (`hybridflow.slurm.dispatch`) read these marks. The names are verl's.

- ``ONE_TO_ALL``: every rank gets the same arguments; the caller gets the list of all ranks' results.
- ``RANK_ZERO``: every rank runs the method (it may hold collectives); the caller gets rank 0's result.
- ``ALL_TO_ALL``: each argument is a list with one entry per rank; rank i gets entry i; results as a list.
- ``DP_COMPUTE_PROTO``: the first argument is a batch (a `DataHandle`); data-parallel rank i computes on its
  contiguous share of the rows and its result batch is written where it runs; the caller gets one handle over all
  the results, in row order. Other arguments go to every rank unchanged.

  A ``DP_COMPUTE_PROTO`` method names the mesh its rows split over (`MESHES`): ``train``, the actor's training
  layout; ``generate``, its generation layout; ``critic``, the training layout when the critic lives in the
  actor's (megatron) layout; None, every rank its own replica. The worker gives this rank's coordinates on a mesh
  (``mesh_coords(mesh) -> (dp_index, dp_size, collect)``, from `hybridflow.engine.parallel_layout.HybridLayout.
  mesh_coords` for every backend: ddp's layout is one replica per rank, fsdp's tensor-parallel groups share rows,
  megatron's model-parallel groups do). The ranks of one replica get the same rows, and only the rank with
  ``collect`` (e.g. the last pipeline stage's first TP rank) returns the replica's result. This is verl's megatron
  protocol, generalised so that one worker uses the training layout for the actor's stages and the generation
  layout for the rollout's. ``judge``: the reward model's scoring, whose generative judge may span blocks of
  ranks (``reward_model.judge.tensor_parallel_size``); every rank its own replica otherwise.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_ATTR = "__hybridflow_dispatch__"

MESHES = ("train", "generate", "critic", "judge")
"""The meshes a ``DP_COMPUTE_PROTO`` method may split its rows over (see the module docstring)."""

PART_KEY = "__part__"  # a result batch written to the data folder: its `write_part` description
DP_KEY = "__dp_rank__"  # beside it: the data-parallel index whose rows it holds (parts are ordered by it)
SKIP_KEY = "__not_collected__"  # a rank whose replica's result another rank returns


class Dispatch(enum.StrEnum):
    ONE_TO_ALL = "ONE_TO_ALL"
    RANK_ZERO = "RANK_ZERO"
    ALL_TO_ALL = "ALL_TO_ALL"
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"


@dataclass(frozen=True)
class TransferProtocol:
    """A registered method's mode and, for ``DP_COMPUTE_PROTO``, the mesh its rows split over (None: every rank a
    replica of its own)."""

    mode: Dispatch
    mesh: str | None = None


def register(
    dispatch_mode: Dispatch = Dispatch.ONE_TO_ALL, mesh: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a worker method as callable by the controller, with its transfer protocol.

    Raises:
        ValueError: `mesh` is not one of `MESHES`, or is given to a mode other than ``DP_COMPUTE_PROTO``.
    """
    mode = Dispatch(dispatch_mode)
    if mesh is not None and (mesh not in MESHES or mode is not Dispatch.DP_COMPUTE_PROTO):
        raise ValueError(f"mesh {mesh!r}: a DP_COMPUTE_PROTO method splits over one of {MESHES}")

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, _ATTR, TransferProtocol(mode, mesh))
        return fn

    return mark


def registered_methods(cls: type) -> dict[str, TransferProtocol]:
    """Name -> transfer protocol of every method of `cls` marked with `register` (inherited ones included)."""
    out = {}
    for name in dir(cls):
        protocol = getattr(getattr(cls, name, None), _ATTR, None)
        if protocol is not None:
            out[name] = protocol
    return out
