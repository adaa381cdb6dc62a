"""Tests for hybridflow.engine.models: response log-probs, entropy and critic values on the real tiny model.

Every forward of the library (micro-batched, packed rows, ``logits_to_keep`` at response positions) is compared with a
plain reference written here: one full forward over ``input_ids`` and an explicit loop over rows and response
positions, reading the output at position P-1+t for response token t.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from hybridflow.engine.models import (
    compute_log_probs,
    compute_values,
    load_critic,
    load_model,
    load_tokenizer,
    pick_device,
    pick_dtype,
    response_logits,
)
from hybridflow.engine.packing import pack_rows
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.tiny import build_tiny_model

QUESTIONS = ["What is 3 + 4?", "Hi", "Compute 12 - 5 and give the result: 7", "Solve it step by step.", "2 + 2"]
ANSWERS = ["The answer is 7.", "Hello there, how can I help you today? I am a", "7", "#### 42", ""]
T = 12  # response length (the second answer is long enough to fill it with no EOS)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def batch(tokenizer) -> DataProto:
    """Prompts left-padded to different lengths, responses (answer + EOS) right-padded to T, built by hand."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompt_rows = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompt_rows]
    p = max(len(ids) for ids in prompt_ids)
    prompts = torch.tensor([[pad] * (p - len(ids)) + ids for ids in prompt_ids])
    prompt_mask = torch.tensor([[0] * (p - len(ids)) + [1] * len(ids) for ids in prompt_ids])

    responses, response_mask = [], []
    for answer in ANSWERS:
        ids = (tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos])[:T]
        responses.append(ids + [pad] * (T - len(ids)))
        response_mask.append([1] * len(ids) + [0] * (T - len(ids)))
    responses, response_mask = torch.tensor(responses), torch.tensor(response_mask)

    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    lengths = response_mask.sum(-1)
    assert len(set(prompt_mask.sum(-1).tolist())) == len(QUESTIONS)  # every prompt has its own amount of padding
    assert lengths.max() == T and (responses[lengths.argmax()] != eos).all()  # one response fills T, no EOS
    assert lengths.min() == 1  # an empty answer: the response is just the EOS
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
        }
    )


def full_forward(model, data: DataProto) -> torch.Tensor:
    """The model's output over every position of the sequences (no logits_to_keep): [B, P+T, V or 1]."""
    with torch.no_grad():
        out = model(
            input_ids=data.batch["input_ids"],
            attention_mask=data.batch["attention_mask"],
            position_ids=data.batch["position_ids"],
        )
    return out.logits.float()


def at_response_positions(per_position: torch.Tensor, data: DataProto, token_index: bool) -> torch.Tensor:
    """out[b, t] = per_position[b, P-1+t, responses[b, t]] (token_index) or per_position[b, P-1+t] (otherwise)."""
    prompt_len = data.batch["prompts"].shape[1]
    responses = data.batch["responses"]
    out = torch.zeros(responses.shape, dtype=torch.float32)
    for b in range(responses.shape[0]):
        for t in range(responses.shape[1]):
            row = per_position[b, prompt_len - 1 + t]
            out[b, t] = row[responses[b, t]] if token_index else row
    return out


def masked(x: torch.Tensor, data: DataProto) -> torch.Tensor:
    return x[data.batch["response_mask"].bool()]


# ------------------------------------------------------------------------------------------------------- log-probs


def test_log_probs_match_full_forward_reference(model, batch):
    logits = full_forward(model, batch)
    reference = at_response_positions(torch.log_softmax(logits, dim=-1), batch, token_index=True)
    results = {}
    for micro_batch_size in (1, 3, len(batch)):
        log_probs, entropy = compute_log_probs(model, batch, micro_batch_size)
        assert entropy is None
        assert log_probs.shape == batch.batch["responses"].shape and log_probs.dtype == torch.float32
        assert_close(masked(log_probs, batch), masked(reference, batch), atol=1e-5, rtol=0)
        results[micro_batch_size] = log_probs
    for micro_batch_size in (1, 3):
        assert_close(masked(results[micro_batch_size], batch), masked(results[len(batch)], batch), atol=1e-5, rtol=0)
    # sanity: log-probs of real tokens under a random model are far from 0 and differ between positions
    assert (masked(reference, batch) < -1.0).all()


@pytest.mark.parametrize("attention", ["eager", "sdpa", "hybridflow"])
def test_log_probs_match_the_reference_with_every_attention_implementation(tiny_model_dir, batch, attention):
    """The packed rows' mask works with Hugging Face's eager attention (an additive mask), its sdpa (a boolean one,
    over the whole packed sequence) and `packed_sdpa` (per prompt group; what `load_model` sets up)."""
    from hybridflow.engine.packing import PACKED_ATTENTION

    if attention == "hybridflow":
        model = load_model(tiny_model_dir)
        assert model.config._attn_implementation == PACKED_ATTENTION
    else:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attention)
    reference = at_response_positions(torch.log_softmax(full_forward(model, batch), -1), batch, token_index=True)
    log_probs, _ = compute_log_probs(model, batch, micro_batch_size=3)
    assert_close(masked(log_probs, batch), masked(reference, batch), atol=1e-5, rtol=0)
    assert (log_probs[~batch.batch["response_mask"].bool()] == 0).all()  # no token: nothing computed there


def test_entropy_matches_reference(model, batch):
    logits = full_forward(model, batch)
    entropy_per_position = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    reference = at_response_positions(entropy_per_position, batch, token_index=False)
    log_probs, entropy = compute_log_probs(model, batch, micro_batch_size=2, calculate_entropy=True)
    assert entropy is not None and entropy.shape == log_probs.shape and entropy.dtype == torch.float32
    assert_close(masked(entropy, batch), masked(reference, batch), atol=1e-5, rtol=0)
    # the log-probs are unaffected by asking for the entropy
    assert_close(log_probs, compute_log_probs(model, batch, micro_batch_size=2)[0], atol=0, rtol=0)


def test_sum_pi_squared_matches_reference_from_the_same_forward(model, batch):
    """The optimal token baseline's input: sum_v pi(v)^2 of the temperature-scaled softmax at each response token."""
    from hybridflow.engine.models import compute_token_stats

    logits = full_forward(model, batch) / 0.7
    reference = at_response_positions(torch.softmax(logits, -1).square().sum(-1), batch, token_index=False)
    stats = compute_token_stats(model, batch, 2, temperature=0.7, calculate_sum_pi_squared=True)
    assert set(stats) == {"log_probs", "sum_pi_squared"}
    assert_close(masked(stats["sum_pi_squared"], batch), masked(reference, batch), atol=1e-6, rtol=0)
    assert_close(stats["log_probs"], compute_log_probs(model, batch, 2, temperature=0.7)[0], atol=0, rtol=0)


def test_temperature_divides_logits(model, batch):
    logits = full_forward(model, batch)
    reference = at_response_positions(torch.log_softmax(logits / 2.0, dim=-1), batch, token_index=True)
    log_probs, _ = compute_log_probs(model, batch, micro_batch_size=3, temperature=2.0)
    assert_close(masked(log_probs, batch), masked(reference, batch), atol=1e-5, rtol=0)
    plain, _ = compute_log_probs(model, batch, micro_batch_size=3, temperature=1.0)
    assert (masked(plain - log_probs, batch).abs() > 1e-3).any()  # the temperature really changed something


# ---------------------------------------------------------------------------------------------------------- critic


def test_critic_values(tiny_model_dir, batch, tmp_path):
    critic = load_critic(tiny_model_dir)
    values = compute_values(critic, batch, micro_batch_size=2)
    b, t = batch.batch["responses"].shape
    assert values.shape == (b, t) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros(b, t))  # zero-initialised head: V = 0 everywhere at start

    head = critic.score
    assert head.weight.shape[0] == 1  # one label: a scalar value per token
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen))
        if head.bias is not None:
            head.bias.copy_(torch.randn(head.bias.shape, generator=gen))
    critic.eval()
    values = compute_values(critic, batch, micro_batch_size=3)
    reference = at_response_positions(full_forward(critic, batch)[..., 0], batch, token_index=False)
    assert_close(masked(values, batch), masked(reference, batch), atol=1e-5, rtol=0)
    assert masked(values, batch).abs().min() > 0  # the random head gives non-zero values
    # micro-batching does not change the values
    assert_close(masked(compute_values(critic, batch, 1), batch), masked(values, batch), atol=1e-5, rtol=0)

    critic.save_pretrained(tmp_path / "critic")
    reloaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic").eval()
    assert reloaded.config.num_labels == 1
    # reloaded plainly, it attends over the whole packed sequence with sdpa, not per group: float rounding apart
    assert_close(compute_values(reloaded, batch, micro_batch_size=3), values, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------- device


def test_pick_dtype():
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert pick_dtype("float32", torch.device("cuda")) == torch.float32


def test_pick_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device("auto") == torch.device(expected)
    assert pick_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_pick_device_cuda_without_cuda_names_the_key():
    with pytest.raises(ValueError, match=r"trainer\.device"):
        pick_device("cuda")


# ------------------------------------------------------------------------------------------------------- precision


def test_trained_models_keep_fp32_weights_frozen_ones_take_the_dtype(tiny_model_dir):
    for trainable_model in (load_model(tiny_model_dir, torch.bfloat16), load_critic(tiny_model_dir, torch.bfloat16)):
        assert {p.dtype for p in trainable_model.parameters()} == {torch.float32}
    frozen = load_model(tiny_model_dir, torch.bfloat16, trainable=False)
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}


def test_bf16_compute_runs_under_autocast(model, batch):
    # CPU autocast supports bf16, so the CUDA path (fp32 weights, bf16 matmuls) runs here too
    packed = pack_rows(batch)
    plain = response_logits(model, packed)
    cast = response_logits(model, packed, compute_dtype=torch.bfloat16)
    assert plain.dtype == torch.float32 and cast.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(response_logits(model, packed, compute_dtype=torch.float32), plain)  # fp32: no cast
    log_probs, _ = compute_log_probs(model, batch, micro_batch_size=3, compute_dtype=torch.bfloat16)
    reference, _ = compute_log_probs(model, batch, micro_batch_size=3)
    assert log_probs.dtype == torch.float32
    assert_close(masked(log_probs, batch), masked(reference, batch), atol=0.05, rtol=0)
    assert (masked(log_probs - reference, batch).abs() > 0).any()  # bf16 rounding: really another compute path


# --------------------------------------------------------------------------------------------------------- dropout


def test_config_dropout_is_off_in_train_mode(tiny_model_dir, batch, tmp_path):
    # attention_dropout is applied functionally in train mode (no nn.Dropout module to zero)
    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    source.config.attention_dropout = 0.5
    source.save_pretrained(tmp_path / "dropout")
    model = load_model(tmp_path / "dropout").train()
    assert model.config.attention_dropout == 0.0
    torch.manual_seed(0)
    train_mode, _ = compute_log_probs(model, batch, micro_batch_size=len(batch))
    model.eval()
    eval_mode, _ = compute_log_probs(model, batch, micro_batch_size=len(batch))
    assert torch.equal(train_mode, eval_mode)

    critic = load_critic(tmp_path / "dropout").train()
    assert critic.config.attention_dropout == 0.0 and critic.config.num_labels == 1
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))
    train_values = compute_values(critic, batch, micro_batch_size=len(batch))
    critic.eval()
    assert torch.equal(train_values, compute_values(critic, batch, micro_batch_size=len(batch)))


# ------------------------------------------------------------------------------------------------------ tiny model


def test_build_tiny_model_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "a", seed=0)
    assert torch.equal(torch.rand(4), expected)
    # and the weights still depend only on the seed
    build_tiny_model(tmp_path / "b", seed=0)
    a, b = load_model(tmp_path / "a"), load_model(tmp_path / "b")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
