"""Smoke path: one GRPO, one RLOO and one PPO (GAE + critic) iteration of the single-process trainer on the tiny
random model, with a custom reward given as ``path.py:function`` (the random model never answers arithmetic right,
so a dense reward is needed for a non-zero policy gradient)."""

import math

import pytest
import torch

from hybridflow.engine.config import load_config
from hybridflow.engine.trainer import SingleProcessTrainer

REWARD = '''
def digit_share(data_source, solution_str, ground_truth, extra_info):
    """Fraction of characters that are digits: varies across samples, so advantages are non-zero."""
    return {"score": sum(c.isdigit() for c in solution_str) / max(1, len(solution_str)), "acc": 0.0}
'''


def _config(tmp_path, tiny_model_dir, estimator, extra=()):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(REWARD)
    overrides = [
        f"model.path={tiny_model_dir}",
        "data.reasoning_gym.name=basic_arithmetic",
        "data.reasoning_gym.train_size=32",
        "data.reasoning_gym.val_size=4",
        "data.train_batch_size=4",
        "rollout.n=2",
        "rollout.response_length=12",
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size=2",
        "actor.optim.lr=1e-3",
        "critic.ppo_mini_batch_size=2",
        "critic.optim.lr=1e-3",
        f"algorithm.adv_estimator={estimator}",
        f"reward.custom_function={reward_file}:digit_share",
        "trainer.total_iterations=1",
        f"trainer.output_dir={tmp_path / 'outputs'}",
        *extra,
    ]
    return load_config(None, overrides)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(before, model):
    return sum(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("estimator", "extra"),
    [
        ("grpo", ["actor.use_kl_loss=true", "actor.entropy_coeff=0.001"]),
        ("rloo", ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"]),
        ("gae", ["algorithm.gamma=0.99", "algorithm.lam=0.95"]),
    ],
)
def test_one_iteration_trains(tmp_path, tiny_model_dir, estimator, extra):
    trainer = SingleProcessTrainer(_config(tmp_path, tiny_model_dir, estimator, extra))
    actor_before = _snapshot(trainer.actor.model)
    critic_before = _snapshot(trainer.critic.model) if trainer.critic else None

    records = trainer.fit(log=lambda record: None)

    metrics = records[-1]
    for name in [
        "actor/pg_loss",
        "actor/ppo_kl",
        "actor/grad_norm",
        "actor/entropy",
        "critic/score/mean",
        "critic/advantages/mean",
        "response_length/mean",
        "timing_s/gen",
        "timing_s/update_actor",
        "perf/throughput",
        "val/reasoning_gym/basic_arithmetic/acc",
    ]:
        assert name in metrics, name
        assert math.isfinite(metrics[name]), (name, metrics[name])
    assert metrics["actor/grad_norm"] > 0
    assert _changed(actor_before, trainer.actor.model) > 0, "actor weights did not change"
    if estimator == "gae":
        assert math.isfinite(metrics["critic/vf_loss"])
        assert _changed(critic_before, trainer.critic.model) > 0, "critic weights did not change"
        assert "timing_s/values" in metrics and "timing_s/update_critic" in metrics
    else:
        assert trainer.critic is None and "critic/vf_loss" not in metrics
    if estimator == "grpo":
        assert "actor/kl_loss" in metrics and "timing_s/ref" in metrics
    if estimator == "rloo":
        assert "actor/reward_kl_penalty" in metrics
    # validation ran before training and after the last iteration; every record reached metrics.jsonl
    assert "val/reasoning_gym/basic_arithmetic/acc" in records[0]
    lines = (tmp_path / "outputs" / "hybridflow" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(records) == 2


def test_ref_policy_stays_frozen(tmp_path, tiny_model_dir):
    trainer = SingleProcessTrainer(_config(tmp_path, tiny_model_dir, "grpo", ["actor.use_kl_loss=true"]))
    ref_before = _snapshot(trainer.ref.model)
    trainer.step()
    assert _changed(ref_before, trainer.ref.model) == 0
