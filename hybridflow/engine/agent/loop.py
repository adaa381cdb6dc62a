"""The agent-loop interface and the built-in loops, in verl's terms.

An agent loop turns one prompt into one trajectory: it asks the engine for tokens, may run tools and feed their
answers back, and returns the trajectory as an `AgentLoopOutput`. It is written as a coroutine, so that the
rollout (`hybridflow.engine.agent.rollout.AgentLoopRollout`) can run the loops of a whole batch together and batch
their engine calls turn by turn. A user's loop is a subclass with a ``run`` method, registered by name::

    @register_agent_loop("my_agent")
    class MyAgent(AgentLoop):
        async def run(self, sampling_params, **row):
            out = await self.engine.generate(self.prompt_ids(row), sampling_params.max_tokens)
            return AgentLoopOutput.single(self.prompt_ids(row), out)

A batch row chooses its loop by its ``agent_name`` column (as in verl's data), else
``rollout.multi_turn.default_agent_loop`` applies; either may also name a loop class by its import path
(``"module:Class"`` or ``"path.py:Class"``). Built in: ``single_turn`` (one response, as without agent loops)
and ``tool_agent`` (`ToolAgentLoop`).
"""

from __future__ import annotations

import abc
import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridflow.engine.agent.chat_format import ChatFormat
from hybridflow.engine.agent.parsers import ToolParser
from hybridflow.engine.agent.tools import ToolSession
from hybridflow.engine.imports import load_object
from hybridflow.engine.rollout.tokens import TokenOutput


@dataclass(frozen=True)
class SamplingParams:
    """What a loop may ask of the engine: `max_tokens`, the trajectory's whole response budget in tokens
    (``rollout.response_length``: model and tool tokens together); `temperature` is the rollout's."""

    max_tokens: int
    temperature: float


class TokenEngine(Protocol):
    """What a loop generates with: token ids in, token ids out (no text, no chat template)."""

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> TokenOutput:
        """Continue `prompt_ids` by at most `max_tokens` sampled ids, stopping after the first EOS id."""
        ...


@dataclass
class AgentLoopOutput:
    """One trajectory, token for token.

    Attributes:
        prompt_ids: the prompt's ids as the engine was first fed them.
        response_ids: everything after the prompt: the model's ids verbatim and the tool turns' ids, in order.
        response_mask: one per response id: 1 on the model's own ids (trained on), 0 on tool and template ids.
        response_logprobs: one per response id: the engine's log-prob of each model id, 0.0 on the others.
        num_turns: the conversation's turns: the prompt's user turn, each assistant turn and each tool turn.
        tool_calls: calls made, per tool name; tool_errors: calls per tool name that came back as an error
            (malformed calls count under ``"<malformed>"``).
        extra: anything else for the reward: passed to the score function as ``extra_info["agent"]``.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    num_turns: int = 1
    tool_calls: Counter = field(default_factory=Counter)
    tool_errors: Counter = field(default_factory=Counter)
    extra: dict[str, Any] = field(default_factory=dict)

    def add_model_turn(self, out: TokenOutput) -> None:
        """Append the model's ids verbatim (mask 1, their log-probs) and count an assistant turn."""
        self.response_ids += out.ids
        self.response_mask += [1] * len(out.ids)
        self.response_logprobs += list(out.log_probs)
        self.num_turns += 1

    def add_tool_turns(self, ids: list[int], turns: int) -> None:
        """Append tool and template ids (mask 0, log-prob 0) holding `turns` tool messages."""
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.response_logprobs += [0.0] * len(ids)
        self.num_turns += turns


@dataclass
class AgentContext:
    """What every loop of a rollout shares.

    Attributes:
        engine: the token engine of this row (seeded for it; `TokenEngine`).
        tokenizer: the actor's tokenizer (to read the model's text).
        chat_format: the template's tool-turn ids (`ChatFormat`); None when the run has no tools.
        tools: the trajectory's tools (`ToolSession`: ``await tools.call(name, arguments)``; its class tools'
            instances are closed when the trajectory ends); parser: the tool-call format's parser.
        max_assistant_turns, max_user_turns: ``rollout.multi_turn`` limits (None: only the token budget).
    """

    engine: TokenEngine
    tokenizer: Any
    chat_format: ChatFormat | None
    tools: ToolSession
    parser: ToolParser
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None


class AgentLoop(abc.ABC):
    """Base of agent loops: one instance per trajectory, built with the rollout's `AgentContext`."""

    def __init__(self, context: AgentContext) -> None:
        self.context = context
        self.engine = context.engine

    @staticmethod
    def prompt_ids(row: dict[str, Any]) -> list[int]:
        """The row's prompt ids (its ``input_ids`` without the left padding)."""
        return list(row["prompt_ids"])

    @abc.abstractmethod
    async def run(self, sampling_params: SamplingParams, **row: Any) -> AgentLoopOutput:
        """One trajectory for `row` (its columns: ``prompt_ids``, ``raw_prompt``, ``reward_model``, ...), within
        ``sampling_params.max_tokens`` response tokens in all."""


_LOOPS: dict[str, type[AgentLoop]] = {}


def register_agent_loop(name: str) -> Callable[[type[AgentLoop]], type[AgentLoop]]:
    """Class decorator: register an `AgentLoop` under `name` (an ``agent_name`` value).

    Raises:
        ValueError: `name` is registered already.
    """

    def add(cls: type[AgentLoop]) -> type[AgentLoop]:
        if name in _LOOPS:
            raise ValueError(f"agent loop {name!r} is registered already")
        _LOOPS[name] = cls
        return cls

    return add


def agent_loop(name: str, key: str = "agent_name") -> type[AgentLoop]:
    """The loop registered as `name`, or the `AgentLoop` subclass `name` gives as ``"module:Class"`` or
    ``"path.py:Class"``.

    Raises:
        ValueError: unknown name (names `key` and the registered loops), or the path names no AgentLoop subclass;
            the errors of `hybridflow.engine.imports.load_object`.
    """
    if name not in _LOOPS and ":" in name:  # a user's loop named by its import path
        cls = load_object(name, key)
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise ValueError(f"{key} {name!r} is not an AgentLoop subclass")
        return cls
    if name not in _LOOPS:
        raise ValueError(
            f"unknown {key} {name!r}; registered agent loops: {sorted(_LOOPS)} (or a 'module:Class' / "
            "'path.py:Class' AgentLoop subclass)"
        )
    return _LOOPS[name]


def agent_loop_names() -> list[str]:
    """The registered loop names, sorted."""
    return sorted(_LOOPS)


@register_agent_loop("single_turn")
class SingleTurnAgentLoop(AgentLoop):
    """One response to the prompt, as a rollout without agent loops samples it."""

    async def run(self, sampling_params: SamplingParams, **row: Any) -> AgentLoopOutput:
        """The prompt and one sampled response (mask 1 throughout, two turns)."""
        out = AgentLoopOutput(self.prompt_ids(row))
        out.add_model_turn(await self.engine.generate(out.prompt_ids, sampling_params.max_tokens))
        return out


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoop):
    """The model answers; while its answer calls tools, the tools run and their answers come back as tool turns.

    Each assistant turn is sampled from the ids so far (prompt, then every earlier turn's ids verbatim). A turn that
    ends with EOS and holds tool calls (``rollout.multi_turn.format``) gets one tool message per call, and per
    unreadable call an error message, appended as the template's tool-turn ids (mask 0); a turn without calls, a turn
    cut by the token budget, or a reached turn limit ends the trajectory. A turn's calls run at once (a class tool's
    calls in the order made), and so do the calls of every trajectory of the batch. Tool answers that would not fit
    the token budget end it too (the row is never longer than ``rollout.response_length``).
    """

    async def run(self, sampling_params: SamplingParams, **row: Any) -> AgentLoopOutput:
        """The trajectory of `row` (see the class docstring)."""
        ctx = self.context
        out = AgentLoopOutput(self.prompt_ids(row))
        budget = sampling_params.max_tokens
        assistant_turns = user_turns = 0
        while True:
            turn = await self.engine.generate(out.prompt_ids + out.response_ids, budget - len(out.response_ids))
            out.add_model_turn(turn)
            assistant_turns += 1
            if not turn.stopped or ctx.chat_format is None:
                break
            if ctx.max_assistant_turns is not None and assistant_turns >= ctx.max_assistant_turns:
                break
            if ctx.max_user_turns is not None and user_turns >= ctx.max_user_turns:
                break
            parsed = ctx.parser(ctx.tokenizer.decode(turn.ids, skip_special_tokens=True))
            if not parsed.calls and not parsed.errors:
                break
            answers = []
            results = await asyncio.gather(*(ctx.tools.call(call.name, call.arguments) for call in parsed.calls))
            for call, result in zip(parsed.calls, results, strict=True):
                out.tool_calls[call.name] += 1
                if result.error is not None:
                    out.tool_errors[call.name] += 1
                answers.append(result.text)
            for error in parsed.errors:
                out.tool_calls["<malformed>"] += 1
                out.tool_errors["<malformed>"] += 1
                answers.append(ctx.tools.answer(error, "malformed_call").text)
            ids = ctx.chat_format.tool_turn_ids(answers)
            if len(out.response_ids) + len(ids) >= budget:
                break  # no room for the tool answers and a word of reply
            out.add_tool_turns(ids, len(answers))
            user_turns += 1
        return out
