"""Conversations for SFT: read, tokenized exactly as a multi-turn rollout lays them out, batched.

A conversation is a list of {role, content} messages and optionally the tools its prompt offers (OpenAI function
schemas; verl's multi-turn SFT layout: columns ``messages`` and ``tools``). Its token row is the one an agent
rollout (`hybridflow.engine.agent.rollout`) would produce had the model written the assistant turns: the prompt (the
messages before the first assistant turn) as the rollout's prompt is encoded (`hybridflow.engine.data.encode_prompt`,
the tools offered in it), each assistant turn's content ids followed by the EOS id (loss mask 1: what the model
learns to write), and the messages between assistant turns as the chat template's ids after an assistant's end
token (`hybridflow.engine.agent.chat_format.ChatFormat.turn_ids`; loss mask 0). So SFT teaches exactly the tokens RL
will sample and score.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hybridflow.engine.agent.chat_format import ChatFormat
from hybridflow.engine.data import encode_prompt
from hybridflow.engine.protocol import DataProto

SFT_TENSORS = ("input_ids", "attention_mask", "loss_mask")
"""A conversation batch's tensors (`collate_conversations`), each int64 [B, L], right-padded."""


def load_conversations(path: str | Path) -> list[dict[str, Any]]:
    """Conversations from a ``.jsonl`` or ``.parquet`` file: one per row, ``messages`` and optionally ``tools``.

    Raises:
        FileNotFoundError: no such file (``data.train_files`` / ``data.val_files`` named).
        ValueError: another extension, no rows, or a row without a list of {role, content} messages with an
            assistant turn (naming the file and the row).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"conversation file {path} does not exist; check data.train_files / data.val_files")
    if path.suffix.lower() == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"{path}: conversation files are .jsonl or .parquet")
    if not rows:
        raise ValueError(f"{path} has no rows")
    out = []
    for i, row in enumerate(rows):
        messages = row.get("messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError(f"{path}, row {i}: column 'messages' must be a list of {{role, content}} messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{path}, row {i}: the conversation has no assistant turn to learn")
        out.append(
            {"messages": [dict(role=m["role"], content=m["content"]) for m in messages], "tools": row.get("tools")}
        )
    return out


def tokenize_conversation(
    conversation: dict[str, Any], tokenizer: Any, chat_format: ChatFormat, eos_id: int
) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of one conversation (module docstring), lists of equal length.

    Messages after the last assistant turn are not kept (nothing to learn follows them).

    Raises:
        ValueError: the conversation has no assistant turn.
    """
    messages = conversation["messages"]
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ValueError("a conversation needs an assistant turn to learn")
    first = roles.index("assistant")
    ids = encode_prompt(messages[:first], tokenizer, True, conversation.get("tools"))
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        if roles[i] == "assistant":
            turn = list(tokenizer.encode(messages[i]["content"], add_special_tokens=False)) + [eos_id]
            ids, mask, i = ids + turn, mask + [1] * len(turn), i + 1
            continue
        j = i
        while j < len(messages) and roles[j] != "assistant":
            j += 1
        if j == len(messages):
            break
        turn = chat_format.turn_ids(messages[i:j])
        ids, mask, i = ids + turn, mask + [0] * len(turn), j
    return ids, mask


def collate_conversations(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> DataProto:
    """Tokenized conversations (`tokenize_conversation`) as one batch: `SFT_TENSORS`, right-padded with `pad_id`."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.int64)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for r, (ids, mask) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
        attention_mask[r, : len(ids)] = 1
        loss_mask[r, : len(ids)] = torch.as_tensor(mask, dtype=torch.int64)
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask})
