"""Answer extraction, GSM8K and reasoning-gym scores, custom score functions and the RewardManager."""

import json
import textwrap

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
    with pytest.raises(ScoreFunctionError, match="raised ValueError: no built-in reward for data_source 's'"):
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
        "    return float(data_source) if '7' in solution_str else 1.0\n"
    )
    with pytest.raises(ScoreFunctionError) as err:
        RewardManager(tiny_tokenizer, load_reward_function(f"{raising}:score"), name=f"{raising}:score")(batch)
    assert str(err.value).startswith(  # the function, the sample and the original error, in one line
        f"reward: the score function {raising}:score raised ValueError: could not convert string to float: 'b' on "
        "sample 1 of 3 (data_source b, ground_truth '', response 'x = 7')"
    )
    infinite = RewardManager(tiny_tokenizer, lambda d, s, g, e: {"score": float("inf")})
    with pytest.raises(NonFiniteError, match=r"returned inf for 3 of 3 samples; the first is sample 0 \(data_source a"):
        infinite(batch)
