"""Tests for the PPO updates: hybridflow.engine.backends.actor (Actor, RefPolicy), critic (Critic) and training.

Batches come from HFRollout on the real tiny model (seeded); ``old_log_probs`` from `Actor.compute_log_prob` on the
weights that generated them (on-policy), and random but fixed advantages. The responses have different lengths,
so a wrong weighting of micro-batches in the token-mean loss shows up in the gradients.
"""

from __future__ import annotations

import math
import os
import types

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from hybridflow.engine.backends.actor import Actor, RefPolicy
from hybridflow.engine.backends.critic import Critic
from hybridflow.engine.backends.training import (
    MetricLog,
    build_optimizer,
    micro_batch_weights,
    mini_batches,
    optimizer_step,
)
from hybridflow.engine.config import ActorConfig, CriticConfig, OptimConfig, RolloutConfig
from hybridflow.engine.guards import NonFiniteError
from hybridflow.engine.models import load_critic, load_model, load_tokenizer, response_log_probs
from hybridflow.engine.packing import _batch_groups, grouped_attention, pack_rows, prompt_groups
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollout.hf import HFRollout

QUESTIONS = ["What is 3 + 4?", "Hi", "Compute 12 - 5 and give the result: 7", "Solve it step by step."]
N = 2  # responses per prompt: batches hold 8 sequences
T = 8


def _sampled(tiny_model_dir, n: int, seed: int, micro_batch_size: int) -> DataProto:
    """The four questions (prompts of different lengths, left-padded) with `n` sampled responses each, some ending
    early (extra stop ids), as the rollout lays them out (a prompt's samples next to each other)."""
    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_model(tiny_model_dir)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *range(100, 160)]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    prompts = DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    config = RolloutConfig(n=n, response_length=T, micro_batch_size=micro_batch_size)
    return HFRollout(model, tokenizer, config, seed=seed).generate_sequences(prompts)


@pytest.fixture(scope="module")
def rollout_batch(tiny_model_dir) -> DataProto:
    """8 sampled sequences with responses of different lengths (extra stop ids make some end early)."""
    data = _sampled(tiny_model_dir, N, seed=1, micro_batch_size=8)
    lengths = data.batch["response_mask"].sum(-1)
    assert lengths.min() < T and lengths.max() == T  # responses of different lengths
    # pairs of rows (micro-batches of 2) hold very different token counts, not proportional to their 2 sequences
    pair_tokens = lengths.view(-1, 2).sum(-1)
    assert pair_tokens.max() >= 3 * pair_tokens.min()
    gen = torch.Generator().manual_seed(1)
    advantages = torch.randn(len(data), T, generator=gen) * data.batch["response_mask"]
    return data.union(DataProto.from_dict({"advantages": advantages}))


def with_old_log_probs(actor: Actor, data: DataProto) -> DataProto:
    return data.union(actor.compute_log_prob(data))


def make_actor(path, **config) -> Actor:
    return Actor(load_model(path), ActorConfig(**config), rollout_n=N)


def params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_change(model, before: dict[str, torch.Tensor]) -> float:
    return max(float((p.detach() - before[name]).abs().max()) for name, p in model.named_parameters())


# ----------------------------------------------------------------------------------------------------------- actor


def test_update_policy_on_policy(tiny_model_dir, rollout_batch):
    # one mini-batch (4 prompts x 2 = the whole batch) in one micro-batch: all metrics come before the step
    actor = make_actor(tiny_model_dir, ppo_mini_batch_size=4, ppo_micro_batch_size=8, optim=OptimConfig(lr=1e-3))
    data = with_old_log_probs(actor, rollout_batch)
    before = params(actor.model)
    metrics = actor.update_policy(data)

    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "actor/lr"):
        assert math.isfinite(metrics[key]), key
    assert abs(metrics["actor/ppo_kl"]) < 1e-5  # old log-probs come from the same weights
    assert metrics["actor/pg_clipfrac"] == 0.0  # ratio 1: nothing clipped
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/lr"] == pytest.approx(1e-3)
    # at ratio 1 the token-mean surrogate is -mean(A) over response tokens
    mask = data.batch["response_mask"].float()
    assert metrics["actor/pg_loss"] == pytest.approx(
        float(-(data.batch["advantages"] * mask).sum() / mask.sum()), abs=1e-5
    )
    assert max_change(actor.model, before) > 1e-4  # the weights moved
    assert actor.model.training


@pytest.mark.parametrize("loss_mode", ["gspo", "cispo"])
def test_the_actor_minimises_the_policy_loss_its_config_names(tiny_model_dir, rollout_batch, loss_mode):
    """``actor.policy_loss.loss_mode`` picks the loss from the registry: at ratio 1 GSPO's loss is the
    sequence-mean of -A (seq-mean-token-mean), CISPO's is -mean(A * log_prob); both step the weights."""
    from hybridflow.engine.config import PolicyLossConfig

    agg = "seq-mean-token-mean" if loss_mode == "gspo" else "token-mean"
    actor = make_actor(
        tiny_model_dir,
        ppo_mini_batch_size=4,
        ppo_micro_batch_size=8,
        optim=OptimConfig(lr=1e-3),
        loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )
    data = with_old_log_probs(actor, rollout_batch)
    before = params(actor.model)
    metrics = actor.update_policy(data)
    mask = data.batch["response_mask"].float()
    adv = data.batch["advantages"]
    if loss_mode == "gspo":
        want = float(((-adv * mask).sum(-1) / mask.sum(-1)).mean())
    else:
        want = float(-(adv * data.batch["old_log_probs"] * mask).sum() / mask.sum())
    assert metrics["actor/pg_loss"] == pytest.approx(want, abs=1e-5)
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/grad_norm"] > 0
    assert max_change(actor.model, before) > 1e-4


def test_clip_covs_random_tokens_are_a_function_of_the_seed_and_iteration_not_the_global_stream(
    tiny_model_dir, rollout_batch
):
    """Clip-Cov draws the tokens whose gradient it removes. The draw runs on the update's own stream
    (`update_random_stream`: the seed and ``global_steps``), so a flow worker resumed from a checkpoint, whose
    global generator starts afresh, updates exactly as the uninterrupted run; the global stream is left as it was."""
    from hybridflow.engine.config import PolicyLossConfig

    loss = PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-1e9, clip_cov_ub=1e9)

    def update(global_seed: int, step: int) -> tuple[dict[str, torch.Tensor], float]:
        actor = make_actor(
            tiny_model_dir, ppo_mini_batch_size=4, ppo_micro_batch_size=8, optim=OptimConfig(lr=1e-3), policy_loss=loss
        )
        data = with_old_log_probs(actor, rollout_batch)
        data.meta_info["global_steps"] = step
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        metrics = actor.update_policy(data)
        assert torch.equal(torch.get_rng_state(), state)  # the global stream untouched
        return params(actor.model), metrics["actor/pg_clipfrac"]

    (first, clipped), (again, clipped_again) = update(1, 3), update(2, 3)
    assert clipped == clipped_again > 0
    assert all(torch.equal(first[k], again[k]) for k in first)
    other, _ = update(1, 4)  # another iteration: another draw
    assert any(not torch.equal(first[k], other[k]) for k in first)


def padded_log_probs(model, micro: DataProto) -> torch.Tensor:
    """The reference path the packed one replaces: one Hugging Face forward over the padded full rows (every
    prompt copy, every pad position, the LM head everywhere), log-softmax at each response position. float32 [b, T]."""
    out = model(
        input_ids=micro.batch["input_ids"],
        attention_mask=micro.batch["attention_mask"],
        position_ids=micro.batch["position_ids"],
    )
    logits = out.logits[:, -T - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, micro.batch["responses"].unsqueeze(-1)).squeeze(-1)


def test_grouped_attention_equals_attention_group_by_group():
    """`grouped_attention` (all prompt groups in one padded batch; `packed_sdpa` takes it on CPU in bf16 for short
    groups) gives each group's attention over its own block: outputs and the gradients of q, k, v equal torch's
    sdpa run group by group, in float32 within 1e-5, with groups of 1 to 37 tokens (padding up to 36 positions
    that must contribute nothing), grouped KV heads (9 query heads over 3) and a packed mask that is not plain
    causal (a second sample's tokens skip the first's). A padded key left visible or a position scattered to the
    wrong place moves outputs by 1e-1."""
    torch.manual_seed(0)
    sizes = [37, 1, 20, 29]
    spans, start = [], 0
    for size in sizes:
        spans.append((start, start + size))
        start += size
    mask = torch.zeros(start, start, dtype=torch.bool)
    for a, b in spans:
        mask[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    a, b = spans[0]
    mask[a + 25 : b, a + 12 : a + 25] = False  # the second response of group 0 does not see the first
    q = torch.randn(1, 9, start, 16, requires_grad=True)
    k = torch.randn(1, 3, start, 16, requires_grad=True)
    v = torch.randn(1, 3, start, 16, requires_grad=True)
    grad = torch.randn(1, start, 9, 16)
    reference = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], attn_mask=mask[a:b, a:b], enable_gqa=True
            ).transpose(1, 2)
            for a, b in spans
        ],
        dim=1,
    )
    out = grouped_attention(q, k, v, mask[None, None], spans)
    assert_close(out, reference, atol=1e-5, rtol=1e-5)
    got, want = torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(reference, (q, k, v), grad)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, atol=1e-5, rtol=1e-5)
    # packed_sdpa batches short bf16 groups on CPU; fp32, long groups (scores over GROUPED_SCORES_BYTES), dropout and
    # sliding windows keep the memory-lean flash kernel group by group
    bf16 = torch.bfloat16
    assert _batch_groups(q, bf16, spans, {"dropout": 0.0, "scaling": 0.25, "position_ids": None})
    assert not _batch_groups(q, torch.float32, spans, {})
    assert not _batch_groups(q, bf16, [(0, 2048)] * 8, {})
    assert not _batch_groups(q, bf16, spans, {"dropout": 0.1})
    assert not _batch_groups(q, bf16, spans, {"sliding_window": 16})


@pytest.mark.parametrize(("n", "micro_batch_size"), [(1, 4), (2, 3), (8, 32), (8, 5)])
def test_packed_rows_give_the_log_probs_and_gradients_of_padded_full_rows(tiny_model_dir, n, micro_batch_size):
    """`response_log_probs` packs each micro-batch (`pack_rows`: no padding, a prompt once for its neighbouring
    samples, attention per prompt group, the LM head at response positions only). Its log-probs and the gradient of
    a token-mean loss over them equal the padded full-row forward, shared or not, for n = 1 (nothing to share),
    n = 2 and n = 8, prompts of different lengths (left padding), responses ending early, micro-batches that cut
    groups apart. Tolerance 1e-5: the paths multiply the same numbers in other shapes, so they differ by float32
    rounding (~1e-7 relative per product, summed over layers and vocabulary); a wrong position, mask or
    prediction index moves log-probs by 1e-2 or more."""
    data = _sampled(tiny_model_dir, n, seed=2, micro_batch_size=32)
    mask = data.batch["response_mask"]
    assert mask.sum(-1).min() < T  # some responses end early
    assert len(set(data.batch["attention_mask"][:, :-T].sum(-1).tolist())) > 1  # prompts of different lengths
    model = load_model(tiny_model_dir)
    results = {}
    for path in ("padded", "shared", "unshared"):
        model.zero_grad()
        log_probs = []
        for micro in data.split(micro_batch_size):
            if path == "padded":
                lp = padded_log_probs(model, micro)
            else:
                lp, _ = response_log_probs(model, micro, share_prompts=path == "shared")
            ((lp * micro.batch["response_mask"]).sum() / mask.sum()).backward()
            log_probs.append(lp.detach())
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[path] = torch.cat(log_probs), grads
    reference, reference_grads = results["padded"]
    for path in ("shared", "unshared"):
        log_probs, grads = results[path]
        assert_close(log_probs[mask.bool()], reference[mask.bool()], atol=1e-5, rtol=0, msg=path)
        assert (log_probs[~mask.bool()] == 0).all()
        assert grads.keys() == reference_grads.keys()
        for name, grad in reference_grads.items():
            assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=f"{path}: {name}")
    # the shared path really shares: each micro-batch's packed sequence holds each prompt once and no padding
    for micro in data.split(micro_batch_size):
        packed, groups = pack_rows(micro), prompt_groups(micro)
        prompt_tokens = micro.batch["attention_mask"][:, :-T].sum(-1)
        firsts = torch.cumsum(groups, 0) - groups
        assert packed.input_ids.shape[1] == prompt_tokens[firsts].sum() + micro.batch["response_mask"].sum()
        assert len(packed.spans) == len(groups)
        unshared = pack_rows(micro, share_prompts=False)
        assert unshared.input_ids.shape[1] == prompt_tokens.sum() + micro.batch["response_mask"].sum()
    if n > 1:
        assert len(prompt_groups(data)) == len(QUESTIONS)


@pytest.mark.parametrize("micro_batch_size", [3, 8])
def test_an_update_without_old_log_probs_equals_the_one_after_the_old_log_prob_stage(
    tiny_model_dir, rollout_batch, micro_batch_size
):
    """The skipped stage (`HybridFlowConfig.skips_old_log_prob`): an on-policy update on a batch without
    ``old_log_probs`` takes its own forward's log-probs, detached, as the old ones. Its loss, gradient, weights after
    the step and the stage's metrics (``actor/entropy``, the rollout drift) equal the path that computes them in a
    stage first. Micro-batches of 3 (uneven token counts) and of the whole batch; the responses end at different
    lengths. Tolerance: the two paths run the same forward on different row groupings, so log-probs differ by
    float32 rounding (~1e-7); the ratio at 1 +- 1e-7 moves the loss by that much and, through Adam's first step,
    a weight by at most a fraction of lr only where a gradient component is within eps of 0 (see the test below)."""
    from hybridflow.engine.metrics import rollout_mismatch

    common = dict(ppo_mini_batch_size=4, ppo_micro_batch_size=micro_batch_size, use_kl_loss=False, shuffle=False)
    drifted = rollout_batch.batch["response_mask"] * 0.01  # a made-up engine drift: the metrics must see it
    engine = DataProto.from_dict({"rollout_log_probs": torch.zeros(len(rollout_batch), T) - drifted})
    keys = sorted(set(rollout_batch.batch.keys()) - {"rollout_log_probs"})  # the hf rollout's own: replaced
    batch = rollout_batch.select(batch_keys=keys).union(engine)
    staged = make_actor(tiny_model_dir, optim=OptimConfig(lr=1e-3), **common)
    skipped = make_actor(tiny_model_dir, optim=OptimConfig(lr=1e-3), **common)
    old = staged.compute_log_prob(batch, calculate_entropy=True)
    entropys = old.pop(batch_keys=["entropys"]).batch["entropys"]
    data = batch.union(old)
    before = params(skipped.model)
    want = staged.update_policy(data)
    want["actor/entropy"] = float((entropys * data.batch["response_mask"]).sum() / data.batch["response_mask"].sum())
    want.update(rollout_mismatch(data))
    got = skipped.update_policy(batch)
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert got["actor/ppo_kl"] == 0.0 and got["actor/pg_clipfrac"] == 0.0  # the ratio is exactly 1
    assert got["rollout/log_prob_diff_mean"] > 1e-3
    skipped_params = dict(skipped.model.named_parameters())
    for name, p in staged.model.named_parameters():
        assert_close(skipped_params[name].detach(), p.detach(), atol=1e-5, rtol=0, msg=name)
    assert max_change(skipped.model, before) > 5e-4
    several = make_actor(tiny_model_dir, **{**common, "ppo_mini_batch_size": 2})
    with pytest.raises(ValueError, match="takes 2"):
        several.update_policy(batch)


@pytest.mark.parametrize("micro_batch_size", [2, 3])
@pytest.mark.parametrize(
    "loss_agg_mode", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_gradient_accumulation_matches_one_micro_batch(tiny_model_dir, rollout_batch, micro_batch_size, loss_agg_mode):
    # token-mean: micro-batch losses weighted by their share of the response tokens (not of the sequences), so
    # splitting the batch does not change the gradient even though the responses have different lengths
    # prompts in full rows: sharing a prompt runs other shapes in each grouping (its exactness: the test above)
    common = dict(ppo_mini_batch_size=4, loss_agg_mode=loss_agg_mode, shuffle=False, optim=OptimConfig(lr=1e-3))
    common["share_prompts"] = False
    whole = make_actor(tiny_model_dir, ppo_micro_batch_size=8, **common)
    split = make_actor(tiny_model_dir, ppo_micro_batch_size=micro_batch_size, **common)
    data = with_old_log_probs(whole, rollout_batch)
    assert_close(split.compute_log_prob(rollout_batch).batch["old_log_probs"], data.batch["old_log_probs"])
    before = params(whole.model)
    m_whole = whole.update_policy(data)
    m_split = split.update_policy(data)
    # Adam's first step is lr * g / (|g| + eps), blind to a constant scale of the loss: compare the grad norm too
    assert m_split["actor/grad_norm"] == pytest.approx(m_whole["actor/grad_norm"], rel=1e-4)
    # Tolerance: the summed micro-batch gradients differ from the one-pass gradient by float32 rounding (~1e-7
    # relative); Adam's first step turns each grad component g into lr * g / (|g| + eps), which is insensitive to
    # that rounding except for components within a few eps (1e-8) of 0, whose update can move by a fraction of
    # lr. 1e-5 (1% of lr = 1e-3) allows that and is still ~100x smaller than a real difference in the update.
    split_params = dict(split.model.named_parameters())
    for name, p in whole.model.named_parameters():
        assert_close(split_params[name].detach(), p.detach(), atol=1e-5, rtol=0, msg=name)
    assert max_change(whole.model, before) > 5e-4


def test_micro_batch_weights_hand_computed():
    # response tokens per sequence: 3, 1 | 2, 0 | 4; sequences with a token: 2 | 1 | 1
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    micros = DataProto.from_dict({"response_mask": mask}).split(2)
    assert micro_batch_weights(micros, "token-mean") == pytest.approx([4 / 10, 2 / 10, 4 / 10])
    assert micro_batch_weights(micros, "seq-mean-token-mean") == pytest.approx([2 / 4, 1 / 4, 1 / 4])
    assert micro_batch_weights(micros, "seq-mean-token-sum") == pytest.approx([2 / 4, 1 / 4, 1 / 4])
    assert micro_batch_weights(micros, "seq-mean-token-sum-norm") == pytest.approx([2 / 5, 2 / 5, 1 / 5])
    empty = DataProto.from_dict({"response_mask": torch.zeros(4, 3, dtype=torch.int64)}).split(2)
    assert micro_batch_weights(empty, "token-mean") == [0.0, 0.0]
    with pytest.raises(ValueError, match="'token-mean'"):
        micro_batch_weights(micros, "mean")


def test_megatron_schedule_refuses_uneven_micro_batches_only_with_pipelines(monkeypatch):
    """megatron's pipeline schedule exchanges activations in buffers of one micro-batch size, so a smaller last
    micro-batch (3 + 1 rows) would crash the last stage mid-step (measured: an IndexError there, then the other
    stage's gloo connection closed): with ``pp > 1`` `run_schedule` refuses it up front, naming the sizes. Without
    pipelines it goes on to the schedule, which ignores ``micro_batch_size`` there (measured at TP=2: the gradient
    of micro-batches of 3 + 1 rows equals the unsplit Hugging Face gradient within 1.2e-6 relative)."""
    if os.environ.get("CI") != "true":  # CI installs megatron-core: there the test must run, never skip
        pytest.importorskip("megatron.core", reason="megatron-core not installed (see .ci/setup)")
    from megatron.core import parallel_state

    from hybridflow.engine.backends.megatron_actor import run_schedule

    micros = DataProto.from_dict({"input_ids": torch.zeros(4, 5, dtype=torch.long)}).split(3)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match=r"micro-batches of 3 and 1 sequences: megatron's pipeline schedule"):
        run_schedule(None, micros, None, forward_only=True)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "is_pipeline_last_stage", lambda: True)
    reached = []
    monkeypatch.setattr(
        "megatron.core.pipeline_parallel.get_forward_backward_func", lambda: lambda **kw: reached.append(kw)
    )
    from megatron.core.transformer import TransformerConfig

    model = types.SimpleNamespace(config=TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1))
    run_schedule(model, micros, None, forward_only=True)
    assert reached[0]["num_microbatches"] == 2
    assert reached[0]["seq_length"] == 5  # no sequence parallelism: megatron runs the unpadded length


def test_bf16_compute_keeps_fp32_master_weights(tiny_model_dir, rollout_batch):
    # what the trainer does on CUDA (compute dtype bf16), here with CPU autocast, which supports bf16 too
    model = load_model(tiny_model_dir, torch.bfloat16, trainable=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    actor = Actor(
        model,
        ActorConfig(
            ppo_mini_batch_size=4, ppo_micro_batch_size=4, log_prob_micro_batch_size=4, optim=OptimConfig(lr=1e-3)
        ),  # the same micro-batches (and shared prompts) for the old log-probs and the update: the same bf16 path
        rollout_n=N,
        compute_dtype=torch.bfloat16,
    )
    data = with_old_log_probs(actor, rollout_batch)
    fp32 = make_actor(tiny_model_dir).compute_log_prob(rollout_batch).batch["old_log_probs"]
    mask = rollout_batch.batch["response_mask"].bool()
    bf16 = data.batch["old_log_probs"]
    assert bf16.dtype == torch.float32
    # the forward really ran in bf16 (so the numbers differ), and it is still the same distribution
    assert (bf16 - fp32)[mask].abs().max() > 1e-4
    assert_close(bf16[mask], fp32[mask], atol=0.1, rtol=0)
    before = params(actor.model)
    metrics = actor.update_policy(data)
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0
    assert abs(metrics["actor/ppo_kl"]) < 1e-5  # same compute path for old and new log-probs
    assert max_change(actor.model, before) > 1e-4
    assert all(p.dtype == torch.float32 for p in actor.model.parameters())
    assert all(s.dtype == torch.float32 for st in actor.optimizer.state.values() for s in st.values() if s.dim())

    critic = Critic(
        load_critic(tiny_model_dir, torch.bfloat16), CriticConfig(), rollout_n=N, compute_dtype=torch.bfloat16
    )
    assert all(p.dtype == torch.float32 for p in critic.model.parameters())
    values = critic.compute_values(rollout_batch).batch["values"]
    assert values.dtype == torch.float32


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_activation_checkpointing_keeps_the_update_and_frees_the_layers_activations(
    tiny_model_dir, rollout_batch, role
):
    """``model.gradient_checkpointing`` / ``critic.gradient_checkpointing``: the update (two mini-batches of two
    micro-batches) moves the weights exactly as without it, while autograd's saved tensors peak far lower (each
    layer keeps only its input until the backward pass reaches it)."""
    from saved_activations import PeakSavedBytes

    from hybridflow.engine.models import checkpoint_layers

    data = with_old_log_probs(make_actor(tiny_model_dir), rollout_batch)
    columns = {"values": torch.zeros(len(data), T), "returns": rollout_batch.batch["advantages"] + 0.5}
    data = data.union(DataProto.from_dict(columns))
    peaks, weights = {}, {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        if role == "actor":
            trained = make_actor(tiny_model_dir, ppo_mini_batch_size=2, ppo_micro_batch_size=2)
        else:
            config = CriticConfig(ppo_mini_batch_size=2, ppo_micro_batch_size=2)
            trained = Critic(load_critic(tiny_model_dir), config, rollout_n=N)
        if checkpointing:
            checkpoint_layers(trained.model)
        with PeakSavedBytes().watch() as meter:
            metrics = trained.update_policy(data) if role == "actor" else trained.update_critic(data)
        peaks[checkpointing], weights[checkpointing] = meter.peak, params(trained.model)
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))
    for name, weight in weights[False].items():
        assert_close(weights[True][name], weight, rtol=0, atol=1e-6, msg=name)
    assert peaks[True] < 0.6 * peaks[False], peaks


def test_warmup_lr_schedule(tiny_model_dir, rollout_batch):
    # documented: linear warm-up from lr/warmup_steps to lr over warmup_steps optimizer steps, then constant
    lr, warmup = 1e-3, 4
    actor = make_actor(
        tiny_model_dir,
        ppo_mini_batch_size=4,
        ppo_micro_batch_size=8,
        optim=OptimConfig(lr=lr, warmup_steps=warmup, weight_decay=0.0),
    )
    data = with_old_log_probs(actor, rollout_batch)
    before = params(actor.model)
    reported = [actor.update_policy(data)["actor/lr"]]
    # the lr the first step really used: Adam's first update is lr * g / (|g| + eps), i.e. lr for any |g| >> eps
    applied = max_change(actor.model, before)
    assert applied == pytest.approx(lr / warmup, rel=1e-3)
    reported += [actor.update_policy(data)["actor/lr"] for _ in range(5)]
    expected = [min(1.0, k / warmup) * lr for k in range(1, 7)]  # 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3
    assert reported == pytest.approx(expected, rel=1e-9)


def test_warmup_by_iterations_is_verls_schedule_whatever_the_steps_per_iteration(tiny_model_dir, rollout_batch):
    """``optim.warmup_iterations`` (verl's ``lr_warmup_steps``): iteration i (from 0, ``global_steps`` i + 1) trains
    every one of its optimizer steps at lr x min(1, i / w), verl's constant schedule with warm-up stepped once per
    update; the first iteration does not move the weights (lr 0), and an iteration given out of order (a resumed
    run's) gets its own rate."""
    lr, warmup = 1e-3, 4
    actor = make_actor(
        tiny_model_dir,
        ppo_mini_batch_size=2,  # two optimizer steps per update
        ppo_micro_batch_size=8,
        optim=OptimConfig(lr=lr, warmup_iterations=warmup, weight_decay=0.0),
    )
    data = with_old_log_probs(actor, rollout_batch)
    before = params(actor.model)
    rates = []
    for step in (1, 2, 3, 4, 5, 6, 3):
        data.meta_info["global_steps"] = step
        rates.append(actor.update_policy(data)["actor/lr"])
        if step == 1:
            assert max_change(actor.model, before) == 0.0  # trained at lr 0
    expected = [lr * min(1.0, i / warmup) for i in (0, 1, 2, 3, 4, 5, 2)]
    assert rates == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert actor.lr_scheduler.last_epoch == 14  # two optimizer steps per update, as taken
    with pytest.raises(ValueError, match="two warm-ups"):
        OptimConfig(warmup_steps=2, warmup_iterations=2)


def test_a_cosine_schedule_decays_by_iteration_as_verls_after_its_warmup(tiny_model_dir, rollout_batch):
    """``optim.lr_scheduler_type: cosine`` (verl's ``get_cosine_schedule_with_warmup``, one scheduler step per
    update): after w warm-up iterations, iteration i trains every optimizer step at lr x (r + (1 - r) (1 +
    cos(2 pi c p)) / 2), p = (i - w) / (T - w), and from T on at lr x r; an iteration given again (a resumed run's)
    gets its own rate. Expected rates written from verl's formula, not from ours."""
    import math

    lr, warmup, horizon, ratio = 1e-3, 2, 6, 0.1
    actor = make_actor(
        tiny_model_dir,
        ppo_mini_batch_size=2,  # two optimizer steps per update
        ppo_micro_batch_size=8,
        optim=OptimConfig(
            lr=lr,
            warmup_iterations=warmup,
            lr_scheduler_type="cosine",
            decay_iterations=horizon,
            min_lr_ratio=ratio,
            weight_decay=0.0,
        ),
    )
    data = with_old_log_probs(actor, rollout_batch)

    def verl(step: int) -> float:  # verl/utils/torch_functional.py, with steps past T held at the minimum
        if step < warmup:
            return step / warmup
        progress = min(1.0, (step - warmup) / (horizon - warmup))
        return max(ratio, math.cos(math.pi * 0.5 * 2.0 * progress) * (1 - ratio) * 0.5 + (1 + ratio) * 0.5)

    rates = []
    for global_steps in (1, 2, 3, 4, 5, 6, 7, 8, 4):
        data.meta_info["global_steps"] = global_steps
        rates.append(actor.update_policy(data)["actor/lr"])
    expected = [lr * verl(i) for i in (0, 1, 2, 3, 4, 5, 6, 7, 3)]
    assert rates == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert rates[2] == pytest.approx(lr) and rates[6] == rates[7] == pytest.approx(lr * ratio)
    with pytest.raises(ValueError, match="decays by training iteration"):
        OptimConfig(lr_scheduler_type="cosine", warmup_steps=3)
    with pytest.raises(ValueError, match="must come after the warm-up"):
        OptimConfig(lr_scheduler_type="cosine", warmup_iterations=4, decay_iterations=4)


def test_kl_loss_on_policy_and_missing_ref(tiny_model_dir, rollout_batch):
    actor = make_actor(
        tiny_model_dir,
        ppo_mini_batch_size=4,
        ppo_micro_batch_size=4,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        optim=OptimConfig(lr=1e-3),
    )
    data = with_old_log_probs(actor, rollout_batch)
    with pytest.raises(KeyError, match="ref_log_prob"):
        actor.update_policy(data)
    ref = DataProto.from_dict({"ref_log_prob": data.batch["old_log_probs"].clone()})
    metrics = actor.update_policy(data.union(ref))
    assert abs(metrics["actor/kl_loss"]) < 1e-6
    assert metrics["actor/kl_coef"] == pytest.approx(0.1)
    assert abs(metrics["actor/ppo_kl"]) < 1e-5


def test_ref_policy_matches_actor_and_is_frozen(tiny_model_dir, rollout_batch):
    actor = make_actor(tiny_model_dir, log_prob_micro_batch_size=8)
    ref = RefPolicy(load_model(tiny_model_dir), micro_batch_size=3)
    assert all(not p.requires_grad for p in ref.model.parameters())
    assert not ref.model.training
    mask = rollout_batch.batch["response_mask"].bool()
    for temperature in (1.0, 0.7):
        data = DataProto(rollout_batch.batch, rollout_batch.non_tensor_batch, {"temperature": temperature})
        ref_lp = ref.compute_ref_log_prob(data).batch["ref_log_prob"]
        actor_lp = actor.compute_log_prob(data).batch["old_log_probs"]
        assert ref_lp.shape == (len(data), T)
        assert_close(ref_lp[mask], actor_lp[mask], atol=1e-5, rtol=0)
        if temperature == 1.0:
            at_one = ref_lp
    assert (ref_lp - at_one)[mask].abs().max() > 1e-3  # the temperature is applied
    assert all(not p.requires_grad for p in ref.model.parameters())


# ---------------------------------------------------------------------------------------------------------- critic


def test_critic_update_lowers_value_loss(tiny_model_dir, rollout_batch):
    critic = Critic(
        load_critic(tiny_model_dir),
        CriticConfig(ppo_mini_batch_size=4, ppo_micro_batch_size=4, optim=OptimConfig(lr=1e-3, warmup_steps=2)),
        rollout_n=N,
    )
    values = critic.compute_values(rollout_batch)
    assert torch.equal(values.batch["values"], torch.zeros(len(rollout_batch), T))
    returns = DataProto.from_dict({"returns": torch.ones(len(rollout_batch), T)})
    data = rollout_batch.union(values).union(returns)
    history = [critic.update_critic(data) for _ in range(20)]
    losses = [m["critic/vf_loss"] for m in history]
    # first update: V = 0 everywhere, target 1 -> 0.5 * (0 - 1)^2
    assert losses[0] == pytest.approx(0.5, abs=1e-6)
    assert history[0]["critic/vpred_mean"] == pytest.approx(0.0, abs=1e-6)
    assert losses[-1] < losses[0]
    for m in history:
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr"):
            assert math.isfinite(m[key]), key
    assert history[-1]["critic/vpred_mean"] > 0.1  # the values moved toward the returns
    # critic/lr is the lr each step used: warm-up 5e-4 for the first step, then 1e-3
    assert [m["critic/lr"] for m in history[:3]] == pytest.approx([5e-4, 1e-3, 1e-3], rel=1e-9)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_critic_gradient_accumulation_matches_one_micro_batch(tiny_model_dir, rollout_batch, loss_agg_mode):
    gen = torch.Generator().manual_seed(2)
    targets = {
        "values": torch.zeros(len(rollout_batch), T),
        "returns": torch.randn(len(rollout_batch), T, generator=gen),
    }
    data = rollout_batch.union(DataProto.from_dict(targets))

    def update(micro_batch_size: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        config = CriticConfig(
            ppo_mini_batch_size=4,
            ppo_micro_batch_size=micro_batch_size,
            shuffle=False,
            loss_agg_mode=loss_agg_mode,
            optim=OptimConfig(lr=1e-3),
        )
        critic = Critic(load_critic(tiny_model_dir), config, rollout_n=N)
        return critic.update_critic(data), params(critic.model)

    m_whole, p_whole = update(8)
    m_split, p_split = update(2)
    assert m_split["critic/grad_norm"] == pytest.approx(m_whole["critic/grad_norm"], rel=1e-4)
    for name, p in p_whole.items():
        assert_close(p_split[name], p, atol=1e-5, rtol=0, msg=name)


def test_mini_batches_not_divisible(tiny_model_dir, rollout_batch):
    with pytest.raises(ValueError, match="ppo_mini_batch_size"):
        list(mini_batches(rollout_batch, 3, epochs=1, shuffle=False, seed=(0,)))
    data = rollout_batch.union(
        DataProto.from_dict(
            {"values": torch.zeros(len(rollout_batch), T), "returns": torch.ones(len(rollout_batch), T)}
        )
    )
    critic = Critic(load_critic(tiny_model_dir), CriticConfig(ppo_mini_batch_size=3), rollout_n=1)
    with pytest.raises(ValueError, match="ppo_mini_batch_size"):
        critic.update_critic(data)


def test_mini_batches_cover_each_epoch(rollout_batch):
    data = DataProto.from_dict({"i": torch.arange(len(rollout_batch))})
    epochs = list(mini_batches(data, 4, epochs=2, shuffle=True, seed=(0, 1)))
    assert len(epochs) == 4 and all(len(m) == 4 for m in epochs)
    first = torch.cat([m.batch["i"] for m in epochs[:2]])
    second = torch.cat([m.batch["i"] for m in epochs[2:]])
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(len(rollout_batch)))
    again = list(mini_batches(data, 4, epochs=2, shuffle=True, seed=(0, 1)))  # order is a function of the seed
    assert torch.equal(torch.cat([m.batch["i"] for m in again]), torch.cat([first, second]))
    plain = list(mini_batches(data, 4, epochs=1, shuffle=False, seed=(0,)))
    assert torch.equal(torch.cat([m.batch["i"] for m in plain]), torch.arange(len(rollout_batch)))


# -------------------------------------------------------------------------------------------------- optimizer_step


def _backward(model) -> None:
    input_ids = torch.tensor([[5, 6, 7, 8, 9]])
    model(input_ids=input_ids).logits.square().mean().backward()


def test_optimizer_step_stops_on_nan(tiny_model_dir):
    """A NaN gradient raises NonFiniteError naming the grad norm and the NaN loss, before any step: the weights,
    Adam's state and the LR schedule are untouched and the grads are cleared."""
    model = load_model(tiny_model_dir)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-3))
    _backward(model)
    next(p for p in model.parameters()).grad[0, 0] = float("nan")
    before = params(model)
    log = MetricLog()
    log.add(pg_loss=float("nan"), pg_clipfrac=0.0)
    with pytest.raises(
        NonFiniteError, match=r"update_actor: actor/grad_norm is nan \(non-finite in this mini-batch: actor/pg_loss\)"
    ):
        optimizer_step(model, optimizer, scheduler, grad_clip=1.0, role="actor", log=log)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
        assert p.grad is None  # grads are cleared
    assert not optimizer.state and scheduler.last_epoch == 0  # nothing was stepped

    # a finite step: returns the pre-clip global norm and moves the weights
    _backward(model)
    expected = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    step = optimizer_step(model, optimizer, scheduler, grad_clip=1e-6)
    assert step["grad_norm"] == pytest.approx(expected, rel=1e-5) and step["lr"] == pytest.approx(1e-3)
    assert max_change(model, before) > 1e-4
    assert all(p.grad is None for p in model.parameters())
    assert np.isfinite([float(p.detach().abs().max()) for p in model.parameters()]).all()


def test_shuffled_mini_batches_keep_a_prompts_samples_together():
    """With the prompt groups (`share_prompts`), the shuffle permutes whole groups: every group's rows stay next
    to each other in their order, the order still depends on the seed, and every row comes once per epoch."""
    groups = torch.tensor([4, 4, 1, 3, 4])
    rows = DataProto.from_dict({"row": torch.arange(16)})
    orders = []
    for seed in ((0, 1, 0), (0, 2, 0)):
        (mini,) = list(mini_batches(rows, 16, 1, True, seed, groups))
        orders.append(mini.batch["row"].tolist())
    starts = [0, 4, 8, 9, 12]
    for order in orders:
        assert sorted(order) == list(range(16))
        for start, size in zip(starts, groups.tolist(), strict=True):
            at = order.index(start)
            assert order[at : at + size] == list(range(start, start + size))
    assert orders[0] != orders[1]
    assert list(mini_batches(rows, 16, 1, True, (0, 1, 0)))[0].batch["row"].tolist() != orders[0]  # rows shuffled
