"""The chat template's tokens around tool turns: the prompt that offers the tools, and the exact ids that follow an
assistant turn when tools answer it.

Token-in-token-out. A multi-turn rollout never re-renders the conversation: the engine is fed the ids of the prompt,
then the model's own output ids verbatim, then the ids of each tool turn, and so on; the training row is exactly
that sequence. The ids of a tool turn are what the chat template writes after an assistant turn's end-of-turn token
(`ChatFormat.tool_turn_ids`: e.g. ``\\n<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>assistant\\n``), found by
rendering a reference conversation with and without the tool messages. That is only right for a *prefix-stable*
template, one that renders the earlier turns the same whatever follows; `ChatFormat` checks this once per template
and refuses one that is not (some templates rewrite earlier assistant turns, e.g. drop their reasoning).
"""

from __future__ import annotations

import json
from typing import Any

_REFERENCE = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]


def tool_instructions(schemas: list[dict[str, Any]]) -> str:
    """System-prompt text offering `schemas` in the ``hermes`` call format (for a template that ignores ``tools=``)."""
    listed = "\n".join(json.dumps(schema) for schema in schemas)
    return (
        "You can call these tools, described as JSON in <tools></tools>:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, write its name and arguments as a JSON object between <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments>}}\n</tool_call>\n'
        "and stop; its answer comes back in the next message."
    )


def render_prompt(messages: list[dict[str, str]], tokenizer: Any, schemas: list[dict[str, Any]] | None = None) -> str:
    """The generation prompt of `messages` as text, offering the tools `schemas` when given.

    The template's own ``tools=`` rendering is used when it has one; a template that ignores ``tools=`` (it renders
    the same text with and without) gets `tool_instructions` at the start of the system message (a new system
    message when there is none).
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not schemas:
        return text
    with_tools = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=False)
    if with_tools != text:
        return with_tools
    instructions = tool_instructions(schemas)
    if messages and messages[0]["role"] == "system":
        messages = [{"role": "system", "content": f"{instructions}\n\n{messages[0]['content']}"}, *messages[1:]]
    else:
        messages = [{"role": "system", "content": instructions}, *messages]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class ChatFormat:
    """The ids a tool turn adds after an assistant turn, for one tokenizer's chat template.

    Args:
        tokenizer: a tokenizer with a chat template.
        eos_token_ids: the ids that end an assistant turn (the rollout's EOS ids).

    Raises:
        ValueError: the template is not prefix-stable, or renders no end-of-turn token after an assistant message
            (the message names the template's tokenizer and what differs).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        base = self._ids(_REFERENCE, generation_prompt=False)
        ends = [i for i, token in enumerate(base) if token in set(eos_token_ids)]
        if not ends:
            raise ValueError(
                f"the chat template of {name} writes no end-of-turn token (any of {eos_token_ids}) after an assistant "
                "message, so a tool turn cannot be appended to the model's output; use a chat model's template"
            )
        self.prefix = base[: ends[-1] + 1]  # the reference conversation up to the assistant turn's end token
        probe = self._ids([*_REFERENCE, {"role": "tool", "content": "T"}], generation_prompt=True)
        if probe[: len(self.prefix)] != self.prefix:
            at = next(i for i, (a, b) in enumerate(zip(probe, self.prefix, strict=False)) if a != b)
            raise ValueError(
                f"the chat template of {name} is not prefix-stable: adding a tool message changes the tokens of the "
                f"earlier turns (from token {at}: {tokenizer.decode(self.prefix[at : at + 8])!r} becomes "
                f"{tokenizer.decode(probe[at : at + 8])!r}), so the training row would not be the tokens the model "
                "saw; use a template that renders earlier turns unchanged"
            )

    def _ids(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tool_turn_ids(self, contents: list[str]) -> list[int]:
        """The ids that follow an assistant turn's end token when tools answer with `contents` (one tool message
        each, in order), through the next assistant turn's generation prompt. int ids, never empty (`turn_ids`)."""
        return self.turn_ids([{"role": "tool", "content": content} for content in contents])

    def turn_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids that follow an assistant turn's end token when `messages` (tool or user messages) come next,
        through the next assistant turn's generation prompt.

        Raises:
            ValueError: the rendering no longer starts with the reference prefix (a template that depends on the
                message contents; the message says so).
        """
        ids = self._ids([*_REFERENCE, *messages], generation_prompt=True)
        if ids[: len(self.prefix)] != self.prefix:
            raise ValueError("the chat template rendered earlier turns differently for these messages")
        return ids[len(self.prefix) :]
