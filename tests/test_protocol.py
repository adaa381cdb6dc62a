"""Tests for `hybridflow.engine.protocol.DataProto`: property tests over random batches plus example tests."""

from __future__ import annotations

import math
import os
import string
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tensordict import TensorDict

import hybridflow.engine.protocol as protocol
from hybridflow.engine.protocol import DataProto

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8]
# Same-width integer dtype, to compare floating tensors bit for bit (NaN payloads, -0.0, bfloat16 patterns).
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------- strategies
def _random_tensor(seed: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of arbitrary bit patterns (floats include NaN, inf, subnormals and -0.0)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


_json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
)
json_values = st.recursive(
    _json_leaves,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)
_names = st.text(alphabet=string.ascii_lowercase + "_.", min_size=1, max_size=6)


@st.composite
def data_protos(draw: st.DrawFn, min_len: int = 0, max_len: int = 12) -> DataProto:
    """A random DataProto whose length is exactly the drawn N (an empty-key TensorDict carries N if needed)."""
    n = draw(st.integers(min_len, max_len))
    tensor_keys = draw(st.lists(_names.map(lambda s: "t_" + s), unique=True, max_size=4))
    non_tensor_keys = draw(st.lists(_names.map(lambda s: "n_" + s), unique=True, max_size=3))
    tensors = {}
    for key in tensor_keys:
        dtype = draw(st.sampled_from(DTYPES))
        trailing = tuple(draw(st.lists(st.integers(0, 5), max_size=2)))
        tensors[key] = _random_tensor(draw(st.integers(0, 2**31)), dtype, (n, *trailing))
    non_tensors = {key: draw(st.lists(json_values, min_size=n, max_size=n)) for key in non_tensor_keys}
    meta_info = draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3))
    if tensors:
        return DataProto.from_dict(tensors, non_tensors, meta_info)
    # No tensors: the batch is None, or a TensorDict without keys (what popping every tensor leaves behind);
    # the latter is the only way to hold N > 0 samples with no columns at all.
    empty_td = draw(st.booleans()) or (n > 0 and not non_tensors)
    batch = TensorDict({}, batch_size=[n]) if empty_td else None
    dp = DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)
    assert len(dp) == n
    return dp


# ---------------------------------------------------------------------------------------------- helpers
def same_json(a: Any, b: Any) -> bool:
    """Strict equality: same types all the way down (1 != 1.0 != True), floats compared by repr (-0.0 != 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_json(a[k], b[k]) for k in a)
    return a == b


def assert_tensor_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    if a.dtype in _BITS:
        a, b = a.contiguous().view(_BITS[a.dtype]), b.contiguous().view(_BITS[b.dtype])
    assert torch.equal(a, b)


def tensor_items(dp: DataProto) -> dict[str, torch.Tensor]:
    return dict(dp.batch.items()) if dp.batch is not None else {}


def assert_dp_equal(a: DataProto, b: DataProto, meta: bool = True) -> None:
    assert len(a) == len(b)
    ta, tb = tensor_items(a), tensor_items(b)
    assert sorted(ta) == sorted(tb)
    for key in ta:
        assert_tensor_equal(ta[key], tb[key])
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for key, column in a.non_tensor_batch.items():
        other = b.non_tensor_batch[key]
        assert isinstance(column, np.ndarray) and column.dtype == object and column.shape == (len(a),)
        assert isinstance(other, np.ndarray) and other.dtype == object and other.shape == (len(b),)
        assert all(same_json(x, y) for x, y in zip(column, other, strict=True)), key
    if meta:
        assert same_json(a.meta_info, b.meta_info)


def assert_row(dp: DataProto, i: int, ref: DataProto, j: int) -> None:
    """Row i of dp equals row j of ref in every column."""
    for key, t in tensor_items(ref).items():
        assert_tensor_equal(dp.batch[key][i], t[j])
    for key, column in ref.non_tensor_batch.items():
        assert same_json(dp.non_tensor_batch[key][i], column[j])


def make_batch(n: int = 4) -> DataProto:
    return DataProto.from_dict(
        {"input_ids": torch.arange(n * 3).reshape(n, 3), "scores": torch.linspace(0, 1, n)},
        {"uid": [f"u{i}" for i in range(n)], "reward_model": [{"gt": i} for i in range(n)]},
        {"temperature": 1.0, "global_steps": 3},
    )


# ---------------------------------------------------------------------------------------------- properties
@PROPERTY_SETTINGS
@given(dp=data_protos())
def test_chunk_then_concat_is_identity(dp: DataProto) -> None:
    n = len(dp)
    divisors = [k for k in range(1, n + 1) if n % k == 0] if n else [1, 2, 3]
    for k in divisors:
        parts = dp.chunk(k)
        assert len(parts) == k
        assert all(len(p) == n // k for p in parts)
        assert_dp_equal(DataProto.concat(parts), dp)


@PROPERTY_SETTINGS
@given(dp=data_protos())
def test_save_load_round_trip_is_exact(dp: DataProto) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batch.safetensors"
        dp.save(path)
        loaded = DataProto.load(path)
        assert sorted(os.listdir(tmp)) == ["batch.safetensors"]
    assert_dp_equal(loaded, dp)
    assert len(loaded) == len(dp)  # also when there are no tensors (length comes from the metadata)


@PROPERTY_SETTINGS
@given(dp=data_protos(min_len=1), divisor=st.integers(1, 8))
def test_pad_to_divisor_then_unpad_is_identity(dp: DataProto, divisor: int) -> None:
    n = len(dp)
    padded, pad_size = dp.pad_to_divisor(divisor)
    assert len(padded) % divisor == 0
    assert 0 <= pad_size < divisor
    assert len(padded) == n + pad_size
    for i in range(len(padded)):
        assert_row(padded, i, dp, i % n)  # originals first, then leading samples repeated
    padded.chunk(divisor)  # now divisible: must not raise
    assert_dp_equal(padded.unpad(pad_size), dp)


@PROPERTY_SETTINGS
@given(dp=data_protos(), times=st.integers(1, 3))
def test_repeat_interleave_and_tile(dp: DataProto, times: int) -> None:
    n = len(dp)
    inter = dp.repeat(times, interleave=True)
    tiled = dp.repeat(times, interleave=False)
    assert len(inter) == len(tiled) == n * times
    for key, t in tensor_items(dp).items():
        assert_tensor_equal(inter.batch[key], t.repeat_interleave(times, dim=0))
        assert_tensor_equal(tiled.batch[key], torch.cat([t] * times, dim=0))
    for key, column in dp.non_tensor_batch.items():
        expected_inter = [v for v in column for _ in range(times)]
        assert all(same_json(x, y) for x, y in zip(inter.non_tensor_batch[key], expected_inter, strict=True))
        assert all(same_json(x, y) for x, y in zip(tiled.non_tensor_batch[key], list(column) * times, strict=True))
    assert same_json(inter.meta_info, dp.meta_info) and same_json(tiled.meta_info, dp.meta_info)


@PROPERTY_SETTINGS
@given(dp=data_protos(), size=st.integers(1, 13))
def test_split_then_concat_is_identity(dp: DataProto, size: int) -> None:
    n = len(dp)
    parts = dp.split(size)
    assert len(parts) == math.ceil(n / size)
    assert all(len(p) == size for p in parts[:-1])
    if n == 0:
        return
    assert 0 < len(parts[-1]) <= size
    assert_dp_equal(DataProto.concat(parts), dp)


@PROPERTY_SETTINGS
@given(dp=data_protos(), data=st.data())
def test_select_and_pop_keep_exactly_the_named_keys(dp: DataProto, data: st.DataObject) -> None:
    n = len(dp)
    tensor_keys = sorted(tensor_items(dp))
    non_tensor_keys = sorted(dp.non_tensor_batch)
    pick_t = data.draw(st.lists(st.sampled_from(tensor_keys), unique=True) if tensor_keys else st.just([]))
    pick_n = data.draw(st.lists(st.sampled_from(non_tensor_keys), unique=True) if non_tensor_keys else st.just([]))
    pick_m = data.draw(st.lists(st.sampled_from(sorted(dp.meta_info)), unique=True) if dp.meta_info else st.just([]))
    original = DataProto.concat([dp])  # an independent copy of the columns to compare against

    selected = dp.select(pick_t, pick_n, pick_m)
    assert sorted(tensor_items(selected)) == sorted(pick_t)
    assert sorted(selected.non_tensor_batch) == sorted(pick_n)
    assert sorted(selected.meta_info) == sorted(pick_m)
    if pick_t or dp.batch is not None:
        assert len(selected) == n
    for key in pick_t:
        assert_tensor_equal(selected.batch[key], dp.batch[key])
    for key in pick_n:
        assert selected.non_tensor_batch[key].tolist() == dp.non_tensor_batch[key].tolist()
    assert_dp_equal(dp, original)  # select leaves the source alone
    assert_dp_equal(dp.select(), original)  # None keeps everything

    # pop on a view made by select() must not reach back into dp (they share a TensorDict otherwise)
    view = dp.select()
    view.pop(pick_t, pick_n)
    assert_dp_equal(dp, original)

    popped = dp.pop(pick_t, pick_n)
    assert sorted(tensor_items(popped)) == sorted(pick_t)
    assert sorted(popped.non_tensor_batch) == sorted(pick_n)
    assert sorted(tensor_items(dp)) == sorted(set(tensor_keys) - set(pick_t))
    assert sorted(dp.non_tensor_batch) == sorted(set(non_tensor_keys) - set(pick_n))
    if pick_t or pick_n:
        assert len(popped) == n
        assert_dp_equal(popped, original.select(pick_t, pick_n))
    else:
        assert popped.keys == []
    if dp.batch is not None:
        assert len(dp) == n
    assert_dp_equal(dp, original.select(sorted(set(tensor_keys) - set(pick_t)), dp.non_tensor_batch.keys()))


# ---------------------------------------------------------------------------------------------- union
def test_union_merges_disjoint_keys() -> None:
    a = DataProto.from_dict({"x": torch.arange(3)}, {"s": ["a", "b", "c"]}, {"m1": 1})
    b = DataProto.from_dict({"y": torch.ones(3, 2)}, {"u": [1, 2, 3]}, {"m2": "two"})
    merged = a.union(b)
    assert sorted(tensor_items(merged)) == ["x", "y"]
    assert torch.equal(merged.batch["x"], torch.arange(3)) and torch.equal(merged.batch["y"], torch.ones(3, 2))
    assert merged.non_tensor_batch["s"].tolist() == ["a", "b", "c"]
    assert merged.non_tensor_batch["u"].tolist() == [1, 2, 3]
    assert merged.meta_info == {"m1": 1, "m2": "two"}
    assert len(merged) == 3


def test_union_with_no_tensors_on_one_side() -> None:
    a = make_batch(3)
    b = DataProto.from_dict(None, {"extra": [[1], [2], [3]]})
    merged = a.union(b)
    assert sorted(merged.keys) == sorted(a.keys + ["extra"])
    assert merged.non_tensor_batch["extra"].tolist() == [[1], [2], [3]]


def test_union_accepts_identical_shared_keys() -> None:
    a = make_batch(4)
    b = DataProto.from_dict(
        {"scores": a.batch["scores"].clone(), "new": torch.zeros(4)},
        {"uid": [f"u{i}" for i in range(4)]},
        {"temperature": 1.0},
    )
    merged = a.union(b)
    assert merged.keys.count("scores") == 1 and merged.keys.count("uid") == 1
    assert sorted(merged.keys) == sorted(a.keys + ["new"])
    assert torch.equal(merged.batch["scores"], a.batch["scores"])
    assert merged.meta_info == {"temperature": 1.0, "global_steps": 3}


@pytest.mark.parametrize(
    "other_scores",
    [
        torch.linspace(0, 1, 4) + 1,  # different values
        torch.linspace(0, 1, 4).double(),  # same values, different dtype
        torch.linspace(0, 1, 4)[:, None],  # same values, different shape
    ],
    ids=["values", "dtype", "shape"],
)
def test_union_rejects_conflicting_tensor(other_scores: torch.Tensor) -> None:
    b = DataProto.from_dict({"scores": other_scores})
    with pytest.raises(ValueError, match="'scores'"):
        make_batch(4).union(b)


def test_union_rejects_conflicting_non_tensor_column() -> None:
    b = DataProto.from_dict(None, {"uid": ["u0", "u1", "u2", "zzz"]})
    with pytest.raises(ValueError, match="'uid'"):
        make_batch(4).union(b)


def test_union_rejects_conflicting_meta_info() -> None:
    b = DataProto.from_dict({"other": torch.zeros(4)}, None, {"temperature": 0.7})
    with pytest.raises(ValueError, match="'temperature'"):
        make_batch(4).union(b)


def test_union_rejects_different_lengths() -> None:
    with pytest.raises(ValueError, match="equal length"):
        make_batch(4).union(make_batch(3))


# ---------------------------------------------------------------------------------------------- construction / rows
@pytest.mark.parametrize("chunks", [3, 5, 0])
def test_chunk_not_divisible_points_to_pad_to_divisor(chunks: int) -> None:
    with pytest.raises(ValueError, match="pad_to_divisor"):
        make_batch(4).chunk(chunks)


def test_pad_empty_batch_raises() -> None:
    with pytest.raises(ValueError, match="empty"):
        DataProto.from_dict({"x": torch.zeros(0, 2)}).pad_to_divisor(2)


def test_from_dict_rejects_different_first_dimensions() -> None:
    with pytest.raises(ValueError, match="input_ids") as info:
        DataProto.from_dict({"input_ids": torch.zeros(4, 3), "mask": torch.zeros(5, 3)})
    assert "mask" in str(info.value) and "5" in str(info.value)
    with pytest.raises(ValueError):
        DataProto.from_dict({"scalar": torch.tensor(1.0)})


def test_non_tensor_column_of_wrong_length_raises() -> None:
    with pytest.raises(ValueError, match="'uid'"):
        DataProto.from_dict({"x": torch.zeros(3)}, {"uid": ["a", "b"]})
    with pytest.raises(ValueError, match="'b'"):
        DataProto.from_dict(None, {"a": [1, 2, 3], "b": [1, 2]})
    with pytest.raises(ValueError, match="1-D"):
        DataProto.from_dict(None, {"grid": np.zeros((2, 2), dtype=object)})


def test_mask_and_integer_indexing_select_the_right_rows() -> None:
    dp = make_batch(5)
    ids = dp.batch["input_ids"]
    mask = [True, False, True, True, False]
    for m in (mask, np.array(mask), torch.tensor(mask)):
        sub = dp[m]
        assert torch.equal(sub.batch["input_ids"], ids[[0, 2, 3]])
        assert sub.non_tensor_batch["uid"].tolist() == ["u0", "u2", "u3"]
        assert sub.meta_info == dp.meta_info
    for idx in ([4, 0, 0, 2], np.array([4, 0, 0, 2]), torch.tensor([4, 0, 0, 2])):
        sub = dp[idx]
        assert torch.equal(sub.batch["input_ids"], ids[[4, 0, 0, 2]])
        assert sub.non_tensor_batch["uid"].tolist() == ["u4", "u0", "u0", "u2"]
    assert dp.reorder([3, 1]).non_tensor_batch["uid"].tolist() == ["u3", "u1"]
    assert len(dp[np.array([], dtype=np.int64)]) == 0
    with pytest.raises(IndexError):
        dp[[True, False]]  # mask of the wrong length


@pytest.mark.parametrize("index", [2, -1, -5, np.int64(2), np.int32(-1)])
def test_int_index_gives_one_sample(index: Any) -> None:
    dp = make_batch(5)
    sub = dp[index]
    assert len(sub) == 1
    assert sub.non_tensor_batch["uid"].tolist() == [f"u{int(index) % 5}"]
    assert torch.equal(sub.batch["input_ids"], dp.batch["input_ids"][[int(index)]])


@pytest.mark.parametrize("index", [5, -6])
def test_int_index_out_of_range_raises(index: int) -> None:
    with pytest.raises(IndexError):
        make_batch(5)[index]


def test_select_and_pop_missing_key_raise_key_error() -> None:
    with pytest.raises(KeyError, match="nope"):
        make_batch().select(["nope"])
    with pytest.raises(KeyError, match="nope"):
        make_batch().pop(non_tensor_batch_keys=["nope"])


def test_concat_rejects_mismatched_columns_and_empty_list() -> None:
    with pytest.raises(ValueError, match="same columns"):
        DataProto.concat([make_batch(2), make_batch(2).select(["scores"])])
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])


def test_pad_and_unpad_return_new_objects() -> None:
    dp = make_batch(4)
    padded, pad_size = dp.pad_to_divisor(2)
    assert pad_size == 0
    padded.pop(["scores"], ["uid"])
    unpadded = dp.unpad(0)
    unpadded.pop(["input_ids"])
    assert sorted(dp.keys) == ["input_ids", "reward_model", "scores", "uid"]


# ---------------------------------------------------------------------------------------------- disk
def test_save_load_without_tensors_keeps_length(tmp_path: Path) -> None:
    only_non_tensor = DataProto.from_dict(None, {"uid": ["a", "b", "c"]}, {"k": [1, {"x": None}]})
    only_non_tensor.save(tmp_path / "a.st")
    loaded = DataProto.load(tmp_path / "a.st")
    assert len(loaded) == 3 and loaded.batch is None
    assert loaded.non_tensor_batch["uid"].tolist() == ["a", "b", "c"]
    assert loaded.meta_info == {"k": [1, {"x": None}]}

    no_columns = make_batch(3)
    no_columns.pop(["input_ids", "scores"], ["uid", "reward_model"])
    assert len(no_columns) == 3
    no_columns.save(tmp_path / "b.st")
    assert len(DataProto.load(tmp_path / "b.st")) == 3


def test_save_load_bfloat16_bit_patterns(tmp_path: Path) -> None:
    bits = torch.tensor([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x3F80, 0x7F7F], dtype=torch.int32)
    t = bits.to(torch.int16).view(torch.bfloat16).reshape(2, 4)  # +-0, +-inf, a NaN payload, subnormal, 1, max
    DataProto.from_dict({"b": t}).save(tmp_path / "bf.st")
    loaded = DataProto.load(tmp_path / "bf.st").batch["b"]
    assert loaded.dtype == torch.bfloat16 and loaded.shape == (2, 4)
    assert torch.equal(loaded.view(torch.int16), t.view(torch.int16))


def test_save_non_json_object_raises_type_error(tmp_path: Path) -> None:
    class Opaque:
        pass

    bad_column = DataProto.from_dict({"x": torch.zeros(2)}, {"uid": ["a", "b"], "extra": [1, Opaque()]})
    with pytest.raises(TypeError, match="Opaque") as info:
        bad_column.save(tmp_path / "x.st")
    assert "'extra'" in str(info.value) and "non_tensor_batch" in str(info.value)

    bad_meta = DataProto.from_dict({"x": torch.zeros(2)}, None, {"fn": Opaque()})
    with pytest.raises(TypeError, match="meta_info") as info:
        bad_meta.save(tmp_path / "x.st")
    assert "Opaque" in str(info.value)
    assert os.listdir(tmp_path) == []  # nothing written, no temp file left


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_load_plain_safetensors_file_raises(tmp_path: Path, metadata: dict[str, str] | None) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2, 2)}, str(path), metadata=metadata)
    with pytest.raises(ValueError, match="not a saved DataProto"):
        DataProto.load(path)


def test_save_is_atomic_and_replaces_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "batch.safetensors"
    make_batch(4).save(path)  # creates the parent folder
    assert os.listdir(path.parent) == ["batch.safetensors"]
    second = make_batch(2)
    second.meta_info["global_steps"] = 9
    second.save(path)
    assert os.listdir(path.parent) == ["batch.safetensors"]
    assert_dp_equal(DataProto.load(path), second)


def test_failed_save_keeps_old_file_and_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "batch.safetensors"
    first = make_batch(4)
    first.save(path)

    def broken_save_file(tensors: dict, filename: str, metadata: dict) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(protocol, "save_file", broken_save_file)
    with pytest.raises(OSError, match="disk full"):
        make_batch(2).save(path)
    assert os.listdir(tmp_path) == ["batch.safetensors"]
    assert_dp_equal(DataProto.load(path), first)


def test_numpy_scalars_save_as_python_values(tmp_path: Path) -> None:
    dp = DataProto.from_dict(
        {"x": torch.zeros(2)},
        {
            "ints": np.array([1, 2], dtype=np.int64),
            "floats": [np.float32(0.5), np.float64(1.25)],
            "bools": [np.bool_(True), np.bool_(False)],
            "nested": [{"k": np.int32(3)}, [np.uint8(4), np.array([5, 6])]],
        },
        {"step": np.int64(7), "lr": np.float32(0.25), "shape": np.array([2, 3])},
    )
    dp.save(tmp_path / "np.st")
    loaded = DataProto.load(tmp_path / "np.st")
    nt = loaded.non_tensor_batch
    assert same_json(nt["ints"].tolist(), [1, 2])
    assert same_json(nt["floats"].tolist(), [0.5, 1.25])
    assert same_json(nt["bools"].tolist(), [True, False])
    assert same_json(nt["nested"].tolist(), [{"k": 3}, [4, [5, 6]]])
    assert same_json(loaded.meta_info, {"step": 7, "lr": 0.25, "shape": [2, 3]})
