"""Prompt files, reasoning-gym rows, tokenization/filtering, collation and the resumable sampler."""

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.engine.data import PromptDataset, PromptSampler, collate_prompts, load_rows, reasoning_gym_rows

ADD_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}


def _row(i: int, question: str | None = None) -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question or f"What is {i} + {i}?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"split": "train", "index": i},
    }


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------- load_rows
def test_parquet_round_trip(tmp_path):
    rows = [_row(i) for i in range(5)]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_rows(path) == rows


def test_jsonl_round_trip_and_defaults(tmp_path):
    rows = [_row(i) for i in range(3)]
    bare = {k: v for k, v in _row(3).items() if k not in ("ability", "extra_info")}
    path = _write_jsonl(tmp_path / "train.jsonl", [*rows, bare])
    loaded = load_rows(path)
    assert loaded[:3] == rows
    assert loaded[3]["ability"] == "" and loaded[3]["extra_info"] == {}
    assert loaded[3]["reward_model"]["ground_truth"] == "6"


def test_json_extension_reads_json_lines_and_plain_string_prompt(tmp_path):
    row = {**_row(1), "prompt": "What is 1 + 1?"}
    loaded = load_rows(_write_jsonl(tmp_path / "train.json", [row]))
    assert loaded[0]["prompt"] == [{"role": "user", "content": "What is 1 + 1?"}]


@pytest.mark.parametrize("column", ["prompt", "data_source", "reward_model"])
def test_missing_column_parquet_names_column_file_and_found(tmp_path, column):
    rows = [{k: v for k, v in _row(i).items() if k != column} for i in range(2)]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError) as info:
        load_rows(path)
    message = str(info.value)
    assert repr(column) in message and str(path) in message and "'ability'" in message


def test_missing_column_jsonl_and_in_some_rows(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{k: v for k, v in _row(0).items() if k != "prompt"}])
    with pytest.raises(ValueError, match=r"no column 'prompt'.*columns found"):
        load_rows(path)
    partial = _write_jsonl(tmp_path / "partial.jsonl", [_row(0), {k: v for k, v in _row(1).items() if k != "prompt"}])
    with pytest.raises(ValueError, match=r"1 of 2 rows have no 'prompt' \(first: row 1\)"):
        load_rows(partial)


def test_ground_truth_missing_and_bad_prompt(tmp_path):
    path = _write_jsonl(tmp_path / "gt.jsonl", [{**_row(0), "reward_model": {"style": "rule"}}])
    with pytest.raises(ValueError, match=r"row 0: column 'reward_model' must be a dict with key 'ground_truth'"):
        load_rows(path)
    path = _write_jsonl(tmp_path / "msg.jsonl", [{**_row(0), "prompt": [{"text": "hi"}]}])
    with pytest.raises(ValueError, match=r"needs 'role' and 'content'"):
        load_rows(path)


def test_unknown_extension_and_bad_lines(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"\.parquet, \.jsonl, \.json"):
        load_rows(path)
    with pytest.raises(FileNotFoundError, match="data.train_files"):
        load_rows(tmp_path / "absent.jsonl")
    bad = tmp_path / "broken.jsonl"
    bad.write_text(json.dumps(_row(0)) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl, line 2"):
        load_rows(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load_rows(empty)


# ---------------------------------------------------------------------------------------------------- reasoning-gym
def test_reasoning_gym_rows_layout():
    rows = reasoning_gym_rows("basic_arithmetic", size=8, seed=3, config=ADD_CONFIG)
    assert len(rows) == 8
    for i, row in enumerate(rows):
        assert row["data_source"] == "reasoning_gym/basic_arithmetic"
        assert row["ability"] == "reasoning_gym"
        (message,) = row["prompt"]
        assert message["role"] == "user"
        assert message["content"].endswith("\nGive only the final answer.")
        entry = row["extra_info"]["entry"]
        assert row["extra_info"]["index"] == i
        assert row["reward_model"] == {"style": "rule", "ground_truth": entry["answer"]}
        assert message["content"].startswith(entry["question"])
        # one-digit additions: the answer is the evaluated expression
        assert int(entry["answer"]) == eval(entry["metadata"]["expression"], {"__builtins__": {}})
        # JSON-safe: tuples became lists, and the row survives a JSON round trip unchanged
        assert entry["metadata"]["difficulty"]["num_terms"] == [2, 2]
        assert json.loads(json.dumps(row)) == row
    assert rows == reasoning_gym_rows("basic_arithmetic", size=8, seed=3, config=ADD_CONFIG)
    assert rows != reasoning_gym_rows("basic_arithmetic", size=8, seed=4, config=ADD_CONFIG)
    custom = reasoning_gym_rows("basic_arithmetic", size=1, seed=3, config=ADD_CONFIG, instruction="")
    assert custom[0]["prompt"][0]["content"] == rows[0]["extra_info"]["entry"]["question"]


def test_reasoning_gym_rows_parquet_round_trip(tmp_path):
    rows = reasoning_gym_rows("basic_arithmetic", size=4, seed=0, config=ADD_CONFIG)
    path = tmp_path / "rg.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_rows(path) == rows


READ_ROWS = """
import json, sys
from hybridflow.engine.data import reasoning_gym_rows
from hybridflow.engine.reward.rewards import check_builtin_source
rows = reasoning_gym_rows("basic_arithmetic", 6, seed=3, config={"max_terms": 2})
check_builtin_source("reasoning_gym/basic_arithmetic")
print(json.dumps({"rows": rows, "imported": "reasoning_gym" in sys.modules}))
"""


def test_generated_rows_are_kept_and_a_later_run_reads_them_without_importing_reasoning_gym(tmp_path):
    """reasoning-gym's import (1.3-2.5 s: it imports matplotlib) is paid by the first process that builds a data
    configuration's rows; the next ones read the same rows from $HYBRIDFLOW_HOME/datasets, and check a generator's
    name against the kept list. Another seed or option is generated anew."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HYBRIDFLOW_HOME": str(tmp_path)}

    def build() -> dict:
        done = subprocess.run([sys.executable, "-c", READ_ROWS], capture_output=True, text=True, env=env, check=True)
        return json.loads(done.stdout)

    first, second = build(), build()
    assert first["imported"] and not second["imported"]
    assert second["rows"] == first["rows"] == reasoning_gym_rows("basic_arithmetic", 6, seed=3, config={"max_terms": 2})
    assert len(list((tmp_path / "datasets" / "reasoning_gym").glob("*.json"))) == 2  # the rows, the names
    other = reasoning_gym_rows("basic_arithmetic", 6, seed=4, config={"max_terms": 2})
    assert [r["prompt"] for r in other] != [r["prompt"] for r in first["rows"]]


def test_reasoning_gym_errors():
    with pytest.raises(ValueError, match=r"data\.reasoning_gym\.name.*did you mean basic_arithmetic"):
        reasoning_gym_rows("basic_arithmetc", size=2, seed=0)
    with pytest.raises(ValueError, match=r"no option 'max_term'.*data\.reasoning_gym\.config\.max_term.*max_terms"):
        reasoning_gym_rows("basic_arithmetic", size=2, seed=0, config={"max_term": 2})
    with pytest.raises(ValueError, match=r"invalid data\.reasoning_gym\.config.*max_terms must be >= min_terms"):
        reasoning_gym_rows("basic_arithmetic", size=2, seed=0, config={"min_terms": 5, "max_terms": 2})
    with pytest.raises(ValueError, match=r"set data\.reasoning_gym\.seed instead"):
        reasoning_gym_rows("basic_arithmetic", size=2, seed=0, config={"seed": 1})
    with pytest.raises(ValueError, match=r"set data\.reasoning_gym\.train_size / val_size instead"):
        reasoning_gym_rows("basic_arithmetic", size=2, seed=0, config={"size": 3})
    with pytest.raises(ValueError, match=r"data\.reasoning_gym\.train_size \+ val_size must be"):
        reasoning_gym_rows("basic_arithmetic", size=0, seed=0)


# ---------------------------------------------------------------------------------------------------- dataset
def test_prompt_dataset_tokenizes_with_template_once(tiny_tokenizer):
    rows = [_row(i) for i in range(3)]
    ds = PromptDataset(rows, tiny_tokenizer, max_prompt_length=512)
    assert len(ds) == 3 and ds.num_filtered == 0
    item = ds[1]
    text = "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert item["input_ids"] == tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(item["input_ids"]) == text
    start = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert item["input_ids"][0] == start and item["input_ids"].count(start) == 2
    assert tiny_tokenizer.bos_token_id not in item["input_ids"]
    assert item["index"] == 1 and item["reward_model"] == rows[1]["reward_model"]
    plain = PromptDataset(rows, tiny_tokenizer, max_prompt_length=512, apply_chat_template=False)
    assert tiny_tokenizer.decode(plain[1]["input_ids"]) == "What is 1 + 1?"


def test_prompt_dataset_filters_long_prompts(tiny_tokenizer, caplog):
    rows = [_row(i) for i in range(4)] + [_row(9, "word " * 200), _row(8, "long " * 300)]
    with caplog.at_level(logging.WARNING, logger="hybridflow.engine.data"):
        ds = PromptDataset(rows, tiny_tokenizer, max_prompt_length=64)
    assert ds.num_filtered == 2 and len(ds) == 4
    assert [r["reward_model"]["ground_truth"] for r in ds.rows] == ["0", "2", "4", "6"]
    assert all(len(ids) <= 64 for ids in ds.input_ids)
    assert "dropped 2 of 6" in caplog.text and "data.max_prompt_length" in caplog.text
    with pytest.raises(ValueError, match=r"all 2 prompts are longer than data\.max_prompt_length=4"):
        PromptDataset(rows[:2], tiny_tokenizer, max_prompt_length=4)


# ---------------------------------------------------------------------------------------------------- collate
def test_collate_left_pads(tiny_tokenizer):
    rows = [_row(1), _row(2, "A much longer question, with many more words in it than the others?"), _row(3, "Hi")]
    ds = PromptDataset(rows, tiny_tokenizer, max_prompt_length=512)
    items = [ds[i] for i in range(3)]
    batch = collate_prompts(items, tiny_tokenizer)
    lengths = [len(it["input_ids"]) for it in items]
    width = max(lengths)
    assert len(set(lengths)) == 3
    pad = tiny_tokenizer.pad_token_id
    ids, mask, pos = batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"]
    assert ids.shape == mask.shape == pos.shape == (3, width)
    assert ids.dtype == mask.dtype == pos.dtype == torch.int64
    for b, item in enumerate(items):
        n = len(item["input_ids"])
        for t in range(width):
            real = t >= width - n
            assert ids[b, t].item() == (item["input_ids"][t - (width - n)] if real else pad)
            assert mask[b, t].item() == int(real)
            assert pos[b, t].item() == (t - (width - n) if real else 0)
    assert list(batch.non_tensor_batch["index"]) == [0, 1, 2]
    assert batch.non_tensor_batch["raw_prompt"][1] == rows[1]["prompt"]
    assert batch.non_tensor_batch["reward_model"][2] == {"style": "rule", "ground_truth": "6"}
    columns = {"data_source", "reward_model", "extra_info", "ability", "raw_prompt", "index"}
    assert set(batch.non_tensor_batch) == columns  # no uid: the sampler (or the rollout) adds it
    assert all(v.dtype == object and len(v) == 3 for v in batch.non_tensor_batch.values())


# ---------------------------------------------------------------------------------------------------- sampler
N_ROWS = 11


@pytest.fixture(scope="module")
def dataset(tiny_tokenizer):
    return PromptDataset([_row(i) for i in range(N_ROWS)], tiny_tokenizer, max_prompt_length=512)


def _indices(batch):
    return [int(i) for i in batch.non_tensor_batch["index"]]


def _uids(batch):
    return list(batch.non_tensor_batch["uid"])


def test_sampler_epoch_order_and_dropped_tail(dataset):
    sampler = PromptSampler(dataset, batch_size=4, seed=7)
    assert sampler.batches_per_epoch == 2
    batches = [sampler.next_batch() for _ in range(5)]
    order0 = np.random.default_rng([7, 0]).permutation(N_ROWS)
    order1 = np.random.default_rng([7, 1]).permutation(N_ROWS)
    order2 = np.random.default_rng([7, 2]).permutation(N_ROWS)
    assert (
        [_indices(b) for b in batches]
        == [
            list(order0[0:4]),
            list(order0[4:8]),
            list(order1[0:4]),  # 3 rows left in epoch 0: dropped, epoch 1 starts
            list(order1[4:8]),
            list(order2[0:4]),
        ]
    )
    assert [b.meta_info for b in batches] == [
        {"epoch": 0, "cursor": 0},
        {"epoch": 0, "cursor": 4},
        {"epoch": 1, "cursor": 0},
        {"epoch": 1, "cursor": 4},
        {"epoch": 2, "cursor": 0},
    ]
    # each row's uid is "<epoch>-<position in the epoch's order>": unique across batches and epochs
    uids = [list(b.non_tensor_batch["uid"]) for b in batches]
    assert uids[1] == ["0-4", "0-5", "0-6", "0-7"] and uids[2] == ["1-0", "1-1", "1-2", "1-3"]
    assert len({u for batch_uids in uids for u in batch_uids}) == 5 * 4
    assert all(b.non_tensor_batch["uid"].dtype == object for b in batches)
    # the batch's input_ids are the dataset's token ids of those rows
    first = batches[0]
    for b, j in enumerate(_indices(first)):
        n = len(dataset[j]["input_ids"])
        assert first.batch["input_ids"][b, -n:].tolist() == dataset[j]["input_ids"]
    assert sampler.state_dict() == {"epoch": 2, "index": 4, "seed": 7}


def test_sampler_no_shuffle_and_errors(dataset):
    sampler = PromptSampler(dataset, batch_size=5, seed=0, shuffle=False)
    assert [_indices(sampler.next_batch()) for _ in range(3)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match=r"data\.train_batch_size=12 is larger than the dataset \(11"):
        PromptSampler(dataset, batch_size=12, seed=0)
    with pytest.raises(KeyError, match="seed"):
        sampler.load_state_dict({"epoch": 0, "index": 0})
    with pytest.raises(ValueError, match="does not fit"):
        sampler.load_state_dict({"epoch": 0, "index": 99, "seed": 0})


@settings(max_examples=40, deadline=None)
@given(
    batch_size=st.integers(1, N_ROWS),
    seed=st.integers(0, 2**32 - 1),
    stop=st.integers(0, 12),
    shuffle=st.booleans(),
)
def test_sampler_resume_matches_uninterrupted(dataset, batch_size, seed, stop, shuffle):
    total = 14  # more than one epoch for every batch size, so the resume point can sit across an epoch boundary
    reference = PromptSampler(dataset, batch_size, seed, shuffle)
    expected = [(_indices(b), _uids(b), b.meta_info) for b in (reference.next_batch() for _ in range(total))]

    first = PromptSampler(dataset, batch_size, seed, shuffle)
    got = [(_indices(b), _uids(b), b.meta_info) for b in (first.next_batch() for _ in range(stop))]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = PromptSampler(dataset, batch_size, seed=seed + 1, shuffle=shuffle)  # saved seed wins
    resumed.load_state_dict(state)
    got += [(_indices(b), _uids(b), b.meta_info) for b in (resumed.next_batch() for _ in range(total - stop))]
    assert got == expected  # the same prompts with the same uids
    assert len({e["epoch"] for _, _, e in expected}) > 1
    all_uids = [u for _, uids, _ in expected for u in uids]
    assert len(set(all_uids)) == len(all_uids)  # unique over the whole run
