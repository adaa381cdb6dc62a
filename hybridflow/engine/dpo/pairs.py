"""Preference pairs as DPO trains on them: each response's tokens after its prompt's, and a mask of the response.

A pair's row is the layout ``hf rm train`` reads (`hybridflow.engine.reward.preference`: ``prompt`` optional, a
string or a chat list; ``chosen`` and ``rejected``). The prompt is rendered as the policy reads it before answering
(a chat list in the tokenizer's chat template with the generation prompt), the response's text is what the whole
rendered conversation adds to it, and the two are tokenised apart and joined (as TRL does), so the response's
tokens are exactly the ones scored. Without a prompt the whole text is the response.

Over ``data.max_length`` tokens, the prompt keeps its end, at most the room the response leaves and at least half
of it, and the response its start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.engine.protocol import DataProto
from hybridflow.engine.reward.preference import render_pair

SIDES = ("chosen", "rejected")
PAIR_KEYS = tuple(f"{side}_{key}" for side in SIDES for key in ("input_ids", "attention_mask", "loss_mask"))
"""A batch of pairs: per side, int64 [B, W], right-padded, both sides to one width."""
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
"""The reference's log-probabilities of each pair's responses, float32 [B] (``dpo.precompute_ref_log_probs``: a row
that carries them hands them to the batch, and no step runs the reference)."""


def prompt_text(prompt: Any, tokenizer: Any) -> str:
    """The text before a response: the prompt string, a chat list in the chat template with the generation
    prompt, or "" without a prompt."""
    if prompt is None or isinstance(prompt, str):
        return prompt or ""
    if not tokenizer.chat_template:
        return render_pair(prompt, [], tokenizer) + "\n"
    return tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)


def pair_token_ids(row: dict[str, Any], tokenizer: Any, max_length: int) -> list[tuple[list[int], int]]:
    """``[(ids, prompt_tokens)]`` for the chosen and the rejected response of `row`: the joined token ids (at most
    `max_length`) and how many of them are the prompt's.

    Raises:
        ValueError: the rendered conversation does not start with the rendered prompt (a chat template that
            rewrites the prompt when a response follows: the message names the row's prompt).
    """
    head = prompt_text(row["prompt"], tokenizer)
    prompt_ids = tokenizer(head, add_special_tokens=False)["input_ids"] if head else []
    out = []
    for side in SIDES:
        text = render_pair(row["prompt"], row[side], tokenizer)
        if not text.startswith(head):
            raise ValueError(
                f"the chat template renders prompt {str(row['prompt'])[:80]!r} otherwise when a response follows; "
                "DPO needs the response's tokens after the prompt's: use a template whose rendering of a "
                "conversation starts with its prompt's (with add_generation_prompt)"
            )
        response = tokenizer(text[len(head) :], add_special_tokens=False)["input_ids"]
        keep = min(len(prompt_ids), max(max_length - len(response), max_length // 2))
        kept = prompt_ids[len(prompt_ids) - keep :] + response[: max_length - keep]
        out.append((kept, keep))
    return out


def collate_dpo_pairs(rows: Sequence[dict[str, Any]], tokenizer: Any, max_length: int) -> DataProto:
    """A batch of pairs: `PAIR_KEYS`; ``*_loss_mask`` is 1 on the response's tokens (`pair_token_ids`); and
    `REF_KEYS` where the rows carry them (precomputed).

    Raises:
        ValueError: the errors of `pair_token_ids`.
    """
    sequences = [pair_token_ids(row, tokenizer, max_length) for row in rows]
    width = max(len(ids) for pair in sequences for ids, _ in pair)
    tensors = {}
    for s, side in enumerate(SIDES):
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.int64)
        attention = torch.zeros((len(rows), width), dtype=torch.int64)
        loss = torch.zeros((len(rows), width), dtype=torch.int64)
        for i, pair in enumerate(sequences):
            tokens, prompt = pair[s]
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            attention[i, : len(tokens)] = 1
            loss[i, prompt : len(tokens)] = 1
        tensors.update({f"{side}_input_ids": ids, f"{side}_attention_mask": attention, f"{side}_loss_mask": loss})
    if rows and REF_KEYS[0] in rows[0]:
        tensors.update({key: torch.tensor([row[key] for row in rows], dtype=torch.float32) for key in REF_KEYS})
    return DataProto.from_dict(tensors)
