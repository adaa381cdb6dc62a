"""Admission control of the streaming rollout (`hybridflow.engine.rollout.admission`): the staleness bound per
group, no group dropped, and the long tail passed over only while slack remains."""

from __future__ import annotations

import json
import random

import pytest

from hybridflow.engine.rollout.admission import StreamAdmission


def test_a_finished_group_is_trained_before_an_older_one_only_while_the_older_can_still_meet_its_deadline():
    # s = 2, one group per batch: g0, g1, g2 admitted at version 0 must all be trained by batch 2
    stream = StreamAdmission(batch_groups=1, max_staleness=2, total_groups=5)
    assert stream.room(0) == 3
    stream.admit(["g0", "g1", "g2"], version=0)
    assert stream.room(0) == 0
    assert stream.next_batch() is None  # nothing finished
    stream.finish(["g2"])
    assert stream.next_batch() == ["g2"]  # g0 and g1 still fit batches 1 and 2
    assert stream.room(1) == 1
    stream.admit(["g3"], version=1)
    stream.finish(["g3"])
    assert stream.next_batch() is None  # taking g3 would leave g0 and g1 for batch 2 alone
    stream.finish(["g0"])
    assert stream.next_batch() == ["g0"]  # the oldest finished goes first
    assert stream.next_batch() is None  # g1 is due in batch 2 and has not finished
    stream.finish(["g1"])
    assert stream.next_batch() == ["g1"]
    assert stream.next_batch() == ["g3"]
    assert stream.trained == 4 and not stream.done


def test_with_slack_a_batch_passes_over_an_unfinished_long_group_and_then_waits_for_it():
    stream = StreamAdmission(batch_groups=2, max_staleness=1, total_groups=6)
    stream.admit(["long", "a", "b", "c"], version=0)
    stream.finish(["a", "b"])
    assert stream.next_batch() == ["a", "b"]
    stream.finish(["c"])
    assert stream.room(1) == 2
    stream.admit(["d", "e"], version=1)
    stream.finish(["d", "e"])
    assert stream.next_batch() is None  # "long" is due in batch 1
    stream.finish(["long"])
    assert stream.next_batch() == ["long", "c"]
    assert stream.next_batch() == ["d", "e"]
    assert stream.done and stream.next_batch() is None


def test_staleness_zero_hands_over_exactly_the_admitted_batch_once_it_has_finished():
    stream = StreamAdmission(batch_groups=2, max_staleness=0, total_groups=4)
    stream.admit(["a", "b"], version=0)
    assert stream.room(0) == 0
    stream.finish(["b"])
    assert stream.next_batch() is None
    stream.finish(["a"])
    assert stream.next_batch() == ["a", "b"]
    assert stream.room(0) == 0 and stream.room(1) == 2


def test_bad_admissions_and_finishes_name_the_problem():
    stream = StreamAdmission(batch_groups=2, max_staleness=1, total_groups=20)
    with pytest.raises(ValueError, match=r"only 4 fit within rollout.max_staleness=1"):
        stream.admit(["a", "b", "c", "d", "e"], version=0)
    stream.admit(["a"], version=0)
    with pytest.raises(ValueError, match="admitted twice"):
        stream.admit(["a"], version=0)
    with pytest.raises(ValueError, match="admitted twice"):
        stream.admit(["x", "x"], version=0)
    stream.admit(["b"], version=1)
    with pytest.raises(ValueError, match="version 0 after one at 1"):
        stream.admit(["c"], version=0)
    with pytest.raises(KeyError, match="not in the stream"):
        stream.finish(["z"])
    with pytest.raises(ValueError, match="rollout.max_staleness"):
        StreamAdmission(batch_groups=0, max_staleness=1, total_groups=4)


def test_the_bookkeeping_resumes_from_its_json_state():
    stream = StreamAdmission(batch_groups=1, max_staleness=2, total_groups=5)
    stream.admit(["g0", "g1", "g2"], version=0)
    stream.finish(["g2"])
    assert stream.next_batch() == ["g2"]
    stream.finish(["g1"])
    restored = StreamAdmission(batch_groups=1, max_staleness=2, total_groups=5)
    restored.load_state_dict(json.loads(json.dumps(stream.state_dict())))
    assert restored.room(1) == stream.room(1) == 1
    assert restored.next_batch() == stream.next_batch() == ["g1"]
    assert restored.state_dict() == stream.state_dict()


@pytest.mark.parametrize("batch_groups", [1, 2, 3])
@pytest.mark.parametrize(("max_staleness", "weight_sync_every"), [(0, 1), (1, 1), (1, 2), (2, 1), (2, 3), (4, 1)])
def test_a_simulated_long_tailed_stream_trains_every_group_once_within_the_bound(
    batch_groups, max_staleness, weight_sync_every
):
    """Groups take 1 to 40 ticks (a long tail), admitted as soon as there is room, the engine taking new weights
    every `weight_sync_every` updates (<= s + 1, as the config requires): every group is trained exactly once, in
    a batch of B, at most s updates after the weights it was admitted with, and the stream never stalls."""
    rng = random.Random(batch_groups * 100 + max_staleness * 10 + weight_sync_every)
    iterations = 24
    stream = StreamAdmission(batch_groups, max_staleness, iterations * batch_groups)
    remaining: dict[str, int] = {}  # in flight -> ticks left
    admitted_at: dict[str, int] = {}
    order: list[str] = []
    trained: list[str] = []
    engine_version, passed_over = 0, 0
    for _tick in range(10_000):
        if stream.done:
            break
        fits = stream.room(engine_version)
        uids = [f"p{len(order) + i}" for i in range(fits)]
        stream.admit(uids, engine_version)
        for uid in uids:
            remaining[uid] = rng.choice([1, 2, 3, 40]) if rng.random() < 0.9 else rng.randint(20, 40)
            admitted_at[uid] = engine_version
        order += uids
        for uid in list(remaining):
            remaining[uid] -= 1
            if remaining[uid] == 0:
                del remaining[uid]
                stream.finish([uid])
        while (batch := stream.next_batch()) is not None:
            version = stream.trained - 1
            assert len(batch) == batch_groups
            assert all(version - admitted_at[u] <= max_staleness for u in batch), (version, batch)
            newest = max(int(u[1:]) for u in batch)
            passed_over += sum(1 for i in range(newest) if f"p{i}" not in trained and f"p{i}" not in batch)
            trained += batch
            if stream.trained % weight_sync_every == 0:
                engine_version = stream.trained
    assert stream.done, "the stream stalled"
    assert sorted(trained) == sorted(order) and len(set(trained)) == len(trained) == iterations * batch_groups
    assert order == [f"p{i}" for i in range(len(order))]
    if max_staleness >= 2:
        assert passed_over > 0  # the stream did hand over finished groups ahead of unfinished older ones
