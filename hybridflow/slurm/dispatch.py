"""Dispatch and collect: how a worker-group call's arguments reach the ranks and their results come back, by the
transfer protocol each method declares (`hybridflow.engine.transfer`).

- the controller's side: `split_arguments` (each rank's arguments) and `gather_results` (the caller's result:
  ``DP_COMPUTE_PROTO`` batches as one `DataHandle` over the ranks' parts, in data-parallel order);
- the rank's side: `rank_share` (this replica's rows of a batch) and `rank_result` (what the rank sends back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow.engine.protocol import DataProto
from hybridflow.engine.transfer import DP_KEY, PART_KEY, SKIP_KEY, Dispatch, TransferProtocol
from hybridflow.slurm.handles import DataHandle


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
    if not collect:
        return {SKIP_KEY: True}
    if isinstance(result, DataProto):
        return {PART_KEY: write(result), DP_KEY: dp_rank}
    return result
