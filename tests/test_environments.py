"""Environments as other libraries write them, unmodified: skyrl-gym's (`hybridflow.engine.agent.skyrl_gym_env`),
run by our agent rollout on the tiny model; on the same completions our rewards equal the environment's own scoring.

Real packages (skyrl-gym, installed with the ``envs`` extra), the real hf engine, no stand-ins."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.agent.environment import environment_score
from hybridflow.engine.agent.loop import agent_loop
from hybridflow.engine.data import collate_prompts, encode_prompt
from hybridflow.engine.models import load_model, load_tokenizer

skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym: pip install 'hybridflow[envs]'")

USER_ENV = '''
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class Vowels(BaseTextEnv):
    """Multi-turn: each turn scores the share of vowels in the answer; asks again up to max_turns."""

    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.max_turns = int((extras.get("extra_info") or {}).get("max_turns") or env_config.get("max_turns", 2))
        self.bonus = float(env_config.get("bonus", 0.0))

    def step(self, action):
        self.turns += 1
        done = self.turns >= self.max_turns
        reward = sum(c in "aeiou" for c in action) / max(len(action), 1) + self.bonus
        observations = [] if done else [{"role": "user", "content": f"Turn {self.turns} done. Again."}]
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done, metadata={"t": self.turns})


if "vowels" not in skyrl_gym.registry:
    skyrl_gym.register(id="vowels", entry_point=Vowels)
'''


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def rollout_of(tiny, tiny_model_dir, loop: str, **multi_turn):
    from tiny_runs import environment_rollout

    return environment_rollout(tiny, tiny_model_dir, loop, **multi_turn)


def batch(tokenizer, questions, truths, **columns):
    items = [
        {
            "input_ids": encode_prompt([{"role": "user", "content": q}], tokenizer),
            "index": i,
            "prompt": [{"role": "user", "content": q}],
            "data_source": "openai/gsm8k",
            "reward_model": {"style": "rule", "ground_truth": truths[i]},
            "extra_info": {"index": i, **columns.get("extra_info", [{}] * len(questions))[i]},
        }
        for i, q in enumerate(questions)
    ]
    return collate_prompts(items, tokenizer)


def model_turns(out, i, tokenizer) -> list[str]:
    """Row i's assistant turns as text: the runs of response_mask 1."""
    ids, mask = out.batch["responses"][i].tolist(), out.batch["response_mask"][i].tolist()
    turns, current = [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    if current:
        turns.append(current)
    return [tokenizer.decode(t, skip_special_tokens=True) for t in turns]


def test_a_skyrl_gym_environment_registered_by_the_user_scores_as_it_does_itself(tiny, tiny_model_dir, tmp_path):
    (tmp_path / "vowels_env.py").write_text(USER_ENV)
    _, tokenizer = tiny
    rollout = rollout_of(
        tiny,
        tiny_model_dir,
        "skyrl_gym/vowels",
        env_imports=[str(tmp_path / "vowels_env.py")],
        env_config={"bonus": 0.5},
    )
    prompts = batch(tokenizer, ["Say a word", "Name a fruit"], ["x", "y"], extra_info=[{"max_turns": 3}] * 2)
    out = rollout.generate_sequences(prompts)
    assert (out.batch["agent/num_turns"] > 2).any()  # observations were appended and answered
    for i, extra in enumerate(out.non_tensor_batch["extra_info"]):
        turns = model_turns(out, i, tokenizer)
        # the environment's own scoring of the same completions, turn by turn
        env = skyrl_gym.make("vowels", env_config={"bonus": 0.5}, extras={"extra_info": {"max_turns": 3}})
        env.init(prompts.non_tensor_batch["raw_prompt"][i // 2])
        own = [env.step(text)["reward"] for text in turns]
        assert extra["agent"]["env_rewards"] == pytest.approx(own, abs=1e-12)
        assert environment_score("x", "", None, extra)["score"] == pytest.approx(sum(own))
        assert [m["t"] for m in extra["agent"]["env_metadata"]] == list(range(1, len(turns) + 1))


def test_skyrl_gyms_gsm8k_scores_the_final_answer_as_it_does_itself(tiny, tiny_model_dir):
    _, tokenizer = tiny
    rollout = rollout_of(tiny, tiny_model_dir, "skyrl_gym/gsm8k")
    prompts = batch(tokenizer, ["What is 6 times 7?", "What is 2 plus 2?"], [42, "4"])
    out = rollout.generate_sequences(prompts)
    assert (out.batch["agent/num_turns"] == 2).all()  # gsm8k: one answer, done
    for i, extra in enumerate(out.non_tensor_batch["extra_info"]):
        [text] = model_turns(out, i, tokenizer)
        for answer, truth in ((text, ["42", "4"][i // 2]), (text + "\n#### " + ["42", "4"][i // 2], None)):
            env = skyrl_gym.make("gsm8k", env_config={}, extras={"reward_spec": {"ground_truth": ["42", "4"][i // 2]}})
            env.init([])
            expected = env.step(answer)["reward"]
            if truth is not None:  # the model's own completion
                assert extra["agent"]["env_reward"] == expected
            else:  # the same scorer would give a right answer 1.0: the adapter passed the truth as skyrl does
                assert expected == 1.0


def test_unknown_skyrl_ids_and_a_missing_env_class_are_refused_before_generation(tiny, tiny_model_dir):
    with pytest.raises(ValueError, match="skyrl-gym has no environment 'nope'.*env_imports"):
        agent_loop("skyrl_gym/nope")
    _, tokenizer = tiny
    rollout = rollout_of(tiny, tiny_model_dir, "skyrl_gym")
    with pytest.raises(ValueError, match="env_class"):
        rollout.generate_sequences(batch(tokenizer, ["Hi"], ["1"]))
    assert torch.tensor(0).item() == 0


def test_hf_run_trains_on_a_skyrl_gym_environments_reward(prefect_api, tmp_path, tiny_model_dir):
    """`hf run` from a config that names the environment: the environment's reward is the training score."""
    from tiny_runs import hf_run_metrics

    (tmp_path / "vowels_env.py").write_text(USER_ENV)
    overrides = [
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.default_agent_loop=skyrl_gym/vowels",
        f"rollout.multi_turn.env_imports=[{tmp_path / 'vowels_env.py'}]",
        "rollout.multi_turn.env_config={max_turns: 2, bonus: 1.0}",
        "reward.custom_function=hybridflow.engine.agent.environment:environment_score",
        "rollout.response_length=48",
        "data.max_prompt_length=512",
        "trainer.total_iterations=2",
        "trainer.log_train_generations=2",
    ]
    metrics = hf_run_metrics(prefect_api, tmp_path, tiny_model_dir, overrides)
    for step in (1, 2):
        assert metrics[step]["reward_extra/env_scored/mean"] == 1.0  # every trajectory scored by its environment
        # the bonus of 1.0 per step, 1 or 2 steps, plus the vowel shares: the environment's reward, not a rule's
        assert 1.0 <= metrics[step]["critic/score/mean"] <= 4.0
