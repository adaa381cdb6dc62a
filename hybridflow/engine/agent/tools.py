"""Tools: typed Python functions with docstrings, or classes with one instance per trajectory, offered to the model
as OpenAI function schemas.

A *function tool* is a function whose parameters have type hints and whose docstring describes it and each argument
(Google style, ``Args:``); `transformers.utils.get_json_schema` turns it into the ``{"type": "function",
"function": {...}}`` schema that chat templates take as ``tools=``. It returns text (anything else is shown with
``str``); it may be a coroutine function. A *class tool* keeps state for one trajectory (an interpreter's variables,
a sandbox): the class has a ``name``, an ``async __call__`` described as a function tool is, and an ``async close``;
its instance is built from the entry's ``config`` at the trajectory's first call of it and closed at the
trajectory's end, and its optional static ``check()`` runs when the tools are loaded, before any work (the
sandboxed interpreter refuses there on a machine without the sandbox).

`ToolSession.call` runs one call and always returns text for the model: a failure (the tool raised, took longer than
its timeout, was called with arguments its signature rejects, or does not exist) comes back as an ``Error: ...``
message, and every answer is cut to ``rollout.multi_turn.max_tool_response_length`` characters, so no tool can stop
a run or flood the context. Calls are coroutines: the calls of all the trajectories of a batch run at once.

The tools of a run are listed in the YAML file ``rollout.multi_turn.tool_config_path``::

    tools:
      - function: hybridflow.engine.agent.calculator:calculator   # "module:name" or "path.py:name"
        timeout_s: 5                                             # optional (default rollout.multi_turn.tool_timeout_s)
      - class: hybridflow.engine.agent.code_interpreter:PythonInterpreter
        config: {memory_mb: 1024}                                # the class's keyword arguments
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hybridflow.engine.imports import load_object


class ToolError(Exception):
    """Raised by a tool whose message is what the model should read as the error, verbatim (a traceback, a
    refusal), instead of ``<tool> failed: <Type>: <message>``."""


@dataclass(frozen=True)
class Tool:
    """A tool offered to the model.

    Attributes:
        name: what the model calls.
        schema: its OpenAI function schema (``{"type": "function", "function": {"name", "description",
            "parameters"}}``).
        timeout_s: seconds a call may take before the model is told it timed out.
        function: a function tool's function (its keyword arguments are the call's ``arguments``); None for a class.
        factory: a class tool's constructor with its config bound: builds one trajectory's instance; None for a
            function.
        restart_note: what a class tool's answer adds after a timeout (its ``restart_note``: e.g. that state is lost).
    """

    name: str
    schema: dict[str, Any]
    timeout_s: float
    function: Callable[..., Any] | None = None
    factory: Callable[[], Any] | None = None
    restart_note: str | None = None


def _schema(function: Callable[..., Any], name: str, what: str) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(function)
    except Exception as e:  # transformers raises its own DocstringParsingException / TypeHintParsingException
        raise ValueError(
            f"tool {what!r} cannot be described to the model: {e}. A tool needs a type hint on every parameter and "
            "a docstring with an Args: line for each"
        ) from None
    schema.get("function", {}).pop("return", None)
    schema["function"]["name"] = name
    return schema


def tool_from_function(function: Callable[..., Any], timeout_s: float = 10.0) -> Tool:
    """`function` as a `Tool`, its schema from its type hints and docstring.

    Raises:
        ValueError: the function lacks a docstring, an argument's type hint or an argument's description (the
            message names the function and what is missing).
    """
    what = getattr(function, "__qualname__", repr(function))
    return Tool(function.__name__, _schema(function, function.__name__, what), float(timeout_s), function=function)


def tool_from_class(cls: type, config: dict[str, Any] | None = None, timeout_s: float = 10.0) -> Tool:
    """The class tool `cls` (module docstring) as a `Tool`: its ``check()`` run, its config tried by building one
    instance (which starts nothing until called), its schema from its ``__call__``.

    Raises:
        ValueError: `cls` has no ``name``, ``__call__`` or ``close``, rejects `config` (the message names the
            class and its error), or cannot be described; whatever its ``check()`` raises (e.g.
            `hybridflow.engine.agent.sandbox.SandboxUnavailable`).
    """
    what = getattr(cls, "__qualname__", repr(cls))
    for needed in ("name", "__call__", "close"):
        if not any(needed in vars(base) for base in cls.__mro__[:-1]):
            raise ValueError(f"tool class {what} needs `{needed}` (a name, an async __call__ and an async close)")
    if callable(getattr(cls, "check", None)):
        cls.check()
    config = dict(config or {})
    try:
        probe = cls(**config)
    except TypeError as e:
        raise ValueError(f"tool class {what} rejects its config {config}: {e}") from None
    factory = lambda: cls(**config)  # noqa: E731 - one instance per trajectory
    schema = _schema(probe.__call__, str(cls.name), what)
    return Tool(
        str(cls.name), schema, float(timeout_s), factory=factory, restart_note=getattr(cls, "restart_note", None)
    )


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

    def session(self) -> ToolSession:
        """The tools of one trajectory (its class tools' instances; `ToolSession`)."""
        return ToolSession(self)

    def answer(self, text: str, error: str | None = None) -> ToolResult:
        """`text` as the model reads it: cut to ``max_response_chars`` (`truncate`); `error`: its kind, or None."""
        return ToolResult(truncate(text, self.max_response_chars, self.truncate_side), error)


class ToolSession:
    """One trajectory's tools: calls them, holds its class tools' instances and closes them (`close`, or ``async
    with``)."""

    def __init__(self, box: ToolBox) -> None:
        self.box = box
        self.instances: dict[str, Any] = {}

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The run's tool schemas (`ToolBox.schemas`)."""
        return self.box.schemas

    def answer(self, text: str, error: str | None = None) -> ToolResult:
        """`ToolBox.answer`."""
        return self.box.answer(text, error)

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Run tool `name` on `arguments`, at most its ``timeout_s`` seconds: a coroutine (a class tool's, or an
        async function) is cancelled then, a plain function runs in a daemon thread of its own that is abandoned
        then (its result dropped).

        Never raises (but cancellation): every failure is a `ToolResult` with ``error`` set and an ``Error: ...``
        text.
        """
        tool = self.box.by_name.get(name)
        if tool is None:
            return self.answer(
                f"Error: there is no tool {name!r}; the tools are {sorted(self.box.by_name)}", "unknown_tool"
            )
        if tool.factory is not None and name not in self.instances:
            self.instances[name] = tool.factory()
        target = tool.function if tool.function is not None else self.instances[name]
        try:
            inspect.signature(target).bind(**arguments)
        except TypeError as e:
            return self.answer(f"Error: bad arguments for {name}: {e}", "bad_arguments")
        try:
            if inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__):
                value = await asyncio.wait_for(target(**arguments), tool.timeout_s)
            else:
                value = await in_thread(functools.partial(target, **arguments), tool.timeout_s)
        except TimeoutError:
            note = f"; {tool.restart_note}" if tool.restart_note else ""
            return self.answer(f"Error: {name} did not answer within {tool.timeout_s:g} s{note}", "timeout")
        except ToolError as e:
            return self.answer(f"Error: {e}", "raised")
        except Exception as e:  # noqa: BLE001 - any failure goes back to the model as text
            return self.answer(f"Error: {name} failed: {type(e).__name__}: {e}", "raised")
        return self.answer(str(value), None)

    async def close(self) -> None:
        """Close the class tools' instances (each once; an error in one does not keep the others open)."""
        instances, self.instances = self.instances, {}
        for instance in instances.values():
            try:
                closed = instance.close()
                if inspect.isawaitable(closed):
                    await closed
            except Exception:  # noqa: BLE001 - closing is best effort; the sandbox dies with its parent anyway
                pass

    async def __aenter__(self) -> ToolSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def in_thread(call: Callable[[], Any], timeout_s: float) -> Any:
    """`call()` in a daemon thread of its own, awaited at most `timeout_s` seconds (a thread of its own: a hung
    call must not take a shared pool's worker; at the timeout it is abandoned, its result dropped).

    Raises:
        TimeoutError: no result in time; whatever `call` raised."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def target() -> None:
        try:
            value, error = call(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            value, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop has closed: the call was abandoned long ago
            loop.call_soon_threadsafe(settle, value, error)

    name = getattr(getattr(call, "func", call), "__name__", "call")
    threading.Thread(target=target, name=f"tool-{name}", daemon=True).start()
    return await asyncio.wait_for(future, timeout_s)


def load_tools(path: str | Path, default_timeout_s: float = 10.0) -> list[Tool]:
    """The tools listed in the YAML file `path` (format in the module docstring).

    Raises:
        FileNotFoundError: `path` does not exist; ValueError: the file is not a mapping with a ``tools`` list of
            entries with a ``function`` or a ``class``, or a tool cannot be described or built (each message names
            ``rollout.multi_turn.tool_config_path`` and the entry); ImportError/AttributeError: a tool cannot be
            loaded (`hybridflow.engine.imports.load_object`); a class tool's ``check()`` errors.
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
        if not isinstance(entry, dict) or len({"function", "class"} & set(entry)) != 1:
            raise ValueError(
                f"{key}: {path}: tools[{i}] needs one of `function: module:name` or `class: module:Class` "
                f"(got {entry!r})"
            )
        allowed = {"function", "timeout_s"} if "function" in entry else {"class", "config", "timeout_s"}
        unknown = set(entry) - allowed
        if unknown:
            raise ValueError(
                f"{key}: {path}: tools[{i}] has unknown keys {sorted(unknown)}; allowed: {', '.join(sorted(allowed))}"
            )
        timeout_s = float(entry.get("timeout_s", default_timeout_s))
        if "function" in entry:
            function = load_object(entry["function"], f"{key} tools[{i}].function")
            tools.append(tool_from_function(function, timeout_s))
            continue
        cls = load_object(entry["class"], f"{key} tools[{i}].class")
        if not isinstance(cls, type):
            raise ValueError(f"{key}: {path}: tools[{i}].class {entry['class']!r} is not a class")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{key}: {path}: tools[{i}].config must be a mapping of the class's arguments")
        try:
            tools.append(tool_from_class(cls, config, timeout_s))
        except ValueError as e:
            raise ValueError(f"{key}: {path}: tools[{i}]: {e}") from None
    return tools
