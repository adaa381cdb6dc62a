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


def test_an_empty_share_with_fewer_columns_is_left_out(tmp_path):
    """3 validation rows over 4 ranks: the rank with none writes no score-function extras (they are known only from
    results). The handle takes the columns of the parts that have rows; parts with rows that disagree still fail."""
    from hybridflow.slurm.handles import write_part

    def part(rank: int, rows: int, extra: bool) -> dict:
        cols = {"token_level_scores": torch.full((rows, 2), float(rank))}
        if extra:
            cols["reward_extra/acc"] = torch.full((rows,), float(rank), dtype=torch.float64)
        return write_part(DataProto.from_dict(cols), tmp_path, "reward", rank)

    handle = DataHandle.from_parts([part(0, 0, False), part(1, 1, True), part(2, 1, True), part(3, 1, True)])
    assert handle.length == 3 and handle.load().batch["reward_extra/acc"].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"different columns.*rows per part: \[1, 1\]"):
        DataHandle.from_parts([part(0, 1, False), part(1, 1, True)])


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


def test_take_and_concat_pick_rows_across_parts_without_copying(tmp_path):
    """Two draws' kept rows (DAPO's dynamic sampling) as one batch: rows from several files, each read in place;
    rows drawn again (PF-PPO) read again."""
    from hybridflow.slurm.handles import write_part

    def drawn(offset: int) -> DataHandle:  # a two-rank result (rows 0-2 and 3-5) with a second column group
        parts = [
            write_part(DataProto.from_dict({"x": torch.arange(r, r + 3) + offset}), tmp_path, "gen", r) for r in (0, 3)
        ]
        scores = DataHandle.put(DataProto.from_dict({"s": (torch.arange(6) + offset).float()}), tmp_path, "score")
        return DataHandle.from_parts(parts).union(scores)

    first, second = drawn(0), drawn(100)
    kept = DataHandle.concat([first.take([1, 2, 3, 4]), second.take([]), second.take([0, 5])])
    files = {p.path for g in kept.groups for p in g.parts}
    assert kept.length == 6 and files <= {p.path for h in (first, second) for g in h.groups for p in g.parts}
    assert kept.load().batch["x"].tolist() == [1, 2, 3, 4, 100, 105]
    assert kept.load().batch["s"].tolist() == [1.0, 2.0, 3.0, 4.0, 100.0, 105.0]
    assert kept.load(slice(3, 5)).batch["x"].tolist() == [4, 100]  # a consumer rank's share crosses draws
    assert DataHandle.from_json(kept.to_json()).load().batch["x"].tolist() == [1, 2, 3, 4, 100, 105]
    with pytest.raises(ValueError, match="ascending"):
        first.take([2, 1])
    # PF-PPO's redraw: rows repeat (across the two ranks' files); a consumer's share reads its repeats
    redrawn = first.take([0, 2, 2, 3, 3, 3])
    assert redrawn.load().batch["x"].tolist() == [0, 2, 2, 3, 3, 3]
    assert redrawn.load(slice(2, 5)).batch["s"].tolist() == [2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match=r"holds columns \['x'\], unlike \['x', 's'\]"):
        DataHandle.concat([first, first.select(["x"])])
    # a batch restored in one file (a generation ahead, from a checkpoint) beside one written a file per stage
    restored = DataHandle.put(DataProto.from_dict({"s": torch.tensor([7.0, 8.0]), "x": torch.tensor([7, 8])}), tmp_path)
    mixed = DataHandle.concat([restored, second.take([0, 5])])
    assert {g.keys for g in mixed.groups} == {("x",), ("s",)}  # apart in the fresh batch, so apart in both
    assert mixed.load().batch["x"].tolist() == [7, 8, 100, 105]
    assert mixed.load().batch["s"].tolist() == [7.0, 8.0, 100.0, 105.0]
