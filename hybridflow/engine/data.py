"""Prompt datasets: read prompt files, build reasoning-gym prompts, tokenize, batch and sample them.

A *row* is one prompt in verl's layout (so files prepared for verl load unchanged)::

    {
        "data_source": "openai/gsm8k",                                   # str, picks the reward function
        "prompt": [{"role": "user", "content": "..."}],                  # chat list
        "ability": "math",                                               # str, informational
        "reward_model": {"style": "rule", "ground_truth": "72"},         # what the reward compares against
        "extra_info": {"index": 0, ...},                                 # anything the reward may need
    }

The pieces, in the order the trainer uses them:

- `load_rows` reads a ``.parquet`` or ``.jsonl`` file (``data.train_files`` / ``data.val_files``);
  `reasoning_gym_rows` generates rows procedurally (``data.reasoning_gym.*``).
- `PromptDataset` tokenizes the prompts once and drops those over ``data.max_prompt_length`` tokens.
- `PromptSampler` walks the dataset in deterministic, resumable epochs and returns `DataProto` batches made by
  `collate_prompts` (left-padded ``input_ids``, ``attention_mask``, ``position_ids`` plus the row's other fields).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridflow.engine.agent.chat_format import render_prompt
from hybridflow.engine.config import DataConfig, HybridFlowConfig
from hybridflow.engine.protocol import DataProto

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("prompt", "data_source", "reward_model")
SUPPORTED_EXTENSIONS = (".parquet", ".jsonl", ".json")
DEFAULT_INSTRUCTION = "Give only the final answer."

_LAYOUT_HINT = (
    "expected verl's prompt layout: data_source (str), prompt (list of {role, content}), ability (str), "
    "reward_model ({style, ground_truth}), extra_info (dict)"
)


# ---------------------------------------------------------------------------------------------------- loading
def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read prompt rows from a ``.parquet`` file or a ``.jsonl`` / ``.json`` file (one JSON object per line).

    Required columns: ``prompt``, ``data_source``, ``reward_model`` (a dict holding ``ground_truth``).
    Optional columns: ``ability`` (default ``""``) and ``extra_info`` (default ``{}``); other columns are kept.
    A ``prompt`` that is a plain string is taken as one user message.

    Args:
        path: the file (as given in ``data.train_files`` or ``data.val_files``).

    Returns:
        One dict per row, in file order, with at least the five layout keys.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: for an unsupported extension (the supported ones are listed), an empty file, a line that is not
            a JSON object (file and line number named), a missing column (the column, the file and the columns
            found are named) or a malformed ``prompt`` / ``reward_model`` value (file, row and column named).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_EXTENSIONS:
        raise ValueError(
            f"cannot read prompt file {path}: unsupported extension {path.suffix!r}; supported: "
            f"{', '.join(SUPPORTED_EXTENSIONS)}. Convert the file or point data.train_files / data.val_files at one."
        )
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist; check data.train_files / data.val_files")

    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        columns = list(table.column_names)
        raw = table.to_pylist()
    else:
        raw, columns = _read_json_lines(path)

    if not raw:
        raise ValueError(f"prompt file {path} has no rows; check data.train_files / data.val_files")
    for column in REQUIRED_COLUMNS:
        if column not in columns:
            raise ValueError(
                f"prompt file {path} has no column {column!r} (columns found: {columns}); {_LAYOUT_HINT}. "
                "Add the column in your preprocessing script."
            )
        lacking = [i for i, row in enumerate(raw) if column not in row]
        if lacking:
            raise ValueError(
                f"prompt file {path}: {len(lacking)} of {len(raw)} rows have no {column!r} (first: row "
                f"{lacking[0]}); every row needs it. {_LAYOUT_HINT}"
            )
    return [_normalise_row(row, path, i) for i, row in enumerate(raw)]


def _read_json_lines(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Parse one JSON object per non-blank line; returns the rows and the union of their keys (first-seen order)."""
    rows: list[dict[str, Any]] = []
    columns: dict[str, None] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}, line {line_no}: not valid JSON ({e.msg}); the file must hold one JSON object per line "
                    "(JSON Lines), not one JSON array"
                ) from e
            if not isinstance(obj, dict):
                raise ValueError(
                    f"{path}, line {line_no}: expected a JSON object (one row), got {type(obj).__name__}; "
                    "the file must hold one JSON object per line"
                )
            rows.append(obj)
            for key in obj:
                columns.setdefault(key, None)
    return rows, list(columns)


def _normalise_row(row: dict[str, Any], path: Path | str, i: int) -> dict[str, Any]:
    """Check one row's types and fill the optional columns."""
    where = f"{path}, row {i}"
    prompt = row["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if not isinstance(prompt, list | tuple) or not prompt:
        raise ValueError(
            f"{where}: column 'prompt' must be a non-empty list of {{role, content}} messages, got {prompt!r}"
        )
    messages = []
    for message in prompt:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: every message in column 'prompt' needs 'role' and 'content', got {message!r}")
        messages.append({"role": str(message["role"]), "content": str(message["content"])})
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError(
            f"{where}: column 'reward_model' must be a dict with key 'ground_truth', got {reward_model!r}; "
            'write e.g. {"style": "rule", "ground_truth": "72"}'
        )
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        raise ValueError(f"{where}: column 'extra_info' must be a dict (or absent), got {type(extra_info).__name__}")
    ability = row.get("ability")
    out = dict(row)
    out.update(
        data_source=str(row["data_source"]),
        prompt=messages,
        ability="" if ability is None else str(ability),
        reward_model=dict(reward_model),
        extra_info=dict(extra_info),
    )
    return out


# ---------------------------------------------------------------------------------------------------- reasoning-gym
def _json_safe(value: Any) -> Any:
    """Copy `value` into plain JSON types: tuples/sets -> lists, numpy -> Python, dict keys -> str, other -> str."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, set | frozenset):
        return [_json_safe(v) for v in sorted(value, key=repr)]
    if isinstance(value, np.ndarray):
        return _json_safe(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)


def reasoning_gym_names() -> list[str]:
    """All generator names that reasoning-gym registers (sorted), e.g. ``basic_arithmetic``, ``chain_sum``; kept
    beside the generated rows (`_generated_cache_path`), so that checking a name does not import reasoning-gym."""
    cache = _generated_cache_path("reasoning_gym", ["generator names"])
    if cache is not None and cache.is_file():
        return json.loads(cache.read_text())
    from reasoning_gym.factory import DATASETS

    names = sorted(DATASETS)
    if cache is not None:
        _write_atomically(cache, json.dumps(names))
    return names


def check_reasoning_gym_name(name: str, config_key: str = "data.reasoning_gym.name") -> None:
    """Raise ValueError if `name` is not a reasoning-gym generator; the message lists the closest valid names."""
    names = reasoning_gym_names()
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"valid names: {', '.join(names)}"
    raise ValueError(f"unknown reasoning-gym generator {name!r} ({config_key}); {hint}")


def reasoning_gym_rows(
    name: str,
    size: int,
    seed: int,
    config: dict[str, Any] | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
) -> list[dict[str, Any]]:
    """Generate `size` prompt rows with the reasoning-gym generator `name` (no download, fully offline).

    Each row: ``data_source`` = ``"reasoning_gym/<name>"``; ``prompt`` = one user message, the question followed
    by `instruction` on a new line (pass ``""`` for the bare question); ``ability`` = ``"reasoning_gym"``;
    ``reward_model`` = ``{"style": "rule", "ground_truth": str(entry["answer"])}`` (None kept for the
    open-ended generators whose scorer verifies the answer itself); ``extra_info`` =
    ``{"index": i, "entry": entry}`` with the entry copied into JSON types (tuples become lists), so that
    `hybridflow.engine.reward.rewards.reasoning_gym_score` can call the generator's ``score_answer`` later and the
    rows can be written to parquet/JSON.

    The rows are kept as JSON under ``$HYBRIDFLOW_HOME/datasets/reasoning_gym/`` keyed by every argument and
    reasoning-gym's version: a later run with the same data reads them without importing reasoning-gym.

    Args:
        name: generator name (``data.reasoning_gym.name``), e.g. ``"basic_arithmetic"``.
        size: number of rows (``data.reasoning_gym.train_size + val_size``), >= 1.
        seed: generator seed (same name, size, seed and config -> identical rows).
        config: extra generator options (``data.reasoning_gym.config``), e.g. ``{"max_terms": 2}``.
        instruction: text appended to every question.

    Raises:
        ValueError: for an unknown name (closest valid names listed), a size below 1, an option the generator does
            not have (the option and the valid options named) or an invalid option value (the generator's message).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"data.reasoning_gym.train_size + val_size must be an integer >= 1, got {size!r}")
    config = dict(config or {})
    cache = _generated_cache_path("reasoning_gym", [name, size, seed, config, instruction])
    if cache is not None and cache.is_file():
        return json.loads(cache.read_text())
    rows = _generate_reasoning_gym_rows(name, size, seed, config, instruction)
    if cache is not None:
        _write_atomically(cache, json.dumps(rows))
    return rows


def _generated_cache_path(source: str, key: list[Any]) -> Path | None:
    """Where what `source` generated for `key` is kept (``$HYBRIDFLOW_HOME/datasets/<source>/
    <sha256>.json``, the package's version in the key), or None when the package is not installed. Generating them
    imports the generator's package (reasoning-gym: 1.3-2.5 s, matplotlib included) in every process that builds a
    run's prompts; the rows are the same for the same key, so every run after the first reads them instead."""
    from importlib.metadata import PackageNotFoundError, version

    from hybridflow.engine.embedded_models import hybridflow_home

    try:
        key = [*key, version(source.replace("_", "-"))]
    except PackageNotFoundError:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return hybridflow_home() / "datasets" / source / f"{digest}.json"


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename (a reader never sees half of it); a folder that
    cannot be written is no error: the rows are generated again next time."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("prompt rows not cached at %s: %s", path, e)
        tmp.unlink(missing_ok=True)


def _generate_reasoning_gym_rows(
    name: str, size: int, seed: int, config: dict[str, Any], instruction: str
) -> list[dict[str, Any]]:
    """`reasoning_gym_rows` without the cache: the generator's options checked, then `size` rows generated."""
    from reasoning_gym.factory import DATASETS, create_dataset

    check_reasoning_gym_name(name)
    _, config_cls = DATASETS[name]
    try:
        valid = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("size", "seed")]
    except TypeError:  # not a dataclass: let the generator's own error speak
        valid = None
    for key in config:
        if key in ("size", "seed"):
            target = "seed" if key == "seed" else "train_size / val_size"
            raise ValueError(f"data.reasoning_gym.config.{key} is not allowed; set data.reasoning_gym.{target} instead")
        if valid is not None and key not in valid:
            raise ValueError(
                f"reasoning-gym generator {name!r} has no option {key!r} (data.reasoning_gym.config.{key}); "
                f"valid options: {', '.join(valid)}"
            )
    try:
        dataset = create_dataset(name, size=size, seed=seed, **config)
    except TypeError as e:
        raise ValueError(
            f"bad data.reasoning_gym.config for generator {name!r}: {e}; valid options: {', '.join(valid or [])}"
        ) from e
    except (AssertionError, ValueError) as e:
        raise ValueError(f"invalid data.reasoning_gym.config for generator {name!r} ({config}): {e}") from e

    rows = []
    for i in range(size):
        entry = dataset[i]
        question = str(entry["question"])
        answer = None if entry["answer"] is None else str(entry["answer"])  # None: open-ended, scorer verifies
        content = f"{question}\n{instruction}" if instruction else question
        rows.append(
            {
                "data_source": f"reasoning_gym/{name}",
                "prompt": [{"role": "user", "content": content}],
                "ability": "reasoning_gym",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"index": i, "entry": _json_safe(entry)},
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------------- dataset
class PromptDataset:
    """Rows with their prompts tokenized once, over-long prompts dropped.

    Tokenization: with ``apply_chat_template=True`` the prompt goes through
    ``tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)`` and the text is encoded
    with ``add_special_tokens=False`` (the template already writes every marker; encoding with special tokens
    would add a second BOS on tokenizers such as Llama's). With ``apply_chat_template=False`` (base models) the
    messages' contents are joined with newlines and encoded with the tokenizer's default special tokens.

    Attributes:
        rows: the kept rows (dataset order).
        input_ids: their token ids, one ``list[int]`` per row.
        num_filtered: how many rows were dropped for being longer than `max_prompt_length`.

    Raises:
        ValueError: if `rows` is empty, `max_prompt_length` < 1, or every row is longer than `max_prompt_length`
            (the message gives the shortest prompt's length and says to raise ``data.max_prompt_length``).
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        max_prompt_length: int,
        apply_chat_template: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        if not rows:
            raise ValueError("PromptDataset got no rows; check data.train_files / data.val_files")
        if max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        self.tokenizer = tokenizer
        self.max_prompt_length = int(max_prompt_length)
        self.apply_chat_template = apply_chat_template
        self.tools = tools
        self.rows: list[dict[str, Any]] = []
        self.input_ids: list[list[int]] = []
        lengths = []
        for row in rows:
            ids = self._encode(row["prompt"])
            lengths.append(len(ids))
            if len(ids) <= self.max_prompt_length:
                self.rows.append(row)
                self.input_ids.append(ids)
        self.num_filtered = len(rows) - len(self.rows)
        if not self.rows:
            raise ValueError(
                f"all {len(rows)} prompts are longer than data.max_prompt_length={self.max_prompt_length} tokens "
                f"(the shortest has {min(lengths)}); raise data.max_prompt_length"
            )
        if self.num_filtered:
            logger.warning(
                "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens (longest: %d); "
                "raise data.max_prompt_length to keep them",
                self.num_filtered,
                len(rows),
                self.max_prompt_length,
                max(lengths),
            )

    def _encode(self, prompt: list[dict[str, str]]) -> list[int]:
        return encode_prompt(prompt, self.tokenizer, self.apply_chat_template, self.tools)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def longest(self) -> int:
        """Tokens in the longest kept prompt."""
        return max(map(len, self.input_ids))

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Row `i` (a shallow copy) plus ``input_ids`` (``list[int]``, unpadded) and ``index`` (= `i`)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"PromptDataset index {i} out of range for {len(self)} rows")
        i = i % len(self)
        return {**self.rows[i], "input_ids": list(self.input_ids[i]), "index": i}


def encode_prompt(
    prompt: list[dict[str, str]],
    tokenizer: Any,
    apply_chat_template: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """A chat prompt's token ids as the rollout sees them (see `PromptDataset` for the two tokenizations); `tools`
    (OpenAI function schemas, with ``rollout.multi_turn``) are offered in the prompt
    (`hybridflow.engine.agent.chat_format.render_prompt`)."""
    if apply_chat_template:
        text = render_prompt(prompt, tokenizer, tools)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode("\n".join(m["content"] for m in prompt)))


def collate_prompts(items: Sequence[dict[str, Any]], tokenizer: Any, width: int | None = None) -> DataProto:
    """Stack dataset items (from `PromptDataset.__getitem__`) into one left-padded batch, `width` tokens wide (default
    the longest prompt's; a fixed width lets batches of several draws be concatenated).

    Returns:
        DataProto with tensors ``input_ids`` int64 [B, P] (P = `width` or the longest prompt in the batch, pads =
        ``tokenizer.pad_token_id`` on the left), ``attention_mask`` int64 [B, P] (1 on real tokens),
        ``position_ids`` int64 [B, P] (0 on pads, then 0..len-1 on real tokens), and numpy object columns
        (length B) ``data_source``, ``reward_model``, ``extra_info``, ``ability``, ``raw_prompt`` (the chat list)
        and ``index`` (the item's position in the dataset). No ``uid``: `PromptSampler.next_batch` adds it (and
        the rollout makes one for batches without it).

    Raises:
        ValueError: if `items` is empty, an item has no tokens, or the tokenizer has no pad token.
    """
    if not items:
        raise ValueError("collate_prompts needs at least one item")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos token) first")
    longest = max(len(item["input_ids"]) for item in items)
    if width is not None and width < longest:
        raise ValueError(f"collate_prompts: width {width} is below the longest prompt ({longest} tokens)")
    width = width or longest
    batch_size = len(items)
    input_ids = torch.full((batch_size, width), int(pad_id), dtype=torch.int64)
    attention_mask = torch.zeros((batch_size, width), dtype=torch.int64)
    position_ids = torch.zeros((batch_size, width), dtype=torch.int64)
    for b, item in enumerate(items):
        ids = item["input_ids"]
        n = len(ids)
        if n == 0:
            raise ValueError(f"item {b} (dataset index {item.get('index')}) has an empty prompt")
        input_ids[b, width - n :] = torch.as_tensor(ids, dtype=torch.int64)
        attention_mask[b, width - n :] = 1
        position_ids[b, width - n :] = torch.arange(n, dtype=torch.int64)
    non_tensors = {
        "data_source": [item["data_source"] for item in items],
        "reward_model": [item["reward_model"] for item in items],
        "extra_info": [item.get("extra_info", {}) for item in items],
        "ability": [item.get("ability", "") for item in items],
        "raw_prompt": [item["prompt"] for item in items],
        "index": [int(item["index"]) for item in items],
    }
    if any("agent_name" in item for item in items):  # the agent loop of each row (rollout.multi_turn)
        non_tensors["agent_name"] = [item.get("agent_name") for item in items]
    return DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}, non_tensors
    )


# ---------------------------------------------------------------------------------------------------- sampler
def train_sampler(dataset: PromptDataset, cfg: HybridFlowConfig) -> PromptSampler:
    """The run's training-prompt sampler: `HybridFlowConfig.prompts_per_draw` prompts per batch, ``data.seed`` and
    ``data.shuffle``, fixed-width batches with dynamic sampling (``algorithm.filter_groups.enable``) and a streaming
    rollout (``rollout.streaming``: a batch joins groups of several draws and of several engines).

    Raises:
        ValueError: as `PromptSampler`.
    """
    fixed = cfg.algorithm.filter_groups.enable or cfg.rollout.streaming
    return PromptSampler(dataset, cfg.prompts_per_draw(), cfg.data.seed, cfg.data.shuffle, fixed_width=fixed)


class PromptSampler:
    """Deterministic, resumable batches of prompts.

    Epoch ``e`` visits the dataset in the order ``np.random.default_rng([seed, e]).permutation(len(dataset))``
    (``np.arange`` when ``shuffle=False``), ``batch_size`` rows at a time. A batch never straddles two epochs:
    when fewer than ``batch_size`` rows remain, that tail is **dropped** for this epoch and the next epoch starts
    (a different permutation, so the dropped rows come back in later epochs). Each epoch thus yields
    ``len(dataset) // batch_size`` batches (`batches_per_epoch`).

    The position is the cursor ``(epoch, index)``; `state_dict` / `load_state_dict` save and restore it, and
    after a restore the following batches are identical to those of an uninterrupted sampler. With `fixed_width`,
    every batch is padded to the dataset's longest prompt, so batches of several draws concatenate (dynamic sampling).

    Raises:
        ValueError: if ``batch_size`` is below 1 or larger than the dataset (``data.train_batch_size``).
    """

    def __init__(
        self, dataset: PromptDataset, batch_size: int, seed: int, shuffle: bool = True, fixed_width: bool = False
    ) -> None:
        n = len(dataset)
        if batch_size < 1:
            raise ValueError(f"data.train_batch_size must be >= 1, got {batch_size}")
        if batch_size > n:
            raise ValueError(
                f"data.train_batch_size={batch_size} is larger than the dataset ({n} prompts after filtering); "
                "lower data.train_batch_size or add prompts"
            )
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.width = dataset.longest if fixed_width else None
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order = np.arange(n)

    @property
    def batches_per_epoch(self) -> int:
        """Number of full batches per epoch (``len(dataset) // batch_size``)."""
        return len(self.dataset) // self.batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices (int64 [len(dataset)]) in the order epoch `epoch` visits them."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_batch(self) -> DataProto:
        """The next `batch_size` prompts as a `collate_prompts` DataProto plus a ``uid`` column.

        ``uid`` (numpy object array of str, length `batch_size`) is ``f"{epoch}-{cursor + i}"`` for row i: unique
        among all prompts the sampler ever returns, and the same after a resume. The rollout copies it to each
        prompt's n responses, and group estimators (GRPO, RLOO) group by it.

        ``meta_info`` holds ``{"epoch": e, "cursor": i}``: the epoch of the batch and the position in that epoch's
        order at which the batch starts.
        """
        if self.index + self.batch_size > len(self.dataset):
            self.epoch += 1
            self.index = 0
        if self._order_epoch != self.epoch:
            self._order = self.epoch_order(self.epoch)
            self._order_epoch = self.epoch
        cursor = self.index
        picks = self._order[cursor : cursor + self.batch_size]
        self.index = cursor + self.batch_size
        batch = collate_prompts([self.dataset[int(j)] for j in picks], self.dataset.tokenizer, self.width)
        uids = [f"{self.epoch}-{cursor + i}" for i in range(len(picks))]
        batch.non_tensor_batch["uid"] = np.array(uids, dtype=object)
        batch.meta_info.update(epoch=self.epoch, cursor=cursor)
        return batch

    def state_dict(self) -> dict[str, int]:
        """The cursor: ``{"epoch": int, "index": int, "seed": int}`` (JSON-serialisable)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a cursor saved by `state_dict`.

        The saved seed wins over the one given to the constructor (a warning is logged if they differ), so a resumed
        run continues the interrupted one.

        Raises:
            KeyError: if a key is missing. ValueError: if the values are out of range for this dataset.
        """
        missing = [k for k in ("epoch", "index", "seed") if k not in state]
        if missing:
            raise KeyError(f"sampler state is missing {missing}; expected keys epoch, index, seed, got {list(state)}")
        epoch, index, seed = int(state["epoch"]), int(state["index"]), int(state["seed"])
        if epoch < 0 or not 0 <= index <= len(self.dataset):
            raise ValueError(
                f"sampler state epoch={epoch}, index={index} does not fit a dataset of {len(self.dataset)} prompts; "
                "was the checkpoint made with other data.train_files?"
            )
        if seed != self.seed:
            logger.warning("sampler state has seed %d, config has %d; continuing with the saved seed", seed, self.seed)
        self.epoch, self.index, self.seed = epoch, index, seed
        self._order_epoch = -1


def build_prompt_rows(data: DataConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and validation rows from ``data.train_files`` / ``data.val_files``, ``data.verifiers`` (an
    environment's datasets: `hybridflow.engine.agent.verifiers_env.verifiers_rows`) and ``data.reasoning_gym``.

    reasoning-gym: one dataset of ``train_size + val_size`` items is generated; the first ``val_size`` are held
    out for validation, and training items whose question also appears among them are dropped, so validation
    measures prompts the actor never trained on.
    """
    train = [row for path in data.train_files for row in load_rows(path)]
    val = [row for path in data.val_files for row in load_rows(path)]
    if data.verifiers is not None:  # the environment's own datasets (hybridflow.engine.agent.verifiers_env)
        from hybridflow.engine.agent.verifiers_env import verifiers_rows

        vf = data.verifiers
        rows, held_out = verifiers_rows(vf.env_id, vf.env_args, vf.train_size, vf.val_size, vf.seed)
        train += rows
        val += held_out
    if data.reasoning_gym is not None:
        rg = data.reasoning_gym
        kwargs = {"instruction": rg.instruction} if rg.instruction is not None else {}
        rows = reasoning_gym_rows(rg.name, rg.train_size + rg.val_size, rg.seed, rg.config, **kwargs)
        held_out = rows[: rg.val_size]
        seen = {row["prompt"][-1]["content"] for row in held_out}
        train += [row for row in rows[rg.val_size :] if row["prompt"][-1]["content"] not in seen]
        val += held_out
    return train, val
