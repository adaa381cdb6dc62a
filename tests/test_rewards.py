"""Answer extraction, GSM8K and reasoning-gym scores, custom score functions and the RewardManager."""

import json
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow.engine.data import reasoning_gym_rows
from hybridflow.engine.guards import NonFiniteError
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.reward.rewards import (
    RewardManager,
    ScoreFunctionError,
    default_compute_score,
    extract_answer,
    gsm8k_score,
    load_reward_function,
    reasoning_gym_score,
)

ADD_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}


# ---------------------------------------------------------------------------------------------------- extraction
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer> 12 </answer>", "12"),
        ("<answer>3</answer> then <answer>\n4\n</answer> and 99", "4"),
        ("<answer>a cat</answer>", "a cat"),
        ("The sum is 7.", "7"),
        ("-3 then 4 and finally -5", "-5"),
        ("it costs 1,234,567.25 dollars", "1234567.25"),
        ("0.5 or 2.75", "2.75"),
        ("<answer>unclosed 5", "5"),
        ("  no digits here  ", "no digits here"),
        ("", ""),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ---------------------------------------------------------------------------------------------------- GSM8K
@pytest.mark.parametrize(
    ("text", "truth", "method", "expected"),
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", "strict", 1.0),
        ("#### 5 wait no\n#### 72", "72", "strict", 1.0),
        ("#### $1,000", "1000", "strict", 1.0),
        ("#### 72.0", "72", "strict", 1.0),
        ("#### -3", "-3", "strict", 1.0),
        ("#### 8", "7", "strict", 0.5),  # found but wrong -> format_score
        ("The answer is 7", "7", "strict", 0.0),  # no '####': nothing found
        ("The answer is 7", "7", "flexible", 1.0),
        ("I think 7, no, 9", "7", "flexible", 0.5),
        ("no number", "7", "flexible", 0.0),
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", "strict", 1.0),
    ],
)
def test_gsm8k_score(text, truth, method, expected):
    assert gsm8k_score(text, truth, method=method, format_score=0.5) == expected


def test_gsm8k_score_custom_score_and_bad_method():
    assert gsm8k_score("#### 3", "3", score=2.0) == 2.0
    assert gsm8k_score("#### 4", "3") == 0.0
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        gsm8k_score("#### 3", "3", method="loose")


# ---------------------------------------------------------------------------------------------------- reasoning-gym
@pytest.fixture(scope="module")
def rg_rows():
    # through JSON, as rows read back from a prompt file would be
    return json.loads(json.dumps(reasoning_gym_rows("basic_arithmetic", size=6, seed=1, config=ADD_CONFIG)))


def test_reasoning_gym_score_real_entries(rg_rows):
    for row in rg_rows:
        source, truth, extra = row["data_source"], row["reward_model"]["ground_truth"], row["extra_info"]
        wrong = str(int(truth) + 3)
        assert reasoning_gym_score(source, f"The result is {truth}.", truth, extra) == {"score": 1.0, "acc": 1.0}
        assert reasoning_gym_score(source, f"<answer>{truth}</answer> (not 55)", truth, extra)["score"] == 1.0
        assert reasoning_gym_score(source, f"It is {wrong}", truth, extra) == {"score": 0.0, "acc": 0.0}
        # partial credit: an answer holding the right one inside a wrong one
        partial = reasoning_gym_score(source, f"<answer>{truth}0</answer>", truth, extra)
        assert 0.0 < partial["score"] < 1.0 and partial["acc"] == 0.0
        # no entry stored: falls back to the ground truth
        assert reasoning_gym_score(source, truth, truth, None)["score"] == 1.0
        assert reasoning_gym_score(source, wrong, truth, {})["score"] == 0.0


def test_reasoning_gym_score_arc_grid_after_json_round_trip():
    import reasoning_gym

    (row,) = json.loads(json.dumps(reasoning_gym_rows("rearc", size=1, seed=0)))
    truth, entry = row["reward_model"]["ground_truth"], row["extra_info"]["entry"]
    assert "\n" in truth  # a grid, which the scorer compares as tuples
    assert reasoning_gym.get_score_answer_fn("rearc")(truth, entry) < 1.0  # JSON turned the tuples into lists
    score = reasoning_gym_score(row["data_source"], f"<answer>{truth}</answer>", truth, row["extra_info"])
    assert score == {"score": 1.0, "acc": 1.0}


def test_reasoning_gym_score_unknown_generator():
    with pytest.raises(ValueError, match="did you mean reasoning_gym/chain_sum"):
        reasoning_gym_score("reasoning_gym/chain_sun", "1", "1", None)


def test_default_compute_score_dispatch(rg_rows):
    assert default_compute_score("openai/gsm8k", "#### 12", "12") == {"score": 1.0, "acc": 1.0}
    assert default_compute_score("gsm8k", "12", "12") == {"score": 0.0, "acc": 0.0}  # strict needs '####'
    row = rg_rows[0]
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score(row["data_source"], truth, truth, row["extra_info"])["score"] == 1.0
    with pytest.raises(ValueError, match=r"'lighteval/MATH'.*reward\.custom_function.*module:function"):
        default_compute_score("lighteval/MATH", "1", "1")


# ---------------------------------------------------------------------------------------------------- custom functions
CUSTOM_SOURCE = textwrap.dedent(
    """
    LIMIT = 3

    def length_reward(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(len(solution_str) <= LIMIT), "length": float(len(solution_str))}

    def two_args(data_source, solution_str):
        return 0.0
    """
)


def test_load_reward_function_from_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(CUSTOM_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_function("my_rewards_mod:length_reward")
    assert fn("x", "abc", "", {}) == {"score": 1.0, "length": 3.0}
    assert fn("x", "abcd", "", {})["score"] == 0.0
    with pytest.raises(AttributeError, match=r"no attribute 'length_rewrd'; did you mean length_reward"):
        load_reward_function("my_rewards_mod:length_rewrd")
    with pytest.raises(TypeError, match="'LIMIT' is a int, not a callable"):
        load_reward_function("my_rewards_mod:LIMIT")
    with pytest.raises(TypeError, match=r"cannot be called as \(data_source, solution_str, ground_truth, extra_info\)"):
        load_reward_function("my_rewards_mod:two_args")
    with pytest.raises(ImportError, match="module 'no_such_reward_module' is not importable"):
        load_reward_function("no_such_reward_module:f")


def test_load_reward_function_from_file(tmp_path, monkeypatch):
    folder = tmp_path / "rewards"
    folder.mkdir()
    path = folder / "scores.py"
    path.write_text(CUSTOM_SOURCE)
    fn = load_reward_function(f"{path}:length_reward")
    assert fn("x", "ab", "", None) == {"score": 1.0, "length": 2.0}
    monkeypatch.chdir(tmp_path)
    assert load_reward_function("rewards/scores.py:length_reward")("x", "abcdef", "", None)["score"] == 0.0
    with pytest.raises(FileNotFoundError, match=r"missing\.py not found"):
        load_reward_function("rewards/missing.py:length_reward")
    broken = folder / "broken.py"
    broken.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ImportError, match="broken.py raised ModuleNotFoundError"):
        load_reward_function(f"{broken}:f")
    with pytest.raises(ValueError, match="'module:name' or 'path.py:name'"):
        load_reward_function("just_a_module")


# ---------------------------------------------------------------------------------------------------- RewardManager
def _response_batch(tokenizer, texts, sources, truths, extra_infos=None, width=None):
    """Encode each text + eos, right-pad with the pad id, as rollout would hand them over."""
    encoded = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] if t else [] for t in texts]
    width = width or max(len(e) for e in encoded)
    responses = torch.full((len(texts), width), tokenizer.pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(texts), width), dtype=torch.int64)
    for b, ids in enumerate(encoded):
        responses[b, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        mask[b, : len(ids)] = 1
    non_tensors = {
        "data_source": sources,
        "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
    }
    if extra_infos is not None:
        non_tensors["extra_info"] = extra_infos
    batch = DataProto.from_dict({"responses": responses, "response_mask": mask}, non_tensors)
    return batch, [len(e) for e in encoded]


def test_reward_manager_default_scores(tiny_tokenizer, rg_rows):
    row = rg_rows[0]
    truth = row["reward_model"]["ground_truth"]
    texts = ["Step by step... #### 42", "#### 41", f"The answer is {truth}", ""]
    sources = ["openai/gsm8k", "openai/gsm8k", row["data_source"], "openai/gsm8k"]
    truths = ["42", "42", truth, "42"]
    batch, lengths = _response_batch(tiny_tokenizer, texts, sources, truths, [{}, {}, row["extra_info"], {}], width=40)
    scores, extra = RewardManager(tiny_tokenizer)(batch)
    assert scores.dtype == torch.float32 and scores.shape == (4, 40)
    expected = [1.0, 0.0, 1.0, 0.0]
    for b, n in enumerate(lengths):
        position = n - 1 if n else 0  # the eos token is the last response token; empty -> position 0
        assert scores[b, position].item() == expected[b]
        others = torch.cat([scores[b, :position], scores[b, position + 1 :]])
        assert torch.count_nonzero(others) == 0
    assert set(extra) == {"score", "acc"}
    np.testing.assert_array_equal(extra["score"], expected)
    np.testing.assert_array_equal(extra["acc"], expected)


def test_reward_manager_custom_function_extras_and_decoding(tiny_tokenizer):
    seen = []

    def score_fn(data_source, solution_str, ground_truth, extra_info):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return {"score": float(solution_str == ground_truth), "length": float(len(solution_str))}

    texts = ["hello world", "7", "12 + 3 = 15"]
    batch, lengths = _response_batch(tiny_tokenizer, texts, ["s"] * 3, ["7", "7", "15"])
    scores, extra = RewardManager(tiny_tokenizer, score_fn)(batch)
    # decoded without the eos / padding, no extra_info column -> None
    assert seen == [("s", t, g, None) for t, g in zip(texts, ["7", "7", "15"], strict=True)]
    assert scores[1, lengths[1] - 1].item() == 1.0 and scores.sum().item() == 1.0
    np.testing.assert_array_equal(extra["length"], [11.0, 1.0, 11.0])
    np.testing.assert_array_equal(extra["score"], [0.0, 1.0, 0.0])


def test_reward_manager_plain_float_function(tiny_tokenizer):
    batch, lengths = _response_batch(tiny_tokenizer, ["a", "abc"], ["s", "s"], ["", ""])
    scores, extra = RewardManager(tiny_tokenizer, lambda d, s, g, e: len(s) / 2)(batch)
    assert extra == {}
    assert scores[0, lengths[0] - 1].item() == 0.5 and scores[1, lengths[1] - 1].item() == 1.5
    assert scores.sum().item() == 2.0


def test_reward_manager_errors(tiny_tokenizer):
    batch, _ = _response_batch(tiny_tokenizer, ["a", "b"], ["s", "s"], ["", ""])

    def returns_text(data_source, solution_str, ground_truth, extra_info):
        return "good"

    with pytest.raises(TypeError, match=r"returns_text returned str 'good'"):
        RewardManager(tiny_tokenizer, returns_text)(batch)

    def ragged(data_source, solution_str, ground_truth, extra_info):
        return {"score": 1.0, "bonus": 1.0} if solution_str == "a" else {"score": 0.0}

    with pytest.raises(KeyError, match=r"'bonus' is missing in 1 of 2 samples \(first: sample 1"):
        RewardManager(tiny_tokenizer, ragged)(batch)

    def no_score(data_source, solution_str, ground_truth, extra_info):
        return {"acc": 1.0}

    with pytest.raises(TypeError, match="without 'score'"):
        RewardManager(tiny_tokenizer, no_score)(batch)

    with pytest.raises(KeyError, match="'response_mask'"):
        RewardManager(tiny_tokenizer)(DataProto.from_dict({"responses": batch.batch["responses"]}, {}))
    without_truth = DataProto.from_dict(dict(batch.batch.items()), {"data_source": ["s", "s"]})
    with pytest.raises(KeyError, match="'reward_model'"):
        RewardManager(tiny_tokenizer)(without_truth)
    with pytest.raises(
        ScoreFunctionError, match="failed on 2 of 2 samples.*ValueError: no built-in reward for data_source 's'"
    ):
        RewardManager(tiny_tokenizer)(batch)


def test_a_nan_score_stops_the_reward_stage(tiny_tokenizer, tmp_path):
    """A custom reward function returning NaN: NonFiniteError naming the stage, the metric, the function as
    configured, how many samples and the first one (its data_source and response)."""
    reward_file = tmp_path / "half_nan.py"
    reward_file.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float('nan') if '7' in solution_str else 1.0\n"
    )
    spec = f"{reward_file}:score"
    batch, _ = _response_batch(tiny_tokenizer, ["hello", "x = 7", "77"], ["a", "b", "c"], ["", "", ""])
    with pytest.raises(NonFiniteError) as err:
        RewardManager(tiny_tokenizer, load_reward_function(spec), name=spec)(batch)
    assert str(err.value).startswith(
        f"reward: token_level_scores: the score function {spec} returned nan for 2 of 3 samples; "
        "the first is sample 1 (data_source b, response 'x = 7')"
    )
    assert "hf resume" in str(err.value)
    raising = tmp_path / "raising.py"
    raising.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float(data_source) if solution_str == 'x = 7' else 1.0\n"
    )
    spec = f"{raising}:score"
    out = RewardManager(tiny_tokenizer, load_reward_function(spec), name=spec).scored(batch)
    # 1 of 3 failed, within reward.max_failed_fraction (0.5): it scores 0.0 and keeps its error, the others score
    assert out.errors == ["", "ValueError: could not convert string to float: 'b'", ""]
    assert out.scores.sum(-1).tolist() == [1.0, 0.0, 1.0]
    strict = RewardManager(tiny_tokenizer, load_reward_function(spec), name=spec, max_failed_fraction=0)
    with pytest.raises(ScoreFunctionError) as err:
        strict(batch)
    assert str(err.value).startswith(  # the function, the count, the first failed sample and its error, in one line
        f"reward: the score function {spec} failed on 1 of 3 samples, more than reward.max_failed_fraction=0 of "
        "the batch (1 left unscored once that was clear); the first is sample 1 (data_source b, ground_truth '', "
        "response 'x = 7'): ValueError: could not convert string to float: 'b'; fix the function"
    )
    infinite = RewardManager(tiny_tokenizer, lambda d, s, g, e: {"score": float("inf")})
    with pytest.raises(NonFiniteError, match=r"returned inf for 3 of 3 samples; the first is sample 0 \(data_source a"):
        infinite(batch)


# ---------------------------------------------------------------------------------------------------- failures
SCORE_FILE = """
import os
import pathlib
import time


def score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "loop":  # hangs: an endless loop on a core, as a buggy verifier would
        pathlib.Path(os.environ["HUNG_PID_FILE"]).write_text(str(os.getpid()))
        while True:
            pass
    if solution_str == "boom":
        raise ValueError("no answer in " + solution_str)
    if solution_str == "exit":  # the process dies mid-call
        os._exit(3)
    if solution_str.startswith("slow"):
        time.sleep(1.0)
    if solution_str == "pid":  # which process scored it (slow enough that every process takes a share)
        time.sleep(0.3)
        return {"score": float(os.getpid()), "length": 3.0}
    return {"score": float(solution_str == ground_truth), "length": float(len(solution_str))}
"""


@pytest.fixture
def score_spec(tmp_path, monkeypatch):
    """``path.py:score`` of `SCORE_FILE`; the scoring processes inherit ``HUNG_PID_FILE``."""
    path = tmp_path / "scores.py"
    path.write_text(SCORE_FILE)
    monkeypatch.setenv("HUNG_PID_FILE", str(tmp_path / "hung.pid"))
    return f"{path}:score"


def _spinning_children(seconds=0.5):
    """This process's descendants that used more than half a core over `seconds`."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        child.cpu_percent(None)
    time.sleep(seconds)
    busy = []
    for child in children:
        try:
            if child.cpu_percent(None) > 50:
                busy.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return busy


def _within(seconds, manager, batch):
    """``manager.scored(batch)``, failing the test (its processes killed) if it has not returned in `seconds`: a
    broken time limit fails here instead of hanging the suite."""
    result = []
    worker = threading.Thread(target=lambda: result.append(manager.scored(batch)), daemon=True)
    worker.start()
    worker.join(seconds)
    if not result:
        manager.close()
        pytest.fail(f"the batch did not return within {seconds} s")
    return result[0]


def test_a_hung_sample_is_stopped_and_the_batch_goes_on(tiny_tokenizer, score_spec, tmp_path):
    """A score function that loops forever on one sample: the batch returns soon after reward.timeout_s, that
    sample scores 0.0 with its error, the others are right, and the process that hung is gone (killed, replaced).
    Again on the next batch, when the calls go in chunks (the function measured cheap)."""
    import psutil

    texts, truths = ["7", "loop", "8", "x", "7", "8", "9", "y"], ["7", "7", "8", "9", "1", "8", "9", "y"]
    batch, lengths = _response_batch(tiny_tokenizer, texts, ["s"] * 8, truths)
    manager = RewardManager(tiny_tokenizer, spec=score_spec, timeout_s=2, num_workers=2)
    try:
        for attempt in range(2):
            if attempt == 1:  # measured cheap: chunks of 2, each allowed 1 s, then the hung one's alone 2 s
                assert manager._processes._chunking(len(texts)) == (2, 1.0)
            started = time.perf_counter()
            out = _within(30, manager, batch)
            elapsed = time.perf_counter() - started
            assert elapsed < 2 + (3 if attempt == 0 else 4), elapsed  # (the first includes the processes' start)
            assert out.errors == ["", "timeout after 2 s"] + [""] * 6
            assert out.timed_out.tolist() == [False, True] + [False] * 6
            expected = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
            assert [out.scores[b, n - 1].item() for b, n in enumerate(lengths)] == expected
            np.testing.assert_array_equal(out.extra["score"], expected)
            np.testing.assert_array_equal(out.extra["length"], [1, 0, 1, 1, 1, 1, 1, 1])  # a failed sample: 0.0
            hung = int((tmp_path / "hung.pid").read_text())
            assert not psutil.pid_exists(hung)  # killed (and reaped) before the batch returned
            assert _spinning_children() == []
    finally:
        manager.close()


def test_a_raising_sample_is_recorded_and_the_batch_goes_on(tiny_tokenizer, score_spec, caplog):
    """A sample whose call raises, or whose process dies mid-call: recorded for it; the others score."""
    texts, truths = ["7", "boom", "8", "exit"], ["7", "7", "8", "9"]
    batch, lengths = _response_batch(tiny_tokenizer, texts, ["s"] * 4, truths)
    manager = RewardManager(tiny_tokenizer, spec=score_spec, timeout_s=5, num_workers=2)
    try:
        with caplog.at_level("WARNING", logger="hybridflow.engine.reward.rewards"):
            out = manager.scored(batch)
        again = manager.scored(batch)  # the dead process was replaced
    finally:
        manager.close()
    died = "the scoring process died (exit code 3) during the call"
    assert out.errors == ["", "ValueError: no answer in boom", "", died] and not out.timed_out.any()
    assert [out.scores[b, n - 1].item() for b, n in enumerate(lengths)] == [1.0, 0.0, 1.0, 0.0]
    assert again.errors == out.errors and torch.equal(again.scores, out.scores)
    assert f"the score function {score_spec} failed on 2 of 4 samples" in caplog.text
    # a plain callable, in this process: the same record
    batch, _ = _response_batch(tiny_tokenizer, texts[:3], ["s"] * 3, truths[:3])
    in_process = RewardManager(tiny_tokenizer, load_reward_function(score_spec)).scored(batch)
    assert in_process.errors == out.errors[:3] and in_process.scores.sum(-1).tolist() == [1.0, 0.0, 1.0]


def test_a_batch_is_scored_when_every_scoring_process_is_killed_as_it_starts(tiny_tokenizer, score_spec):
    """Every scoring process killed from outside (a job's processes signalled, the OOM killer) just before a
    batch: pebble fails every task of that pool at once ("All workers expired"), which no sample caused; the
    batch goes to a new pool and every sample scores, none blamed on the function."""
    import signal

    pids_batch, _ = _response_batch(tiny_tokenizer, ["pid"] * 4, ["s"] * 4, ["7"] * 4)
    batch, lengths = _response_batch(tiny_tokenizer, ["7", "8", "x", "7"], ["s"] * 4, ["7", "8", "9", "7"])
    manager = RewardManager(tiny_tokenizer, spec=score_spec, timeout_s=10, num_workers=2)
    try:
        for _attempt in range(3):
            scores, _ = manager(pids_batch)
            pids = {int(p) for p in scores.sum(-1).tolist()}
            assert len(pids) == 2, pids  # both processes scored
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            out = manager.scored(batch)
            assert out.errors == [""] * 4
            assert [out.scores[b, n - 1].item() for b, n in enumerate(lengths)] == [1.0, 1.0, 0.0, 1.0]
    finally:
        manager.close()


def test_most_samples_failing_stops_the_run_naming_the_cause(tiny_tokenizer, score_spec):
    batch, _ = _response_batch(tiny_tokenizer, ["boom", "boom", "7", "boom"], ["s"] * 4, ["7"] * 4)
    manager = RewardManager(tiny_tokenizer, spec=score_spec, timeout_s=5, num_workers=2)
    try:
        with pytest.raises(ScoreFunctionError) as err:
            manager(batch)
    finally:
        manager.close()
    said = str(err.value)
    assert said.startswith(
        f"reward: the score function {score_spec} failed on 3 of 4 samples, more than reward.max_failed_fraction=0.5 "
        "of the batch; the first is sample 0 (data_source s, ground_truth '7', response 'boom'): ValueError: no "
        "answer in boom; fix the function (raise reward.timeout_s=5 if it is only slow, or raise "
        "reward.max_failed_fraction to go on past failures)"
    ), said
    assert "hf resume" in said


def test_samples_are_scored_at_once_in_processes(tiny_tokenizer, score_spec):
    """reward.num_workers=2 and 1 s per sample: 4 samples in about 2 s, not 4."""
    manager = RewardManager(tiny_tokenizer, spec=score_spec, timeout_s=10, num_workers=2)
    try:
        warm, _ = _response_batch(tiny_tokenizer, ["7", "8"], ["s"] * 2, ["7", "8"])
        manager(warm)  # the processes started
        batch, _ = _response_batch(tiny_tokenizer, ["slow a", "slow b", "slow c", "slow d"], ["s"] * 4, ["slow a"] * 4)
        started = time.perf_counter()
        scores, extra = manager(batch)
        elapsed = time.perf_counter() - started
    finally:
        manager.close()
    assert 1.9 < elapsed < 3.0, elapsed
    np.testing.assert_array_equal(extra["score"], [1.0, 0.0, 0.0, 0.0])


def test_a_plain_callable_past_the_timeout_is_abandoned(tiny_tokenizer):
    """In this process (no spec) a call cannot be stopped: past timeout_s it is recorded and abandoned."""
    release = threading.Event()

    def waits(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "loop":
            release.wait(60)
        return float(solution_str == ground_truth)

    batch, _ = _response_batch(tiny_tokenizer, ["7", "loop", "8"], ["s"] * 3, ["7", "7", "8"])
    started = time.perf_counter()
    try:
        out = RewardManager(tiny_tokenizer, waits, timeout_s=1).scored(batch)
    finally:
        release.set()
    assert time.perf_counter() - started < 3
    assert out.errors == ["", "timeout after 1 s", ""] and out.scores.sum(-1).tolist() == [1.0, 0.0, 1.0]


def test_a_failed_sample_reaches_the_run_store_and_hf_runs_samples(tiny_tokenizer, tiny_model_dir, tmp_path):
    """The worker's reward stage (reward.custom_function, its scoring processes) on real rows: the failed rows'
    errors as ``reward_error``, ``reward_extra/failed`` and ``/timed_out``; kept with the samples in the run store
    and printed by ``hf runs samples``."""
    import subprocess

    from tiny_runs import tiny_run_config

    from hybridflow.engine.generations import decode_generations
    from hybridflow.engine.worker import RLHFWorker
    from hybridflow.flows.reporting import _with_reward_errors
    from hybridflow.flows.store.run_store import RunStore

    (tmp_path / "scores.py").write_text(SCORE_FILE)
    extra = [f"reward.custom_function={tmp_path / 'scores.py'}:score", "reward.timeout_s=2"]
    cfg = tiny_run_config(tmp_path, tiny_model_dir, "grpo", extra)
    worker = RLHFWorker(0, 1, str(tmp_path), cfg.model_dump(mode="json"), ["reward"])
    worker.init_model()
    rows, _ = _response_batch(tiny_tokenizer, ["7", "boom", "8", "x"], ["s"] * 4, ["7", "7", "8", "9"])
    prompts = torch.tensor([tiny_tokenizer.encode("1+1=", add_special_tokens=False)] * 4)
    rows.batch["prompts"] = prompts
    rows.batch["attention_mask"] = torch.cat([torch.ones_like(prompts), rows.batch["response_mask"]], dim=1)
    try:
        scored = worker.compute_reward(rows)
    finally:
        worker.reward_fn.close()
    assert list(scored.non_tensor_batch["reward_error"]) == ["", "ValueError: no answer in boom", "", ""]
    assert scored.batch["reward_extra/failed"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert scored.batch["reward_extra/timed_out"].tolist() == [0.0] * 4
    rows = rows.union(scored)
    samples = _with_reward_errors(decode_generations(rows, tiny_tokenizer, 1), rows)
    assert samples[1]["reward_error"] == "ValueError: no answer in boom" and "reward_error" not in samples[0]
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    with RunStore(db) as store:
        run_id = store.create_run({}, "exp")
        store.record_samples(run_id, 1, "train", samples)
        kept = store.samples(run_id)
    assert [s.reward_error for s in kept] == [None, "ValueError: no answer in boom", None, None]
    assert all(s.judge_text is None for s in kept)
    hf = Path(sys.executable).parent / "hf"
    shown = subprocess.run([hf, "runs", "samples", run_id, "--db", db], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("reward error") == 1 and "ValueError: no answer in boom (scored 0.0)" in shown.stdout
    as_json = subprocess.run(
        [hf, "runs", "samples", run_id, "--db", db, "--json"], capture_output=True, text=True, timeout=120
    )
    printed = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [p["reward_error"] for p in printed] == [None, "ValueError: no answer in boom", None, None]
    assert all(p["judge_text"] is None for p in printed)
