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
(``"module:Class"`` or ``"path.py:Class"``; an `hybridflow.engine.agent.environment.Environment` subclass named so
runs in its loop). Built in: ``single_turn`` (one response, as without agent loops) and ``tool_agent`` (the run's
tools as an environment: `hybridflow.engine.agent.environment.ToolEnvironment`).
"""

from __future__ import annotations

import abc
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
            (unreadable calls count under ``"malformed_call"``).
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
        env_config: ``rollout.multi_turn.env_config``, for environments made by an adapter (skyrl-gym's
            ``env_config``).
        step_timeout_s: seconds a synchronous environment's step may take (``rollout.multi_turn.tool_timeout_s``).
    """

    engine: TokenEngine
    tokenizer: Any
    chat_format: ChatFormat | None
    tools: ToolSession
    parser: ToolParser
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    env_config: dict[str, Any] = field(default_factory=dict)
    step_timeout_s: float = 10.0


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
ADAPTERS = {
    "skyrl_gym": "hybridflow.engine.agent.skyrl_gym_env:skyrl_gym_loop",
    "verifiers": "hybridflow.engine.agent.verifiers_env:verifiers_loop",
}
"""Loop names ``<prefix>/<id>`` that run another library's environment ``<id>``: prefix -> the function (imported
when first named: the library is optional) that returns the loop of an id."""


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
    """The loop registered as `name`; the `AgentLoop` (or `Environment`) subclass `name` gives as ``"module:Class"``
    or ``"path.py:Class"``; or for ``"<library>/<id>"`` the loop of another library's environment (`ADAPTERS`:
    ``skyrl_gym/<id>``, ``verifiers/<id>``).

    Raises:
        ValueError: unknown name (names `key` and the registered loops), or the path names no AgentLoop subclass;
            the errors of `hybridflow.engine.imports.load_object`.
    """
    prefix, _, env_id = name.partition("/")
    if name not in _LOOPS and prefix in ADAPTERS:  # an environment of another library's, by its id
        return load_object(ADAPTERS[prefix], key)(env_id)
    if name not in _LOOPS and ":" in name:  # a user's loop named by its import path
        cls = load_object(name, key)
        if isinstance(cls, type) and callable(getattr(cls, "as_agent_loop", None)):
            cls = cls.as_agent_loop()  # an Environment: the loop that runs it
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise ValueError(f"{key} {name!r} is neither an AgentLoop nor an Environment subclass")
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
