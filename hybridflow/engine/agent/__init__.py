"""Agent loops: multi-turn rollouts in which the model calls tools and reads their output before it is scored.

- `loop`: the `AgentLoop` interface (verl's ``AgentLoop.run(sampling_params, **row) -> AgentLoopOutput``), its
  registry, and the built-in ``single_turn``;
- `environment`: the `Environment` interface (``reset``, ``step(text) -> EnvStep``: observations, reward, done;
  ``close``), the loop that runs one, and ``tool_agent``, the run's tools as an environment;
- `tools`: typed Python functions and per-trajectory classes as tools (OpenAI function schemas; `ToolSession`: one
  trajectory's calls, concurrent, with a timeout and bounded output);
- `sandbox`: bubblewrap with kernel limits, for model-written code; `code_interpreter` (its ``python`` tool) and
  `interpreter_driver` (the loop inside the sandbox);
- `parsers`: tool calls read from the model's text (``hermes``: ``<tool_call>{json}</tool_call>``);
- `chat_format`: the chat template's tokens around a tool turn, computed once and checked prefix-stable;
- `skyrl_gym_env`, `verifiers_env`: environments written for SkyRL-gym (``skyrl_gym/<id>``) and for verifiers
  (``verifiers/<env_id>``, with ``data.verifiers``), run unmodified;
- `demonstrations`: SFT warm-up conversations that call a tool, made by running it;
- `rollout`: `AgentLoopRollout`, which runs the loops of a batch on a rollout engine, token-in-token-out;
- `calculator`: the built-in calculator tool.
"""
