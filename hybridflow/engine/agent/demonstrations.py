"""Tool-use demonstrations: conversations in which the assistant calls the right tool and answers with its result,
generated from prompt rows whose metadata says what the call is, for the SFT warm-up (``hf sft train``,
``data.demonstrations``) that teaches a small model the call format before RL.

A demonstration is ``{"messages": [user..., assistant (the call, hermes format), tool (the tool's real answer),
assistant (the answer)], "tools": [schemas]}``. The tool runs for real (`ToolSession.call`); a row whose tool answer
differs from its label is left out (and counted), so no demonstration teaches a wrong answer. Builders are
registered by name (``data.demonstrations.builder``):

- ``calculator``: arithmetic rows (reasoning-gym ``basic_arithmetic``; ``metadata.expression``) -> one calculator
  call on the expression;
- ``python``: arithmetic rows (reasoning-gym ``products``, ``basic_arithmetic``; ``metadata.expression``) -> one
  call of the sandboxed ``python`` interpreter (`hybridflow.engine.agent.code_interpreter`) printing the expression;
- ``letter_counting``: reasoning-gym ``letter_counting`` rows (``metadata.span``, ``metadata.target_letter``) -> one
  ``count_letter`` call on the text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from hybridflow.engine.agent.tools import ToolBox, ToolResult

Builder = Callable[[dict[str, Any]], tuple[str, dict[str, Any]] | None]
"""``row -> (tool name, arguments)``, or None when the row has no call to demonstrate."""


def _metadata(row: dict[str, Any]) -> dict[str, Any]:
    return ((row.get("extra_info") or {}).get("entry") or {}).get("metadata") or {}


def calculator_call(row: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The calculator call of an arithmetic row (its ``metadata.expression``)."""
    expression = _metadata(row).get("expression")
    return ("calculator", {"expression": expression}) if expression else None


def python_call(row: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The ``python`` call of an arithmetic row: code that prints its ``metadata.expression``."""
    expression = _metadata(row).get("expression")
    return ("python", {"code": f"print({expression})"}) if expression else None


def letter_counting_call(row: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The count_letter call of a letter-counting row (its ``metadata.span`` words and ``target_letter``)."""
    meta = _metadata(row)
    if not meta.get("span") or not meta.get("target_letter"):
        return None
    return ("count_letter", {"text": " ".join(meta["span"]), "letter": meta["target_letter"]})


BUILDERS: dict[str, Builder] = {
    "calculator": calculator_call,
    "python": python_call,
    "letter_counting": letter_counting_call,
}
"""The demonstration builders by ``data.demonstrations.builder`` name."""


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """An assistant turn that calls `name` with `arguments` in the ``hermes`` format."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


async def _call(tools: ToolBox, name: str, arguments: dict[str, Any]) -> ToolResult:
    async with tools.session() as session:
        return await session.call(name, arguments)


def build_demonstrations(
    rows: list[dict[str, Any]], builder: str, tools: ToolBox
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Demonstrations (module docstring) for `rows` (prompt rows: ``prompt`` messages, ``reward_model.ground_truth``,
    ``extra_info.entry.metadata``, as reasoning-gym rows carry it).

    Returns:
        the demonstrations, and counts: ``made``, ``no_call`` (the builder found none), ``tool_error`` (the tool
        failed), ``wrong_label`` (the tool's answer is not the row's label).

    Raises:
        ValueError: unknown `builder` (names ``data.demonstrations.builder`` and the known builders).
    """
    if builder not in BUILDERS:
        raise ValueError(f"unknown data.demonstrations.builder {builder!r}; known: {sorted(BUILDERS)}")
    counts = dict.fromkeys(("made", "no_call", "tool_error", "wrong_label"), 0)
    out = []
    for row in rows:
        call = BUILDERS[builder](row)
        if call is None:
            counts["no_call"] += 1
            continue
        result = asyncio.run(_call(tools, *call))
        if result.error is not None:
            counts["tool_error"] += 1
            continue
        if result.text.strip() != str(row["reward_model"]["ground_truth"]).strip():
            counts["wrong_label"] += 1
            continue
        messages = [
            *row["prompt"],
            {"role": "assistant", "content": tool_call_text(*call)},
            {"role": "tool", "content": result.text},
            {"role": "assistant", "content": result.text},
        ]
        out.append({"messages": messages, "tools": tools.schemas})
        counts["made"] += 1
    return out, counts
