"""Tests for the algorithms' tensor functions: hybridflow.engine.torch_ops and hybridflow.engine.algorithms.{estimators,
kl,
lagrangian, losses}.

Each algorithm is compared with a plain-Python reference (loops over batch and time on python floats) on random
inputs with random right-padded masks, and checked on small cases worked out by hand in the comments.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from hybridflow.engine import advantage, dynamic_sampling, torch_ops
from hybridflow.engine.algorithms import estimators, kl, losses
from hybridflow.engine.algorithms.lagrangian import LagrangeMultiplier, lagrangian_advantages

# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------


def random_mask(batch: int, length: int, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """Right-padded mask: each row is 1s (at least one) followed by 0s."""
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    return (torch.arange(length)[None, :] < lengths[:, None]).to(dtype)


def row_lengths(mask: torch.Tensor) -> list[int]:
    return [int(x) for x in mask.sum(-1).tolist()]


def py_whiten(rows: list[list[float]], lengths: list[int]) -> list[list[float]]:
    """Whiten the first `lengths[i]` entries of each row with the mean and unbiased variance of all of them."""
    flat = [x for row, n in zip(rows, lengths, strict=True) for x in row[:n]]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def py_group_scores(rewards: torch.Tensor, mask: torch.Tensor, index) -> tuple[list[float], dict]:
    scores = [sum(float(rewards[i, t]) for t in range(int(mask[i].sum()))) for i in range(rewards.shape[0])]
    groups: dict = {}
    for i, uid in enumerate(index):
        groups.setdefault(uid, []).append(i)
    return scores, groups


def broadcast_rows(per_seq: list[float], mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(mask, dtype=torch.float32)
    for i, a in enumerate(per_seq):
        for t in range(int(mask[i].sum())):
            out[i, t] = a
    return out


# --------------------------------------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-1e3, 1e3, width=32), st.booleans()), min_size=1, max_size=30),
)
def test_masked_mean_equals_mean_of_selected(pairs):
    values = torch.tensor([v for v, _ in pairs])
    mask = torch.tensor([k for _, k in pairs])
    selected = values[mask]
    expected = selected.mean() if selected.numel() else torch.tensor(0.0)  # empty selection -> 0 by contract
    assert_close(torch_ops.masked_mean(values, mask), expected, rtol=1e-5, atol=1e-3)
    assert_close(torch_ops.masked_sum(values, mask), selected.sum(), rtol=1e-5, atol=1e-3)


def test_masked_mean_sum_along_dim_and_padding_garbage_is_ignored():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # rows: mean(1, 2) = 1.5; mean(4) = 4; empty row -> 0.
    assert_close(torch_ops.masked_mean(values, mask, dim=-1), torch.tensor([1.5, 4.0, 0.0]))
    assert_close(torch_ops.masked_sum(values, mask, dim=-1), torch.tensor([3.0, 4.0, 0.0]))
    # columns: mean(1, 4) = 2.5; mean(2) = 2; nothing -> 0.
    assert_close(torch_ops.masked_mean(values, mask, dim=0), torch.tensor([2.5, 2.0, 0.0]))
    assert_close(torch_ops.masked_mean(values, mask), torch.tensor(7.0 / 3))


def test_masked_mean_gradient_only_reaches_selected_entries():
    values = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    torch_ops.masked_mean(values, torch.tensor([[True, True, False]])).backward()
    assert_close(values.grad, torch.tensor([[0.5, 0.5, 0.0]]))


def test_masked_var_and_whiten_match_torch_on_selection():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 9, generator=gen) * 3 + 1
    mask = random_mask(6, 9, gen)
    selected = values[mask.bool()]
    assert_close(torch_ops.masked_var(values, mask), selected.var())
    assert_close(torch_ops.masked_var(values, mask, unbiased=False), selected.var(unbiased=False))
    white = torch_ops.masked_whiten(values, mask)[mask.bool()]
    assert_close(white.mean(), torch.tensor(0.0), atol=1e-5, rtol=0)
    assert_close(white.var(), torch.tensor(1.0), atol=1e-5, rtol=0)
    kept_mean = torch_ops.masked_whiten(values, mask, shift_mean=False)[mask.bool()]
    assert_close(kept_mean.mean(), selected.mean(), atol=1e-5, rtol=0)
    assert_close(kept_mean.std(), torch.tensor(1.0), atol=1e-5, rtol=0)


def test_masked_var_needs_enough_entries():
    values = torch.tensor([[1.0, 2.0]])
    with pytest.raises(ValueError, match="at least 2"):
        torch_ops.masked_var(values, torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="no entries"):
        torch_ops.masked_var(values, torch.tensor([[0, 0]]), unbiased=False)
    assert_close(torch_ops.masked_var(values, torch.tensor([[1, 0]]), unbiased=False), torch.tensor(0.0))


def test_mask_shape_mismatch_names_shapes():
    with pytest.raises(ValueError, match=r"\[2, 3\].*\[2, 4\]"):
        torch_ops.masked_mean(torch.zeros(2, 4), torch.ones(2, 3))
    # a mask that broadcasts to the values is fine
    assert_close(
        torch_ops.masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[1], [0]])), torch.tensor(2.0)
    )


# --------------------------------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------------------------------


def py_gae(rewards, values, mask, gamma, lam):
    """Reference GAE: per row, recursion over the real tokens only, bootstrapping with V = 0 after the last one."""
    batch, length = rewards.shape
    lengths = row_lengths(mask)
    advs, rets = [], []
    for i in range(batch):
        n = lengths[i]
        r = [float(x) for x in rewards[i]]
        v = [float(x) for x in values[i]]
        adv = [0.0] * length
        last = 0.0
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * next_v - v[t]
            last = delta + gamma * lam * last
            adv[t] = last
        advs.append(adv)
        rets.append([adv[t] + v[t] if t < n else 0.0 for t in range(length)])
    white = py_whiten(advs, lengths)
    white = [[x if t < n else 0.0 for t, x in enumerate(row)] for row, n in zip(white, lengths, strict=True)]
    return torch.tensor(white), torch.tensor(rets)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_reference(gamma, lam):
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(5, 8, generator=gen)
    values = torch.randn(5, 8, generator=gen)
    mask = random_mask(5, 8, gen)
    adv, ret = estimators.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = py_gae(rewards, values, mask, gamma, lam)
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)


def test_gae_hand_computed_1x3_and_padding_is_inert():
    # gamma = 0.5, lam = 1: A_t is the discounted return minus V_t.
    # rewards [0, 0, 1] -> discounted returns [0.25, 0.5, 1.0]; values [0.1, 0.2, 0.3] -> A = [0.15, 0.3, 0.7].
    # whiten: mean 1.15 / 3 = 0.38333; deviations [-0.23333, -0.08333, 0.31667];
    # unbiased var = (0.054444 + 0.006944 + 0.100278) / 2 = 0.080833, std 0.284312
    # -> [-0.8207, -0.2931, 1.1138].
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 0.3]])
    adv, ret = estimators.compute_gae_advantage_return(rewards, values, torch.ones(1, 3), gamma=0.5, lam=1.0)
    assert_close(ret, torch.tensor([[0.25, 0.5, 1.0]]))
    dev = [0.15 - 1.15 / 3, 0.3 - 1.15 / 3, 0.7 - 1.15 / 3]
    std = math.sqrt(sum(d * d for d in dev) / 2 + 1e-8)
    assert_close(adv, torch.tensor([[d / std for d in dev]]))
    assert_close(adv, torch.tensor([[-0.8207, -0.2931, 1.1138]]), atol=1e-4, rtol=0)

    # The same response right-padded by two tokens holding garbage gives the same numbers and zeros at padding.
    rewards_p = torch.tensor([[0.0, 0.0, 1.0, 5.0, float("nan")]])
    values_p = torch.tensor([[0.1, 0.2, 0.3, 100.0, float("inf")]])
    mask_p = torch.tensor([[1, 1, 1, 0, 0]])
    adv_p, ret_p = estimators.compute_gae_advantage_return(rewards_p, values_p, mask_p, gamma=0.5, lam=1.0)
    assert_close(adv_p[:, :3], adv)
    assert_close(ret_p[:, :3], ret)
    assert adv_p[0, 3:].tolist() == [0.0, 0.0] and ret_p[0, 3:].tolist() == [0.0, 0.0]


def test_gae_skips_a_hole_inside_a_response():
    # mask [1, 0, 1], gamma 0.5, lam 1: token 1 is skipped, so token 0 bootstraps from token 2.
    # t=2: delta = 1 - 0.25 = 0.75, A = 0.75, return 1.0.
    # t=0: delta = 0 + 0.5 * 0.25 - 0.5 = -0.375, A = -0.375 + 0.5 * 0.75 = 0, return 0.5.
    # whitened over the two real tokens [0, 0.75]: mean 0.375, unbiased var 0.28125 -> [-0.7071, 0.7071].
    rewards = torch.tensor([[0.0, 9.0, 1.0]])
    values = torch.tensor([[0.5, 7.0, 0.25]])
    adv, ret = estimators.compute_gae_advantage_return(rewards, values, torch.tensor([[1, 0, 1]]), gamma=0.5, lam=1.0)
    assert_close(ret, torch.tensor([[0.5, 0.0, 1.0]]))
    half_sqrt2 = 0.375 / math.sqrt(0.28125 + 1e-8)
    assert_close(adv, torch.tensor([[-half_sqrt2, 0.0, half_sqrt2]]))


def test_gae_rejects_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"values \[2, 4\]"):
        estimators.compute_gae_advantage_return(x, torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="algorithm.gamma"):
        estimators.compute_gae_advantage_return(x, x, torch.ones(2, 3), 1.5, 1.0)


# --------------------------------------------------------------------------------------------------------------------
# GRPO and RLOO
# --------------------------------------------------------------------------------------------------------------------


def random_outcome_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(10, 6, gen)
    rewards = torch.randn(10, 6, generator=gen)
    # groups of sizes 4, 3, 2, 1, interleaved
    index = np.array(["a", "b", "a", "c", "b", "a", "d", "c", "b", "a"], dtype=object)
    return rewards, mask, index


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference(norm):
    rewards, mask, index = random_outcome_batch(2)
    adv, ret = estimators.compute_grpo_outcome_advantage(
        rewards, mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm
    )
    scores, groups = py_group_scores(rewards, mask, index)
    expected = [0.0] * len(scores)
    for members in groups.values():
        group = torch.tensor([scores[i] for i in members])
        mean, std = (0.0, 1.0) if len(members) == 1 else (float(group.mean()), float(group.std()))
        for i in members:
            expected[i] = (scores[i] - mean) / (std + 1e-6) if norm else scores[i] - mean
    assert_close(adv, broadcast_rows(expected, mask))
    assert torch.equal(adv, ret)


def test_grpo_hand_computed_group_of_three_and_singleton():
    # scores [1, 0, 0]: mean 1/3; unbiased std = sqrt(((2/3)^2 + 2 * (1/3)^2) / 2) = sqrt(1/3) = 0.57735
    # -> [ (2/3) / 0.57735, -(1/3) / 0.57735, -(1/3) / 0.57735 ] = [1.1547, -0.5774, -0.5774].
    # the singleton group "q" with score 2 uses mean 0, std 1 -> 2 / (1 + eps).
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [2.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 0]])
    index = np.array(["p", "p", "p", "q"], dtype=object)
    adv, _ = estimators.compute_grpo_outcome_advantage(rewards, mask, index)
    s = math.sqrt(1 / 3) + 1e-6
    expected = torch.tensor([[2 / 3 / s] * 2, [-1 / 3 / s] * 2, [-1 / 3 / s, 0.0], [2 / (1 + 1e-6), 0.0]])
    assert_close(adv, expected)
    assert_close(adv[0, 0], torch.tensor(1.1547), atol=1e-4, rtol=0)


def test_outcome_score_is_masked_sum_and_uids_may_be_ints_or_lists():
    # a reward at a padded position is ignored: scores are 1 and 0, not 1 and 7
    rewards = torch.tensor([[1.0, 0.0], [0.0, 7.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv_int, _ = estimators.compute_rloo_outcome_advantage(rewards, mask, np.array([3, 3]))
    adv_list, _ = estimators.compute_rloo_outcome_advantage(rewards, mask, ["x", "x"])
    # RLOO of [1, 0]: [1 - 0, 0 - 1]
    assert_close(adv_int, torch.tensor([[1.0, 1.0], [-1.0, 0.0]]))
    assert_close(adv_list, adv_int)


def test_rloo_hand_computed_and_singleton():
    # scores [1, 0, 0]: baselines are the mean of the other two: [0, 0.5, 0.5] -> [1, -0.5, -0.5].
    # singleton score 3 -> baseline 0 -> 3.
    rewards = torch.tensor([[1.0], [0.0], [0.0], [3.0]])
    adv, ret = estimators.compute_rloo_outcome_advantage(rewards, torch.ones(4, 1), np.array([0, 0, 0, 1]))
    assert_close(adv, torch.tensor([[1.0], [-0.5], [-0.5], [3.0]]))
    assert torch.equal(adv, ret)


def test_rloo_matches_reference():
    rewards, mask, index = random_outcome_batch(3)
    adv, _ = estimators.compute_rloo_outcome_advantage(rewards, mask, index)
    scores, groups = py_group_scores(rewards, mask, index)
    expected = [0.0] * len(scores)
    for members in groups.values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            expected[i] = scores[i] - (sum(others) / len(others) if others else 0.0)
    assert_close(adv, broadcast_rows(expected, mask))


def test_outcome_estimators_reject_wrong_index_length():
    with pytest.raises(ValueError, match="`index` has 2 entries but the batch has 3"):
        estimators.compute_grpo_outcome_advantage(torch.zeros(3, 2), torch.ones(3, 2), np.array(["a", "b"]))
    with pytest.raises(ValueError, match="uid"):
        estimators.compute_rloo_outcome_advantage(torch.zeros(3, 2), torch.ones(3, 2), np.array(["a"]))


# --------------------------------------------------------------------------------------------------------------------
# Advantage-estimator registry
# --------------------------------------------------------------------------------------------------------------------


def test_registry_uniform_calling_convention():
    rewards, mask, index = random_outcome_batch(4)
    values = torch.randn(rewards.shape, generator=torch.Generator().manual_seed(5))
    everything = dict(index=index, values=values, gamma=0.9, lam=0.8, epsilon=1e-6, norm_adv_by_std_in_grpo=False)
    gae = estimators.get_adv_estimator_fn("gae")(rewards, mask, **everything)
    assert_close(gae[0], estimators.compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)[0])
    grpo = estimators.get_adv_estimator_fn("grpo")(rewards, mask, **everything)
    assert_close(
        grpo[0], estimators.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)[0]
    )
    rloo = estimators.get_adv_estimator_fn("rloo")(rewards, mask, index=index)
    assert_close(rloo[0], estimators.compute_rloo_outcome_advantage(rewards, mask, index)[0])
    # gamma and lam default to 1 in the uniform convention
    assert_close(
        estimators.get_adv_estimator_fn("gae")(rewards, mask, values=values)[1],
        estimators.compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)[1],
    )


def test_registry_errors():
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator.*'gae', 'gdpo', 'gpg', 'grpo', 'opo'.*'rloo'"):
        estimators.get_adv_estimator_fn("ppo2")
    with pytest.raises(ValueError, match=r"needs \['values'\]"):
        estimators.get_adv_estimator_fn("gae")(torch.zeros(2, 2), torch.ones(2, 2))
    for name in ("grpo", "rloo"):  # the message names the batch column that carries the prompt ids
        with pytest.raises(ValueError, match=r"needs \['index'\].*the batch's non-tensor `uid` column"):
            estimators.get_adv_estimator_fn(name)(torch.zeros(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="unexpected keyword"):
        estimators.get_adv_estimator_fn("rloo")(torch.zeros(2, 2), torch.ones(2, 2), index=[0, 0], gama=0.9)
    with pytest.raises(ValueError, match="already registered"):
        estimators.register_adv_est("gae")(lambda token_level_rewards, response_mask: None)


def test_register_custom_estimator_and_uses_critic():
    assert estimators.uses_critic("gae") and not estimators.uses_critic("grpo") and not estimators.uses_critic("rloo")
    assert "gae" in estimators.ADV_ESTIMATORS_NEEDING_CRITIC and "grpo" not in estimators.ADV_ESTIMATORS_NEEDING_CRITIC
    with pytest.raises(ValueError, match="algorithm.adv_estimator"):
        estimators.uses_critic("nope")

    @estimators.register_adv_est("test_reinforce")
    def reinforce(token_level_rewards, response_mask, scale=1.0):
        adv = token_level_rewards * response_mask * scale
        return adv, adv

    try:
        fn = estimators.get_adv_estimator_fn("test_reinforce")
        adv, _ = fn(torch.ones(1, 2), torch.tensor([[1, 0]]), index=None, scale=3.0, gamma=0.5)
        assert_close(adv, torch.tensor([[3.0, 0.0]]))
        assert not estimators.uses_critic("test_reinforce")
    finally:
        del estimators._ADV_ESTIMATORS["test_reinforce"]


# --------------------------------------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------------------------------------


def test_kl_penalty_known_values():
    # k1 = logp - ref.  Column 0: logp 0, ref -1 -> k1 = 1, k3 = e^-1 - (-1) - 1 = e^-1 = 0.367879.
    # Column 1: logp -1, ref 0 -> k1 = -1, k3 = e^1 - 1 - 1 = 0.718282.  Column 2: equal -> all 0.
    logp = torch.tensor([[0.0, -1.0, -0.3]])
    ref = torch.tensor([[-1.0, 0.0, -0.3]])
    expected = {
        "kl": [1.0, -1.0, 0.0],
        "abs": [1.0, 1.0, 0.0],
        "mse": [0.5, 0.5, 0.0],
        "low_var_kl": [math.exp(-1), math.e - 2, 0.0],
    }
    aliases = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
    for name in kl.KL_PENALTY_TYPES:  # "k3+" and the other straight-through forms: the value of their estimator
        base = name.removesuffix("+")
        want = torch.tensor([expected[aliases.get(base, base)]])
        assert_close(kl.kl_penalty(logp, ref, name), want, msg=name)


def test_k3_clamps():
    # ref - logp = 50 is clamped to 20: e^20 - 21 -> clamped to 10.  ref - logp = -50 -> -20: e^-20 + 19 -> 10.
    # ref - logp = 5 is inside: e^5 - 6 = 142.4 -> 10 as well; ref - logp = 2: e^2 - 3 = 4.389 unclamped.
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0])
    ref = torch.tensor([50.0, -50.0, 5.0, 2.0])
    out = kl.kl_penalty(logp, ref, "k3")
    assert_close(out, torch.tensor([10.0, 10.0, 10.0, math.exp(2) - 3]))
    assert torch.isfinite(out).all()


def test_kl_penalty_reference_on_random_inputs():
    gen = torch.Generator().manual_seed(6)
    logp, ref = torch.randn(4, 7, generator=gen), torch.randn(4, 7, generator=gen)
    k3 = kl.kl_penalty(logp, ref, "low_var_kl")
    for i in range(4):
        for t in range(7):
            d = float(ref[i, t]) - float(logp[i, t])
            assert math.isclose(float(k3[i, t]), math.exp(d) - d - 1, rel_tol=1e-5, abs_tol=1e-6)


def test_kl_penalty_unknown_name():
    with pytest.raises(ValueError, match=r"algorithm\.kl_penalty.*actor\.kl_loss_type.*'low_var_kl'"):
        kl.kl_penalty(torch.zeros(1), torch.zeros(1), "full")


def test_adaptive_kl_controller_one_update():
    # error = clip(9 / 6 - 1, -0.2, 0.2) = clip(0.5) = 0.2; value = 0.1 * (1 + 0.2 * 256 / 10000) = 0.100512
    ctrl = kl.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)
    assert math.isclose(ctrl.value, 0.100512, rel_tol=1e-12)
    # error = 6.6 / 6 - 1 = 0.1 (inside the clip): value *= 1 + 0.1 * 1000 / 10000 = 1.01
    ctrl.update(current_kl=6.6, n_steps=1000)
    assert math.isclose(ctrl.value, 0.100512 * 1.01, rel_tol=1e-12)
    # error = clip(0 / 6 - 1) = -0.2: value *= 1 - 0.2 * 5000 / 10000 = 0.9
    ctrl.update(current_kl=0.0, n_steps=5000)
    assert math.isclose(ctrl.value, 0.100512 * 1.01 * 0.9, rel_tol=1e-12)


def test_fixed_controller_and_factory():
    fixed = kl.get_kl_controller("fixed", 0.05)
    fixed.update(current_kl=100.0, n_steps=64)
    assert isinstance(fixed, kl.FixedKLController) and fixed.value == 0.05
    adaptive = kl.get_kl_controller("adaptive", 0.2, target_kl=1.0, horizon=100)
    assert isinstance(adaptive, kl.AdaptiveKLController) and adaptive.value == 0.2
    with pytest.raises(ValueError, match=r"target_kl.*horizon"):
        kl.get_kl_controller("adaptive", 0.2, target_kl=1.0)
    with pytest.raises(ValueError, match=r"algorithm\.kl_ctrl\.type.*fixed, adaptive"):
        kl.get_kl_controller("pid", 0.2)


class RecordingController:
    def __init__(self, value):
        self.value = value
        self.calls = []

    def update(self, current_kl, n_steps):
        self.calls.append((current_kl, n_steps))
        self.value *= 2


def test_apply_kl_penalty_hand_computed():
    # k1 per token: row 0 [1, 2, (pad)], row 1 [-1, (pad), (pad)]; beta = 0.5.
    # rewards = scores - 0.5 * k1 on real tokens: row 0 [0 - 0.5, 1 - 1, 9], row 1 [2 + 0.5, 0, 0].
    # current KL = mean over rows of the per-row mean = (1.5 + (-1)) / 2 = 0.25.
    scores = torch.tensor([[0.0, 1.0, 9.0], [2.0, 0.0, 0.0]])
    logp = torch.tensor([[1.0, 2.0, 30.0], [-1.0, 7.0, 7.0]])
    ref = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ctrl = RecordingController(0.5)
    rewards, metrics = kl.apply_kl_penalty(scores, logp, ref, mask, ctrl, kl_penalty="kl")
    assert_close(rewards, torch.tensor([[-0.5, 0.0, 9.0], [2.5, 0.0, 0.0]]))
    assert ctrl.calls == [(pytest.approx(0.25), 2)]
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(0.25), "actor/reward_kl_penalty_coeff": 0.5}
    assert ctrl.value == 1.0  # the controller was updated after the coefficient was used


def test_apply_kl_penalty_matches_reference():
    gen = torch.Generator().manual_seed(7)
    scores, logp, ref = (torch.randn(6, 5, generator=gen) for _ in range(3))
    mask = random_mask(6, 5, gen)
    ctrl = kl.AdaptiveKLController(0.3, target_kl=0.1, horizon=1000)
    rewards, metrics = kl.apply_kl_penalty(scores, logp, ref, mask, ctrl, kl_penalty="k2")
    per_seq = []
    expected = scores.clone()
    for i, n in enumerate(row_lengths(mask)):
        kls = [0.5 * (float(logp[i, t]) - float(ref[i, t])) ** 2 for t in range(n)]
        per_seq.append(sum(kls) / n)
        for t in range(n):
            expected[i, t] = float(scores[i, t]) - 0.3 * kls[t]
    assert_close(rewards, expected)
    current = sum(per_seq) / len(per_seq)
    assert math.isclose(metrics["actor/reward_kl_penalty"], current, rel_tol=1e-5)
    err = max(min(current / 0.1 - 1, 0.2), -0.2)
    assert math.isclose(ctrl.value, 0.3 * (1 + err * 6 / 1000), rel_tol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# agg_loss
# --------------------------------------------------------------------------------------------------------------------


def test_agg_loss_modes_2x3():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # token-mean: (1 + 2 + 4) / 3 = 7/3;  seq-mean-token-sum: (3 + 4) / 2 = 3.5
    # seq-mean-token-mean: (1.5 + 4) / 2 = 2.75;  seq-mean-token-sum-norm: 7 / (2 * 3) = 7/6
    expected = {
        "token-mean": 7 / 3,
        "seq-mean-token-sum": 3.5,
        "seq-mean-token-mean": 2.75,
        "seq-mean-token-sum-norm": 7 / 6,
    }
    for mode, want in expected.items():
        assert_close(torch_ops.agg_loss(loss, mask, mode), torch.tensor(want), msg=mode)


def test_agg_loss_all_masked_sequence():
    # Row 1 has no tokens.  token-mean: (1 + 2) / 2 = 1.5.  The seq-mean modes skip row 1:
    # seq-mean-token-sum = 3, seq-mean-token-mean = 1.5.  seq-mean-token-sum-norm keeps B = 2: 3 / 6 = 0.5.
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    expected = {
        "token-mean": 1.5,
        "seq-mean-token-sum": 3.0,
        "seq-mean-token-mean": 1.5,
        "seq-mean-token-sum-norm": 0.5,
    }
    for mode, want in expected.items():
        assert_close(torch_ops.agg_loss(loss, mask, mode), torch.tensor(want), msg=mode)
    # everything masked: loss 0 and zero gradient in every mode
    for mode in torch_ops.AGG_LOSS_MODES:
        mat = loss.clone().requires_grad_(True)
        out = torch_ops.agg_loss(mat, torch.zeros(2, 3), mode)
        out.backward()
        assert out.item() == 0.0 and torch.count_nonzero(mat.grad) == 0, mode


def test_agg_loss_unknown_mode_and_bad_shape():
    with pytest.raises(ValueError, match=r"actor\.loss_agg_mode.*'token-mean'.*'seq-mean-token-sum-norm'"):
        torch_ops.agg_loss(torch.zeros(2, 3), torch.ones(2, 3), "sum")
    with pytest.raises(ValueError, match=r"\[2, 3\].*\[3, 2\]"):
        torch_ops.agg_loss(torch.zeros(2, 3), torch.ones(3, 2), "token-mean")


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 5),
    length=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    scale=st.floats(0.1, 10.0),
)
def test_agg_loss_invariants(batch, length, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(batch, length, generator=gen)
    mask = random_mask(batch, length, gen)
    for mode in torch_ops.AGG_LOSS_MODES:
        base = torch_ops.agg_loss(loss, mask, mode)
        # linear in the loss
        assert_close(torch_ops.agg_loss(loss * scale, mask, mode), base * scale, rtol=1e-5, atol=1e-5)
        # padding values do not matter
        garbage = torch.where(mask.bool(), loss, torch.full_like(loss, 1e6))
        assert_close(torch_ops.agg_loss(garbage, mask, mode), base)
    # reference loops
    lengths = row_lengths(mask)
    rows = [[float(loss[i, t]) for t in range(n)] for i, n in enumerate(lengths)]
    flat = [x for row in rows for x in row]
    ref = {
        "token-mean": sum(flat) / len(flat),
        "seq-mean-token-sum": sum(sum(r) for r in rows) / batch,
        "seq-mean-token-mean": sum(sum(r) / len(r) for r in rows) / batch,
        "seq-mean-token-sum-norm": sum(flat) / (batch * length),
    }
    for mode, want in ref.items():
        assert_close(torch_ops.agg_loss(loss, mask, mode), torch.tensor(want), rtol=1e-5, atol=1e-5)
    # with a full mask, every mean-type mode agrees with token-mean
    full = torch.ones(batch, length)
    token_mean = torch_ops.agg_loss(loss, full, "token-mean")
    assert_close(torch_ops.agg_loss(loss, full, "seq-mean-token-mean"), token_mean)
    assert_close(torch_ops.agg_loss(loss, full, "seq-mean-token-sum-norm"), token_mean)


# --------------------------------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------------------------------


def py_policy_loss(old, new, adv, mask, low, high, c):
    """Reference per-token PPO loss (dual-clip) and the three metrics, token-mean aggregation."""
    losses, clipped, lower, kls = [], [], [], []
    for i, n in enumerate(row_lengths(mask)):
        for t in range(n):
            a = float(adv[i, t])
            log_ratio = min(max(float(new[i, t]) - float(old[i, t]), -20.0), 20.0)
            ratio = math.exp(log_ratio)
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1 - low), 1 + high)
            loss = max(l1, l2)
            dual = a < 0 and loss > -a * c
            if a < 0:
                loss = min(loss, -a * c)
            losses.append(loss)
            clipped.append(float(l2 > l1))
            lower.append(float(dual))
            kls.append(float(old[i, t]) - float(new[i, t]))

    def mean(xs):
        return sum(xs) / len(xs)

    return mean(losses), mean(clipped), mean(kls), mean(lower)


@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.2, 0.28)])
def test_policy_loss_matches_reference(low, high):
    gen = torch.Generator().manual_seed(8)
    old = torch.randn(6, 7, generator=gen) - 2
    new = old + 0.8 * torch.randn(6, 7, generator=gen)  # ratios spread around 1, some far out
    adv = torch.randn(6, 7, generator=gen)
    mask = random_mask(6, 7, gen)
    out = losses.compute_policy_loss(old, new, adv, mask, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0)
    ref = py_policy_loss(old, new, adv, mask, low, high, 3.0)
    for got, want, name in zip(out, ref, ["pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"], strict=True):
        assert got.dim() == 0, name
        assert_close(got, torch.tensor(want), msg=name)
    assert 0 < out[1] < 1  # the random case does exercise clipping


def test_dual_clip_engages_for_large_ratio_with_negative_advantage():
    # ratio = 10, A = -1: unclipped -A * r = 10, clipped -A * 1.2 = 1.2, PPO max = 10; dual-clip min(10, 3) = 3.
    # ppo_kl = old - new = -ln 10.
    old = torch.tensor([[0.0]])
    new = torch.tensor([[math.log(10.0)]], requires_grad=True)
    loss, clipfrac, ppo_kl, clipfrac_lower = losses.compute_policy_loss(
        old, new, torch.tensor([[-1.0]]), torch.ones(1, 1)
    )
    assert_close(loss, torch.tensor(3.0))
    assert clipfrac.item() == 0.0 and clipfrac_lower.item() == 1.0
    assert_close(ppo_kl, torch.tensor(-math.log(10.0)))
    loss.backward()
    assert new.grad.item() == 0.0  # the constant bound carries no gradient
    # with A > 0 the same ratio is ordinary-clipped: max(-10, -1.2) = -1.2, dual-clip does not apply
    loss_pos, clipfrac_pos, _, lower_pos = losses.compute_policy_loss(old, new, torch.tensor([[1.0]]), torch.ones(1, 1))
    assert_close(loss_pos, torch.tensor(-1.2))
    assert clipfrac_pos.item() == 1.0 and lower_pos.item() == 0.0


def test_clip_higher_and_gradient():
    # ratio 1.25, A = 1: symmetric eps 0.2 clips to -1.2 (no gradient); clip-higher eps_high 0.28 does not clip,
    # loss = -1.25 and d loss / d log_prob = -A * ratio = -1.25.
    old = torch.tensor([[0.0]])
    adv = torch.tensor([[1.0]])
    new = torch.tensor([[math.log(1.25)]], requires_grad=True)
    sym = losses.compute_policy_loss(old, new, adv, torch.ones(1, 1), 0.2, 0.2)
    assert_close(sym[0], torch.tensor(-1.2)) and sym[1].item() == 1.0
    high = losses.compute_policy_loss(old, new, adv, torch.ones(1, 1), 0.2, 0.28)
    assert_close(high[0], torch.tensor(-1.25))
    assert high[1].item() == 0.0
    high[0].backward()
    assert_close(new.grad, torch.tensor([[-1.25]]))


def test_policy_loss_uses_agg_mode_and_ignores_padding():
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.0, 0.0, 80.0], [0.0, float("nan"), 0.0]])  # garbage only at padding
    adv = torch.tensor([[1.0, 3.0, 1.0], [2.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # ratio 1 everywhere real: per-token loss = -A -> [[-1, -3], [-2]]; seq-mean-token-mean = (-2 + -2) / 2 = -2
    loss, clipfrac, ppo_kl, _ = losses.compute_policy_loss(old, new, adv, mask, loss_agg_mode="seq-mean-token-mean")
    assert_close(loss, torch.tensor(-2.0))
    assert clipfrac.item() == 0.0 and ppo_kl.item() == 0.0


def test_policy_loss_errors():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"actor\.clip_ratio_c.*> 1"):
        losses.compute_policy_loss(x, x, x, torch.ones(1, 2), clip_ratio_c=1.0)
    with pytest.raises(ValueError, match=r"actor\.loss_agg_mode"):
        losses.compute_policy_loss(x, x, x, torch.ones(1, 2), loss_agg_mode="mean")
    with pytest.raises(ValueError, match=r"advantages \[1, 3\]"):
        losses.compute_policy_loss(x, x, torch.zeros(1, 3), torch.ones(1, 2))


# --------------------------------------------------------------------------------------------------------------------
# Value loss
# --------------------------------------------------------------------------------------------------------------------


def test_value_loss_hand_computed():
    # values 0, clip 0.5.  Token 0: vpred 1, return 2 -> clipped pred 0.5; (1-2)^2 = 1 < (0.5-2)^2 = 2.25
    # -> 0.5 * 2.25 = 1.125, clipped term wins.  Token 1: vpred 1, return 0 -> (1)^2 = 1 > (0.5)^2 = 0.25
    # -> 0.5, unclipped wins.  token-mean = (1.125 + 0.5) / 2 = 0.8125, clipfrac = 1/2.
    vpreds = torch.tensor([[1.0, 1.0, 50.0]], requires_grad=True)
    values = torch.zeros(1, 3)
    returns = torch.tensor([[2.0, 0.0, -50.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, clipfrac = losses.compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.5)
    assert_close(loss, torch.tensor(0.8125))
    assert_close(clipfrac, torch.tensor(0.5))
    loss.backward()
    # token 0 is clipped (no gradient); token 1: d/dv 0.5 * (v - 0)^2 / 2 tokens = 1 / 2
    assert_close(vpreds.grad, torch.tensor([[0.0, 0.5, 0.0]]))


def test_value_loss_matches_reference():
    gen = torch.Generator().manual_seed(9)
    vpreds, values, returns = (torch.randn(5, 6, generator=gen) for _ in range(3))
    mask = random_mask(5, 6, gen)
    c = 0.3
    loss, clipfrac = losses.compute_value_loss(vpreds, values, returns, mask, c, loss_agg_mode="seq-mean-token-sum")
    seq_sums, flags = [], []
    for i, n in enumerate(row_lengths(mask)):
        total = 0.0
        for t in range(n):
            vp, v, r = float(vpreds[i, t]), float(values[i, t]), float(returns[i, t])
            clipped_pred = v + min(max(vp - v, -c), c)
            l1, l2 = (vp - r) ** 2, (clipped_pred - r) ** 2
            total += 0.5 * max(l1, l2)
            flags.append(float(l2 > l1))
        seq_sums.append(total)
    assert_close(loss, torch.tensor(sum(seq_sums) / len(seq_sums)))
    assert_close(clipfrac, torch.tensor(sum(flags) / len(flags)))


def test_value_loss_rejects_negative_cliprange():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"critic\.cliprange_value"):
        losses.compute_value_loss(x, x, x, torch.ones(1, 2), cliprange_value=-0.1)


# --------------------------------------------------------------------------------------------------------------------
# Logits helpers
# --------------------------------------------------------------------------------------------------------------------


def test_entropy_matches_reference_for_3d_and_2d():
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(2, 3, 11, generator=gen) * 4
    ent = torch_ops.entropy_from_logits(logits)
    assert ent.shape == (2, 3)
    for i in range(2):
        for t in range(3):
            probs = torch.softmax(logits[i, t].double(), -1).tolist()
            want = -sum(p * math.log(p) for p in probs if p > 0)
            assert math.isclose(float(ent[i, t]), want, rel_tol=1e-5, abs_tol=1e-6)
    assert_close(torch_ops.entropy_from_logits(logits.reshape(6, 11)), ent.reshape(6))


def test_entropy_gradient_matches_torch_distributions():
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(4, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    torch_ops.entropy_from_logits(logits).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    torch.distributions.Categorical(logits=logits).entropy().sum().backward()
    assert_close(ours, logits.grad)


def test_entropy_uniform_and_extreme_logits():
    # uniform over V = 8 -> ln 8; one logit far above the rest -> ~0, without NaN.
    assert_close(torch_ops.entropy_from_logits(torch.zeros(3, 8)), torch.full((3,), math.log(8)))
    extreme = torch.tensor([[1000.0, -1000.0, 0.0], [5e4, 5e4, -5e4]])
    out = torch_ops.entropy_from_logits(extreme)
    assert torch.isfinite(out).all()
    assert_close(out, torch.tensor([0.0, math.log(2)]), atol=1e-4, rtol=0)


def test_logprobs_from_logits_matches_reference():
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(3, 4, 13, generator=gen) * 3).requires_grad_(True)
    labels = torch.randint(0, 13, (3, 4), generator=gen)
    out = torch_ops.logprobs_from_logits(logits, labels)
    assert out.shape == (3, 4) and out.dtype == torch.float32
    got = out.detach()
    for i in range(3):
        for t in range(4):
            row = [float(x) for x in logits.detach()[i, t]]
            top = max(row)
            lse = top + math.log(sum(math.exp(x - top) for x in row))
            assert math.isclose(float(got[i, t]), row[int(labels[i, t])] - lse, rel_tol=1e-5, abs_tol=1e-5)
    out.sum().backward()
    # d/dz of log softmax(z)[y] = onehot(y) - softmax(z)
    want_grad = torch.nn.functional.one_hot(labels, 13).float() - torch.softmax(logits.detach(), -1)
    assert_close(logits.grad, want_grad)


def test_logprobs_from_bf16_logits_are_fp32_and_accurate():
    gen = torch.Generator().manual_seed(12)
    logits = (torch.randn(2100, 50, generator=gen) * 5).bfloat16()  # more rows than one chunk
    labels = torch.randint(0, 50, (2100,), generator=gen)
    out = torch_ops.logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32 and out.shape == (2100,)
    want = torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)
    assert_close(out, want)


def test_logprobs_label_shape_mismatch():
    with pytest.raises(ValueError, match=r"labels of shape \[2, 3\].*logits of shape \[2, 4, 5\]"):
        torch_ops.logprobs_from_logits(torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long))


def test_non_finite_advantages_stop_the_adv_stage():
    """A NaN score on a response token stops compute_advantage with NonFiniteError naming the stage, the metric
    and the first sample (its uid); NaN on a padding position is ignored."""
    from hybridflow.engine.advantage import compute_advantage
    from hybridflow.engine.config import AlgorithmConfig
    from hybridflow.engine.guards import NonFiniteError
    from hybridflow.engine.protocol import DataProto

    scores = torch.zeros(4, 3)
    scores[:, 1] = torch.tensor([1.0, 0.0, 0.5, 0.25])
    mask = torch.tensor([[1, 1, 0]] * 4)
    uids = np.array(["p0", "p0", "p1", "p1"], dtype=object)
    algorithm = AlgorithmConfig(adv_estimator="grpo")
    scores[0, 2] = float("nan")  # padding: not a response token
    out, _ = compute_advantage(
        DataProto.from_dict({"token_level_scores": scores, "response_mask": mask}, {"uid": uids}), algorithm
    )
    assert torch.isfinite(out.batch["advantages"][:, :2]).all()
    scores[2, 1] = float("nan")
    data = DataProto.from_dict({"token_level_scores": scores, "response_mask": mask}, {"uid": uids})
    with pytest.raises(
        NonFiniteError,
        match=r"^adv: 1 non-finite value\(s\) of token_level_rewards; the first in sample 2 \(uid p1\) is nan; "
        r".*hf resume",
    ):
        compute_advantage(data, algorithm)


# --------------------------------------------------------------------------------------------------------------------
# Issue 19: more estimators, policy losses, KL straight-through, token-sum
# --------------------------------------------------------------------------------------------------------------------


def _whiten_by_hand(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_reinforce_plus_plus_discounts_within_each_response_and_whitens_over_the_batch():
    # a reward past a response's end (masked) must not flow back into it
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0], [0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    fn = estimators.get_adv_estimator_fn("reinforce_plus_plus")
    advantages, returns = fn(rewards, mask, gamma=0.5)
    assert_close(returns, torch.tensor([[0.25, 0.5, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]]))
    want = _whiten_by_hand([0.25, 0.5, 1.0, 1.0, 2.0])
    assert_close(advantages[mask.bool()], torch.tensor(want), atol=1e-6, rtol=0)
    assert (advantages[~mask.bool()] == 0).all()
    assert not estimators.uses_groups("reinforce_plus_plus") and not estimators.uses_critic("reinforce_plus_plus")


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_then_whitens():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    index = np.array(["a", "a", "b"], dtype=object)
    advantages, returns = estimators.get_adv_estimator_fn("reinforce_plus_plus_baseline")(rewards, mask, index=index)
    # centred scores: a: 1 - 0.5 = 0.5, 0 - 0.5 = -0.5; b alone: baseline 0 -> 3; one per token, then whitened
    tokens = [0.5, 0.5, -0.5, -0.5, -0.5, 3.0]
    assert_close(advantages[mask.bool()], torch.tensor(_whiten_by_hand(tokens)), atol=1e-6, rtol=0)
    assert (advantages[~mask.bool()] == 0).all() and torch.equal(advantages, returns)
    assert estimators.uses_groups("reinforce_plus_plus_baseline")


def test_opo_baseline_is_the_length_weighted_group_mean():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0]])
    index = [0, 0, 1]
    advantages, _ = estimators.get_adv_estimator_fn("opo")(rewards, mask, index=index)
    # group 0: lengths 3 and 1, scores 1 and 0 -> baseline (3 * 1 + 1 * 0) / 4 = 0.75; group 1 alone: baseline 0
    assert_close(advantages, torch.tensor([[0.25, 0.25, 0.25], [-0.75, 0.0, 0.0], [2.0, 0.0, 0.0]]))
    plain_mean = 0.5  # an unweighted baseline would give 0.5 / -0.5: the test tells them apart
    assert not math.isclose(float(advantages[0, 0]), 1 - plain_mean)


def test_the_policy_loss_registry_names_the_key_and_holds_the_three_losses():
    assert {"vanilla", "gspo", "cispo"} <= set(losses.policy_loss_modes())
    assert losses.get_policy_loss_fn("vanilla") is losses.compute_policy_loss
    with pytest.raises(ValueError, match=r"actor\.policy_loss\.loss_mode.*registered"):
        losses.get_policy_loss_fn("nope")


def test_gspo_uses_the_geometric_mean_ratio_of_each_sequence():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    log_prob = torch.tensor([[0.1, 0.3, 5.0], [0.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # the 5.0 is padding: it must not enter the ratio
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    loss, clipfrac, ppo_kl, lower = losses.compute_policy_loss_gspo(
        old, log_prob, adv, mask, clip_ratio_low=1.0, clip_ratio_high=1.0, loss_agg_mode="seq-mean-token-mean"
    )
    s0, s1 = math.exp(0.2), 1.0  # exp(mean log-ratio) per sequence
    assert math.isclose(float(loss), (-1.0 * s0 + 2.0 * s1) / 2, rel_tol=1e-6)  # mean over sequences
    loss.backward()
    # d/d log_prob_t of -A * s: -A * s / |y| per token, over 2 sequences
    want = torch.tensor([[-s0 / 2 / 2, -s0 / 2 / 2, 0.0], [2.0 * s1 / 2, 0.0, 0.0]])
    assert_close(log_prob.grad, want, atol=1e-6, rtol=0)
    assert float(clipfrac) == 0 and float(lower) == 0
    assert math.isclose(float(ppo_kl), -(0.1 + 0.3) / 3, rel_tol=1e-6)
    # a tight clip: sequence 0's ratio (1.22) is above 1 + 1e-3 with A > 0, so it is clipped and gets no gradient;
    # sequence 1's (1.0) is inside
    log_prob.grad = None
    clipped, clipfrac, _, _ = losses.compute_policy_loss_gspo(old, log_prob, adv, mask, 1e-3, 1e-3)
    clipped.backward()
    assert (log_prob.grad[0] == 0).all() and (log_prob.grad[1, 0] != 0)
    assert math.isclose(float(clipfrac), 2 / 3, rel_tol=1e-6)


def test_cispo_keeps_the_gradient_of_clipped_tokens_weighted_by_the_clipped_ratio():
    old = torch.tensor([[0.0, 0.0]])
    log_prob = torch.tensor([[0.5, -0.1]], requires_grad=True)  # ratios 1.65 (clipped to 1.28) and 0.905
    adv = torch.tensor([[1.0, 1.0]])
    mask = torch.tensor([[1, 1]])
    loss, clipfrac, _, lower = losses.compute_policy_loss_cispo(old, log_prob, adv, mask, 0.2, 0.28)
    w = torch.tensor([[1.28, math.exp(-0.1)]])
    assert math.isclose(float(loss), float(-(w * log_prob.detach()).mean()), rel_tol=1e-6)
    loss.backward()
    assert_close(log_prob.grad, -w / 2)  # both tokens keep a gradient; PPO's clip would zero the first
    assert float(clipfrac) == 0.5 and float(lower) == 0.0
    vanilla_grad = torch.autograd.grad(losses.compute_policy_loss(old, log_prob, adv, mask, 0.2, 0.28)[0], log_prob)[0]
    assert vanilla_grad[0, 0] == 0 and log_prob.grad[0, 0] != 0


def test_gpg_advantage_is_the_group_centred_score_scaled_by_the_share_of_non_zero_scores():
    # groups a: scores 1, 0, 1 (mean 2/3); b: 0 alone (mean 0); c: 1, 1 (mean 1); 4 of 6 scores non-zero: alpha 1.5
    rewards = torch.zeros(6, 3)
    rewards[[0, 2, 4, 5], 1] = 1.0
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0]])
    advantages, returns = estimators.get_adv_estimator_fn("gpg")(rewards, mask, index=["a", "a", "a", "b", "c", "c"])
    per_row = 1.5 * torch.tensor([1 - 2 / 3, 0 - 2 / 3, 1 - 2 / 3, 0.0, 0.0, 0.0])
    assert_close(advantages, per_row.unsqueeze(-1) * mask)
    assert torch.equal(advantages, returns) and estimators.uses_groups("gpg")
    none, _ = estimators.get_adv_estimator_fn("gpg")(torch.zeros(2, 3), mask[:2], index=["a", "a"])
    assert not none.any()  # no non-zero score: alpha = B / 1, times centred zeros


def test_gpg_loss_is_the_plain_policy_gradient():
    old = torch.zeros(2, 3)
    log_prob = torch.tensor([[-0.5, -1.0, -9.0], [-2.0, -0.1, -0.3]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, clipfrac, ppo_kl, lower = losses.get_policy_loss_fn("gpg")(old, log_prob, adv, mask, 0.2, 0.28)
    # token-mean over 5 tokens of -A * log_prob
    assert math.isclose(float(loss), (0.5 + 1.0 - 4.0 - 0.2 - 0.6) / 5, rel_tol=1e-6)
    loss.backward()
    assert_close(log_prob.grad, -adv * mask / 5)  # no ratio, no clip: every token keeps -A / N
    assert float(clipfrac) == float(lower) == 0.0
    assert math.isclose(float(ppo_kl), (0.5 + 1.0 + 2.0 + 0.1 + 0.3) / 5, rel_tol=1e-6)


def test_sapo_gates_the_ratio_smoothly_with_a_temperature_per_advantage_sign():
    """SAPO (arXiv 2511.20347, verl's compute_policy_loss_sapo): loss_t = -A_t sigmoid(tau (r - 1)) 4 / tau, tau_pos
    where A > 0 else tau_neg, a mean over sequences of their token means; at r = 1 the gate's slope is 1 whatever tau
    (the plain policy gradient), away from it the gradient fades, faster for the larger tau; no clip is counted."""
    old = torch.zeros(2, 3)
    log_prob = torch.tensor([[0.0, 0.5, 3.0], [0.0, -0.7, -0.2]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    tau_pos, tau_neg = 1.0, 3.0
    loss, clipfrac, ppo_kl, lower = losses.get_policy_loss_fn("sapo")(
        old, log_prob, adv, mask, loss_agg_mode="token-mean", tau_pos=tau_pos, tau_neg=tau_neg
    )

    def gate(x: float, tau: float) -> float:  # the paper's f, written out
        return 4.0 / tau / (1.0 + math.exp(-tau * (math.exp(x) - 1.0)))

    seq0 = -(gate(0.0, tau_pos) + gate(0.5, tau_pos)) / 2
    seq1 = 2.0 * (gate(0.0, tau_neg) + gate(-0.7, tau_neg) + gate(-0.2, tau_neg)) / 3
    assert math.isclose(float(loss), (seq0 + seq1) / 2, rel_tol=1e-6)
    loss.backward()

    def slope(x: float, tau: float) -> float:  # d f(exp(x)) / dx
        s = 1.0 / (1.0 + math.exp(-tau * (math.exp(x) - 1.0)))
        return 4.0 * s * (1.0 - s) * math.exp(x)

    assert math.isclose(slope(0.0, tau_pos), 1.0) and math.isclose(slope(0.0, tau_neg), 1.0)
    want = torch.tensor(
        [
            [-1.0 * slope(0.0, tau_pos) / 4, -1.0 * slope(0.5, tau_pos) / 4, 0.0],
            [2.0 * slope(0.0, tau_neg) / 6, 2.0 * slope(-0.7, tau_neg) / 6, 2.0 * slope(-0.2, tau_neg) / 6],
        ]
    )
    assert_close(log_prob.grad, want, atol=1e-6, rtol=1e-5)
    assert 0 < float(log_prob.grad[1, 1]) < float(log_prob.grad[1, 0])  # far from r = 1 the gradient fades
    assert float(clipfrac) == float(lower) == 0.0
    assert math.isclose(float(ppo_kl), (-0.5 + 0.7 + 0.2) / 5, rel_tol=1e-6, abs_tol=1e-7)
    assert losses.update_agg_mode("token-mean", "sapo") == "seq-mean-token-mean"


def test_gmpo_is_the_geometric_mean_of_sign_aware_clipped_ratios_times_the_sequence_advantage():
    old = torch.zeros(2, 3)
    # sequence 0 (A > 0): log-ratios 0.1, 0.9 (above the 0.4 clip: taken at 0.4, no gradient), padding 7.0
    # sequence 1 (A < 0): log-ratios -0.9 (below -0.4: with s = -1, c = -min(-l, -clamp(l)) = max(l, clamp(l)),
    # taken at -0.4, no gradient), 0.2, 0.3
    log_prob = torch.tensor([[0.1, 0.9, 7.0], [-0.9, 0.2, 0.3]], requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, clipfrac, ppo_kl, lower = losses.get_policy_loss_fn("geo_mean")(
        old, log_prob, adv, mask, 0.4, 0.4, loss_agg_mode="token-mean"
    )
    r0, r1 = math.exp((0.1 + 0.4) / 2), math.exp((-0.4 + 0.2 + 0.3) / 3)
    assert math.isclose(float(loss), (-2.0 * r0 + 1.0 * r1) / 2, rel_tol=1e-6)  # a mean over the 2 sequences
    loss.backward()
    want = torch.tensor([[-2.0 * r0 / 2 / 2, 0.0, 0.0], [0.0, r1 / 3 / 2, r1 / 3 / 2]])
    assert_close(log_prob.grad, want, atol=1e-6, rtol=0)  # the clipped tokens pass no gradient
    assert math.isclose(float(clipfrac), 1 / 5, rel_tol=1e-6) and math.isclose(float(lower), 1 / 5, rel_tol=1e-6)
    assert math.isclose(float(ppo_kl), -(0.1 + 0.9 - 0.9 + 0.2 + 0.3) / 5, rel_tol=1e-6)
    # whatever actor.loss_agg_mode, an update combines GMPO's micro-batches by sequences
    assert losses.update_agg_mode("token-mean", "geo_mean") == "seq-mean-token-mean"
    assert losses.update_agg_mode("token-mean", "vanilla") == "token-mean"


@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k3", "low_var_kl"])
def test_straight_through_kl_has_the_value_of_its_estimator_and_the_gradient_of_k2(kind):
    log_prob = torch.tensor([0.3, -0.4, 0.1], requires_grad=True)
    ref = torch.tensor([0.0, 0.2, 0.1])
    value = kl.kl_penalty(log_prob, ref, kind + "+")
    assert_close(value, kl.kl_penalty(log_prob, ref, kind))
    value.sum().backward()
    assert_close(log_prob.grad, (log_prob - ref).detach())  # d/dx of 0.5 (x - ref)^2
    assert kind + "+" in kl.KL_PENALTY_TYPES


def test_token_sum_sums_every_masked_token():
    loss = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert float(torch_ops.agg_loss(loss, mask, "token-sum")) == 6.0
    assert float(torch_ops.agg_loss(loss, torch.zeros_like(mask), "token-sum")) == 0.0


def test_overlong_reward_falls_linearly_over_the_buffer():
    lengths = torch.tensor([3, 6, 7, 9, 10])
    # L_max 10, L_cache 4: free up to 6 tokens, then (6 - |y|) / 4, -1 at 10; times the penalty 0.5
    assert_close(advantage.overlong_reward(lengths, 10, 4, 0.5), torch.tensor([0.0, 0.0, -0.125, -0.375, -0.5]))
    with pytest.raises(ValueError, match=r"reward\.overlong_buffer.*len \(10\) < rollout\.response_length \(10\)"):
        advantage.overlong_reward(lengths, 10, 10, 1.0)


def test_overlong_shaping_puts_the_penalty_on_the_last_response_token():
    from hybridflow.engine.advantage import overlong_shaped
    from hybridflow.engine.config import OverlongBufferConfig

    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    shaped, metrics = overlong_shaped(rewards, mask, OverlongBufferConfig(enable=True, len=2, penalty=1.0), 4)
    # lengths 3, 4, 0 against a 4-token limit with a 2-token buffer: -0.5, -1, 0
    assert_close(shaped, torch.tensor([[0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, -0.5], [0.0, 0.0, 0.0, 0.0]]))
    assert metrics == {"reward_extra/overlong_reward/mean": -0.5, "reward_extra/overlong/mean": pytest.approx(2 / 3)}


def test_remax_advantage_is_the_reward_to_go_minus_the_greedy_score():
    rewards = torch.tensor([[0.0, 0.5, 1.0, 9.0], [0.0, 2.0, 0.0, 0.0]])  # 9.0 is padding
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    baselines = torch.tensor([0.25, 3.0])
    advantages, returns = estimators.get_adv_estimator_fn("remax")(rewards, mask, reward_baselines=baselines)
    assert_close(returns, torch.tensor([[1.5, 1.5, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]]))
    assert_close(advantages, torch.tensor([[1.25, 1.25, 0.75, 0.0], [-1.0, -1.0, 0.0, 0.0]]))
    assert estimators.uses_greedy_baseline("remax") and not estimators.uses_greedy_baseline("grpo")
    assert not estimators.uses_groups("remax") and not estimators.uses_critic("remax")
    with pytest.raises(ValueError, match=r"needs \['reward_baselines'\]"):
        estimators.get_adv_estimator_fn("remax")(rewards, mask)
    with pytest.raises(ValueError, match=r"one per row: \(2,\)"):
        estimators.get_adv_estimator_fn("remax")(rewards, mask, reward_baselines=torch.zeros(3))


def test_greedy_baselines_follow_each_rows_prompt_and_the_training_reward():
    from hybridflow.engine.advantage import greedy_baselines
    from hybridflow.engine.config import OverlongBufferConfig
    from hybridflow.engine.protocol import DataProto

    greedy = DataProto.from_dict(
        {
            "token_level_scores": torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0]]),
            "rm_scores": torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]]),
            "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
        },
        non_tensors={"uid": np.array(["b", "a"], dtype=object)},
    )
    uids = np.array(["a", "a", "b", "b"], dtype=object)
    assert_close(greedy_baselines(uids, greedy), torch.tensor([1.5, 1.5, 3.0, 3.0]))  # function + reward model
    shaped = greedy_baselines(
        uids, greedy, function_coef=2.0, rm_coef=0.5, overlong=OverlongBufferConfig(enable=True, len=2, penalty=1.0),
        max_length=3,
    )  # fmt: skip
    # b: 2*1 + 0.5*2 - 0.5 (2 of 3 tokens, a 2-token buffer); a: 2*0.5 + 0.5*1
    assert_close(shaped, torch.tensor([1.5, 1.5, 2.5, 2.5]))
    with pytest.raises(ValueError, match="no greedy response for prompt uid 'c'"):
        greedy_baselines(np.array(["c"], dtype=object), greedy)


def test_varied_groups_keep_the_groups_whose_values_differ_and_singletons():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.25])
    uids = np.array(["a", "a", "b", "b", "c", "c", "d"], dtype=object)
    assert dynamic_sampling.varied_groups(values, uids).tolist() == [False, False, True, True, False, False, True]


def test_dynamic_sampling_keeps_varied_groups_and_counts_draws_to_the_limit():
    from hybridflow.engine.config import load_config
    from hybridflow.engine.dynamic_sampling import DrawCount, DynamicSamplingError, kept_rows
    from hybridflow.engine.protocol import DataProto

    data = DataProto.from_dict(
        {
            "token_level_scores": torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 2.0]]),
            "response_mask": torch.tensor([[1, 0], [1, 1], [1, 1], [1, 1]]),
            "reward_extra/acc": torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64),
        },
        non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)},
    )
    assert kept_rows(data, "acc") == [2, 3]  # group a: both right
    assert kept_rows(data, "seq_reward") == [2, 3]  # group a: 1 and 1 (the 0 after the mask)
    shaped = {"function_coef": 1.0, "rm_coef": 1.0, "overlong": None, "max_length": 2}
    assert kept_rows(data, "seq_final_reward", **shaped) == [2, 3]
    with pytest.raises(
        ValueError, match=r"metric=format: the score function reports no 'format' \(it reports \['acc'\]\)"
    ):
        kept_rows(data, "format")

    cfg = load_config(
        None,
        [
            "model.path=tiny", "data.reasoning_gym.name=basic_arithmetic", "data.train_batch_size=4", "rollout.n=2",
            "actor.ppo_mini_batch_size=4",
            "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=3",
            "data.gen_batch_size=2",
        ],
    )  # fmt: skip
    count = DrawCount(cfg)
    assert not count.add(2) and not count.add(4)  # 1 + 2 prompts of 4
    with pytest.raises(DynamicSamplingError, match=r"3 draws of 2 prompts kept 3 .*max_num_gen_batches"):
        count.add(0)
    assert DrawCount(cfg).add(8) and DrawCount(cfg).rows() == 8


def test_clip_cov_detaches_a_high_covariance_token_that_the_clip_leaves_active():
    # mean A = -0.25, mean log pi = 0: covariances 2.25, 0, 0, 2.75; only the first is inside (1, 2.5)
    advantages = torch.tensor([[2.0, 0.0, 0.0, -3.0]])
    old = torch.tensor([[1.0, 0.0, 0.0, -1.0]])
    log_prob = old.clone().requires_grad_(True)
    mask = torch.ones(1, 4)
    loss, clipfrac, ppo_kl, lower = losses.get_policy_loss_fn("clip_cov")(
        old, log_prob, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ub=2.5
    )
    loss.backward()
    assert_close(log_prob.grad, torch.tensor([[0.0, 0.0, 0.0, 0.75]]))  # vanilla: [-0.5, 0, 0, 0.75]
    assert float(loss) == pytest.approx(3.0 / 4) and float(clipfrac) == 0.25 and float(lower) == float(ppo_kl) == 0
    with pytest.raises(ValueError, match=r"clip_cov_ratio` must be in \(0, 1\]"):
        losses.compute_policy_loss_clip_cov(old, log_prob, advantages, mask, clip_cov_ratio=0.0)


def test_kl_cov_penalises_the_log_ratio_of_the_highest_covariance_token():
    advantages = torch.tensor([[2.0, 0.0, 0.0, -3.0]])
    old = torch.tensor([[1.0, 0.0, 0.0, -1.2]])
    log_prob = torch.tensor([[1.0, 0.0, 0.0, -1.0]], requires_grad=True)  # covariances 2.25, 0, 0, 2.75
    mask = torch.ones(1, 4)
    loss, clipfrac, ppo_kl, _ = losses.compute_policy_loss_kl_cov(old, log_prob, advantages, mask, ppo_kl_coef=0.5)
    loss.backward()
    ratio = math.exp(0.2)
    assert float(loss) == pytest.approx((-2.0 + 3.0 * ratio + 0.5 * 0.2) / 4, rel=1e-6)
    assert_close(log_prob.grad, torch.tensor([[-0.5, 0.0, 0.0, (3.0 * ratio + 0.5) / 4]]))
    assert float(ppo_kl) == pytest.approx(0.05) and float(clipfrac) == 0


def test_the_actor_passes_a_loss_its_own_policy_loss_keys():
    from hybridflow.engine.backends.actor import policy_loss
    from hybridflow.engine.config import ActorConfig

    advantages, mask = torch.tensor([[2.0, 0.0, 0.0, -3.0]]), torch.ones(1, 4)
    old, log_prob = torch.tensor([[1.0, 0.0, 0.0, -1.2]]), torch.tensor([[1.0, 0.0, 0.0, -1.0]])
    config = ActorConfig(policy_loss={"loss_mode": "kl_cov", "ppo_kl_coef": 0.5})
    got = policy_loss(config, old, log_prob, advantages, mask)[0]
    want = losses.compute_policy_loss_kl_cov(old, log_prob, advantages, mask, ppo_kl_coef=0.5)[0]
    assert float(got) == float(want) != float(losses.compute_policy_loss_kl_cov(old, log_prob, advantages, mask)[0])


def test_the_lagrange_multiplier_rises_over_the_cost_limit_and_falls_under_it():
    """Safe-RLHF: log lambda += lambda_lr x (mean cost of the window - d) x lambda; lambda stays in (0, lambda_max],
    and the state (log lambda, the window) round-trips."""
    lagrangian = LagrangeMultiplier(cost_limit=0.5, lambda_init=1.0, lambda_lr=0.1, window=4)
    assert lagrangian.update([2.0, 3.0]) == pytest.approx(math.exp(0.2))  # mean 2.5, over the limit by 2: up
    up = math.exp(0.2)
    assert lagrangian.update([0.0, -3.0]) == pytest.approx(up * math.exp(0.1 * (0.5 - 0.5) * up))  # window mean 0.5
    assert list(lagrangian.costs) == [2.0, 3.0, 0.0, -3.0]
    down = lagrangian.update([-7.0, -7.0])  # the window drops the two oldest: mean (0 - 3 - 7 - 7) / 4
    assert down == pytest.approx(up * math.exp(0.1 * (-4.25 - 0.5) * up)) and 0 < down < 1
    copy = LagrangeMultiplier(0.5, 1.0, 0.1, window=4)
    copy.load_state_dict(lagrangian.state_dict())
    assert copy.value == down and copy.update([1.0]) == lagrangian.update([1.0])
    capped = LagrangeMultiplier(0.0, 1.0, 1.0, lambda_max=2.0)
    assert capped.update([5.0]) == pytest.approx(2.0)
    floor = LagrangeMultiplier(0.0, 1.0, 1e6)
    assert floor.update([-1e6]) == math.exp(LagrangeMultiplier.LOG_LAMBDA_MIN) > 0  # clamped: no underflow to 0
    assert floor.update([-1e6]) > 0  # so the next step still has a log
    with pytest.raises(ValueError, match=r"algorithm.lambda_init. must be > 0"):
        LagrangeMultiplier(0.0, 0.0, 0.1)
    with pytest.raises(ValueError, match=r"algorithm.episode_cost_window. must be >= 1"):
        LagrangeMultiplier(0.0, 1.0, 0.1, window=0)


def test_lagrangian_advantages_weigh_the_cost_by_lambda_over_one_plus_lambda():
    reward_adv = torch.tensor([[1.0, -2.0], [0.5, 0.0]])
    cost_adv = torch.tensor([[0.5, 1.0], [-1.0, 0.0]])
    assert_close(lagrangian_advantages(reward_adv, cost_adv, 0.0), reward_adv)
    assert_close(lagrangian_advantages(reward_adv, cost_adv, 3.0), torch.tensor([[-0.125, -1.25], [0.875, 0.0]]))
    with pytest.raises(ValueError, match=r"multiplier must be >= 0"):
        lagrangian_advantages(reward_adv, cost_adv, -1.0)


def test_compute_advantage_steps_lambda_then_combines_the_reward_and_cost_gae():
    """The advantage stage with costs: lambda is stepped with the batch's episode costs first; the advantages are the
    whitened `lagrangian_advantages` of the two unwhitened GAEs under the new lambda; ``cost_returns`` is the cost
    critic's target; the in-reward KL penalty is charged to the cost as well."""
    from hybridflow.engine.advantage import build_lagrangian, compute_advantage
    from hybridflow.engine.config import AlgorithmConfig
    from hybridflow.engine.protocol import DataProto

    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    costs = torch.tensor([[0.0, 0.0, 2.0], [0.0, 4.0, 0.0]])  # episode costs 2 and 4: mean 3
    values, cost_values = torch.full((2, 3), 0.25), torch.tensor([[1.0, 0.5, 0.0], [2.0, 1.0, 0.0]])
    columns = {
        "token_level_scores": scores, "response_mask": mask, "values": values,
        "token_level_costs": costs, "cost_values": cost_values,
    }  # fmt: skip
    data = DataProto.from_dict(columns)
    algorithm = AlgorithmConfig(adv_estimator="gae", cost_limit=1.0, lambda_init=0.5, lambda_lr=0.2)
    lagrangian = build_lagrangian(algorithm)
    out, metrics = compute_advantage(data, algorithm, lagrangian=lagrangian)
    multiplier = 0.5 * math.exp(0.2 * (3.0 - 1.0) * 0.5)
    assert lagrangian.value == pytest.approx(multiplier)
    assert metrics["critic/cost/mean"] == 3.0 and metrics["actor/lagrange_multiplier"] == pytest.approx(multiplier)
    gae = estimators.compute_gae_advantage_return
    reward_adv, returns = gae(scores, values, mask, 1.0, 1.0, whiten=False)
    cost_adv, cost_returns = gae(costs, cost_values, mask, 1.0, 1.0, whiten=False)
    want = torch_ops.masked_whiten(lagrangian_advantages(reward_adv, cost_adv, multiplier), mask) * mask
    assert_close(out.batch["advantages"], want)
    assert_close(out.batch["returns"], returns)
    assert_close(cost_returns, torch.tensor([[2.0, 2.0, 2.0], [4.0, 4.0, 0.0]]))  # the cost to go
    assert_close(out.batch["cost_returns"], cost_returns)

    # KL in the reward: beta x KL_t leaves the reward and joins the cost (both critics' targets show it)
    log_probs = {"old_log_probs": torch.zeros(2, 3), "ref_log_prob": torch.full((2, 3), -0.5)}  # k1 KL 0.5 a token
    kl = AlgorithmConfig(
        adv_estimator="gae", cost_limit=1.0, use_kl_in_reward=True, kl_ctrl={"type": "fixed", "kl_coef": 0.2}
    )
    from hybridflow.engine.advantage import build_kl_controller

    out, _ = compute_advantage(
        DataProto.from_dict({**columns, **log_probs}), kl, build_kl_controller(kl), lagrangian=build_lagrangian(kl)
    )
    penalty = 0.2 * 0.5 * mask  # beta x KL on every response token
    assert_close(out.batch["returns"], gae(scores - penalty, values, mask, 1.0, 1.0, whiten=False)[1])
    assert_close(out.batch["cost_returns"], gae(costs + penalty, cost_values, mask, 1.0, 1.0, whiten=False)[1])
    with pytest.raises(ValueError, match=r"needs both the batch's token_level_costs .* got only one"):
        compute_advantage(data, algorithm)
    with pytest.raises(ValueError, match=r"needs both the batch's token_level_costs .* got only one"):
        compute_advantage(DataProto.from_dict({"token_level_scores": scores, "response_mask": mask, "values": values}),
                          algorithm, lagrangian=build_lagrangian(algorithm))  # fmt: skip
    assert build_lagrangian(AlgorithmConfig()) is None


def test_pf_ppo_weights_are_verls_and_the_redraw_follows_them():
    """PF-PPO (Shen et al. 2024; verl's compute_pf_ppo_reweight_data): pow |s|^p, max_min 1 at the extremes else 0,
    max_random 0.4 at the maximum else 0.1, each + 1e-8; B rows drawn with replacement in proportion, ascending,
    the same for the same generator seed."""
    from hybridflow.engine.algorithms.policy_filtration import filtration_weights, resampled_rows

    scores = torch.tensor([-2.0, 0.0, 1.0, 3.0, 3.0, 0.5])
    assert_close(filtration_weights(scores, "pow", 2.0), torch.tensor([4.0, 0.0, 1.0, 9.0, 9.0, 0.25]) + 1e-8)
    assert_close(filtration_weights(scores, "max_min", 2.0), torch.tensor([1.0, 0, 0, 1, 1, 0]) + 1e-8)
    assert_close(filtration_weights(scores, "max_random", 2.0), torch.tensor([0.1, 0.1, 0.1, 0.4, 0.4, 0.1]) + 1e-8)
    with pytest.raises(ValueError, match="pow, max_min or max_random"):
        filtration_weights(scores, "top", 2.0)
    rows = resampled_rows(scores, "max_min", 2.0, torch.Generator().manual_seed(0))
    assert len(rows) == 6 and rows == sorted(rows) and set(rows) <= {0, 3, 4}  # weight 1e-8 rows: drawn p ~ 1e-8
    assert rows == resampled_rows(scores, "max_min", 2.0, torch.Generator().manual_seed(0))
    # many draws: the frequencies follow the pow weights (row 1, score 0, never)
    counts = torch.zeros(6)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2000):
        counts += torch.bincount(torch.tensor(resampled_rows(scores, "pow", 2.0, generator)), minlength=6)
    assert_close(counts / counts.sum(), torch.tensor([4.0, 0.0, 1.0, 9.0, 9.0, 0.25]) / 23.25, atol=0.01, rtol=0)


def test_optimal_token_baseline_by_hand():
    """Two responses of prompt a (lengths 2 and 1) and one of prompt b: W_t accumulates 1 - 2 pi + sum pi^2,
    B_t = sum_i G_i,t W_i,t / sum_i W_i,t over the responses reaching t; a group of one gets no baseline."""
    rewards = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.5, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    old = torch.log(torch.tensor([[0.5, 0.25], [0.8, 1.0], [0.5, 1.0]]))
    squared = torch.tensor([[0.3, 0.4], [0.7, 0.0], [0.5, 0.0]])
    uids = np.array(["a", "a", "b"], dtype=object)
    fn = estimators.get_adv_estimator_fn("optimal_token_baseline")
    advantages, returns = fn(rewards, mask, index=uids, old_log_probs=old, sum_pi_squared=squared)
    # returns [1, 1], [2, 0]; W: [0.3, 1.2], [0.1]; B_0 = (1 x 0.3 + 2 x 0.1) / 0.4 = 1.25, B_1 = 1.2 / 1.2 = 1
    assert_close(returns, torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.5, 0.0]]))
    assert_close(advantages, torch.tensor([[-0.25, 0.0], [0.75, 0.0], [0.5, 0.0]]), atol=1e-6, rtol=0)
    # truncated IS weights scale W by their squares: response 2's W_0 = 0.1 x 4, so B_0 = (0.3 + 0.8) / 0.7
    rho = torch.tensor([[1.0, 1.0], [2.0, 1.0], [1.0, 1.0]])
    advantages, _ = fn(rewards, mask, index=uids, old_log_probs=old, sum_pi_squared=squared, rollout_is_weights=rho)
    assert_close(advantages[:2, 0], torch.tensor([1 - 1.1 / 0.7, 2 - 1.1 / 0.7]), atol=1e-6, rtol=0)


def test_sum_pi_squared_of_logits_is_the_softmaxs():
    logits = torch.randn(5, 11, dtype=torch.float64) * 3
    assert_close(torch_ops.sum_pi_squared(logits), torch.softmax(logits, -1).square().sum(-1))
    assert torch_ops.sum_pi_squared(logits.bfloat16()).dtype == torch.float32


def test_gdpo_normalises_each_reward_component_in_its_group_then_whitens_their_weighted_sum():
    """GDPO (verl's ``gdpo`` estimator): a component of tiny spread (a 0/1 format reward) weighs as much as one of
    large spread (a -3..3 accuracy reward) once each is normalised within its group; the weighted sum is whitened
    over the batch's response tokens. Checked against an independent numpy computation; a missing component is
    refused naming the keys the score function returned."""
    accuracy = np.array([3.0, -3.0, 1.0, 2.0])  # two groups of two (uids a, a, b, b)
    fmt = np.array([1.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    uids = np.array(["a", "a", "b", "b"], dtype=object)

    def normalised(r):  # per group: (r - mean) / (unbiased std + 1e-6)
        out = np.empty_like(r)
        for g in ("a", "b"):
            sel = uids == g
            out[sel] = (r[sel] - r[sel].mean()) / (r[sel].std(ddof=1) + 1e-6)
        return out

    combined = 1.0 * normalised(accuracy) + 0.5 * normalised(fmt)
    tokens = np.repeat(combined, mask.sum(-1).int().numpy())  # each response token holds its response's value
    whitened = (combined - tokens.mean()) / np.sqrt(tokens.var(ddof=1) + 1e-8)
    components = torch.tensor(np.stack([accuracy, fmt], -1))
    adv, ret = estimators.get_adv_estimator_fn("gdpo")(
        torch.zeros(4, 3), mask, index=uids, reward_components=components, reward_weights=[1.0, 0.5]
    )
    expected = torch.tensor(whitened, dtype=torch.float32)[:, None] * mask
    assert_close(adv, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(adv, ret)
    assert abs(float(torch_ops.masked_mean(adv, mask))) < 1e-6  # whitened over the tokens
    from hybridflow.engine.protocol import DataProto

    data = DataProto.from_dict({"reward_extra/accuracy": torch.tensor(accuracy), "response_mask": mask})
    assert advantage.reward_components(data, ["accuracy"]).shape == (4, 1)
    with pytest.raises(ValueError, match=r"names \['format'\], which the score function did not return: it returned"):
        advantage.reward_components(data, ["accuracy", "format"])
