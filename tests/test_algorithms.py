"""The registered estimators and policy losses through a real iteration (`SingleProcessTrainer`, the tiny model):
each one configured by its key runs, steps the weights, and changes what it should change on the same rollout.

Every variant samples the same first batch (same seed and data), so the rewards are equal across variants: a
different ``critic/advantages/*`` shows the estimator ran, a different ``actor/pg_loss`` that the policy loss did.
"""

import math

import pytest
from tiny_runs import tiny_run_config

from hybridflow.engine.trainer import SingleProcessTrainer

VARIANTS = {
    "grpo": ("grpo", []),
    "dr_grpo": ("grpo", ["algorithm.norm_adv_by_std_in_grpo=false", "actor.loss_agg_mode=seq-mean-token-sum-norm"]),
    "rloo": ("rloo", []),
    "reinforce_plus_plus": ("reinforce_plus_plus", ["algorithm.gamma=0.9"]),
    "reinforce_plus_plus_baseline": ("reinforce_plus_plus_baseline", []),
    "opo": ("opo", []),
    "gspo": ("grpo", ["actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=seq-mean-token-mean"]),
    "cispo": ("grpo", ["actor.policy_loss.loss_mode=cispo"]),
    "token_sum_k3plus": ("grpo", ["actor.loss_agg_mode=token-sum", "actor.use_kl_loss=true", "actor.kl_loss_type=k3+"]),
    "overlong": ("grpo", ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=10"]),
}


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory, tiny_model_dir):
    """Each variant's metrics after one iteration, and how far its actor's weights moved."""
    out = {}
    for name, (estimator, extra) in VARIANTS.items():
        root = tmp_path_factory.mktemp(name)
        trainer = SingleProcessTrainer(
            tiny_run_config(root, tiny_model_dir, estimator, [*extra, "trainer.total_iterations=1"])
        )
        before = {k: v.detach().clone() for k, v in trainer.actor.model.named_parameters()}
        metrics = trainer.step()
        moved = max((p.detach() - before[k]).abs().max().item() for k, p in trainer.actor.model.named_parameters())
        out[name] = metrics, moved
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_runs_an_iteration_and_steps_the_actor(first_steps, name):
    metrics, moved = first_steps[name]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/advantages/mean", "critic/score/mean"):
        assert math.isfinite(metrics[key]), key
    assert moved > 0


def test_the_same_rollout_gives_each_estimator_its_own_advantages(first_steps):
    scores = {name: m["critic/score/mean"] for name, (m, _) in first_steps.items()}
    assert len(set(scores.values())) == 1, scores  # one rollout for all: the comparison below is fair
    estimators = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
    seen = [round(first_steps[name][0]["critic/advantages/max"], 6) for name in estimators]
    assert len(set(seen)) == len(seen), dict(zip(estimators, seen, strict=True))
    # OPO's baseline is the length-weighted group mean: Dr. GRPO's plain mean when a group's lengths are equal
    opo, dr_grpo = first_steps["opo"][0], first_steps["dr_grpo"][0]
    same_lengths = opo["response_length/min"] == opo["response_length/max"]
    for key in ("critic/advantages/max", "critic/advantages/min"):
        assert (abs(opo[key] - dr_grpo[key]) < 1e-6) == same_lengths, (key, opo[key], dr_grpo[key])


def test_the_same_advantages_give_each_policy_loss_its_own_value(first_steps):
    grpo, gspo, cispo = (first_steps[name][0] for name in ("grpo", "gspo", "cispo"))
    assert grpo["critic/advantages/max"] == gspo["critic/advantages/max"] == cispo["critic/advantages/max"]
    losses = [grpo["actor/pg_loss"], gspo["actor/pg_loss"], cispo["actor/pg_loss"]]
    assert len({round(x, 6) for x in losses}) == 3, losses
    # token-sum sums where token-mean averages: the gradient grows with the mini-batch's token count (dozens here)
    summed = first_steps["token_sum_k3plus"][0]
    assert summed["actor/grad_norm"] > 5 * grpo["actor/grad_norm"]
    assert math.isfinite(summed["actor/kl_loss"])


def test_the_overlong_penalty_joins_the_training_reward_not_the_score(first_steps):
    """12-token limit, a 10-token buffer: a response longer than 2 tokens loses up to 1 (DAPO, eq. 13)."""
    metrics = first_steps["overlong"][0]
    assert metrics["critic/score/mean"] == first_steps["grpo"][0]["critic/score/mean"]  # the function's, unshaped
    assert -1.0 <= metrics["reward_extra/overlong_reward/mean"] < 0 and metrics["reward_extra/overlong/mean"] > 0
    assert metrics["critic/rewards/mean"] == pytest.approx(
        metrics["critic/score/mean"] + metrics["reward_extra/overlong_reward/mean"], abs=1e-6
    )
