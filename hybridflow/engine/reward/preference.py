"""Preference pairs for reward-model training: read, render as the reward model reads them, batch.

The layout is the field's (TRL's preference datasets; OpenRLHF's ``prompt_key`` / ``chosen_key`` / ``rejected_key``
defaults): one row per pair with ``chosen`` and ``rejected``, and optionally ``prompt``. Two formats:

- **conversational**: ``prompt`` a chat list (``[{"role": "user", "content": ...}]``), ``chosen`` / ``rejected``
  each a chat list of the response's messages or a string (taken as one assistant message). A pair is rendered with
  the tokenizer's chat template, exactly as `hybridflow.engine.reward.reward_model.reward_model_texts` renders a
  rollout for scoring, so the trained model reads at scoring time what it read in training.
- **standard**: ``prompt``, ``chosen`` and ``rejected`` strings; a pair's text is prompt + response.

Without ``prompt`` the responses are whole texts (or whole conversations).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hybridflow.engine.protocol import DataProto
from hybridflow.engine.reward.reward_model import encode_texts, render_chat

PAIR_COLUMNS = ("chosen", "rejected")
"""Required columns; ``prompt`` is optional."""
PAIR_TENSORS = ("chosen_input_ids", "chosen_attention_mask", "rejected_input_ids", "rejected_attention_mask")
"""A pair batch's tensors (`collate_pairs`), each int64 [B, W]."""
_LAYOUT = (
    "preference files have one row per pair with columns chosen, rejected (strings or chat lists) and optionally "
    "prompt (a string or a chat list), as TRL's preference datasets"
)


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def load_preference_rows(path: str | Path) -> list[dict[str, Any]]:
    """Read preference pairs from a ``.parquet`` or ``.jsonl`` file.

    Returns:
        One dict per row with ``prompt`` (None, a string or a chat list), ``chosen`` and ``rejected``.

    Raises:
        FileNotFoundError: the file does not exist (``data.train_files`` / ``data.val_files`` named).
        ValueError: another extension, no rows, a missing column, or a value of the wrong type, naming the file, the
            row and the column.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"preference file {path} does not exist; check data.train_files / data.val_files")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        raw = pq.read_table(path).to_pylist()
    elif path.suffix.lower() in (".jsonl", ".json"):
        raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        raise ValueError(f"cannot read preference file {path}: use .parquet or .jsonl ({_LAYOUT})")
    if not raw:
        raise ValueError(f"preference file {path} has no rows; check data.train_files / data.val_files")
    rows = []
    for i, row in enumerate(raw):
        where = f"preference file {path}, row {i}"
        if not isinstance(row, dict) or any(c not in row for c in PAIR_COLUMNS):
            found = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{where}: needs columns chosen and rejected (found {found}); {_LAYOUT}")
        prompt = row.get("prompt")
        for column in ("prompt", *PAIR_COLUMNS):
            value = row.get(column)
            if column == "prompt" and value is None:
                continue
            if not (isinstance(value, str) or _is_chat(value)):
                raise ValueError(
                    f"{where}: column {column!r} is {type(value).__name__}, not a string or a chat list of "
                    f"{{'role', 'content'}} messages; {_LAYOUT}"
                )
        if isinstance(prompt, str) and not all(isinstance(row[c], str) for c in PAIR_COLUMNS):
            raise ValueError(
                f"{where}: a string prompt needs string chosen and rejected (or make the prompt a chat list)"
            )
        rows.append({"prompt": prompt, "chosen": row["chosen"], "rejected": row["rejected"]})
    return rows


def render_pair(prompt: Any, response: Any, tokenizer: Any) -> str:
    """The text of a prompt (None, a string or a chat list) and one response (a string, or a chat list of the
    response's messages): prompt + response for strings, else the conversation in the tokenizer's chat template."""
    if isinstance(prompt, str) or (prompt is None and isinstance(response, str)):
        return (prompt or "") + response
    messages = list(prompt or [])
    messages += response if isinstance(response, list) else [{"role": "assistant", "content": response}]
    return render_chat(messages, tokenizer)


def pair_texts(row: dict[str, Any], tokenizer: Any) -> tuple[str, str]:
    """The texts the reward model reads for a pair: ``(chosen, rejected)`` (see the module docstring)."""
    return render_pair(row["prompt"], row["chosen"], tokenizer), render_pair(row["prompt"], row["rejected"], tokenizer)


def collate_pairs(rows: Sequence[dict[str, Any]], tokenizer: Any, max_length: int) -> DataProto:
    """A batch of pairs: `PAIR_TENSORS`, each int64 [B, W] (right-padded, each text's last `max_length` tokens;
    chosen and rejected padded to one width W)."""
    texts = [text for row in rows for text in pair_texts(row, tokenizer)]
    input_ids, attention_mask = encode_texts(tokenizer, texts, max_length)
    return DataProto.from_dict(
        {
            "chosen_input_ids": input_ids[0::2],
            "chosen_attention_mask": attention_mask[0::2],
            "rejected_input_ids": input_ids[1::2],
            "rejected_attention_mask": attention_mask[1::2],
        }
    )


def pair_scores(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """Held-out metrics of a reward model over pairs: ``acc`` (share with chosen > rejected), ``margin`` (mean
    chosen - rejected), ``loss`` (the mean Bradley-Terry loss), from float [N] scores."""
    diff = chosen.double() - rejected.double()
    return {
        "acc": float((diff > 0).double().mean()),
        "margin": float(diff.mean()),
        "loss": float(-torch.nn.functional.logsigmoid(diff).mean()),
    }
