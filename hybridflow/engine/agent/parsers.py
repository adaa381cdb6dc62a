"""Tool calls read from the text of one assistant turn, by format (``rollout.multi_turn.format``).

A parser takes the turn's decoded text and returns the calls it finds plus the problems of the ones it could not
read; a problem goes back to the model as an error message
(`hybridflow.engine.agent.environment.ToolEnvironment`), it never
stops the run. Built in: ``hermes``, the format of Hermes and Qwen models (and their chat templates)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

Register another with `register_tool_parser`, or name a parser function by its import path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridflow.engine.imports import load_object


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """What a parser found in one turn: `calls` in order, and `errors` (one message per call it could not read)."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


ToolParser = Callable[[str], ParsedTurn]
_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(name: str) -> Callable[[ToolParser], ToolParser]:
    """Decorator: register a parser ``text -> ParsedTurn`` under ``rollout.multi_turn.format: <name>``.

    Raises:
        ValueError: `name` is registered already.
    """

    def add(parser: ToolParser) -> ToolParser:
        if name in _PARSERS:
            raise ValueError(f"tool-call format {name!r} is registered already")
        _PARSERS[name] = parser
        return parser

    return add


def tool_parser(name: str) -> ToolParser:
    """The parser of format `name`, or the parser function `name` gives as ``"module:function"`` or
    ``"path.py:function"``.

    Raises:
        ValueError: unknown format (names ``rollout.multi_turn.format`` and the registered formats); the errors of
            `hybridflow.engine.imports.load_object`.
    """
    if name not in _PARSERS and ":" in name:  # a user's parser named by its import path
        return load_object(name, "rollout.multi_turn.format")
    if name not in _PARSERS:
        raise ValueError(
            f"unknown rollout.multi_turn.format {name!r}; registered: {sorted(_PARSERS)} (or a parser's "
            "'module:function' / 'path.py:function')"
        )
    return _PARSERS[name]


def tool_formats() -> list[str]:
    """The registered formats, sorted."""
    return sorted(_PARSERS)


_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@register_tool_parser("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of `text` (``arguments`` may also be a
    JSON string holding the object, as some models write it). An opening tag without its closing tag, text that is
    not JSON, or JSON without a string ``name`` and an object ``arguments`` is an error."""
    parsed = ParsedTurn()
    for body in _HERMES_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            parsed.errors.append(
                f"Error: the tool call is not JSON ({e.msg} at character {e.pos}): {body.strip()[:80]}"
            )
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            parsed.errors.append(
                'Error: a tool call must be {"name": "<tool>", "arguments": {...}}, got ' + body.strip()[:80]
            )
            continue
        parsed.calls.append(ToolCall(call["name"], arguments))
    if text.count("<tool_call>") > text.count("</tool_call>"):
        parsed.errors.append("Error: a <tool_call> is not closed with </tool_call>")
    return parsed
