"""Tests for hybridflow.engine.rollout.hf: masks and positions by hand, and HFRollout on the real tiny model.

The tiny model's random init (weights of std 0.02) leaves the residual stream dominated by the current token's
embedding, so greedy decoding repeats one token whatever the prompt; a broken padding or position id would go
unnoticed. The generation tests therefore use `sharpened_dir`: the same model with its decoder linear layers scaled
up, so each greedy token depends on the whole context. EOS is rare under a random model, so tests that need responses
to stop early declare extra EOS ids in ``generation_config.eos_token_id`` (a list, as Llama-3 style models ship).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from hybridflow.engine.config import ConfigError, RolloutConfig, load_config
from hybridflow.engine.extensions import (
    _ROLLOUTS,
    awake,
    build_rollout,
    register_rollout,
    rollout_names,
    rollout_spec,
)
from hybridflow.engine.models import load_model, load_tokenizer, response_log_probs, response_logits
from hybridflow.engine.packing import pack_rows
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollout.hf import HFRollout, position_ids_from_mask, response_mask_from_eos

GRPO_TINY = Path(__file__).parents[1] / "examples" / "grpo_tiny.yaml"
QUESTIONS = ["What is 3 + 4?", "Hi", "Compute 12 - 5 and give the result: 7"]
KEYS = {"prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask", "rollout_log_probs"}


# ------------------------------------------------------------------------------------------------ masks, positions


def test_response_mask_eos_in_middle():
    responses = torch.tensor([[5, 6, 2, 7, 8], [2, 9, 9, 9, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 2]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    mask = response_mask_from_eos(responses, [2])
    assert mask.dtype == torch.int64
    assert torch.equal(mask, expected)


def test_response_mask_pad_equal_to_eos():
    # pad id == eos id (2): the first 2 ends the response, the later 2s are padding
    responses = torch.tensor([[5, 2, 2, 2, 2], [5, 6, 7, 2, 2], [2, 2, 2, 2, 2]])
    expected = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    assert torch.equal(response_mask_from_eos(responses, [2]), expected)


def test_response_mask_several_eos_ids():
    responses = torch.tensor([[5, 11, 2, 7], [5, 6, 2, 11], [11, 2, 5, 5], [5, 6, 7, 8]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    assert torch.equal(response_mask_from_eos(responses, [2, 11]), expected)
    # with only id 2 declared, 11 is an ordinary token
    assert torch.equal(
        response_mask_from_eos(responses, [2]), torch.tensor([[1, 1, 1, 0]] * 2 + [[1, 1, 0, 0]] + [[1] * 4])
    )


def test_position_ids_from_mask_left_pads():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    expected = torch.tensor([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 2, 2]])
    positions = position_ids_from_mask(mask)
    assert positions.dtype == torch.int64
    assert torch.equal(positions, expected)


# ----------------------------------------------------------------------------------------------------- generation


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def sharpened_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with every decoder linear weight x10 and the (tied) embeddings x5 (see the module docstring)."""
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.weight.mul_(10.0)
        model.get_input_embeddings().weight.mul_(5.0)
    path = tmp_path_factory.mktemp("sharpened")
    model.save_pretrained(path)
    return path


def chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def prompt_batch(tokenizer, questions: list[str], **non_tensors) -> DataProto:
    """Chat-templated prompts, left-padded by the tokenizer (padding_side is left)."""
    enc = tokenizer([chat(tokenizer, q) for q in questions], padding=True, return_tensors="pt")
    return DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, non_tensors)


def greedy(model, tokenizer, prompts: DataProto, response_length: int) -> DataProto:
    rollout = HFRollout(model, tokenizer, RolloutConfig(n=1, response_length=response_length, micro_batch_size=8))
    return rollout.generate_sequences(prompts, temperature=0.0)


def test_generate_sequences_layout(tiny_model_dir, tokenizer):
    model = load_model(tiny_model_dir)
    # 60 extra stop ids (about 1 in 6 tokens under the near-uniform random model), so some responses end early
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *range(100, 160)]
    eos_ids = [tokenizer.eos_token_id, *range(100, 160)]
    pad = tokenizer.pad_token_id
    prompts = prompt_batch(tokenizer, QUESTIONS, data_source=["a", "b", "c"], extra=[{"k": 0}, {"k": 1}, {"k": 2}])
    prompts.meta_info["global_steps"] = 3
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    assert len(set(prompt_mask.sum(-1).tolist())) == 3 and (prompt_mask[:, 0] == 0).any()  # really left-padded
    b, p, n, t = len(QUESTIONS), prompt_ids.shape[1], 3, 8

    rollout = HFRollout(model, tokenizer, RolloutConfig(n=n, response_length=t, micro_batch_size=4))
    out = rollout.generate_sequences(prompts)
    assert set(prompts.non_tensor_batch) == {"data_source", "extra"}  # the caller's batch is not modified

    assert set(out.batch.keys()) == KEYS
    shapes = {k: tuple(v.shape) for k, v in out.batch.items()}
    assert shapes == {
        "prompts": (b * n, p),
        "responses": (b * n, t),
        "input_ids": (b * n, p + t),
        "attention_mask": (b * n, p + t),
        "position_ids": (b * n, p + t),
        "response_mask": (b * n, t),
        "rollout_log_probs": (b * n, t),
    }
    # samples of one prompt are adjacent: rows 3i..3i+2 hold prompt i
    rows = torch.arange(b).repeat_interleave(n)
    assert torch.equal(out.batch["prompts"], prompt_ids[rows])
    responses, response_mask = out.batch["responses"], out.batch["response_mask"]
    assert torch.equal(out.batch["input_ids"], torch.cat([out.batch["prompts"], responses], dim=1))
    assert torch.equal(out.batch["attention_mask"], torch.cat([prompt_mask[rows], response_mask], dim=1))
    assert torch.equal(out.batch["position_ids"], (out.batch["attention_mask"].cumsum(-1) - 1).clamp(min=0))

    uid = out.non_tensor_batch["uid"]
    assert list(uid) == ["train-3-0"] * 3 + ["train-3-1"] * 3 + ["train-3-2"] * 3  # made from the row, no uid given
    assert list(out.non_tensor_batch["data_source"]) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    assert [e["k"] for e in out.non_tensor_batch["extra"]] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert out.meta_info["temperature"] == 1.0 and out.meta_info["global_steps"] == 3

    # the mask covers each response up to and including its first stop id, pad ids after it
    for i in range(b * n):
        stops = [j for j in range(t) if int(responses[i, j]) in eos_ids]
        length = stops[0] + 1 if stops else t
        assert response_mask[i].tolist() == [1] * length + [0] * (t - length)
        assert (responses[i, length:] == pad).all()
        assert (responses[i, :length] != pad).all()
    lengths = response_mask.sum(-1)
    assert lengths.min() < t and lengths.max() == t  # both early stops and full-length responses occurred
    # samples differ (temperature 1.0)
    assert not torch.equal(responses[0], responses[1])

    # a uid already present (as PromptSampler sets it) is kept
    with_uid = DataProto(prompts.batch, {**prompts.non_tensor_batch, "uid": ["0-7", "0-8", "0-9"]}, prompts.meta_info)
    again = rollout.generate_sequences(with_uid, n=2)
    assert list(again.non_tensor_batch["uid"]) == ["0-7", "0-7", "0-8", "0-8", "0-9", "0-9"]
    assert list(with_uid.non_tensor_batch["uid"]) == ["0-7", "0-8", "0-9"]


def test_greedy_is_padding_invariant_and_argmax(sharpened_dir, tokenizer):
    model = load_model(sharpened_dir)
    t = 10
    batched = greedy(model, tokenizer, prompt_batch(tokenizer, QUESTIONS), t)
    responses, mask = batched.batch["responses"], batched.batch["response_mask"]
    assert len(set(map(tuple, responses.tolist()))) == len(QUESTIONS)  # the prompts lead to different responses
    for i, question in enumerate(QUESTIONS):
        alone = greedy(model, tokenizer, prompt_batch(tokenizer, [question]), t)
        assert (alone.batch["attention_mask"][0, : alone.batch["prompts"].shape[1]] == 1).all()  # no padding
        assert torch.equal(alone.batch["response_mask"][0], mask[i])
        assert torch.equal(alone.batch["responses"][0][mask[i].bool()], responses[i][mask[i].bool()])

    # each greedy token is the argmax of the model's own logits at that position (padded batch, no cache)
    with torch.no_grad():
        packed = pack_rows(batched)
        logits = response_logits(model, packed)
    assert torch.equal(logits.argmax(-1), responses[packed.rows, packed.cols])
    assert torch.equal(packed.scatter(torch.ones(len(logits))), mask.float())  # every response token, no other

    # a stop id met in the middle: row 0 stops at its step-4 token; every row keeps its greedy prefix, then pads
    stop = int(responses[0, 4])
    assert stop not in responses[0, :4].tolist()
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    stopped = greedy(model, tokenizer, prompt_batch(tokenizer, QUESTIONS), t)
    assert stopped.batch["response_mask"][0].tolist() == [1] * 5 + [0] * (t - 5)
    for i in range(len(QUESTIONS)):
        hits = (responses[i] == stop).nonzero()
        length = int(hits[0]) + 1 if len(hits) else t
        assert stopped.batch["response_mask"][i].sum() == length
        assert torch.equal(stopped.batch["responses"][i, :length], responses[i, :length])
        assert (stopped.batch["responses"][i, length:] == tokenizer.pad_token_id).all()


def test_top_k_1_sampling_equals_greedy(sharpened_dir, tokenizer):
    model = load_model(sharpened_dir)
    prompts = prompt_batch(tokenizer, QUESTIONS)
    expected = greedy(model, tokenizer, prompts, 8).batch["responses"]
    rollout = HFRollout(model, tokenizer, RolloutConfig(n=2, response_length=8, micro_batch_size=8, top_k=1), seed=1)
    sampled = rollout.generate_sequences(prompts, temperature=1.0)
    assert sampled.meta_info["temperature"] == 1.0
    assert torch.equal(sampled.batch["responses"], expected.repeat_interleave(2, dim=0))
    # without top_k the same seed does not reproduce greedy (the sampler really samples)
    rollout = HFRollout(model, tokenizer, RolloutConfig(n=2, response_length=8, micro_batch_size=8), seed=1)
    assert not torch.equal(rollout.generate_sequences(prompts).batch["responses"], expected.repeat_interleave(2, 0))


def test_validation_samples_with_its_own_top_k_and_top_p(sharpened_dir, tokenizer):
    """``rollout.val_top_k`` / ``val_top_p`` (verl's ``val_kwargs.top_k`` / ``top_p``) filter the validation streams
    only: top-k 1 on validation makes its sampling greedy while training's streams still sample, and the reverse."""
    model = load_model(sharpened_dir)
    prompts = prompt_batch(tokenizer, QUESTIONS)
    expected = greedy(model, tokenizer, prompts, 8).batch["responses"].repeat_interleave(2, dim=0)
    for train_k, val_k in ((0, 1), (1, 0)):
        config = RolloutConfig(n=2, response_length=8, micro_batch_size=8, top_k=train_k, val_top_k=val_k)
        rollout = HFRollout(model, tokenizer, config, seed=1)
        outputs = {s: rollout.generate_sequences(prompts, temperature=1.0, stream=s) for s in ("train", "val-0")}
        greedy_streams = {s for s, out in outputs.items() if torch.equal(out.batch["responses"], expected)}
        assert greedy_streams == ({"val-0"} if val_k == 1 else {"train"}), (train_k, val_k)
    assert RolloutConfig(top_p=0.9, val_top_p=0.7).filters("val") == (0, 0.7)


def test_rollout_log_probs_are_those_of_the_distribution_each_token_was_drawn_from(sharpened_dir, tokenizer):
    """``rollout_log_probs``: each response token's log-prob under softmax(logits / temperature), as the actor
    computes it from the same weights (fp32, 1e-5), 0 past the response; under top-k the distribution drawn from
    is renormalised over the k kept tokens, so each sampled token's log-prob is the actor's plus log(1 / kept mass),
    never below it."""
    model = load_model(sharpened_dir)
    prompts = prompt_batch(tokenizer, QUESTIONS)
    for top_k in (0, 5):
        config = RolloutConfig(n=2, response_length=6, temperature=0.7, top_k=top_k)
        out = HFRollout(model, tokenizer, config, seed=1).generate_sequences(prompts)
        mask = out.batch["response_mask"].bool()
        engine = out.batch["rollout_log_probs"]
        with torch.no_grad():
            actor, _ = response_log_probs(model, out, temperature=0.7)
        assert (engine[~mask] == 0).all()
        if top_k == 0:
            torch.testing.assert_close(engine[mask], actor[mask], rtol=0, atol=1e-5)
        else:
            assert (engine[mask] >= actor[mask] - 1e-5).all() and (engine[mask] - actor[mask]).max() > 1e-3


@pytest.mark.parametrize("training", [True, False])
def test_training_mode_restored(tiny_model_dir, tokenizer, training):
    model = load_model(tiny_model_dir)
    model.train(training)
    rollout = HFRollout(model, tokenizer, RolloutConfig(n=1, response_length=3, micro_batch_size=2))
    rollout.generate_sequences(prompt_batch(tokenizer, QUESTIONS[:2]))
    assert model.training is training
    assert all(m.training is training for m in model.modules())


# ------------------------------------------------------------------------------------------- sampling distribution


def _effective_processors(model, generation_config, prompt_length: int):
    """The logits processors ``generate`` would build: the config after transformers fills in its None fields from
    ``model.generation_config`` and the global defaults, then its processor list."""
    effective, _ = model._prepare_generation_config(generation_config)
    return effective, model._get_logits_processor(effective, input_ids_seq_length=prompt_length, device="cpu")


def test_model_generation_config_does_not_leak_into_sampling(tiny_model_dir, tokenizer):
    model = load_model(tiny_model_dir)
    # what a chat model's generation_config.json may ship; none of it may reach the rollout's sampler
    model.generation_config.update(
        do_sample=True,
        top_k=50,
        top_p=0.8,
        temperature=0.7,
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
        min_p=0.1,
        typical_p=0.5,
        suppress_tokens=[7],
    )
    prompt_ids = prompt_batch(tokenizer, QUESTIONS).batch["input_ids"]
    scores = torch.randn(len(QUESTIONS), model.config.vocab_size, generator=torch.Generator().manual_seed(0))

    rollout = HFRollout(model, tokenizer, RolloutConfig(top_k=0, top_p=1.0))
    effective, processors = _effective_processors(model, rollout._generation_config(1.0), prompt_ids.shape[1])
    assert effective.do_sample and effective.top_k == 0 and effective.top_p == 1.0 and effective.temperature == 1.0
    assert effective.repetition_penalty == 1.0 and effective.no_repeat_ngram_size == 0
    names = {type(p).__name__ for p in processors}
    assert not names & {"TopKLogitsWarper", "TopPLogitsWarper", "TemperatureLogitsWarper", "TypicalLogitsWarper"}
    # whatever transformers lists, the scores reach the sampler unchanged: it draws from softmax(logits)
    assert torch.equal(processors(prompt_ids, scores.clone()), scores)

    # greedy (validation): only the argmax, no penalty or n-gram ban from the model's config
    effective, processors = _effective_processors(model, rollout._generation_config(0.0), prompt_ids.shape[1])
    assert not effective.do_sample and effective.num_beams == 1
    assert torch.equal(processors(prompt_ids, scores.clone()), scores)

    # the configured options are applied, and only they: softmax(logits / 0.5) cut to the top 5, renormalised, cut
    # to the smallest prefix with mass >= 0.6
    rollout = HFRollout(model, tokenizer, RolloutConfig(top_k=5, top_p=0.6))
    _, processors = _effective_processors(model, rollout._generation_config(0.5), prompt_ids.shape[1])
    warped = processors(prompt_ids, scores.clone())
    for row in range(len(QUESTIONS)):
        top = (scores[row] / 0.5).topk(5)
        probs = torch.softmax(top.values, dim=-1)
        keep = int((probs.cumsum(0) - probs < 0.6).sum())
        kept = set(top.indices[:keep].tolist())
        assert 1 <= keep < 5
        assert {i for i in range(scores.shape[1]) if torch.isfinite(warped[row, i])} == kept
        assert torch.allclose(warped[row, list(kept)], scores[row, list(kept)] / 0.5)


def test_generation_option_without_off_value_is_refused(tiny_model_dir, tokenizer):
    model = load_model(tiny_model_dir)
    model.generation_config.forced_bos_token_id = 5
    with pytest.raises(ValueError, match=r"forced_bos_token_id.*generation_config\.json"):
        HFRollout(model, tokenizer, RolloutConfig())


# ------------------------------------------------------------------------------------------------ seeded sampling


def _sample(rollout: HFRollout, prompts: DataProto, global_steps: int, **kwargs) -> torch.Tensor:
    batch = DataProto(prompts.batch, prompts.non_tensor_batch, {"global_steps": global_steps})
    return rollout.generate_sequences(batch, **kwargs).batch["responses"]


def test_sampling_is_a_function_of_seed_step_and_stream(tiny_model_dir, tokenizer):
    config = RolloutConfig(n=2, response_length=6, micro_batch_size=4)
    prompts = prompt_batch(tokenizer, QUESTIONS)
    rollout = HFRollout(load_model(tiny_model_dir), tokenizer, config, seed=11)
    torch.manual_seed(0)
    first = _sample(rollout, prompts, global_steps=4)

    # the global RNG neither influences the samples nor is advanced by them
    torch.rand(1000)  # what the rest of an iteration might consume
    state = torch.get_rng_state()
    again = _sample(rollout, prompts, global_steps=4)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(again, first)

    # a "resumed run": a fresh rollout on freshly loaded weights, a different global RNG history, same step
    resumed = HFRollout(load_model(tiny_model_dir), tokenizer, config, seed=11)
    torch.manual_seed(12345)
    assert torch.equal(_sample(resumed, prompts, global_steps=4), first)

    # another step, stream or seed draws other samples
    assert not torch.equal(_sample(rollout, prompts, global_steps=5), first)
    assert not torch.equal(_sample(rollout, prompts, global_steps=4, stream="val"), first)
    other_seed = HFRollout(rollout.weights.model, tokenizer, config, seed=12)
    assert not torch.equal(_sample(other_seed, prompts, global_steps=4), first)
    # micro-batches of one call get different seeds: the two samples of each prompt differ
    assert all(not torch.equal(first[2 * i], first[2 * i + 1]) for i in range(len(QUESTIONS)))


# ------------------------------------------------------------------------------------------------ registry, protocol


class _CountingSource:
    """A `WeightSource` over a real model that counts the generation models it lends."""

    def __init__(self, model):
        self.model, self.generation_config, self.device, self.lent = model, model.generation_config, model.device, 0

    @contextlib.contextmanager
    def generation_model(self):
        self.lent += 1
        yield self.model


def test_registered_rollout_is_a_config_choice_and_built_from_the_weight_source(tiny_model_dir, tokenizer):
    calls = []

    @register_rollout("test_recording", syncs_weights=True)
    def build(cfg, weights, tok, model_path, compute_dtype):
        calls.append((cfg.rollout.name, model_path))
        return HFRollout(weights, tok, cfg.rollout, seed=cfg.trainer.seed, compute_dtype=compute_dtype)

    try:
        assert "test_recording" in rollout_names()
        cfg = load_config(GRPO_TINY, ["rollout.name=test_recording"])
        source = _CountingSource(load_model(tiny_model_dir))
        rollout = build_rollout(cfg, source, tokenizer, tiny_model_dir)
        assert calls == [("test_recording", tiny_model_dir)]
        with awake(rollout):
            out = rollout.generate_sequences(prompt_batch(tokenizer, QUESTIONS[:2]), n=1, temperature=0.0)
        assert len(out) == 2 and source.lent == 1  # the model was borrowed from the source for the call
        assert rollout_spec("test_recording").syncs_weights and not rollout_spec("hf").syncs_weights
        assert rollout.update_weights() == {}
    finally:
        _ROLLOUTS.pop("test_recording")
    with pytest.raises(ConfigError, match=r"rollout.name 'test_recording'; registered: \['hf', 'vllm'\]"):
        load_config(GRPO_TINY, ["rollout.name=test_recording"])
    with pytest.raises(ValueError, match="registered: "):
        rollout_spec("nope")
