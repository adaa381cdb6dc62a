"""Smoke path: one GRPO, one RLOO and one PPO (GAE + critic) iteration of the single-process trainer on the tiny
random model, with a custom reward given as ``path.py:function`` (the random model never answers arithmetic right,
so a dense reward is needed for a non-zero policy gradient)."""

import math

import pytest
import torch
from tiny_runs import tiny_run_config

from hybridflow.engine.trainer import SingleProcessTrainer


def _config(tmp_path, tiny_model_dir, estimator, extra=()):
    return tiny_run_config(tmp_path, tiny_model_dir, estimator, ["trainer.total_iterations=1", *extra])


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
    # verl's throughput figures (metric_utils.compute_throughout_metrics): tokens per second per device, one here
    assert metrics["perf/time_per_step"] == metrics["timing_s/step"]
    assert metrics["perf/throughput"] == pytest.approx(metrics["perf/total_num_tokens"] / metrics["timing_s/step"])
    assert 0 <= metrics["prompt_length/clip_ratio"] <= 1
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
    verl_named = {k: v for k, v in records[0].items() if k.startswith(("val-core/", "val-aux/"))}  # verl's names
    assert verl_named in (
        {
            "val-core/reasoning_gym/basic_arithmetic/reward/mean@1": records[0][
                "val/reasoning_gym/basic_arithmetic/score"
            ]
        },
        {
            "val-core/reasoning_gym/basic_arithmetic/acc/mean@1": records[0]["val/reasoning_gym/basic_arithmetic/acc"],
            "val-aux/reasoning_gym/basic_arithmetic/reward/mean@1": records[0][
                "val/reasoning_gym/basic_arithmetic/score"
            ],
        },
    )
    lines = (tmp_path / "outputs" / "hybridflow" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(records) == 2


def test_ref_policy_stays_frozen(tmp_path, tiny_model_dir):
    trainer = SingleProcessTrainer(_config(tmp_path, tiny_model_dir, "grpo", ["actor.use_kl_loss=true"]))
    ref_before = _snapshot(trainer.ref.model)
    trainer.step()
    assert _changed(ref_before, trainer.ref.model) == 0


def test_the_reward_model_alone_trains_the_single_process_trainer(tmp_path, tiny_model_dir):
    """``reward.function_coef: 0`` with a reward model: the training reward is the RM's score alone, while the
    function's score is still logged (``critic/score``) and still drives validation."""
    from tiny_runs import write_reward_model
    from transformers import AutoTokenizer

    rm = write_reward_model(tmp_path / "rm", AutoTokenizer.from_pretrained(tiny_model_dir))
    extra = ["reward_model.enable=true", f"reward_model.path={rm}", "reward_model.coef=2.0", "reward.function_coef=0"]
    trainer = SingleProcessTrainer(_config(tmp_path, tiny_model_dir, "grpo", extra))
    metrics = trainer.fit(log=lambda record: None)[-1]
    assert metrics["timing_s/rm_score"] > 0
    assert metrics["critic/rewards/mean"] == pytest.approx(2.0 * metrics["critic/rm_score/mean"], rel=1e-5, abs=1e-6)
    assert metrics["critic/score/mean"] != pytest.approx(metrics["critic/rewards/mean"])
    assert metrics["actor/grad_norm"] > 0 and "val/reasoning_gym/basic_arithmetic/acc" in metrics
