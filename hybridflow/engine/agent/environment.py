"""Environments: one trajectory's world, stepped by the model's turns (the field's ``step(action) -> observations,
reward, done`` interface), and the agent loop that runs one token-in-token-out.

An `Environment` is built per trajectory; `reset` sees the row, `step` gets each of the model's turns as text and
answers with an `EnvStep`: messages to append (tool or user messages), a reward for the turn, whether the episode is
over; `close` ends it, however the trajectory ended. Its methods are coroutines: the environments of a whole batch
run at once, and their engine calls are batched turn by turn (`hybridflow.engine.agent.rollout`). The loop that
runs an environment (`EnvironmentLoop`) keeps the tokens exact: the model's ids verbatim (mask 1), the
observations' ids as the chat template writes them after an assistant turn (mask 0; `ChatFormat.turn_ids`), and
the whole trajectory within ``rollout.response_length``. The rewards of its steps reach the score function as
``extra_info["agent"]["env_reward"]`` (their sum) and ``["env_rewards"]`` (per step).

A user's environment is a subclass, registered by name (an ``agent_name`` value, or
``rollout.multi_turn.default_agent_loop``) or named by its import path as loops are::

    @register_environment("guess")
    class Guess(Environment):
        async def step(self, text, last):
            right = text.strip() == "42"
            return EnvStep([] if right or last else [{"role": "user", "content": "No. Again?"}], float(right), right)

`ToolEnvironment` is the built-in ``tool_agent``: its observations are the answers of the tools the turn calls.
"""

from __future__ import annotations

import abc
import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hybridflow.engine.agent.loop import AgentContext, AgentLoop, AgentLoopOutput, SamplingParams, register_agent_loop

MALFORMED = "malformed_call"
"""The tool name under which unreadable tool calls are counted (``agent/tool_calls/malformed_call``)."""


@dataclass
class EnvStep:
    """An environment's answer to one model turn.

    Attributes:
        observations: chat messages (``{"role": "tool" | "user", "content": str}``) the model reads next; none ends
            the episode as `done` does.
        reward: the turn's reward, or None.
        done: the episode is over (the model gets no further turn).
        tool_calls, tool_errors: calls made and calls that failed, per tool name (metrics ``agent/tool_calls/...``).
        metadata: anything else; kept per step under ``extra_info["agent"]["env_metadata"]``.
    """

    observations: list[dict[str, str]] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    tool_calls: Counter = field(default_factory=Counter)
    tool_errors: Counter = field(default_factory=Counter)
    metadata: dict[str, Any] = field(default_factory=dict)


class Environment(abc.ABC):
    """Base of environments: one instance per trajectory, built with the rollout's `AgentContext` (its tokenizer,
    its trajectory's tools)."""

    def __init__(self, context: AgentContext) -> None:
        self.context = context

    async def reset(self, row: dict[str, Any]) -> None:
        """Start the episode of `row` (the batch row's columns: ``raw_prompt``, ``reward_model``, ``extra_info``,
        ...). The default does nothing."""
        return None

    @abc.abstractmethod
    async def step(self, text: str, last: bool) -> EnvStep:
        """Answer the model's turn `text` (decoded without special tokens). `last`: no turn follows whatever this
        answers (the turn was cut by the token budget, or a turn limit is reached): score it, run nothing."""

    async def close(self) -> None:
        """End the episode (called however the trajectory ended). The default closes the trajectory's tools."""
        await self.context.tools.close()

    @classmethod
    def as_agent_loop(cls) -> type[AgentLoop]:
        """The agent loop that runs this environment (`EnvironmentLoop`)."""
        return type(f"{cls.__name__}Loop", (EnvironmentLoop,), {"environment": cls, "__doc__": cls.__doc__})


def register_environment(name: str):
    """Class decorator: register an `Environment` as the agent loop `name` (its `EnvironmentLoop`).

    Raises:
        ValueError: `name` is registered already."""

    def add(cls: type[Environment]) -> type[Environment]:
        register_agent_loop(name)(cls.as_agent_loop())
        return cls

    return add


class EnvironmentLoop(AgentLoop):
    """An agent loop that runs `environment` (module docstring).

    Each assistant turn is sampled from the ids so far; the environment steps on its text; its observations are
    appended as the template's ids (mask 0) and the model answers again, until the environment is done or gives no
    observation, a turn is cut by the token budget, a turn limit (``rollout.multi_turn.max_assistant_turns``,
    ``max_user_turns``) is reached, or the observations would not fit the budget.
    """

    environment: type[Environment]

    async def run(self, sampling_params: SamplingParams, **row: Any) -> AgentLoopOutput:
        """The trajectory of `row` (see the class docstring)."""
        ctx = self.context
        env = self.environment(ctx)
        out = AgentLoopOutput(self.prompt_ids(row))
        budget = sampling_params.max_tokens
        assistant_turns = user_turns = 0
        rewards: list[float] = []
        metadata: list[dict[str, Any]] = []
        try:
            await env.reset(row)
            while True:
                turn = await self.engine.generate(out.prompt_ids + out.response_ids, budget - len(out.response_ids))
                out.add_model_turn(turn)
                assistant_turns += 1
                last = (
                    not turn.stopped
                    or ctx.chat_format is None
                    or (ctx.max_assistant_turns is not None and assistant_turns >= ctx.max_assistant_turns)
                    or (ctx.max_user_turns is not None and user_turns >= ctx.max_user_turns)
                )
                step = await env.step(ctx.tokenizer.decode(turn.ids, skip_special_tokens=True), last)
                out.tool_calls.update(step.tool_calls)
                out.tool_errors.update(step.tool_errors)
                if step.reward is not None:
                    rewards.append(float(step.reward))
                if step.metadata:
                    metadata.append(step.metadata)
                if last or step.done or not step.observations:
                    break
                ids = ctx.chat_format.turn_ids(step.observations)
                if len(out.response_ids) + len(ids) >= budget:
                    break  # no room for the observations and a word of reply
                out.add_tool_turns(ids, len(step.observations))
                user_turns += 1
        finally:
            await env.close()
        if rewards:
            out.extra.update(env_reward=sum(rewards), env_rewards=rewards)
        if metadata:
            out.extra["env_metadata"] = metadata
        return out


class ToolEnvironment(Environment):
    """The tools of the run as an environment (``tool_agent``): a turn's tool calls (``rollout.multi_turn.format``)
    run at once (a class tool's in the order made), and their answers, and an error message per unreadable call,
    are the observations (tool messages); a turn without calls ends the episode. No reward: the score function
    scores the trajectory."""

    async def step(self, text: str, last: bool) -> EnvStep:
        """The tool messages answering the calls in `text` (none when `last`: nothing runs)."""
        if last:
            return EnvStep(done=True)
        ctx = self.context
        parsed = ctx.parser(text)
        step = EnvStep(done=not parsed.calls and not parsed.errors)
        results = await asyncio.gather(*(ctx.tools.call(call.name, call.arguments) for call in parsed.calls))
        for call, result in zip(parsed.calls, results, strict=True):
            step.tool_calls[call.name] += 1
            if result.error is not None:
                step.tool_errors[call.name] += 1
            step.observations.append({"role": "tool", "content": result.text})
        for error in parsed.errors:
            step.tool_calls[MALFORMED] += 1
            step.tool_errors[MALFORMED] += 1
            step.observations.append({"role": "tool", "content": ctx.tools.answer(error, "malformed_call").text})
        return step


register_environment("tool_agent")(ToolEnvironment)


def environment_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """The environment's own reward as the score function (``reward.custom_function:
    hybridflow.engine.agent.environment:environment_score``): the sum of the trajectory's step rewards
    (``extra_info["agent"]["env_reward"]``); 0.0 where its environment gave none (it raised or timed out:
    ``env_scored`` 0.0 then, else 1.0, logged as ``reward_extra/env_scored``)."""
    agent = (extra_info or {}).get("agent") or {}
    if "env_reward" not in agent:
        return {"score": 0.0, "env_scored": 0.0}
    return {"score": float(agent["env_reward"]), "env_scored": 1.0}
