"""Data handles: what the controller passes between stages instead of tensors.

A stage's output stays where it was produced: each producing rank writes its share of the batch as one
`DataProto` file (safetensors) in the run's data folder, and the controller receives a `DataHandle` that lists
those parts, the columns they hold and their lengths: a few hundred bytes of JSON, whatever the batch size.

A consumer rank reads only the rows it is given (`DataHandle.load(rows=...)`), straight from the producers'
files: this is the many-to-many transfer between groups of different data-parallel sizes. Columns produced by
different stages are combined with `union` without copying anything: a handle is a list of column groups over the
same rows. On Slurm the data folder must be on a file system all nodes share (the run's output folder).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.engine.protocol import DataProto


@dataclass(frozen=True)
class Part:
    """One producer's rows of a column group: the file, how many of its rows, from which row on."""

    path: str
    length: int
    start: int = 0


@dataclass(frozen=True)
class ColumnGroup:
    """Columns written together by one stage, as consecutive parts (in rank order) covering every row."""

    keys: tuple[str, ...]
    parts: tuple[Part, ...]

    @property
    def length(self) -> int:
        return sum(p.length for p in self.parts)


@dataclass(frozen=True)
class DataHandle:
    """A batch of `length` rows stored as files; small and JSON-serialisable (a Prefect task result).

    Attributes:
        length: number of rows (samples).
        groups: column groups, each covering all rows; a key appears in one group only.
        meta_info: batch-wide values (JSON), merged into every loaded DataProto.
        id: identifies the handle in logs.
    """

    length: int
    groups: tuple[ColumnGroup, ...]
    meta_info: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12], compare=False)

    # ------------------------------------------------------------------ making handles
    @classmethod
    def put(cls, data: DataProto, data_dir: str | Path, name: str = "batch") -> DataHandle:
        """Write `data` as one part under `data_dir` and return its handle (the controller's own batches)."""
        path = Path(data_dir) / f"{name}-{uuid.uuid4().hex[:12]}.safetensors"
        data.save(path)
        return cls(len(data), (ColumnGroup(tuple(data.keys), (Part(str(path), len(data)),)),), dict(data.meta_info))

    @classmethod
    def from_parts(cls, parts: Sequence[dict[str, Any]], meta_info: dict[str, Any] | None = None) -> DataHandle:
        """Assemble the handle of a data-parallel result from each DP group's part description.

        Args:
            parts: in DP-rank order, each ``{"path", "length", "keys"}`` as returned by `write_part`. Empty parts
                (a rank given no rows when a batch has fewer rows than DP ranks) are left out: a worker method may
                write fewer columns for no rows (a score function's extras, known only from its results).

        Raises:
            ValueError: if the non-empty parts do not hold the same columns.
        """
        filled = [p for p in parts if int(p["length"])] or list(parts[:1])
        keys = [tuple(p["keys"]) for p in filled]
        if any(k != keys[0] for k in keys):
            lengths = [int(p["length"]) for p in filled]
            raise ValueError(f"parts of one result hold different columns: {keys} (rows per part: {lengths})")
        group = ColumnGroup(keys[0], tuple(Part(p["path"], int(p["length"])) for p in filled))
        return cls(group.length, (group,), dict(meta_info or {}))

    # ------------------------------------------------------------------ combining
    @property
    def keys(self) -> list[str]:
        return [k for g in self.groups for k in g.keys]

    def union(self, other: DataHandle) -> DataHandle:
        """The columns of both handles over the same rows (no data is read or copied).

        Raises:
            ValueError: if the lengths differ or a column appears in both (name it).
        """
        if self.length != other.length:
            raise ValueError(f"union of handles with {self.length} and {other.length} rows")
        shared = set(self.keys) & set(other.keys)
        if shared:
            raise ValueError(f"union: columns {sorted(shared)} are in both handles; select() one side first")
        return DataHandle(self.length, self.groups + other.groups, {**self.meta_info, **other.meta_info})

    def select(self, keys: Sequence[str]) -> DataHandle:
        """A handle over only the named columns. Raises KeyError naming a missing column."""
        missing = [k for k in keys if k not in self.keys]
        if missing:
            raise KeyError(f"handle has no column(s) {missing}; it has {self.keys}")
        wanted = set(keys)
        groups = tuple(
            ColumnGroup(tuple(k for k in g.keys if k in wanted), g.parts) for g in self.groups if wanted & set(g.keys)
        )
        return DataHandle(self.length, groups, dict(self.meta_info))

    def drop(self, keys: Sequence[str]) -> DataHandle:
        """A handle without the named columns (names it lacks are ignored; nothing is read or copied)."""
        return self.select([k for k in self.keys if k not in keys])

    def with_meta(self, **meta_info: Any) -> DataHandle:
        """The same handle with `meta_info` entries added (e.g. ``global_steps``)."""
        return DataHandle(self.length, self.groups, {**self.meta_info, **meta_info}, self.id)

    def take(self, rows: Sequence[int]) -> DataHandle:
        """A handle over rows `rows` (ascending; a row may repeat) of this one, in that order, reading the same
        files (nothing is read or copied): e.g. the kept groups of DAPO's dynamic sampling, PF-PPO's redrawn rows.

        Raises:
            ValueError: `rows` is not ascending or leaves 0..length-1.
        """
        rows = list(rows)
        if any(b < a for a, b in zip(rows, rows[1:], strict=False)) or (
            rows and (rows[0] < 0 or rows[-1] >= self.length)
        ):
            raise ValueError(f"take: rows must be ascending within 0..{self.length - 1}")
        runs: list[tuple[int, int]] = []  # [start, stop) runs of consecutive rows
        for r in rows:
            if runs and runs[-1][1] == r:
                runs[-1] = (runs[-1][0], r + 1)
            else:
                runs.append((r, r + 1))
        groups = []
        for group in self.groups:
            parts, offset = [], 0
            for part in group.parts:
                for lo, hi in runs:
                    lo, hi = max(lo, offset), min(hi, offset + part.length)
                    if lo < hi:
                        parts.append(Part(part.path, hi - lo, part.start + lo - offset))
                offset += part.length
            groups.append(ColumnGroup(group.keys, tuple(parts) or (Part(group.parts[0].path, 0),)))
        return DataHandle(len(rows), tuple(groups), dict(self.meta_info))

    @classmethod
    def concat(cls, handles: Sequence[DataHandle]) -> DataHandle:
        """The rows of `handles` one after another (nothing is read or copied); the first one's ``meta_info``.

        The handles may group their columns differently (a batch generated ahead and restored from a checkpoint is
        one file; a fresh one is a file per stage): the result's groups are the columns that lie together in every
        handle, each listing the parts of every handle in turn.

        Raises:
            ValueError: the handles do not hold the same columns.
        """
        keys = handles[0].keys
        for h in handles[1:]:
            if set(h.keys) != set(keys):
                raise ValueError(f"concat: handle {h.id} holds columns {h.keys}, unlike {handles[0].keys}")
        where = [{k: i for i, g in enumerate(h.groups) for k in g.keys} for h in handles]
        together: dict[tuple[int, ...], list[str]] = {}  # each handle's group of a column -> the columns sharing them
        for key in keys:
            together.setdefault(tuple(w[key] for w in where), []).append(key)
        groups = tuple(
            ColumnGroup(tuple(names), tuple(p for h, i in zip(handles, at, strict=True) for p in h.groups[i].parts))
            for at, names in together.items()
        )
        return cls(sum(h.length for h in handles), groups, dict(handles[0].meta_info))

    # ------------------------------------------------------------------ reading
    def load(self, rows: slice | None = None) -> DataProto:
        """Read rows `rows` (step 1; default all) of every column, touching only the parts that overlap them."""
        start, stop, _ = (rows or slice(None)).indices(self.length)
        stop = max(start, stop)
        out: DataProto | None = None
        for group in self.groups:
            pieces, offset = [], 0
            for part in group.parts:
                lo, hi = max(start, offset), min(stop, offset + part.length)
                if lo < hi:
                    begin = part.start + lo - offset
                    pieces.append(DataProto.load(part.path, slice(begin, begin + hi - lo), keys=list(group.keys)))
                offset += part.length
            if not pieces:  # an empty share (fewer rows than ranks): no rows, but the columns
                pieces.append(DataProto.load(group.parts[0].path, slice(0, 0), keys=list(group.keys)))
            loaded = DataProto.concat(pieces) if len(pieces) > 1 else pieces[0]
            loaded.meta_info = {}
            out = loaded if out is None else out.union(loaded)
        if out is None:
            raise ValueError(f"handle {self.id} has no columns")
        out.meta_info = dict(self.meta_info)
        return out

    def delete(self) -> None:
        """Remove every part file of this handle (once no stage will read it again)."""
        for group in self.groups:
            for part in group.parts:
                Path(part.path).unlink(missing_ok=True)

    def shard_rows(self, rank: int, world: int) -> slice:
        """Rows of data-parallel rank `rank` of `world`: contiguous, sizes differ by at most one."""
        return slice(rank * self.length // world, (rank + 1) * self.length // world)

    @property
    def nbytes(self) -> int:
        """Bytes on disk of every part (the size of the data this handle stands for)."""
        return sum(Path(p.path).stat().st_size for g in self.groups for p in g.parts)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "length": self.length,
            "meta_info": self.meta_info,
            "groups": [
                {"keys": list(g.keys), "parts": [[p.path, p.length, p.start] for p in g.parts]} for g in self.groups
            ],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> DataHandle:
        groups = tuple(
            ColumnGroup(
                tuple(g["keys"]), tuple(Part(p[0], int(p[1]), int(p[2]) if len(p) > 2 else 0) for p in g["parts"])
            )
            for g in obj["groups"]
        )
        return cls(int(obj["length"]), groups, dict(obj.get("meta_info", {})), obj.get("id", uuid.uuid4().hex[:12]))

    def __repr__(self) -> str:
        return f"DataHandle(id={self.id}, length={self.length}, keys={self.keys}, parts={len(self.groups[0].parts)})"


def write_part(data: DataProto, data_dir: str | Path, stage: str, rank: int) -> dict[str, Any]:
    """Worker side: write this rank's result and describe it for `DataHandle.from_parts`."""
    path = Path(data_dir) / f"{stage}-{uuid.uuid4().hex[:12]}-rank{rank}.safetensors"
    data.save(path)
    return {"path": str(path), "length": len(data), "keys": data.keys}
