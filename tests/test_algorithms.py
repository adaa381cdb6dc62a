"""The registered estimators and policy losses through a real iteration (`SingleProcessTrainer`, the tiny model):
each one configured by its key runs, steps the weights, and changes what it should change on the same rollout.

Every variant samples the same first batch (same seed and data), so the rewards are equal across variants: a
different ``critic/advantages/*`` shows the estimator ran, a different ``actor/pg_loss`` that the policy loss did.
"""

import math

import pytest
import torch
from tiny_runs import tiny_run_config, write_cost

from hybridflow.engine.dynamic_sampling import DynamicSamplingError
from hybridflow.engine.trainer import SingleProcessTrainer

VARIANTS = {
    "grpo": ("grpo", []),
    "dr_grpo": ("grpo", ["algorithm.norm_adv_by_std_in_grpo=false", "actor.loss_agg_mode=seq-mean-token-sum-norm"]),
    "rloo": ("rloo", []),
    "reinforce_plus_plus": ("reinforce_plus_plus", ["algorithm.gamma=0.9"]),
    "reinforce_plus_plus_baseline": ("reinforce_plus_plus_baseline", []),
    "opo": ("opo", []),
    # the tiny model's greedy responses hold no digits: the overlong penalty gives their baselines a value
    "remax": ("remax", ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=10"]),
    "gspo": ("grpo", ["actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=seq-mean-token-mean"]),
    "cispo": ("grpo", ["actor.policy_loss.loss_mode=cispo"]),
    "gpg": ("gpg", ["actor.policy_loss.loss_mode=gpg"]),
    "gmpo": ("grpo", ["actor.policy_loss.loss_mode=geo_mean", "actor.clip_ratio_low=0.4", "actor.clip_ratio_high=0.4"]),
    "sapo": ("grpo", ["actor.policy_loss.loss_mode=sapo", "actor.policy_loss.tau_neg=2.0"]),
    "clip_cov": ("grpo", ["actor.policy_loss.loss_mode=clip_cov", "actor.policy_loss.clip_cov_ratio=0.2"]),
    "kl_cov": ("grpo", ["actor.policy_loss.loss_mode=kl_cov", "actor.policy_loss.kl_cov_ratio=0.2"]),
    "token_sum_k3plus": ("grpo", ["actor.loss_agg_mode=token-sum", "actor.use_kl_loss=true", "actor.kl_loss_type=k3+"]),
    "overlong": ("grpo", ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=10"]),
    "gae": ("gae", []),
    "pf_ppo": ("gae", ["algorithm.use_pf_ppo=true", "algorithm.pf_ppo.weight_pow=4"]),
    "otb": ("optimal_token_baseline", ["actor.calculate_sum_pi_squared=true"]),
    "gdpo": ("gdpo", ["algorithm.gdpo_reward_keys=[score, acc]", "algorithm.gdpo_reward_weights=[1.0, 0.5]"]),
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
        if name == "remax":  # the greedy responses' mean score, before the step, on the batch it will draw
            cursor = trainer.sampler.state_dict()
            greedy = trainer.rollout.generate_sequences(trainer.sampler.next_batch(), n=1, temperature=0.0)
            trainer.sampler.load_state_dict(cursor)
            lengths = greedy.batch["response_mask"].sum(-1).float()
            penalty = ((12 - 10 - lengths) / 10).clamp(max=0)  # DAPO eq. 13: 12-token limit, 10-token buffer
            greedy_score = float((trainer.reward_fn(greedy)[0].sum(-1) + penalty).mean())
        metrics = trainer.step()
        moved = max((p.detach() - before[k]).abs().max().item() for k, p in trainer.actor.model.named_parameters())
        out[name] = metrics, moved
    out["remax"][0]["greedy_score"] = greedy_score
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
    # GPG centres on the group mean as Dr. GRPO does, scaled by B / (non-zero scores) > 1 when some score is 0
    gpg, dr_grpo_max = (
        first_steps["gpg"][0]["critic/advantages/max"],
        first_steps["dr_grpo"][0]["critic/advantages/max"],
    )
    assert gpg > dr_grpo_max > 0
    # OPO's baseline is the length-weighted group mean: Dr. GRPO's plain mean when a group's lengths are equal
    opo, dr_grpo = first_steps["opo"][0], first_steps["dr_grpo"][0]
    same_lengths = opo["response_length/min"] == opo["response_length/max"]
    for key in ("critic/advantages/max", "critic/advantages/min"):
        assert (abs(opo[key] - dr_grpo[key]) < 1e-6) == same_lengths, (key, opo[key], dr_grpo[key])


def test_gdpo_whitens_the_group_normalised_components_of_the_score_functions_dict(
    first_steps, tmp_path, tiny_model_dir
):
    """GDPO on the dense reward's dict ({score, acc}): acc is 0 everywhere, so it normalises to 0, and the
    advantages are GRPO's of the score, whitened over the batch's response tokens: mean 0, another spread."""
    gdpo, grpo = first_steps["gdpo"][0], first_steps["grpo"][0]
    assert abs(gdpo["critic/advantages/mean"]) < 1e-5
    assert gdpo["critic/advantages/max"] != pytest.approx(grpo["critic/advantages/max"], abs=1e-4)
    with pytest.raises(ValueError, match="algorithm.adv_estimator=gdpo normalises the score function's reward"):
        tiny_run_config(tmp_path, tiny_model_dir, "gdpo")


def test_the_same_advantages_give_each_policy_loss_its_own_value(first_steps):
    names = ("grpo", "gspo", "cispo", "gmpo")
    assert len({first_steps[name][0]["critic/advantages/max"] for name in names}) == 1
    losses = [first_steps[name][0]["actor/pg_loss"] for name in names[:3]]
    assert len({round(x, 6) for x in losses}) == 3, losses
    # on-policy (every ratio 1) GMPO's loss is GSPO's with seq-mean-token-mean: minus each response's mean advantage,
    # averaged over responses; their gradients differ (GMPO clips each token's ratio, GSPO the sequence's)
    gmpo, gspo = first_steps["gmpo"][0]["actor/pg_loss"], first_steps["gspo"][0]["actor/pg_loss"]
    assert gmpo == pytest.approx(gspo, abs=1e-6) and gmpo != pytest.approx(losses[0], abs=1e-6)
    grpo = first_steps["grpo"][0]
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


def test_pf_ppo_trains_on_the_batch_redrawn_by_reward(first_steps):
    """PF-PPO (|score|^4 weights): the update trains on rows redrawn from the same rollout, higher scores more often
    (the mean score of the rows drawn is above the batch's), some rows twice and others never, so the loss differs
    from plain GAE's on the same samples."""
    pf, gae = first_steps["pf_ppo"][0], first_steps["gae"][0]
    assert pf["critic/score/mean"] == gae["critic/score/mean"] == first_steps["grpo"][0]["critic/score/mean"]
    assert pf["pf_ppo/score_mean"] > gae["critic/score/mean"]
    assert 0 < pf["pf_ppo/distinct_fraction"] < 1
    assert pf["actor/pg_loss"] != pytest.approx(gae["actor/pg_loss"], abs=1e-6)


def test_the_optimal_token_baseline_weighs_returns_by_path_variance(first_steps):
    """OTB on the same samples as GRPO: its returns are the reward-to-go (the outcome score on every token), and
    its per-token baselines (the exact values are checked in test_core_algos) give advantages of its own."""
    otb, grpo = first_steps["otb"][0], first_steps["grpo"][0]
    assert otb["critic/score/mean"] == grpo["critic/score/mean"]
    assert otb["critic/returns/max"] == pytest.approx(otb["critic/score/max"], abs=1e-6)
    assert otb["critic/advantages/max"] != pytest.approx(grpo["critic/advantages/max"], abs=1e-4)
    assert "timing_s/old_log_prob" in otb  # the stage that computes sum_pi_squared runs


def test_remax_subtracts_the_score_of_each_prompts_greedy_response(first_steps):
    """The baseline is the greedy responses' training score (here with the overlong penalty), from a greedy
    generation of the batch's prompts; the returns are the reward-to-go (every token of a response: its training
    reward); the exact advantage is checked in test_core_algos."""
    remax, grpo = first_steps["remax"][0], first_steps["grpo"][0]
    assert remax["critic/score/mean"] == grpo["critic/score/mean"]  # the same samples
    assert remax["greedy_score"] < 0  # a baseline that matters
    assert remax["critic/reward_baseline/mean"] == pytest.approx(remax["greedy_score"], abs=1e-6)
    assert remax["critic/returns/max"] == pytest.approx(remax["critic/rewards/max"], abs=1e-6)
    assert remax["critic/advantages/max"] != grpo["critic/advantages/max"]


DAPO = ["algorithm.filter_groups.enable=true", "data.gen_batch_size=2", "trainer.total_iterations=2"]


def test_dynamic_sampling_draws_until_enough_varied_groups_and_resumes_exactly(tmp_path, tiny_model_dir):
    """2 prompts a draw for a batch of 4: at least two draws per iteration, each advancing the checkpointed cursor,
    so a run resumed after iteration 1 repeats iteration 2 exactly."""

    def trainer(name: str, *extra: str) -> SingleProcessTrainer:
        root = tmp_path / name
        root.mkdir()
        return SingleProcessTrainer(tiny_run_config(root, tiny_model_dir, "grpo", [*DAPO, *extra]))

    varied = ["algorithm.filter_groups.metric=seq_reward"]
    whole = trainer("whole", *varied)
    first, second = whole.step(), whole.step()
    draws = [m["train/num_gen_batches"] for m in (first, second)]
    assert min(draws) >= 2 and whole.sampler.state_dict()["index"] == 2 * sum(draws)
    assert first["timing_s/filter_groups"] > 0

    stopped = trainer("stopped", *varied)
    stopped.step()
    resumed = trainer("resumed", *varied)
    resumed.load_checkpoint(stopped.save_checkpoint().path)
    again = resumed.step()
    for key, value in second.items():
        if not key.startswith(("timing_s/", "perf/")):
            assert again[key] == value, key

    # the tiny model never answers right: every group's acc is equal, so no draw keeps anything
    hopeless = trainer(
        "hopeless", "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=3"
    )
    before = {k: v.detach().clone() for k, v in hopeless.actor.model.named_parameters()}
    with pytest.raises(DynamicSamplingError, match=r"3 draws of 2 prompts kept 0 with a varied acc"):
        hopeless.step()
    assert all(torch.equal(p, before[k]) for k, p in hopeless.actor.model.named_parameters())  # nothing trained


def test_safe_rlhf_steps_lambda_against_the_cost_limit_trains_the_cost_critic_and_resumes_exactly(
    tmp_path, tiny_model_dir
):
    """Safe-RLHF (``algorithm.cost_limit`` with ``reward.cost_function``): lambda rises while the mean episode cost
    is over the limit and falls while it is under, the cost critic trains beside the critic, and a run resumed
    after iteration 1 repeats iteration 2 exactly, lambda included."""

    def trainer(name: str, limit: float) -> SingleProcessTrainer:
        root = tmp_path / name
        root.mkdir()
        extra = [f"algorithm.cost_limit={limit}", f"reward.cost_function={write_cost(root)}"]
        return SingleProcessTrainer(tiny_run_config(root, tiny_model_dir, "gae", extra))

    over = trainer("over", 0.0)  # every response costs more than 0
    cost_before = {k: v.detach().clone() for k, v in over.cost_critic.model.named_parameters()}
    first, second = over.step(), over.step()
    cost = first["critic/cost/mean"]
    assert cost > 0 and first["actor/lagrange_multiplier"] == pytest.approx(math.exp(0.1 * cost))
    assert 1.0 < first["actor/lagrange_multiplier"] < second["actor/lagrange_multiplier"]
    assert math.isfinite(first["cost_critic/vf_loss"]) and first["cost_critic/grad_norm"] > 0
    assert first["cost_critic/vf_loss"] != first["critic/vf_loss"]  # its own targets: the cost's returns
    moved = max((p.detach() - cost_before[k]).abs().max().item() for k, p in over.cost_critic.model.named_parameters())
    assert moved > 0

    under = trainer("under", 1e3).step()  # far under the limit: lambda falls
    assert under["actor/lagrange_multiplier"] < 1.0

    stopped = trainer("stopped", 0.0)
    stopped.step()
    saved = stopped.save_checkpoint().path
    assert (saved / "cost_critic").is_dir()
    resumed = trainer("resumed", 0.0)
    resumed.load_checkpoint(saved)
    assert resumed.lagrangian.value == first["actor/lagrange_multiplier"]
    again = resumed.step()
    for key, value in second.items():
        if not key.startswith(("timing_s/", "perf/")):
            assert again[key] == value, key

    # a checkpoint without a cost critic (plain PPO) cannot continue as Safe-RLHF: refused before any work
    from hybridflow.flows.preflight import InputError, check_run_inputs

    (tmp_path / "plain").mkdir()
    plain = SingleProcessTrainer(tiny_run_config(tmp_path / "plain", tiny_model_dir, "gae")).save_checkpoint().path
    safe = ["algorithm.cost_limit=0", f"reward.cost_function={write_cost(tmp_path)}"]
    check_run_inputs(tiny_run_config(tmp_path, tiny_model_dir, "gae", [*safe, f"trainer.resume_from={saved}"]))
    with pytest.raises(InputError, match=r"has no cost_critic/ \(a run without Safe-RLHF wrote it\)"):
        check_run_inputs(tiny_run_config(tmp_path, tiny_model_dir, "gae", [*safe, f"trainer.resume_from={plain}"]))
