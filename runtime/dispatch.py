"""Transfer protocols: how a worker-group method's arguments are split across ranks and its results gathered, in
one module: the modes, the mesh a data-parallel method splits over, the rank's share and result, and the
controller's split and gather. The worker group (``hybridflow.runtime.worker_group``) and its ranks
(``hybridflow.runtime.worker``) call these functions; a worker class only marks its methods with `register`. The
names are verl's.

- ``ONE_TO_ALL``: every rank gets the same arguments; the caller gets the list of all ranks' results.
- ``RANK_ZERO``: every rank runs the method (it may hold collectives); the caller gets rank 0's result.
- ``ALL_TO_ALL``: each argument is a list with one entry per rank; rank i gets entry i; results as a list.
- ``DP_COMPUTE_PROTO``: the first argument is a batch (a `DataHandle`); data-parallel rank i computes on its
  contiguous share of the rows and its result batch is written where it runs; the caller gets one handle over all
  the results, in row order. Other arguments go to every rank unchanged.

  A ``DP_COMPUTE_PROTO`` method names the mesh its rows split over (`MESHES`): ``train``, the actor's training
  layout; ``generate``, its generation layout; ``critic``, the training layout when the critic lives in the
  actor's (megatron) layout; None, every rank its own replica. The worker gives this rank's coordinates on a mesh
  (``mesh_coords(mesh) -> (dp_index, dp_size, collect)``, from `hybridflow.backends.parallel_layout.HybridLayout.
  mesh_coords` for every backend: ddp's layout is one replica per rank, fsdp's tensor-parallel groups share rows,
  megatron's model-parallel groups do). The ranks of one replica get the same rows, and only the rank with
  ``collect`` (e.g. the last pipeline stage's first TP rank) returns the replica's result. This is verl's megatron
  protocol, generalised so that one worker uses the training layout for the actor's stages and the generation
  layout for the rollout's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_ATTR = "__hybridflow_dispatch__"

MESHES = ("train", "generate", "critic")
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


# ---------------------------------------------------------------------------------------------- controller side
def split_arguments(
    mode: Dispatch, method: str, world_size: int, args: tuple, kwargs: dict
) -> dict[int, tuple[list, dict]]:
    """Each rank's ``(args, kwargs)`` for a call of `method` in `mode` (a ``DP_COMPUTE_PROTO`` batch goes whole to
    every rank, which takes its share: `rank_share`).

    Raises:
        ValueError: ``ALL_TO_ALL`` arguments that are not one entry per rank; a ``DP_COMPUTE_PROTO`` call whose
            first argument is not a `DataHandle`.
    """
    from hybridflow.runtime.handles import DataHandle

    ranks = range(world_size)
    if mode is Dispatch.ALL_TO_ALL:
        for value in [*args, *kwargs.values()]:
            if not isinstance(value, list | tuple) or len(value) != world_size:
                raise ValueError(
                    f"{method} is ALL_TO_ALL: every argument must be a list of {world_size} entries (one per rank)"
                )
        return {r: ([a[r] for a in args], {k: v[r] for k, v in kwargs.items()}) for r in ranks}
    if mode is Dispatch.DP_COMPUTE_PROTO and (not args or not isinstance(args[0], DataHandle)):
        raise ValueError(f"{method} is DP_COMPUTE_PROTO: its first argument must be a DataProto or DataHandle")
    return {r: (list(args), dict(kwargs)) for r in ranks}


def gather_results(mode: Dispatch, ordered: list[Any], meta_info: dict[str, Any] | None) -> Any:
    """The caller's result from the ranks' results `ordered` by rank: ``DP_COMPUTE_PROTO`` batches as one
    `DataHandle` over the collecting ranks' parts in data-parallel order (with the input's `meta_info`), rank 0's
    result for ``RANK_ZERO``, else the list (a part in it as a handle of its own)."""
    from hybridflow.runtime.handles import DataHandle

    if mode is Dispatch.DP_COMPUTE_PROTO:
        ordered = [r for r in ordered if not (isinstance(r, dict) and SKIP_KEY in r)]
        if all(isinstance(r, dict) and PART_KEY in r for r in ordered):
            ordered.sort(key=lambda r: r[DP_KEY])
            return DataHandle.from_parts([r[PART_KEY] for r in ordered], meta_info=meta_info)
    ordered = [  # e.g. per-rank metrics of a DP update
        DataHandle.from_parts([r[PART_KEY]]) if isinstance(r, dict) and PART_KEY in r else r for r in ordered
    ]
    return ordered[0] if mode is Dispatch.RANK_ZERO else ordered


# ---------------------------------------------------------------------------------------------- rank side
def rank_share(
    protocol: TransferProtocol, worker: Any, rank: int, world_size: int, args: list
) -> tuple[list, int, bool]:
    """This rank's arguments for a call, its data-parallel index and whether it returns its replica's result.

    ``DP_COMPUTE_PROTO``: the first argument (a `DataHandle`) becomes this replica's contiguous share of the rows, a
    `DataProto` with ``meta_info["row_offset"]`` (where the share starts in the whole batch), the replica from
    ``worker.mesh_coords(protocol.mesh)`` (None, or no mesh: every rank its own). Other modes: unchanged."""
    if protocol.mode is not Dispatch.DP_COMPUTE_PROTO:
        return args, rank, True
    coords = worker.mesh_coords(protocol.mesh) if protocol.mesh is not None else None
    dp_rank, dp_size, collect = coords or (rank, world_size, True)
    rows = args[0].shard_rows(dp_rank, dp_size)
    shard = args[0].load(rows)
    shard.meta_info["row_offset"] = rows.start
    return [shard, *args[1:]], dp_rank, collect


def rank_result(result: Any, dp_rank: int, collect: bool, write: Callable[[Any], dict[str, Any]]) -> Any:
    """What a rank sends back: a skip mark when another rank of its replica collects, a batch result written by
    `write` (its part description) with its data-parallel index, anything else as it is."""
    from hybridflow.core.protocol import DataProto

    if not collect:
        return {SKIP_KEY: True}
    if isinstance(result, DataProto):
        return {PART_KEY: write(result), DP_KEY: dp_rank}
    return result
