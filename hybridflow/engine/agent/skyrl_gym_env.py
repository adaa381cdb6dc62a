"""SkyRL-gym environments (PyPI ``skyrl-gym``), unmodified, as `hybridflow.engine.agent.environment.Environment`s.

A row's loop ``skyrl_gym/<id>`` (an ``agent_name`` value or ``rollout.multi_turn.default_agent_loop``) runs the
environment registered in skyrl-gym as ``<id>`` (built in: ``gsm8k``, ``gsm8k_multi_turn``, ``aime``, ``lcb``,
``text2sql``, ``search``, ``searchcode``; a user's own is registered with ``skyrl_gym.register(id=...,
entry_point=...)`` in a module named in ``rollout.multi_turn.env_imports``); plain ``skyrl_gym`` takes the id from
the row's ``env_class`` column, as SkyRL's datasets carry it. Per trajectory: ``skyrl_gym.make(id,
env_config=rollout.multi_turn.env_config, extras=row)``, ``init(prompt)``, ``step(text)`` on each model turn (its
``observations`` appended as the template's ids, its ``reward`` kept per turn, ``done`` ends it), ``close()``.

``extras`` is the row as SkyRL's generator passes it: every column, plus ``reward_spec`` (SkyRL's name for verl's
``reward_model``, taken from it when the row has none) with a numeric ground truth written as text, as SkyRL's
datasets store it (its ``gsm8k`` compares strings). skyrl-gym environments are synchronous: each ``step`` runs in a
thread of its own, bounded by ``rollout.multi_turn.tool_timeout_s``; one that raises or times out ends its
trajectory with no reward and the error in ``env_metadata`` (the run goes on). Code-running environments of
skyrl-gym (``lcb``, its Python tool) run code unsandboxed, as skyrl-gym does.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
from typing import Any

from hybridflow.engine.agent.environment import Environment, EnvStep
from hybridflow.engine.agent.loop import AgentLoop
from hybridflow.engine.agent.tools import in_thread

PREFIX = "skyrl_gym"


def skyrl_gym_loop(env_id: str) -> type[AgentLoop]:
    """The agent loop of skyrl-gym environment `env_id` ('' for the row's ``env_class``).

    Raises:
        ImportError: skyrl-gym is not installed (names the extra to install); ValueError: `env_id` is not registered
            (names the registered ids and ``rollout.multi_turn.env_imports``).
    """
    gym = _skyrl_gym()
    if env_id:
        _check_registered(gym, env_id)
    cls = type(f"SkyRLGym_{env_id or 'env_class'}", (SkyRLGymEnvironment,), {"env_id": env_id or None})
    return cls.as_agent_loop()


def _skyrl_gym():
    try:
        import skyrl_gym
    except ImportError:
        raise ImportError(
            "skyrl_gym/... environments need skyrl-gym: pip install 'hybridflow[envs]' (or skyrl-gym==0.4.0)"
        ) from None
    return skyrl_gym


def _check_registered(gym: Any, env_id: str) -> None:
    if env_id not in gym.registry:
        raise ValueError(
            f"skyrl-gym has no environment {env_id!r}; registered: {sorted(gym.registry)}. A module that registers "
            "one (skyrl_gym.register(id=..., entry_point=...)) goes in rollout.multi_turn.env_imports"
        )


def skyrl_extras(row: dict[str, Any]) -> dict[str, Any]:
    """SkyRL's ``extras`` for `row` (module docstring): the row's columns (not its ids) plus ``reward_spec``."""
    extras = {key: value for key, value in row.items() if key != "prompt_ids"}
    spec = dict(extras.get("reward_spec") or extras.get("reward_model") or {})
    if isinstance(spec.get("ground_truth"), numbers.Number):
        spec["ground_truth"] = str(spec["ground_truth"])
    extras["reward_spec"] = spec
    return extras


class SkyRLGymEnvironment(Environment):
    """One trajectory's skyrl-gym environment (module docstring); `env_id` None: the row's ``env_class``."""

    env_id: str | None = None

    async def reset(self, row: dict[str, Any]) -> None:
        """``make`` the row's environment and ``init`` it with the row's prompt messages.

        Raises:
            ValueError: no id (the row lacks ``env_class``), an unregistered id, or an ``init`` that changes the
                prompt (the prompt's tokens are already the row's; names the environment)."""
        gym = _skyrl_gym()
        env_id = self.env_id or str(row.get("env_class") or "")
        if not env_id:
            raise ValueError("agent loop skyrl_gym needs the row's env_class column (or name one: skyrl_gym/<id>)")
        _check_registered(gym, env_id)
        self.name = env_id
        from omegaconf import OmegaConf  # skyrl-gym's own config type (its environments read attributes of it)

        config = OmegaConf.create(dict(self.context.env_config))
        self.env = gym.make(env_id, env_config=config, extras=skyrl_extras(row))
        prompt = [dict(message) for message in row["raw_prompt"]]
        given, _ = self.env.init(prompt)
        if [dict(m) for m in given] != prompt:
            raise ValueError(
                f"skyrl-gym environment {env_id!r} changed the prompt in init(); the row's prompt tokens are encoded "
                "before the rollout, so put the prompt it wants in the data instead"
            )

    async def step(self, text: str, last: bool) -> EnvStep:
        """The environment's ``step(text)``: its observations, reward and ``done`` (done too when `last`)."""
        try:
            out = await in_thread(functools.partial(self.env.step, text), self.context.step_timeout_s)
        except TimeoutError:
            return EnvStep(done=True, metadata={"env_error": f"{self.name}.step timed out"})
        except Exception as e:  # noqa: BLE001 - the trajectory ends, the run goes on
            return EnvStep(done=True, metadata={"env_error": f"{self.name}.step raised {type(e).__name__}: {e}"})
        reward = out.get("reward")
        return EnvStep(
            observations=[{"role": m["role"], "content": m["content"]} for m in out.get("observations") or []],
            reward=None if reward is None else float(reward),
            done=bool(out.get("done")) or last,
            metadata=dict(out.get("metadata") or {}),
        )

    async def close(self) -> None:
        """The environment's ``close()`` (in a thread, bounded as ``step``), then the trajectory's tools'."""
        env = getattr(self, "env", None)
        if env is not None:
            with contextlib.suppress(Exception):  # closing is best effort
                await in_thread(env.close, self.context.step_timeout_s)
        await super().close()
