"""verifiers environments (PyPI ``verifiers``, its classic ``vf.Environment`` API), unmodified, as agent loops.

An environment written for verifiers is a module with ``load_environment(**env_args) -> vf.Environment`` (a
``vf.SingleTurnEnv``, ``vf.ToolEnv``, ``vf.StatefulToolEnv``, a ``vf.MultiTurnEnv`` subclass, ...) holding its
dataset, its tools and its ``Rubric`` of reward functions. Three pieces run one:

- **data** (``data.verifiers``: ``env_id``, ``env_args``, sizes): the rows of the environment's own dataset
  (``env.get_dataset()``) and eval dataset (``env.get_eval_dataset()``, the validation set; none when it has none),
  as `verifiers_rows` lays them out; its tools (``env.tool_defs``) are offered in the prompts (`prompt_schemas`);
- **rollout** (``rollout.multi_turn.default_agent_loop: verifiers/<env_id>``): per trajectory the environment's own
  ``env.rollout(input, client, model)`` runs: its turns, its ``env_response`` (tool calls, user turns), its stop
  conditions and ``max_turns``, its set-up and clean-up. The client it asks for each model response is ours
  (`EngineClient`): it feeds the engine token ids, never a re-rendered chat: the first request's messages must be
  the row's prompt (ids: the row's), each later one the conversation so far plus the environment's new messages,
  whose ids are the chat template's after an assistant turn (mask 0, `hybridflow.engine.agent.chat_format`); the
  model's text is read for tool calls in ``rollout.multi_turn.format`` and handed back as ``vf.ToolCall``s, as an
  OpenAI server's tool parser would;
- **reward**: then the environment's ``rubric.score_rollout(state)`` (its weighted reward functions) and
  ``rubric.cleanup``, as verifiers' ``run_rollout`` does; the reward reaches the score function as
  ``extra_info["agent"]["env_reward"]`` (``env_passed``: reward >= the environment's ``pass_threshold``;
  ``env_metrics``: its rubric's functions), which the built-in reward of ``data_source: verifiers/<env_id>`` and
  `hybridflow.engine.agent.environment.environment_score` score.

A trajectory stops where verifiers stops it, and where the token budget (``rollout.response_length``) is spent:
then the request raises ``vf.OverlongPromptError``, which verifiers records as ``prompt_too_long``. A request the
token-exact rollout cannot serve (an environment that rewrites earlier messages, or whose prompt is not the row's)
fails the run, naming the environment; an environment's own errors (a tool that raises) stay in its trajectory, as
verifiers keeps them. verifiers runs an environment's coroutines in the rollout's event loop and its synchronous
tools inline (``ToolEnv``), as it does itself: a blocking tool blocks the batch's turn (``env.timeout_seconds``
bounds a rollout). Environments with group reward functions (scored per group of rollouts) are refused.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import time
from collections.abc import Iterator
from typing import Any

from hybridflow.engine.agent.environment import MALFORMED
from hybridflow.engine.agent.loop import AgentContext, AgentLoop, AgentLoopOutput, SamplingParams

PREFIX = "verifiers"
VERSION = "0.3.1"


def _vf():
    try:
        import verifiers as vf
    except ImportError:
        raise ImportError(
            f"verifiers/... environments need verifiers: pip install 'hybridflow[envs]' and "
            f"pip install --no-deps verifiers=={VERSION}"
        ) from None
    return vf


@contextlib.contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """Keep this process's SIGINT/SIGTERM handlers while an environment is built: ``vf.Environment`` installs its
    own (tear down, then exit), which would replace a rank's (preemption, shutdown) and which Python allows only in
    the main thread."""
    install = signal.signal
    signal.signal = lambda signum, handler: signal.getsignal(signum)  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = install


@functools.lru_cache(maxsize=8)
def _load(env_id: str, env_args_json: str) -> Any:
    vf = _vf()
    with _own_signal_handlers():
        try:
            env = vf.load_environment(env_id, **json.loads(env_args_json))
        except (ValueError, RuntimeError) as e:
            raise ValueError(
                f"verifiers environment {env_id!r} (data.verifiers.env_id) did not load: {e}. The id is the module "
                "that defines load_environment() (installed, or on PYTHONPATH); data.verifiers.env_args are its "
                "keyword arguments"
            ) from None
    if env.requires_group_rollouts:
        raise ValueError(
            f"verifiers environment {env_id!r} has group reward functions (scored per group of rollouts); "
            "verifiers/<id> scores each rollout by itself: use per-rollout reward functions"
        )
    return env


def load_environment(env_id: str, env_args: dict[str, Any] | None = None) -> Any:
    """The verifiers environment `env_id` built with `env_args` (``vf.load_environment``), once per process.

    Raises:
        ImportError: verifiers is not installed (names what to install). ValueError: the environment does not load
            (its error, and what the id and the arguments are), or it has group reward functions.
    """
    return _load(env_id, json.dumps(env_args or {}, sort_keys=True))


def prompt_schemas(env: Any) -> list[dict[str, Any]] | None:
    """The environment's tools (``env.tool_defs``, ``vf.Tool``) as the OpenAI function schemas a chat template
    takes as ``tools=``; None without tools."""
    tools = env.tool_defs or []
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tools
    ] or None


def verifiers_rows(
    env_id: str,
    env_args: dict[str, Any],
    train_size: int | None = None,
    val_size: int | None = None,
    seed: int | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and validation rows of environment `env_id`'s datasets, in verl's layout.

    Each row: ``data_source`` = ``"verifiers/<env_id>"``; ``prompt`` = the dataset's prompt messages (its
    ``system_prompt`` and few-shot turns included, as verifiers formats them); ``reward_model.ground_truth`` = its
    ``answer``; ``extra_info.verifiers`` = what ``env.rollout`` takes besides the prompt (``example_id``,
    ``answer``, ``info``, ``task`` where given) and the ``env_id`` / ``env_args`` the loop loads.

    Args:
        train_size, val_size: rows of ``env.get_dataset()`` / ``env.get_eval_dataset()`` (None: all of them;
            validation: none when the environment has no eval dataset).
        seed: shuffles each dataset before the first rows are taken (verifiers' ``seed``); None keeps its order.

    Raises:
        ValueError: as `load_environment`; a prompt with other than text contents (names the row).
    """
    env = load_environment(env_id, env_args)
    train = _rows(env_id, env_args, env.get_dataset(-1 if train_size is None else train_size, seed), "train")
    has_eval = env.eval_dataset is not None or env.eval_dataset_source is not None
    val: list[dict[str, Any]] = []
    if has_eval and val_size != 0:
        val = _rows(env_id, env_args, env.get_eval_dataset(-1 if val_size is None else val_size, seed), "eval")
    return train, val


def _rows(env_id: str, env_args: dict[str, Any], dataset: Any, split: str) -> list[dict[str, Any]]:
    rows = []
    for i, item in enumerate(dataset):
        prompt = []
        for message in item["prompt"]:
            if not isinstance(message.get("content"), str):
                raise ValueError(
                    f"verifiers environment {env_id!r}, {split} row {i}: a {message.get('role')} message whose "
                    "content is not text; verifiers/<id> trains on text prompts"
                )
            prompt.append({"role": message["role"], "content": message["content"]})
        given = {key: item[key] for key in ("example_id", "answer", "info", "task") if item.get(key) is not None}
        rows.append(
            {
                "data_source": f"{PREFIX}/{env_id}",
                "prompt": prompt,
                "ability": PREFIX,
                "reward_model": {"style": "verifiers", "ground_truth": str(item.get("answer") or "")},
                "extra_info": {"split": split, "index": i, PREFIX: {"env_id": env_id, "env_args": env_args, **given}},
            }
        )
    return rows


def verifiers_loop(env_id: str) -> type[AgentLoop]:
    """The agent loop of verifiers environment `env_id` (``verifiers/<env_id>``; module docstring).

    Raises:
        ImportError: verifiers is not installed (names what to install); ValueError: no id given."""
    _vf()
    if not env_id:
        raise ValueError("agent loop verifiers/<id> names the environment: verifiers/<env_id> (data.verifiers.env_id)")
    return type(f"Verifiers_{env_id}", (VerifiersLoop,), {"env_id": env_id})


class VerifiersLoop(AgentLoop):
    """One trajectory of a verifiers environment (module docstring); `env_id` its id, the environment's arguments
    from the row (``extra_info.verifiers.env_args``)."""

    env_id: str
    observes = True  # the environment's messages need the chat template's turn ids, with or without tools

    async def run(self, sampling_params: SamplingParams, **row: Any) -> AgentLoopOutput:
        """``env.rollout`` of `row` on `EngineClient`, then its rubric's score (module docstring).

        Raises:
            ValueError: a request the token-exact rollout cannot serve (`EngineClient`), naming the environment.
        """
        given = dict((row.get("extra_info") or {}).get(PREFIX) or {})
        env = load_environment(self.env_id, given.get("env_args") or {})
        out = AgentLoopOutput(self.prompt_ids(row))
        client = engine_client(self.context, out, row["raw_prompt"], sampling_params.max_tokens, self.env_id)
        rollout_input = {"prompt": [dict(m) for m in row["raw_prompt"]], "example_id": int(given.get("example_id", 0))}
        rollout_input.update({key: given[key] for key in ("answer", "info", "task") if key in given})
        state = await env.rollout(rollout_input, client, self.env_id, None)
        if client.failure is not None:
            raise client.failure
        if env.score_rollouts:
            await env.rubric.score_rollout(state)
        else:
            await env.rubric.dummy_score_rollout(state)
        await env.rubric.cleanup(state)
        reward = float(state["reward"] or 0.0)
        out.extra.update(
            env_reward=reward,
            env_passed=float(reward >= env.pass_threshold),
            env_metrics={name: float(value) for name, value in (state["metrics"] or {}).items()},
            env_stop=str(state.get("stop_condition")),
        )
        if state.get("error") is not None:
            out.extra["env_error"] = f"{type(state['error']).__name__}: {state['error']}"
        return out


def _text(message: Any) -> tuple[str, str]:
    content = message.content if isinstance(message.content, str) else json.dumps(message.content, default=str)
    return message.role, content or ""


def engine_client(context: AgentContext, out: AgentLoopOutput, prompt: Any, budget: int, env_id: str) -> Any:
    """The ``vf.Client`` of one trajectory (`EngineClient` as a subclass of verifiers' ``Client``): `prompt` the
    row's messages, `budget` its response tokens, `out` what it appends to."""
    return _engine_client_class()(context, out, prompt, budget, env_id)


class EngineClient:
    """What the ``vf.Client`` an environment's rollout asks for model responses does (`engine_client`): one per
    trajectory, appending to its `AgentLoopOutput` (module docstring)."""

    def __init__(self, context: AgentContext, out: AgentLoopOutput, prompt: Any, budget: int, env_id: str) -> None:
        super().__init__(None)  # type: ignore[call-arg] # vf.Client(client_or_config): no underlying client
        self.context, self.out, self.budget, self.env_id = context, out, budget, env_id
        self.prompt = [(m["role"], m["content"]) for m in prompt]
        self.seen: list[tuple[str, str]] | None = None  # the messages the ids so far hold, the last answer included
        self.last_cut = False
        self.failure: Exception | None = None
        self.calls = 0

    def _refuse(self, problem: str) -> Exception:
        self.failure = ValueError(f"verifiers environment {self.env_id!r}: {problem}")
        return self.failure

    def _append(self, messages: list[Any]) -> None:
        vf = _vf()
        given = [_text(m) for m in messages]
        if self.seen is None:
            if given != self.prompt:
                raise self._refuse(
                    "its first request is not the row's prompt (the prompt's tokens are encoded before the "
                    "rollout); put the prompt it wants in its dataset"
                )
            self.seen = given
            return
        if given[: len(self.seen)] != self.seen:
            raise self._refuse(
                "it rewrote earlier messages of the conversation; a token-exact rollout only appends to it"
            )
        new = given[len(self.seen) :]
        if not new or any(role not in ("tool", "user") for role, _ in new):
            roles = [role for role, _ in new] or "no messages"
            raise self._refuse(f"its env_response gave {roles}; a token-exact rollout appends tool or user messages")
        if self.last_cut or self.context.chat_format is None:
            raise vf.OverlongPromptError("the token budget (rollout.response_length) is spent")
        ids = self.context.chat_format.turn_ids([{"role": role, "content": text} for role, text in new])
        if len(self.out.response_ids) + len(ids) >= self.budget:
            raise vf.OverlongPromptError("the environment's messages do not fit rollout.response_length")
        self.out.add_tool_turns(ids, len(new))
        self.seen = given

    async def respond(self, messages: list[Any], model: str, tools: list[Any] | None) -> Any:
        """The model's next turn after `messages` (``vf.Messages``) as a ``vf.Response``; `tools` (``vf.Tool``)
        decide whether its text is read for tool calls.

        Raises:
            vf.OverlongPromptError: the budget is spent; ValueError: see the module docstring."""
        vf = _vf()
        self._append(messages)
        left = self.budget - len(self.out.response_ids)
        if left < 1:
            raise vf.OverlongPromptError("the token budget (rollout.response_length) is spent")
        turn = await self.context.engine.generate(self.out.prompt_ids + self.out.response_ids, left)
        self.out.add_model_turn(turn)
        self.last_cut = not turn.stopped
        text = self.context.tokenizer.decode(turn.ids, skip_special_tokens=True)
        calls = []
        if tools:
            parsed = self.context.parser(text)
            for call in parsed.calls:
                self.calls += 1
                self.out.tool_calls[call.name] += 1
                calls.append(vf.ToolCall(id=f"call_{self.calls}", name=call.name, arguments=json.dumps(call.arguments)))
            self.out.tool_calls[MALFORMED] += len(parsed.errors)
            self.out.tool_errors[MALFORMED] += len(parsed.errors)
        self.seen = [*self.seen, ("assistant", text)]
        finish = "tool_calls" if calls else ("stop" if turn.stopped else "length")
        message = vf.ResponseMessage(
            content=text, tool_calls=calls or None, finish_reason=finish, is_truncated=not turn.stopped
        )
        prompt_tokens = len(self.out.prompt_ids) + len(self.out.response_ids) - len(turn.ids)
        usage = vf.Usage(
            prompt_tokens=prompt_tokens,
            reasoning_tokens=0,
            completion_tokens=len(turn.ids),
            total_tokens=prompt_tokens + len(turn.ids),
        )
        answer_id = f"{model}-{len(self.seen)}"
        return vf.Response(id=answer_id, created=int(time.time()), model=model, usage=usage, message=message)


@functools.cache
def _engine_client_class() -> type:
    """`EngineClient` as a subclass of ``vf.Client`` (verifiers is imported only when an environment runs)."""
    vf = _vf()

    class _EngineClient(EngineClient, vf.Client):
        def setup_client(self, config: Any) -> Any:
            raise ValueError("the engine client has no underlying client to set up")

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
            return messages, {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs) -> Any:
            return await self.respond(prompt, model, tools)

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

    return _EngineClient
