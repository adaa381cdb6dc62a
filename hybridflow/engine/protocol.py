"""DataProto: the batch that flows between RLHF stages.

A `DataProto` holds one batch of N samples (prompts, or prompt+response sequences) in three parts, as in verl:

- ``batch``: a `tensordict.TensorDict` with batch size ``[N]``; every tensor's first dimension is N
  (e.g. ``input_ids`` int64 [N, L], ``response_mask`` int64 [N, T], ``old_log_probs`` float32 [N, T]).
- ``non_tensor_batch``: ``dict[str, np.ndarray]``, each a 1-D numpy ``object`` array of length N
  (e.g. ``data_source``, ``uid``, ``reward_model``).
- ``meta_info``: a plain dict for the whole batch (e.g. ``temperature``, ``global_steps``).

Every operation returns a new DataProto; tensors are shared, not copied, unless stated.
On disk a DataProto is one safetensors file: the tensors as tensors (dtype and shape exact), the non-tensor
columns and ``meta_info`` as JSON in the file's metadata. JSON (not pickle) so that loading a file never runs code.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tensordict import TensorDict

_NON_TENSOR_META = "hybridflow.non_tensor_batch"
_META_INFO_META = "hybridflow.meta_info"
_LENGTH_META = "hybridflow.length"


def _as_object_array(values: Any, key: str) -> np.ndarray:
    """Convert a list or array of length N to a 1-D numpy object array (nested lists/dicts stay Python objects)."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    if isinstance(values, np.ndarray) and values.ndim != 1:
        raise ValueError(f"non_tensor_batch[{key!r}] must be 1-D (one entry per sample), got shape {values.shape}")
    return out


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


@dataclass
class DataProto:
    """A batch of N samples: tensors, per-sample Python objects, and batch-wide metadata.

    Attributes:
        batch: TensorDict with ``batch_size == [N]`` (or None for a batch with no tensors).
        non_tensor_batch: column name -> numpy object array of shape [N].
        meta_info: batch-wide values (JSON-serialisable if the batch is to be saved).

    Raises:
        ValueError: if tensors and non-tensor columns disagree on N.
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensor_batch = {k: _as_object_array(v, k) for k, v in self.non_tensor_batch.items()}
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise ValueError(f"DataProto.batch must have a 1-D batch size [N], got {list(self.batch.batch_size)}")
        n = len(self)
        for key, values in self.non_tensor_batch.items():
            if len(values) != n:
                raise ValueError(
                    f"non_tensor_batch[{key!r}] has {len(values)} entries but the batch has {n} samples; "
                    "every column needs one entry per sample"
                )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        """Build a DataProto from plain dicts.

        Args:
            tensors: name -> tensor whose first dimension is N (all equal).
            non_tensors: name -> list or array of N Python objects.
            meta_info: batch-wide values.

        Raises:
            ValueError: if the tensors' first dimensions differ (the message lists each key's size).
        """
        batch = None
        if tensors:
            sizes = {k: (v.shape[0] if v.dim() > 0 else None) for k, v in tensors.items()}
            if len(set(sizes.values())) != 1 or None in sizes.values():
                raise ValueError(f"all tensors need the same first dimension N; got {sizes}")
            batch = TensorDict(dict(tensors), batch_size=[next(iter(sizes.values()))])
        return cls(batch=batch, non_tensor_batch=dict(non_tensors or {}), meta_info=dict(meta_info or {}))

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    def __getitem__(self, index: int | slice | Sequence[int] | torch.Tensor | np.ndarray) -> DataProto:
        """Select samples by int, slice, integer index array or boolean mask; returns a DataProto (length 1 for int)."""
        if isinstance(index, (int, np.integer)):
            if not -len(self) <= index < len(self):
                raise IndexError(f"index {int(index)} is out of range for a batch of {len(self)} samples")
            index = int(index) % len(self)
            index = slice(index, index + 1)
        if isinstance(index, slice):
            np_index: Any = index
            torch_index: Any = index
        else:
            np_index = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index)
            if np_index.dtype == bool:
                if np_index.shape != (len(self),):
                    raise IndexError(f"boolean mask of shape {np_index.shape} for a batch of {len(self)} samples")
                np_index = np.nonzero(np_index)[0]
            np_index = np_index.astype(np.int64)
            torch_index = torch.from_numpy(np_index)
        batch = self.batch[torch_index] if self.batch is not None else None
        non_tensor = {k: v[np_index] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def take(self, rows: Sequence[int]) -> DataProto:
        """The samples at `rows` (indices, in that order), as `hybridflow.slurm.handles.DataHandle.take`."""
        return self[np.asarray(list(rows), dtype=np.int64)]

    @property
    def keys(self) -> list[str]:
        """Tensor keys followed by non-tensor keys."""
        tensor_keys = list(self.batch.keys()) if self.batch is not None else []
        return tensor_keys + list(self.non_tensor_batch)

    def __repr__(self) -> str:
        tensors = {k: f"{tuple(v.shape)} {v.dtype}" for k, v in (self.batch.items() if self.batch is not None else [])}
        return (
            f"DataProto(len={len(self)}, tensors={tensors}, non_tensor={list(self.non_tensor_batch)}, "
            f"meta_info={list(self.meta_info)})"
        )

    # ------------------------------------------------------------------ column operations
    def drop(self, keys: Sequence[str]) -> DataProto:
        """The batch without the named columns (tensor or non-tensor; names it lacks are ignored)."""
        tensor_keys = [k for k in (self.batch.keys() if self.batch is not None else []) if k not in keys]
        return self.select(tensor_keys, [k for k in self.non_tensor_batch if k not in keys])

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Keep only the named columns (None keeps all of that part). Raises KeyError naming a missing key."""
        self._check_keys(batch_keys, non_tensor_batch_keys)
        batch = self.batch
        if batch is not None and batch_keys is not None:
            batch = batch.select(*batch_keys)
        non_tensor = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            non_tensor = {k: non_tensor[k] for k in non_tensor_batch_keys}
        meta = self.meta_info
        if meta_info_keys is not None:
            meta = {k: meta[k] for k in meta_info_keys}
        return DataProto(batch=batch, non_tensor_batch=dict(non_tensor), meta_info=dict(meta))

    def pop(self, batch_keys: Sequence[str] = (), non_tensor_batch_keys: Sequence[str] = ()) -> DataProto:
        """Remove the named columns from this DataProto and return them as a new one (meta_info is copied)."""
        self._check_keys(batch_keys, non_tensor_batch_keys)
        tensors = {k: self.batch.get(k) for k in batch_keys} if batch_keys else None
        if batch_keys:  # rebind, not TensorDict.pop: self.batch may be shared with another DataProto
            self.batch = self.batch.exclude(*batch_keys)
        non_tensor = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        if tensors:
            return DataProto(TensorDict(tensors, batch_size=[len(self)]), non_tensor, dict(self.meta_info))
        return DataProto(None, non_tensor, dict(self.meta_info))

    def _check_keys(self, batch_keys: Sequence[str] | None, non_tensor_batch_keys: Sequence[str] | None) -> None:
        have = set(self.batch.keys()) if self.batch is not None else set()
        missing = [k for k in (batch_keys or []) if k not in have]
        missing += [k for k in (non_tensor_batch_keys or []) if k not in self.non_tensor_batch]
        if missing:
            raise KeyError(f"DataProto has no column(s) {missing}; it has {self.keys}")

    def union(self, other: DataProto) -> DataProto:
        """Merge the columns of two batches of the same samples.

        A key present in both must hold equal values (tensors: same shape, dtype and values; non-tensor: equal
        entries; meta_info: equal values); it is then kept once.

        Raises:
            ValueError: if the lengths differ or a shared key holds different values (the key is named).
        """
        if len(self) != len(other):
            raise ValueError(f"union needs batches of equal length, got {len(self)} and {len(other)}")
        if self.batch is None or other.batch is None:
            batch = self.batch if other.batch is None else other.batch
        else:
            merged = dict(self.batch.items())
            for key, value in other.batch.items():
                if key in merged and not (
                    merged[key].shape == value.shape
                    and merged[key].dtype == value.dtype
                    and torch.equal(merged[key], value)
                ):
                    raise ValueError(f"union: tensor {key!r} differs between the two batches; rename one of them")
                merged[key] = value
            batch = TensorDict(merged, batch_size=[len(self)])
        non_tensor = dict(self.non_tensor_batch)
        for key, value in other.non_tensor_batch.items():
            if key in non_tensor and not all(_obj_equal(a, b) for a, b in zip(non_tensor[key], value, strict=True)):
                raise ValueError(f"union: non-tensor column {key!r} differs between the two batches")
            non_tensor[key] = value
        meta = dict(self.meta_info)
        for key, value in other.meta_info.items():
            if key in meta and not _obj_equal(meta[key], value):
                raise ValueError(f"union: meta_info[{key!r}] differs: {meta[key]!r} vs {value!r}")
            meta[key] = value
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    # ------------------------------------------------------------------ row operations
    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into `chunks` equal consecutive parts (sample order kept).

        Raises:
            ValueError: if ``len(self)`` is not divisible by ``chunks``; use `pad_to_divisor` first.
        """
        if chunks < 1 or len(self) % chunks != 0:
            raise ValueError(
                f"cannot chunk a batch of {len(self)} samples into {chunks} equal parts; "
                f"call pad_to_divisor({chunks}) first (and unpad after gathering)"
            )
        size = len(self) // chunks
        return [self[i * size : (i + 1) * size] for i in range(chunks)]

    def split(self, size: int) -> list[DataProto]:
        """Split into consecutive parts of `size` samples (the last may be shorter), e.g. for micro-batches."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self[i : i + size] for i in range(0, len(self), size)]

    @staticmethod
    def concat(parts: Sequence[DataProto]) -> DataProto:
        """Concatenate batches sample-wise; meta_info is taken from the first part.

        Raises:
            ValueError: if `parts` is empty or the parts do not have the same columns.
        """
        if not parts:
            raise ValueError("concat needs at least one DataProto")
        keys = [sorted(p.keys) for p in parts]
        if any(k != keys[0] for k in keys):
            raise ValueError(f"concat needs the same columns in every part; got {keys}")
        batch = None
        if parts[0].batch is not None:
            batch = torch.cat([p.batch for p in parts], dim=0)
        non_tensor = {
            k: _as_object_array(np.concatenate([p.non_tensor_batch[k] for p in parts]), k)
            for k in parts[0].non_tensor_batch
        }
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(parts[0].meta_info))

    def repeat(self, repeat_times: int, interleave: bool = True) -> DataProto:
        """Repeat every sample `repeat_times` times.

        interleave=True gives a,a,b,b (each prompt's n samples adjacent, as rollout with n>1 needs);
        interleave=False gives a,b,a,b.
        """
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}")
        n = len(self)
        index = np.arange(n)
        index = np.repeat(index, repeat_times) if interleave else np.tile(index, repeat_times)
        return self[index]

    def reorder(self, indices: torch.Tensor | np.ndarray | Sequence[int]) -> DataProto:
        """Return the samples in the order given by `indices` (a permutation or any index array)."""
        return self[indices]

    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Pad by repeating leading samples so that the length is a multiple of `divisor`.

        Returns:
            (padded DataProto, pad_size); pass pad_size to `unpad` on the gathered result.
        """
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor}")
        n = len(self)
        if n == 0:
            raise ValueError("cannot pad an empty batch")
        pad_size = (-n) % divisor
        if pad_size == 0:
            return self[:], 0
        index = np.concatenate([np.arange(n), np.arange(pad_size) % n])
        return self[index], pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last `pad_size` samples (undoes `pad_to_divisor`)."""
        return self[: len(self) - pad_size]

    # ------------------------------------------------------------------ disk
    def save(self, path: str | os.PathLike) -> None:
        """Write to one safetensors file atomically (temporary file, then rename).

        Tensors keep dtype and shape exactly. Non-tensor entries and meta_info must be JSON-serialisable
        (str, numbers, bool, None, lists, dicts; numpy scalars and arrays become Python values).

        Raises:
            TypeError: naming the column whose values cannot be written.
        """
        path = Path(path)
        tensors = {}
        if self.batch is not None:
            tensors = {k: v.detach().cpu().contiguous().clone() for k, v in self.batch.items()}
        metadata = {_LENGTH_META: str(len(self)), _NON_TENSOR_META: "{}", _META_INFO_META: "{}"}
        columns = {}
        for k, v in self.non_tensor_batch.items():
            try:
                columns[k] = json.dumps(v.tolist(), default=_json_default)
            except TypeError as e:
                raise TypeError(f"DataProto.save: non_tensor_batch[{k!r}] is not JSON-serialisable: {e}") from e
        metadata[_NON_TENSOR_META] = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in columns.items()) + "}"
        try:
            metadata[_META_INFO_META] = json.dumps(self.meta_info, default=_json_default)
        except TypeError as e:
            raise TypeError(f"DataProto.save: meta_info is not JSON-serialisable: {e}") from e
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike, rows: slice | None = None, keys: Sequence[str] | None = None) -> DataProto:
        """Read a file written by `save`, optionally only some rows and columns.

        Args:
            path: the file.
            rows: a step-1 slice of samples to read (e.g. one data-parallel rank's share); tensors are read
                from disk for those rows only.
            keys: tensor and non-tensor columns to read (None: all).

        Raises:
            ValueError: if the file is not a DataProto file (no HybridFlow metadata), or `rows` has a step.
            KeyError: if a requested key is not in the file.
        """
        if rows is not None and rows.step not in (None, 1):
            raise ValueError(f"DataProto.load reads contiguous rows only; got a slice with step {rows.step}")
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if _LENGTH_META not in metadata:
                raise ValueError(f"{path} is a safetensors file but not a saved DataProto (no HybridFlow metadata)")
            n = int(metadata[_LENGTH_META])
            start, stop, _ = (rows or slice(None)).indices(n)
            stop = max(start, stop)
            non_tensor_all = json.loads(metadata[_NON_TENSOR_META])
            tensor_keys = list(f.keys())
            if keys is not None:
                missing = [k for k in keys if k not in tensor_keys and k not in non_tensor_all]
                if missing:
                    raise KeyError(f"{path} has no column(s) {missing}; it has {tensor_keys + list(non_tensor_all)}")
                tensor_keys = [k for k in tensor_keys if k in keys]
                non_tensor_all = {k: v for k, v in non_tensor_all.items() if k in keys}
            if rows is None:
                tensors = {k: f.get_tensor(k) for k in tensor_keys}
            else:
                tensors = {k: f.get_slice(k)[start:stop] for k in tensor_keys}
        length = stop - start
        non_tensor = {k: _as_object_array(v[start:stop], k) for k, v in non_tensor_all.items()}
        batch = TensorDict(tensors, batch_size=[length]) if tensors or (length > 0 and not non_tensor) else None
        return cls(batch=batch, non_tensor_batch=non_tensor, meta_info=json.loads(metadata[_META_INFO_META]))


def _obj_equal(a: Any, b: Any) -> bool:
    """Equality that treats numpy arrays element-wise and returns one bool."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object)))
    try:
        return bool(a == b)
    except (ValueError, TypeError):
        return a is b
