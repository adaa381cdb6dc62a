"""The run store's checks of what it is asked to write (names, steps, statuses, metric values, placements)."""

from __future__ import annotations

import json
import math
import operator
import secrets
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from hybridflow.flows.store.constants import _NAME_MAX, EXECUTORS, ROLES, RUN_STATUSES
from hybridflow.flows.store.schema import PlacementRow

if TYPE_CHECKING:
    pass


# ------------------------------------------------------------------------------------------------------ validation


def _now() -> datetime:
    return datetime.now(UTC)


def _new_run_id() -> str:
    return f"run-{_now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def _text(value: Any, what: str, max_len: int = _NAME_MAX) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > max_len:
        raise ValueError(f"{what} is {len(value)} characters long; at most {max_len} are allowed")
    return value


def _step(step: Any) -> int:
    if isinstance(step, bool):
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    try:
        value = operator.index(step)  # int, numpy integers; not floats
    except TypeError:
        raise ValueError(f"step must be an int >= 0, got {step!r} ({type(step).__name__})") from None
    if value < 0:
        raise ValueError(f"step must be an int >= 0, got {value}")
    return value


def _status(status: Any) -> str:
    if status not in RUN_STATUSES:
        raise ValueError(f"invalid run status {status!r}; allowed: {', '.join(RUN_STATUSES)}")
    return str(status)


def _metric_value(step: int, name: str, value: Any) -> float | None:
    if value is None or isinstance(value, str | bytes):
        raise ValueError(f"metric {name!r} at step {step} is {value!r}, not a number; pass a float")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError, RuntimeError) as err:
        raise ValueError(
            f"metric {name!r} at step {step} is {value!r} ({type(value).__name__}), not a number ({err}); "
            "pass a float (a tensor: .item())"
        ) from None
    return number if math.isfinite(number) else None


def _json_list(value: Any, what: str, item_type: type, row: int) -> list[Any]:
    if not isinstance(value, list | tuple) or any(not isinstance(v, item_type) or isinstance(v, bool) for v in value):
        raise ValueError(f"placement row {row}: {what} must be a list of {item_type.__name__}, got {value!r}")
    return list(value)


_PLACEMENT_KEYS = ("role", "group_name", "ranks", "executor", "slurm_job_id", "hosts", "parallel")
_PLACEMENT_REQUIRED = ("role", "group_name", "ranks", "executor")


def _placement(run_id: str, index: int, row: Any, now: datetime) -> PlacementRow:
    if not isinstance(row, Mapping):
        raise ValueError(f"placement row {index} must be a dict with keys {', '.join(_PLACEMENT_KEYS)}, got {row!r}")
    unknown = sorted(set(row) - set(_PLACEMENT_KEYS))
    missing = [k for k in _PLACEMENT_REQUIRED if k not in row]
    if unknown or missing:
        problems = ([f"unknown keys {unknown}"] if unknown else []) + ([f"missing keys {missing}"] if missing else [])
        raise ValueError(
            f"placement row {index}: {', '.join(problems)}; "
            f"required: {', '.join(_PLACEMENT_REQUIRED)}; optional: slurm_job_id, hosts, parallel"
        )
    if row["role"] not in ROLES:
        raise ValueError(f"placement row {index}: invalid role {row['role']!r}; allowed: {', '.join(ROLES)}")
    if row["executor"] not in EXECUTORS:
        raise ValueError(
            f"placement row {index}: invalid executor {row['executor']!r}; allowed: {', '.join(EXECUTORS)}"
        )
    ranks = _json_list(row["ranks"], "ranks", int, index)
    if not ranks or min(ranks) < 0:
        raise ValueError(f"placement row {index}: ranks must be a non-empty list of ints >= 0, got {ranks!r}")
    job = row.get("slurm_job_id")
    if job is not None and (isinstance(job, bool) or not isinstance(job, str | int) or not str(job)):
        raise ValueError(f"placement row {index}: slurm_job_id must be a str, an int or None, got {job!r}")
    parallel = row.get("parallel")
    if parallel is not None and not isinstance(parallel, Mapping):
        raise ValueError(f"placement row {index}: parallel must be a dict (JSON object) or None, got {parallel!r}")
    return PlacementRow(
        run_id=run_id,
        role=row["role"],
        group_name=_text(row["group_name"], f"placement row {index}: group_name"),
        ranks=ranks,
        executor=row["executor"],
        slurm_job_id=None if job is None else str(job),
        hosts=_json_list(row.get("hosts", []), "hosts", str, index),
        parallel=None if parallel is None else json.loads(json.dumps(parallel)),
        created_at=now,
    )
