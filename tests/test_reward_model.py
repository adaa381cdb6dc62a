"""The reward model's scoring, against a direct `AutoModelForSequenceClassification` forward on the same decoded
texts: with the actor's own tokenizer, with a different tokenizer (SmolLM2's vocabulary and chat template), with
left truncation; and its input errors."""

import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from hybridflow.engine.protocol import DataProto
from hybridflow.engine.reward_model import (
    RewardModelError,
    load_reward_model,
    place_on_last_token,
    reward_model_texts,
    score_texts,
)

PROMPTS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 12 - 5?"}],
    [{"role": "user", "content": "Say nothing."}],
]
RESPONSES = ["The answer is 7.", "7", ""]


def _reward_model(folder, tokenizer, seed: int = 0):
    """A random one-label Llama sequence classifier over `tokenizer`'s vocabulary, saved with it in `folder`."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_labels=1, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )  # fmt: skip
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _rollout(actor_tokenizer) -> DataProto:
    """Three rows as the rollout leaves them: left-padded prompts, right-padded responses (EOS included)."""
    rendered = [actor_tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in PROMPTS]
    prompts = [actor_tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]
    responses = [
        actor_tokenizer.encode(r, add_special_tokens=False) + [actor_tokenizer.eos_token_id] for r in RESPONSES
    ]
    responses[2] = []  # an empty response: nothing generated
    p_width, t_width = max(map(len, prompts)), max(map(len, responses))
    pad = actor_tokenizer.pad_token_id
    batch = {
        "prompts": torch.full((3, p_width), pad),
        "responses": torch.full((3, t_width), pad),
        "response_mask": torch.zeros((3, t_width), dtype=torch.int64),
    }
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        batch["prompts"][i, p_width - len(p) :] = torch.tensor(p)
        if r:
            batch["responses"][i, : len(r)] = torch.tensor(r)
            batch["response_mask"][i, : len(r)] = 1
    return DataProto.from_dict(batch, {"raw_prompt": PROMPTS})


def _direct(folder, texts, max_length=None) -> list[float]:
    """What `AutoModelForSequenceClassification` says of each text on its own (no padding)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if max_length is not None:
            ids = ids[:, -max_length:]
        with torch.no_grad():
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from hybridflow.engine.embedded_models import prepare_model

    return AutoTokenizer.from_pretrained(prepare_model("smollm2"))


@pytest.mark.parametrize("rm_vocab", ["actor", "smollm2"])
def test_scores_equal_a_direct_forward_on_the_decoded_texts(tmp_path, tiny_model_dir, smollm2_tokenizer, rm_vocab):
    actor_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rm_tokenizer = actor_tokenizer if rm_vocab == "actor" else smollm2_tokenizer
    folder = _reward_model(tmp_path / "rm", rm_tokenizer)
    model, tokenizer = load_reward_model(folder)
    data = _rollout(actor_tokenizer)
    texts = reward_model_texts(data, actor_tokenizer, tokenizer)
    # the RM reads the prompt's messages and the decoded response in its own chat template
    assert texts[0] == rm_tokenizer.apply_chat_template(
        [*PROMPTS[0], {"role": "assistant", "content": "The answer is 7."}], tokenize=False
    )
    if rm_vocab == "smollm2":
        assert "<|im_start|>assistant\nThe answer is 7.<|im_end|>" in texts[0]
    scores = score_texts(model, tokenizer, texts, max_length=512, micro_batch_size=2)  # right-padded micro-batches
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    assert scores.tolist() == pytest.approx(_direct(folder, texts), rel=1e-5, abs=1e-6)
    short = score_texts(model, tokenizer, texts, max_length=6, micro_batch_size=3)  # the prompt loses its start
    assert short.tolist() == pytest.approx(_direct(folder, texts, max_length=6), rel=1e-5, abs=1e-6)
    assert short.tolist() != pytest.approx(scores.tolist())

    placed = place_on_last_token(scores, data.batch["response_mask"])
    lengths = data.batch["response_mask"].sum(-1).tolist()
    for row, length in enumerate(lengths):
        at = max(length - 1, 0)
        assert placed[row, at] == scores[row] and placed[row].count_nonzero() <= 1


def test_inputs_that_cannot_score_are_refused(tmp_path, tiny_model_dir):
    with pytest.raises(
        RewardModelError, match=r"reward_model.path=.*LlamaForCausalLM.*not a \*ForSequenceClassification"
    ):
        load_reward_model(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    folder = _reward_model(tmp_path / "two", tokenizer)
    config = json.loads((folder / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(RewardModelError, match="has 2 labels; a reward model has exactly one"):
        load_reward_model(folder)
    no_pad = _reward_model(tmp_path / "nopad", tokenizer)
    settings = json.loads((no_pad / "tokenizer_config.json").read_text())
    settings["pad_token"] = None
    (no_pad / "tokenizer_config.json").write_text(json.dumps(settings))
    model, loaded = load_reward_model(no_pad)
    assert loaded.pad_token == loaded.eos_token and model.config.pad_token_id == loaded.eos_token_id
