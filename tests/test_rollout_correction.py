"""The rollout correction (``algorithm.rollout_correction``, `hybridflow.engine.algorithms.rollout_correction`):
truncated importance weights, rejection sampling with verl's k1/k2/k3 bounds, batch-normalised weights, decoupled
and bypass modes, checked by hand against verl's formulas, then through a flow on real processes with vLLM."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from hybridflow.engine.algorithms.losses import compute_policy_loss
from hybridflow.engine.algorithms.rollout_correction import (
    batch_mean_weight,
    bypass_policy_loss,
    kept_loss_scale,
    rejection_bounds,
    rejection_mask,
    rollout_is_weights,
)
from hybridflow.engine.config import ActorConfig, ConfigError, RolloutCorrectionConfig, load_config
from hybridflow.engine.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")


def test_rollout_is_weights_by_token_and_by_sequence_and_their_effect_on_the_policy_loss():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.6, 0.5]]))
    rollout = torch.log(torch.tensor([[0.25, 0.4, 0.3], [0.6, 0.6, 0.7]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the second response has 2 tokens
    # pi_old / pi_rollout per token: [2, 0.5, 3] and [0.5, 1, (padding)] -> truncated at 2.5: [2, 0.5, 2.5], [0.5, 1]
    w, stats = rollout_is_weights(old, rollout, mask, "token", threshold=2.5)
    assert_close(w * mask, torch.tensor([[2.0, 0.5, 2.5], [0.5, 1.0, 0.0]]))
    raw = torch.tensor([2.0, 0.5, 3.0, 0.5, 1.0])  # the response tokens' weights before truncation
    assert_close(stats["rollout_is_mean"], raw.mean())
    assert_close(stats["rollout_is_ratio_fraction_high"], torch.tensor(1 / 5))  # 3 > 2.5
    assert_close(stats["rollout_is_ratio_fraction_low"], torch.tensor(0.0))  # none below 1 / 2.5
    clamped = raw.clamp(0.4, 2.5)
    assert_close(stats["rollout_is_eff_sample_size"], 1 / ((clamped / clamped.mean()) ** 2).mean())
    # sequence level: each response's product of ratios, on all its tokens: 2 x 0.5 x 3 = 3 -> 2.5; 0.5 x 1 = 0.5
    w, stats = rollout_is_weights(old, rollout, mask, "sequence", threshold=2.5)
    assert_close(w * mask, torch.tensor([[2.5, 2.5, 2.5], [0.5, 0.5, 0.0]]))
    assert_close(stats["rollout_is_ratio_fraction_high"], torch.tensor(3 / 5))  # of response tokens
    # ratio 1 (log_prob == old): per-token loss -A, weighted: -(1*2 + 3*0.5 + 2*2.5) / 3
    w, _ = rollout_is_weights(old[:1], rollout[:1], mask[:1], "token", threshold=2.5)
    adv = torch.tensor([[1.0, 3.0, 2.0]])
    new = old[:1].clone().requires_grad_(True)
    loss, *_ = compute_policy_loss(old[:1], new, adv, mask[:1], is_weights=w)
    assert_close(loss, torch.tensor(-(2.0 + 1.5 + 5.0) / 3))
    loss.backward()
    # d(-A * w * exp(new - old)) / d new = -A * w at ratio 1: the weights scale the gradient, and get none
    assert_close(new.grad, -(adv * w) / 3)
    with pytest.raises(ValueError, match=r"rollout_correction\.rollout_is_threshold"):
        rollout_is_weights(old, rollout, mask, "token", threshold=0.0)
    with pytest.raises(ValueError, match=r"rollout_correction\.rollout_is must be token or sequence"):
        rollout_is_weights(old, rollout, mask, "geometric")


def test_rejection_keeps_tokens_and_responses_within_verls_k1_k2_k3_bounds():
    # log ratio (train - rollout); row 0 has 2 response tokens, row 1 three, row 2 one
    log_ratio = torch.tensor([[0.1, -0.7, 9.0], [0.2, 0.1, -0.3], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    # token_k1 keeps -log_ratio in [log 0.6, log 1.6] = [-0.51, 0.47]: rejects -0.7's token (0.7) and 3.0's (-3)
    kept, stats = rejection_mask(log_ratio, mask, rejection_bounds("token_k1", "0.6_1.6"))
    assert kept.tolist() == [[1, 0, 0], [1, 1, 1], [0, 0, 0]] and kept.dtype == mask.dtype
    assert_close(stats["rollout_rs_token_k1_masked_fraction"], torch.tensor(2 / 6))
    assert_close(stats["rollout_rs_seq_masked_fraction"], torch.tensor(2 / 3))
    assert_close(stats["rollout_rs_token_k1_mean"], torch.tensor(-(0.1 - 0.7 + 0.2 + 0.1 - 0.3 + 3.0) / 6))
    # seq_max_k2: the largest log_ratio^2 / 2 per response: 0.245, 0.045, 4.5 -> bound 2.5 drops row 2 only
    kept, _ = rejection_mask(log_ratio, mask, rejection_bounds("seq_max_k2", 2.5))
    assert kept.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    # seq_sum_k3: sum of exp(r) - 1 - r: row 0 = 0.00517 + 0.09659, row 1 = 0.02140 + 0.00517 + 0.04082 = 0.0674
    k3 = torch.expm1(log_ratio) - log_ratio
    sums = [(k3[0, :2]).sum(), k3[1].sum(), k3[2, 0]]
    kept, _ = rejection_mask(log_ratio, mask, rejection_bounds("seq_sum_k3", 0.08))
    assert [bool(row.any()) for row in kept] == [bool(s <= 0.08) for s in sums] == [False, True, False]
    # seq_mean_k1 with upper alone: lower = 1 / upper; row means of -r: 0.3, 0.0, -3.0 in [log 1/2, log 2]
    kept, _ = rejection_mask(log_ratio, mask, rejection_bounds("seq_mean_k1", "2"))
    assert kept.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    # two options, one threshold each, both must pass
    kept, stats = rejection_mask(log_ratio, mask, rejection_bounds("token_k1,seq_max_k2", "0.6_1.6,0.2"))
    assert kept.tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0]]  # row 0's max k2 0.245 > 0.2
    assert_close(stats["rollout_rs_masked_fraction"], torch.tensor(3 / 6))
    # padding never matters, even if it is garbage
    kept, _ = rejection_mask(torch.where(mask.bool(), log_ratio, float("nan")), mask, rejection_bounds("token_k2", 1))
    assert kept.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]


@pytest.mark.parametrize(
    ("options", "threshold", "error"),
    [
        ("token_k4", 1.0, r"unknown option \['token_k4'\]"),
        ("seq_max_k1", 1.0, r"unknown option"),
        ("token_k2", None, r"needs algorithm.rollout_correction.rollout_rs_threshold"),
        ("token_k2", "0.5_2", r"token_k2 takes one upper bound"),
        ("token_k1,token_k2", "1,2,3", r"one threshold for all 2 rollout_rs options or one per option"),
        ("token_k3", "-1", r"must be > 0"),
        ("token_k1", "a_b", r"not a number"),
    ],
)
def test_rejection_thresholds_are_checked_before_any_work(options, threshold, error):
    with pytest.raises(ValueError, match=error):
        rejection_bounds(options, threshold)
    overrides = [f"algorithm.rollout_correction.rollout_rs={options}", "rollout.name=vllm"]
    if threshold is not None:
        overrides.append(f"algorithm.rollout_correction.rollout_rs_threshold='{threshold}'")
    with pytest.raises(ConfigError, match=error):
        load_config(ROOT / "examples" / "grpo_tiny.yaml", overrides)


def test_the_modes_keys_are_checked_together():
    path, vllm = ROOT / "examples" / "grpo_tiny.yaml", "rollout.name=vllm"
    key = "algorithm.rollout_correction"
    with pytest.raises(ConfigError, match=r"rollout_is_batch_normalize normalises the weights of rollout_is"):
        load_config(path, [vllm, f"{key}.rollout_is_batch_normalize=true"])
    with pytest.raises(ConfigError, match=r"loss_type=reinforce is bypass mode's loss"):
        load_config(path, [vllm, f"{key}.loss_type=reinforce"])
    # a registered rollout that returns no rollout_log_probs (the hf and vllm rollouts both do)
    from hybridflow.engine.extensions import _ROLLOUTS, register_rollout

    register_rollout("test_no_log_probs", "hybridflow.engine.rollout.hf:build", syncs_weights=False)
    try:
        with pytest.raises(ConfigError, match=r"bypass_mode corrects .* the test_no_log_probs rollout reports none"):
            load_config(path, ["rollout.name=test_no_log_probs", f"{key}.bypass_mode=true"])
    finally:
        _ROLLOUTS.pop("test_no_log_probs")
    assert load_config(path, [f"{key}.bypass_mode=true", f"{key}.loss_type=reinforce"]).skips_old_log_prob()
    with pytest.raises(
        ConfigError, match=r"bypass_mode trains with its own loss .*, not actor.policy_loss.loss_mode=gspo"
    ):
        load_config(path, [vllm, f"{key}.bypass_mode=true", "actor.policy_loss.loss_mode=gspo"])
    bypass = load_config(path, [vllm, f"{key}.bypass_mode=true", f"{key}.loss_type=reinforce"])
    assert bypass.skips_old_log_prob()  # the rollout's log-probs are the old ones
    # decoupled rejection needs the proximal policy's log-probs before the update, even for one on-policy step
    one_step = [vllm, "actor.ppo_mini_batch_size=4"]
    assert load_config(path, one_step).skips_old_log_prob()
    rejecting = load_config(path, [*one_step, f"{key}.rollout_rs=token_k2", f"{key}.rollout_rs_threshold=1.0"])
    assert not rejecting.skips_old_log_prob()


def test_batch_normalised_weights_average_one_per_token_or_per_response():
    weights = torch.tensor([[2.0, 1.0, 0.0], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert_close(batch_mean_weight(weights, mask, "token"), torch.tensor(4.5 / 5))
    # per response: 1.5 and 0.5 -> 1.0
    assert_close(batch_mean_weight(weights, mask, "sequence"), torch.tensor(1.0))
    assert_close(batch_mean_weight(weights, torch.zeros_like(mask), "token"), torch.tensor(1.0))  # nothing to scale


def test_kept_loss_scale_keeps_the_original_denominator():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    kept = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0]])
    assert_close(kept_loss_scale(mask, kept, "token-mean"), torch.tensor(2 / 5))
    assert_close(kept_loss_scale(mask, kept, "seq-mean-token-mean"), torch.tensor(1 / 2))
    assert_close(kept_loss_scale(mask, kept, "token-sum"), torch.tensor(1.0))


def _micro_batch():
    rollout = torch.log(torch.tensor([[0.5, 0.2, 0.4, 0.9], [0.3, 0.6, 0.5, 0.5]]))
    current = torch.log(torch.tensor([[0.55, 0.6, 0.38, 0.9], [0.3, 0.9, 0.5, 0.5]]))
    advantages = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return rollout, current, advantages, mask


def test_bypass_reinforce_is_the_importance_weighted_policy_gradient_over_the_kept_tokens():
    rollout, current, advantages, mask = _micro_batch()
    actor = ActorConfig(loss_agg_mode="token-mean")
    correction = RolloutCorrectionConfig(
        rollout_is="token",
        rollout_is_threshold=2.0,
        bypass_mode=True,
        loss_type="reinforce",
        rollout_rs="token_k1",
        rollout_rs_threshold="0.5_2.0",
    )
    log_prob = current.clone().requires_grad_(True)
    (pg_loss, clipfrac, ppo_kl, _), stats = bypass_policy_loss(actor, correction, log_prob, rollout, advantages, mask)
    # ratios pi / pi_rollout: [1.1, 3.0, 0.95], [1.0, 1.5]; token_k1 keeps ratios in [0.5, 2.0]: drops 3.0
    ratio = torch.tensor([[1.1, 3.0, 0.95, 1.0], [1.0, 1.5, 1.0, 1.0]])
    kept = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    w = ratio.clamp(max=2.0)
    # verl: sum over kept tokens of -w * A * log pi, divided by all 5 response tokens (the global denominator)
    expected = -(w * advantages * current * kept).sum() / 5
    assert_close(pg_loss, expected)
    pg_loss.backward()
    assert_close(log_prob.grad, -(w * advantages * kept) / 5)  # the weights carry no gradient
    assert clipfrac == 0 and stats["rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    assert_close(ppo_kl, ((rollout - current) * kept).sum() / 4)  # over the kept tokens, as verl
    assert stats["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # 3.0 > 2 (before the rejection)


def test_bypass_ppo_clip_is_ppos_loss_around_the_rollout_policy_and_normalises_weights_on_request():
    rollout, current, advantages, mask = _micro_batch()
    actor = ActorConfig(loss_agg_mode="token-mean")
    correction = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_batch_normalize=True, bypass_mode=True)
    (pg_loss, clipfrac, ppo_kl, _), stats = bypass_policy_loss(actor, correction, current, rollout, advantages, mask)
    reference = compute_policy_loss(rollout, current, advantages, mask, loss_agg_mode="token-mean")
    assert_close((pg_loss, clipfrac, ppo_kl), reference[:3])  # the weights are reported, not applied
    # sequence weights: 1.1 x 3.0 x 0.95 = 3.135 -> 2.0 and 1.0 x 1.5 = 1.5: mean per response 1.75
    assert stats["rollout_is_batch_norm_factor"] == pytest.approx(1.75)
    assert "rollout_rs_masked_fraction" not in stats


def _flow_run(tmp_path: Path, name: str, extra: list[str]) -> dict[int, dict[str, float]]:
    """A 2-iteration GRPO flow (real worker processes, Prefect) of the tiny vLLM-compatible model with `extra`;
    its metrics by step."""
    from tiny_runs import write_reward

    from hybridflow.flows.rlhf import rlhf_flow
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    cfg = load_config(
        ROOT / "examples" / "grpo_tiny.yaml",
        [
            f"model.path={build_tiny_model(tmp_path / 'tiny32', hidden_size=64, head_dim=32)}",
            "rollout.name=vllm",
            "rollout.vllm_kv_cache_gb=0.25",
            "rollout.vllm_dtype=float32",
            f"trainer.output_dir={tmp_path / name}",
            f"reward.custom_function={write_reward(tmp_path)}",
            *extra,
        ],
    )
    run_id = store.create_run(cfg.model_dump(mode="json"), name)
    rlhf_flow(run_id=run_id, db_url=store.url)
    assert store.get_run(run_id).status == "completed"
    metrics: dict[int, dict[str, float]] = {}
    for point in store.metrics(run_id):
        metrics.setdefault(point.step, {})[point.name] = point.value
    return metrics


@needs_vllm
def test_decoupled_rejection_reaches_the_advantages_and_the_update_and_bypass_trains_on_the_rollouts_log_probs(
    prefect_api, tmp_path
):
    key = "algorithm.rollout_correction"
    # decoupled: bounds that exclude ratio 1 reject every token before the advantages; the update then sees an
    # all-zero mask, so even k1's KL loss (whose gradient is not 0 at ratio 1) adds nothing
    rejected = _flow_run(
        tmp_path,
        "decoupled",
        [f"{key}.rollout_rs=token_k1", f"{key}.rollout_rs_threshold=1.5_2.0", "actor.kl_loss_type=kl"],
    )
    first = rejected[1]
    assert first["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert first["actor/pg_loss"] == 0.0 and first["actor/grad_norm"] == 0.0
    assert "timing_s/old_log_prob" in first  # the proximal policy's log-probs, before the advantages
    # bypass: no old_log_prob stage; REINFORCE with batch-normalised token weights, two optimizer steps an
    # iteration (ppo_mini_batch_size 2 of 4 prompts), which an on-policy update without old log-probs refuses
    bypass = _flow_run(
        tmp_path,
        "bypass",
        [
            f"{key}.bypass_mode=true",
            f"{key}.loss_type=reinforce",
            f"{key}.rollout_is=token",
            f"{key}.rollout_is_batch_normalize=true",
            f"{key}.rollout_rs=token_k1",
            f"{key}.rollout_rs_threshold=0.5_2.0",
        ],
    )
    for step in (1, 2):
        metrics = bypass[step]
        assert "timing_s/old_log_prob" not in metrics
        assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.0, abs=0.05)
        assert metrics["rollout_corr/rollout_rs_masked_fraction"] < 0.05  # vLLM's fp32 log-probs are the actor's
        assert metrics["actor/grad_norm"] > 0
