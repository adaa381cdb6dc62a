"""Data handles on real files: row shares, empty shares, union, select, delete."""

import pytest
import torch

from hybridflow.engine.protocol import DataProto
from hybridflow.slurm.handles import DataHandle


def test_shares_cover_every_row_once_even_with_more_ranks_than_rows(tmp_path):
    handle = DataHandle.put(DataProto.from_dict({"x": torch.arange(3)}), tmp_path)
    shares = [handle.load(handle.shard_rows(r, 5)) for r in range(5)]
    assert [len(s) for s in shares] == [0, 1, 0, 1, 1]
    assert torch.cat([s.batch["x"] for s in shares if len(s)]).tolist() == [0, 1, 2]
    assert list(shares[0].batch.keys()) == ["x"]  # an empty share still has the columns


def test_union_select_and_delete(tmp_path):
    a = DataHandle.put(DataProto.from_dict({"x": torch.arange(4)}), tmp_path, "a")
    b = DataHandle.put(DataProto.from_dict({"y": torch.arange(4) * 2}), tmp_path, "b")
    both = a.union(b)
    assert both.load(slice(1, 3)).batch["y"].tolist() == [2, 4]
    assert both.select(["y"]).keys == ["y"]
    with pytest.raises(ValueError, match=r"\['x'\]"):
        both.union(a)
    both.delete()
    assert not list(tmp_path.glob("*.safetensors"))
