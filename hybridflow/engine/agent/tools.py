"""Tools: typed Python functions with docstrings, offered to the model as OpenAI function schemas.

A tool is a function whose parameters have type hints and whose docstring describes it and each argument (Google
style, ``Args:``); `transformers.utils.get_json_schema` turns it into the ``{"type": "function", "function":
{...}}`` schema that chat templates take as ``tools=``. It returns text (anything else is shown with ``str``).

`ToolBox.call` runs one call and always returns text for the model: a failure (the tool raised, took longer than its
timeout, was called with arguments its signature rejects, or does not exist) comes back as an ``Error: ...``
message, and every answer is cut to ``rollout.multi_turn.max_tool_response_length`` characters, so no tool can stop
a run or flood the context.

The tools of a run are listed in the YAML file ``rollout.multi_turn.tool_config_path``::

    tools:
      - function: hybridflow.engine.agent.calculator:calculator   # "module:name" or "path.py:name"
        timeout_s: 5                                             # optional (default rollout.multi_turn.tool_timeout_s)
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hybridflow.engine.imports import load_object


@dataclass(frozen=True)
class Tool:
    """A function offered to the model.

    Attributes:
        name: the function's name (what the model calls).
        function: the Python function; its keyword arguments are the call's ``arguments``.
        schema: its OpenAI function schema (``{"type": "function", "function": {"name", "description",
            "parameters"}}``).
        timeout_s: seconds a call may take before the model is told it timed out.
    """

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]
    timeout_s: float


def tool_from_function(function: Callable[..., Any], timeout_s: float = 10.0) -> Tool:
    """`function` as a `Tool`, its schema from its type hints and docstring.

    Raises:
        ValueError: the function lacks a docstring, an argument's type hint or an argument's description (the
            message names the function and what is missing).
    """
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(function)
    except Exception as e:  # transformers raises its own DocstringParsingException / TypeHintParsingException
        raise ValueError(
            f"tool {getattr(function, '__qualname__', function)!r} cannot be described to the model: {e}. A tool "
            "needs a type hint on every parameter and a docstring with an Args: line for each"
        ) from None
    schema.get("function", {}).pop("return", None)
    return Tool(function.__name__, function, schema, float(timeout_s))


@dataclass
class ToolResult:
    """One call's answer: the text the model reads and whether it is an error (``error`` names its kind:
    ``"raised"``, ``"timeout"``, ``"bad_arguments"``, ``"unknown_tool"``, ``"malformed_call"``; None: success)."""

    text: str
    error: str | None = None


def truncate(text: str, limit: int, side: str = "middle") -> str:
    """`text` cut to at most `limit` characters plus a marker saying how many were cut (`side`: which part is
    dropped: ``"left"``, ``"right"`` or ``"middle"``, verl's ``tool_response_truncate_side``)."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    marker = f"...({cut} characters cut)..."
    if side == "left":
        return marker + text[cut:]
    if side == "right":
        return text[:limit] + marker
    head = limit // 2
    return text[:head] + marker + text[len(text) - (limit - head) :]


@dataclass
class ToolBox:
    """The tools of a run, by name, and how their answers are bounded.

    Args:
        tools: the tools (names must differ).
        max_response_chars: the longest answer the model reads, in characters
            (``rollout.multi_turn.max_tool_response_length``).
        truncate_side: which part of a longer answer is cut (`truncate`).

    Raises:
        ValueError: two tools share a name.
    """

    tools: list[Tool]
    max_response_chars: int = 256
    truncate_side: str = "middle"
    by_name: dict[str, Tool] = field(init=False)

    def __post_init__(self) -> None:
        self.by_name = {}
        for tool in self.tools:
            if tool.name in self.by_name:
                raise ValueError(f"two tools are named {tool.name!r}; tool names must be unique")
            self.by_name[tool.name] = tool

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' OpenAI function schemas, in order (the chat template's ``tools=``)."""
        return [tool.schema for tool in self.tools]

    def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Run tool `name` on `arguments` in a daemon thread, at most its ``timeout_s`` seconds.

        Never raises: every failure is a `ToolResult` with ``error`` set and an ``Error: ...`` text. A call that
        times out is abandoned (its thread runs on in the background and its result is dropped).
        """
        tool = self.by_name.get(name)
        if tool is None:
            return self.answer(
                f"Error: there is no tool {name!r}; the tools are {sorted(self.by_name)}", "unknown_tool"
            )
        try:
            inspect.signature(tool.function).bind(**arguments)
        except TypeError as e:
            return self.answer(f"Error: bad arguments for {name}: {e}", "bad_arguments")
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = tool.function(**arguments)
            except BaseException as e:  # noqa: BLE001 - any failure goes back to the model as text
                box["error"] = e

        thread = threading.Thread(target=target, name=f"tool-{name}", daemon=True)
        thread.start()
        thread.join(tool.timeout_s)
        if thread.is_alive():
            return self.answer(f"Error: {name} did not answer within {tool.timeout_s:g} s", "timeout")
        if "error" in box:
            e = box["error"]
            return self.answer(f"Error: {name} failed: {type(e).__name__}: {e}", "raised")
        return self.answer(str(box.get("value")), None)

    def answer(self, text: str, error: str | None = None) -> ToolResult:
        """`text` as the model reads it: cut to ``max_response_chars`` (`truncate`); `error`: its kind, or None."""
        return ToolResult(truncate(text, self.max_response_chars, self.truncate_side), error)


def load_tools(path: str | Path, default_timeout_s: float = 10.0) -> list[Tool]:
    """The tools listed in the YAML file `path` (format in the module docstring).

    Raises:
        FileNotFoundError: `path` does not exist; ValueError: the file is not a mapping with a ``tools`` list of
            entries with a ``function``, or a function cannot be described (each message names
            ``rollout.multi_turn.tool_config_path`` and the entry); ImportError/AttributeError: a function cannot be
            loaded (`hybridflow.engine.imports.load_object`).
    """
    key = "rollout.multi_turn.tool_config_path"
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{key}: no file {path.resolve()}")
    tree = yaml.safe_load(path.read_text()) or {}
    entries = tree.get("tools") if isinstance(tree, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{key}: {path} must hold `tools:`, a list of entries like `- function: module:name`")
    tools = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "function" not in entry:
            raise ValueError(f"{key}: {path}: tools[{i}] needs `function: module:name` (got {entry!r})")
        unknown = set(entry) - {"function", "timeout_s"}
        if unknown:
            raise ValueError(
                f"{key}: {path}: tools[{i}] has unknown keys {sorted(unknown)}; allowed: function, timeout_s"
            )
        function = load_object(entry["function"], f"{key} tools[{i}].function")
        tools.append(tool_from_function(function, float(entry.get("timeout_s", default_timeout_s))))
    return tools
