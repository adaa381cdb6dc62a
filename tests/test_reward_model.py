"""The reward model's scoring, against a direct `AutoModelForSequenceClassification` forward on the same decoded
texts: with the actor's own tokenizer, with a different tokenizer (SmolLM2's vocabulary and chat template), with
left truncation; in worker groups of 1 and 2 ranks (ddp and fsdp), real processes; and its input errors, from the
config, the pre-flight check and the loader."""

import json
import math

import pytest
import torch
from tiny_runs import tiny_run_config, worker_group, write_reward_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hybridflow.engine.protocol import DataProto
from hybridflow.engine.reward.reward_model import (
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
    folder = write_reward_model(tmp_path / "rm", rm_tokenizer)
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
    folder = write_reward_model(tmp_path / "two", tokenizer)
    config = json.loads((folder / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(RewardModelError, match="has 2 labels; a reward model has exactly one"):
        load_reward_model(folder)
    no_pad = write_reward_model(tmp_path / "nopad", tokenizer)
    settings = json.loads((no_pad / "tokenizer_config.json").read_text())
    settings["pad_token"] = None
    (no_pad / "tokenizer_config.json").write_text(json.dumps(settings))
    model, loaded = load_reward_model(no_pad)
    assert loaded.pad_token == loaded.eos_token and model.config.pad_token_id == loaded.eos_token_id


def test_worker_groups_of_two_ranks_score_as_one_rank_and_the_direct_forward(tmp_path, tiny_model_dir):
    """``compute_rm_score`` (DP_COMPUTE_PROTO) over 3 rows: 1 rank, 2 ddp ranks (2 + 1 rows) and 2 fsdp ranks
    (sharded weights, gathered for the call even by the rank with fewer rows) give the same ``rm_scores``."""
    from hybridflow.flows.groups import WORKER_CLS
    from hybridflow.slurm.channel import create_secret
    from hybridflow.slurm.handles import DataHandle

    actor_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    folder = write_reward_model(tmp_path / "rm", actor_tokenizer)
    rm = ["reward_model.enable=true", f"reward_model.path={folder}", "reward_model.micro_batch_size=1"]
    create_secret(tmp_path / "secret")
    data = _rollout(actor_tokenizer)
    handle = DataHandle.put(data, tmp_path / "data")
    direct = _direct(folder, reward_model_texts(data, actor_tokenizer, AutoTokenizer.from_pretrained(folder)))
    got = {}
    for name, ranks, strategy in (("dp1", 1, "ddp"), ("dp2", 2, "ddp"), ("fsdp2", 2, "fsdp")):
        cfg = tiny_run_config(tmp_path, tiny_model_dir, "grpo", [*rm, f"reward_model.strategy={strategy}"])
        group = worker_group(tmp_path, name, WORKER_CLS, ranks, cfg, ["reward_model"])
        try:
            group.init_model()
            got[name] = group.compute_rm_score(handle).load().batch["rm_scores"]
        finally:
            group.shutdown()
    lengths = data.batch["response_mask"].sum(-1)
    last = (lengths - 1).clamp(min=0)
    for name, scores in got.items():
        assert scores.dtype == torch.float32 and scores.shape == data.batch["response_mask"].shape, name
        assert scores[torch.arange(3), last].tolist() == pytest.approx(direct, rel=1e-5, abs=1e-6), name
        assert scores.count_nonzero() <= 3
        torch.testing.assert_close(scores, got["dp1"], rtol=1e-5, atol=1e-6, msg=name)


def test_config_and_preflight_refuse_a_reward_model_that_cannot_work(tmp_path, tiny_model_dir):
    from hybridflow.engine.config import ConfigError
    from hybridflow.flows.preflight import InputError, check_run_inputs

    with pytest.raises(ConfigError, match="reward_model.enable is true but reward_model.path is not set"):
        tiny_run_config(tmp_path, tiny_model_dir, "grpo", ["reward_model.enable=true"])
    with pytest.raises(ConfigError, match="reward.function_coef=0 leaves no training reward"):
        tiny_run_config(tmp_path, tiny_model_dir, "grpo", ["reward.function_coef=0"])
    folder = write_reward_model(tmp_path / "rm", AutoTokenizer.from_pretrained(tiny_model_dir))

    def check(path, *extra):
        rm = ["reward_model.enable=true", f"reward_model.path={path}", *extra]
        check_run_inputs(tiny_run_config(tmp_path, tiny_model_dir, "grpo", rm))

    check(folder)  # a usable one passes
    with pytest.raises(InputError, match=r"reward_model.path=.*LlamaForCausalLM.*not a \*ForSequenceClassification"):
        check(tiny_model_dir)
    with pytest.raises(InputError, match="reward_model.path: .*looks like a model hub id"):
        check("OpenAssistant/reward-model-deberta-v3-large")
    with pytest.raises(InputError, match=r"reward_model.max_length=8 tokens is not longer than the shortest training"):
        check(folder, "reward_model.max_length=8")


def test_a_cost_model_scores_safe_rlhfs_cost_and_is_checked_before_work(tmp_path, tiny_model_dir):
    """``reward_model.cost_path`` (Safe-RLHF's cost model, without a reward model): the rm_score stage's classifier
    whose score is ``token_level_costs``; the iteration's ``critic/cost/mean`` is its mean score over the batch, and
    a folder that is no classifier is refused up front, naming the key."""
    from hybridflow.engine.trainer import SingleProcessTrainer
    from hybridflow.flows.preflight import InputError, check_run_inputs

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    folder = write_reward_model(tmp_path / "cost", tokenizer, seed=3)
    safe = ["algorithm.cost_limit=0", f"reward_model.cost_path={folder}", "trainer.total_iterations=1"]
    cfg = tiny_run_config(tmp_path, tiny_model_dir, "gae", safe)
    assert "reward_model" in cfg.roles() and not cfg.reward_model.enable
    check_run_inputs(cfg)
    trainer = SingleProcessTrainer(cfg)
    assert trainer.scorers and trainer.scorers[0].column == "token_level_costs"
    cursor = trainer.sampler.state_dict()
    batch = trainer.rollout.generate_sequences(trainer.sampler.next_batch())  # the rows the step will draw
    trainer.sampler.load_state_dict(cursor)
    direct = _direct(folder, reward_model_texts(batch, tokenizer, AutoTokenizer.from_pretrained(folder)))
    metrics = trainer.step()
    assert metrics["critic/cost/mean"] == pytest.approx(sum(direct) / len(direct), rel=1e-4)
    assert "timing_s/rm_score" in metrics and math.isfinite(metrics["cost_critic/vf_loss"])
    with pytest.raises(InputError, match=r"reward_model.cost_path=.*not a \*ForSequenceClassification"):
        not_a_classifier = ["algorithm.cost_limit=0", f"reward_model.cost_path={tiny_model_dir}"]
        check_run_inputs(tiny_run_config(tmp_path, tiny_model_dir, "gae", not_a_classifier))
