"""How a worker-group method's arguments are split across ranks and its results gathered (transfer protocols).

A worker class marks the methods the controller may call with `register`; the worker group reads the mode and
does the splitting and collecting (``hybridflow.slurm.worker_group``). The names are verl's.

- ``ONE_TO_ALL``: every rank gets the same arguments; the caller gets the list of all ranks' results.
- ``RANK_ZERO``: every rank runs the method (it may hold collectives); the caller gets rank 0's result.
- ``ALL_TO_ALL``: each argument is a list with one entry per rank; rank i gets entry i; results as a list.
- ``DP_COMPUTE_PROTO``: the first argument is a batch (a `DataHandle`); data-parallel rank i computes on its
  contiguous share of the rows and its result batch is written where it runs; the caller gets one handle over all
  the results, in row order. Other arguments go to every rank unchanged.

  By default every rank is its own data-parallel replica. A worker whose model is split over several ranks says
  otherwise per method with ``dispatch_coords(method) -> (dp_index, dp_size, collect)`` (None: the default): the
  ranks of one replica (e.g. one megatron model-parallel group) get the same rows, and only the rank with
  ``collect`` (e.g. the last pipeline stage's first TP rank) returns the replica's result; the others' results are
  dropped. This is verl's megatron protocol, generalised so that one worker can use the training layout for the
  actor's stages and the generation layout for the rollout.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

_ATTR = "__hybridflow_dispatch__"


class Dispatch(enum.StrEnum):
    ONE_TO_ALL = "ONE_TO_ALL"
    RANK_ZERO = "RANK_ZERO"
    ALL_TO_ALL = "ALL_TO_ALL"
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"


def register(dispatch_mode: Dispatch = Dispatch.ONE_TO_ALL) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a worker method as callable by the controller, with its transfer protocol."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, _ATTR, Dispatch(dispatch_mode))
        return fn

    return mark


def registered_methods(cls: type) -> dict[str, Dispatch]:
    """Name -> dispatch mode of every method of `cls` marked with `register` (inherited ones included)."""
    out = {}
    for name in dir(cls):
        mode = getattr(getattr(cls, name, None), _ATTR, None)
        if mode is not None:
            out[name] = mode
    return out
