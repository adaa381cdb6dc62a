"""Several distillation teachers in one pool, each scoring the rows of its own data source (``teacher.routes``:
verl's multi-teacher distillation, ``distillation.teacher_models`` routed by ``distillation.teacher_key``)."""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.engine.backends.actor import RefPolicy
from hybridflow.engine.protocol import DataProto


class RoutedTeachers:
    """Teachers by route: row i is scored by ``teachers[data.non_tensor_batch[route_key][i]]``, and the columns
    of every teacher are joined back in the rows' order, as one teacher's would be (``teacher_log_prob`` float32
    [B, T]; with ``teacher.top_k`` = k also ``teacher_top_k_ids`` int64 and ``teacher_top_k_log_probs`` float32
    [B, T, k]). Each teacher sees its rows in their order, so a prompt's samples (one data source) stay together
    for prompt sharing.

    Args:
        teachers: `RefPolicy` (column ``teacher_log_prob``) by route value (``teacher.routes``' keys).
        route_key: the non-tensor column holding each row's route value (``teacher.route_key``).
    """

    def __init__(self, teachers: dict[str, RefPolicy], route_key: str):
        self.teachers, self.route_key = teachers, route_key

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """The teachers' columns for `data`'s rows (see the class).

        Raises:
            KeyError: `data` lacks the ``route_key`` column.
            ValueError: a row's route value has no teacher (the values and the teachers named, and the key to set).
        """
        if self.route_key not in data.non_tensor_batch:
            raise KeyError(f"teacher.route_key={self.route_key}: the batch has no column {self.route_key!r}")
        routes = np.asarray([str(v) for v in data.non_tensor_batch[self.route_key]], dtype=object)
        unknown = sorted(set(routes) - set(self.teachers))
        if unknown:
            raise ValueError(
                f"teacher.routes has no teacher for {self.route_key} {', '.join(map(repr, unknown))} (teachers: "
                f"{', '.join(map(repr, sorted(self.teachers)))}): add teacher.routes.<value>=DIR for each"
            )
        joined: dict[str, torch.Tensor] = {}
        for route, teacher in self.teachers.items():
            rows = np.flatnonzero(routes == route)
            if len(rows) == 0:
                continue
            part = teacher.compute_ref_log_prob(data[rows])
            for key in part.keys:
                values = part.batch[key]
                if key not in joined:
                    joined[key] = torch.zeros((len(data), *values.shape[1:]), dtype=values.dtype)
                joined[key][torch.as_tensor(rows)] = values
        return DataProto.from_dict(joined)
