"""A generative reward model (``reward_model.judge``): the judge (SmolLM2, or the tiny causal LM) reads the prompt the
user's prompt function builds from each sample, and the user's verdict function turns what it wrote into ``rm_scores``.
Against an independent greedy ``generate`` of the same chat-templated prompt, with transformers in one rank and on
vLLM engines in a worker group of two ranks (real processes); in a training iteration; and its input errors."""

import json
import os
from pathlib import Path

import pytest
import torch
from tiny_runs import tiny_run_config, worker_group, write_reward_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.engine.protocol import DataProto

QUESTIONS = ["What is 3 + 4?", "What is 12 - 5?", "Name a colour.", "What is 2 x 3?"]
RESPONSES = ["The answer is 7.", "7", "", "six"]
TRUTHS = ["7", "7", "red", "6"]
MAX_TOKENS = 6

JUDGE = """
import json
import os
from pathlib import Path

LOG = Path(__file__).with_name("verdicts.jsonl")


def judge_prompt(data_source, solution_str, ground_truth, extra_info):
    question = (extra_info or {}).get("question", "")
    text = f"Question: {question}\\nAnswer: {solution_str}\\nIs the answer {ground_truth}?"
    return [{"role": "user", "content": text}]


def picky_prompt(data_source, solution_str, ground_truth, extra_info):
    if not solution_str:
        raise ValueError("nothing to judge")
    return judge_prompt(data_source, solution_str, ground_truth, extra_info)


def verdict(judge_text, data_source, solution_str, ground_truth, extra_info):
    with LOG.open("a") as f:
        f.write(json.dumps({"judge_text": judge_text, "solution_str": solution_str, "pid": os.getpid()}) + "\\n")
    return {"score": len(judge_text) / 10, "words": len(judge_text.split())}


def three_arguments(data_source, solution_str, ground_truth):
    return ""


async def verl_genrm(
    data_source, solution_str, ground_truth, extra_info, reward_router_address, reward_model_tokenizer
):
    return 0.0
"""


def _write_judge(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "judge.py").write_text(JUDGE)
    return folder / "judge.py"


def _judge_keys(path: Path, engine: str, judge_dir: Path) -> list[str]:
    return [
        "reward_model.enable=true",
        f"reward_model.path={judge_dir}",
        "reward_model.judge.enable=true",
        f"reward_model.judge.prompt_function={path}:judge_prompt",
        f"reward_model.judge.verdict_function={path}:verdict",
        f"reward_model.judge.engine={engine}",
        "reward_model.judge.vllm_dtype=float32",
        f"reward_model.judge.max_tokens={MAX_TOKENS}",
        "reward_model.max_length=256",
    ]


def _rollout(tokenizer) -> DataProto:
    """Four scored-to-be rows: right-padded responses (one empty), their data source, truth and question."""
    responses = [tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id] for r in RESPONSES]
    responses[2] = []
    width = max(map(len, responses))
    batch = {
        "responses": torch.full((4, width), tokenizer.pad_token_id),
        "response_mask": torch.zeros((4, width), dtype=torch.int64),
    }
    for i, r in enumerate(responses):
        if r:
            batch["responses"][i, : len(r)] = torch.tensor(r)
            batch["response_mask"][i, : len(r)] = 1
    non_tensor = {
        "data_source": ["judge_test"] * 4,
        "reward_model": [{"ground_truth": t} for t in TRUTHS],
        "extra_info": [{"question": q} for q in QUESTIONS],
    }
    return DataProto.from_dict(batch, non_tensor, meta_info={"global_steps": 3})


def _direct_verdicts(model_dir: Path) -> list[str]:
    """What the judge writes for each row on its own: transformers' greedy generate of the prompt function's chat
    messages in the judge's chat template, decoded without special tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    texts = []
    for question, response, truth in zip(QUESTIONS, RESPONSES, TRUTHS, strict=True):
        content = f"Question: {question}\nAnswer: {response}\nIs the answer {truth}?"
        messages = [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS)
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def _check_scores(data: DataProto, scored: DataProto, verdicts: list[str]) -> None:
    mask = data.batch["response_mask"]
    last = (mask.sum(-1) - 1).clamp(min=0)
    scores = scored.batch["rm_scores"]
    assert scores.shape == mask.shape and scores.count_nonzero() <= 4
    assert scores[torch.arange(4), last].tolist() == pytest.approx([len(v) / 10 for v in verdicts])
    assert scored.batch["reward_extra/judge_words"].tolist() == [len(v.split()) for v in verdicts]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The judge: SmolLM2-135M-Instruct (embedded), another vocabulary and chat template than the tiny actor's."""
    from hybridflow.engine.embedded_models import prepare_model

    return Path(prepare_model("smollm2"))


def test_the_judge_scores_each_sample_by_its_verdict_on_the_prompt_built_for_it(tmp_path, tiny_model_dir, smollm2_dir):
    """transformers in one rank, vLLM engines in a group of two ranks (2 + 2 rows): the verdict function sees, for
    each row, the row's decoded response and exactly what a greedy generate of the built prompt writes; its score
    lands on the row's last response token and its extra key becomes ``reward_extra/judge_words``."""
    from hybridflow.engine.reward.judge import JudgeRewardModel
    from hybridflow.flows.groups import WORKER_CLS
    from hybridflow.slurm.channel import create_secret
    from hybridflow.slurm.handles import DataHandle

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = _rollout(tokenizer)
    direct = _direct_verdicts(smollm2_dir)
    assert len(set(direct)) > 1 and all(direct)  # verdicts that tell the prompts apart

    path = _write_judge(tmp_path / "hf")
    cfg = tiny_run_config(tmp_path, tiny_model_dir, "grpo", _judge_keys(path, "hf", smollm2_dir))
    judge = JudgeRewardModel(cfg.reward_model, smollm2_dir, tokenizer, "cpu", torch.float32, seed=0)
    _check_scores(data, judge.compute_rm_score(data), direct)
    logged = [json.loads(line) for line in path.with_name("verdicts.jsonl").read_text().splitlines()]
    assert [x["solution_str"] for x in logged] == RESPONSES and [x["judge_text"] for x in logged] == direct

    path = _write_judge(tmp_path / "vllm")
    cfg = tiny_run_config(tmp_path, tiny_model_dir, "grpo", _judge_keys(path, "vllm", smollm2_dir))
    create_secret(tmp_path / "secret")
    group = worker_group(tmp_path, "judge", WORKER_CLS, 2, cfg, ["reward_model"])
    try:
        group.init_model()
        scored = group.compute_rm_score(DataHandle.put(data, tmp_path / "data")).load()
    finally:
        group.shutdown()
    _check_scores(data, scored, direct)
    logged = [json.loads(line) for line in path.with_name("verdicts.jsonl").read_text().splitlines()]
    assert sorted(x["solution_str"] for x in logged) == sorted(RESPONSES)  # each rank judged its own rows


def test_a_prompt_function_that_raises_fails_its_sample_only(tmp_path, tiny_model_dir):
    """The prompt function raises on the empty response (row 2): that row scores 0.0, is marked failed and says why in
    its judge_text; the other rows are judged as they are without the failure (same prompts, same row seeds)."""
    from hybridflow.engine.reward.judge import JudgeRewardModel
    from hybridflow.engine.reward.rewards import ScoreFunctionError

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = _rollout(tokenizer)
    path = _write_judge(tmp_path)

    def judge(prompt_function: str, fraction: float = 0.5):
        keys = [
            *_judge_keys(path, "hf", tiny_model_dir),
            f"reward_model.judge.prompt_function={path}:{prompt_function}",
        ]
        cfg = tiny_run_config(tmp_path, tiny_model_dir, "grpo", keys)
        return JudgeRewardModel(cfg.reward_model, tiny_model_dir, tokenizer, "cpu", torch.float32, 0, fraction)

    whole = judge("judge_prompt").compute_rm_score(data)
    scored = judge("picky_prompt").compute_rm_score(data)
    assert scored.batch["reward_extra/judge_failed"].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert scored.batch["rm_scores"][2].count_nonzero() == 0
    text = scored.non_tensor_batch["judge_text"][2]
    assert text.startswith("[failed: ") and "prompt_function" in text and "nothing to judge" in text
    for i in (0, 1, 3):
        assert scored.non_tensor_batch["judge_text"][i] == whole.non_tensor_batch["judge_text"][i]
        assert torch.equal(scored.batch["rm_scores"][i], whole.batch["rm_scores"][i])
    with pytest.raises(ScoreFunctionError, match=r"failed on 1 of 4 samples.*nothing to judge"):
        judge("picky_prompt", fraction=0.0).compute_rm_score(data)


def test_a_training_iteration_adds_the_judges_score_to_the_reward(tmp_path, tiny_model_dir):
    """One iteration of the single-process trainer with the judge (transformers): ``critic/rm_score/mean`` is the
    mean verdict score, and the training reward is reward_model.coef x verdict + the function's score."""
    from hybridflow.engine.trainer import SingleProcessTrainer

    path = _write_judge(tmp_path)
    extra = [*_judge_keys(path, "hf", tiny_model_dir), "reward_model.coef=0.5", "trainer.total_iterations=1"]
    trainer = SingleProcessTrainer(tiny_run_config(tmp_path, tiny_model_dir, "grpo", extra))
    metrics = trainer.step()
    logged = [json.loads(line) for line in path.with_name("verdicts.jsonl").read_text().splitlines()]
    assert len(logged) == 8  # 4 prompts x 2 samples
    verdict_mean = sum(len(x["judge_text"]) / 10 for x in logged) / len(logged)
    assert metrics["critic/rm_score/mean"] == pytest.approx(verdict_mean, rel=1e-6)
    assert metrics["critic/rewards/mean"] == pytest.approx(
        metrics["critic/score/mean"] + 0.5 * verdict_mean, rel=1e-5, abs=1e-6
    )


def test_a_judge_that_cannot_work_is_refused_before_any_work(tmp_path, tiny_model_dir):
    from hybridflow.engine.config import ConfigError
    from hybridflow.flows.preflight import InputError, check_run_inputs

    path = _write_judge(tmp_path)
    with pytest.raises(ConfigError, match=r"judge.enable needs reward_model.enable=true .*judge.verdict_function"):
        tiny_run_config(tmp_path, tiny_model_dir, "grpo", ["reward_model.judge.enable=true"])

    def check(*extra: str, engine: str = "hf") -> None:
        keys = [*_judge_keys(path, engine, tiny_model_dir), *extra]
        check_run_inputs(tiny_run_config(tmp_path, tiny_model_dir, "grpo", keys))

    check()  # a usable one passes
    classifier = write_reward_model(tmp_path / "rm", AutoTokenizer.from_pretrained(tiny_model_dir))
    with pytest.raises(InputError, match=r"reward_model.path=.*ForSequenceClassification.*not a \*ForCausalLM"):
        check(f"reward_model.path={classifier}")
    with pytest.raises(InputError, match=r"verdict_function .*cannot be called as \(judge_text, data_source"):
        check(f"reward_model.judge.verdict_function={path}:three_arguments")
    with pytest.raises(InputError, match=r"prompt_function .*has no .*missing_function"):
        check(f"reward_model.judge.prompt_function={path}:missing_function")
    # verl's way (a causal LM as the RM, a score function asking it over HTTP) is pointed at the judge keys
    rm = ["reward_model.enable=true", f"reward_model.path={tiny_model_dir}"]
    with pytest.raises(InputError, match=r"not a \*ForSequenceClassification.*set reward_model.judge.enable=true"):
        check_run_inputs(tiny_run_config(tmp_path, tiny_model_dir, "grpo", rm))
    verl_function = [f"reward.custom_function={path}:verl_genrm"]
    with pytest.raises(InputError, match=r"reward_router_address.*reward_model.judge.prompt_function"):
        check_run_inputs(tiny_run_config(tmp_path, tiny_model_dir, "grpo", verl_function))
    assert not os.path.exists(path.with_name("verdicts.jsonl"))  # nothing was judged


def test_a_judge_engine_over_two_ranks_of_its_own_pool_scores_the_flows_iterations(
    prefect_api, tmp_path, tiny_model_dir
):
    """``hf run``'s flow with the judge on a vLLM engine tensor-parallel over the two ranks of a pool of its own
    (``reward_model.judge.tensor_parallel_size=2``, verl's ``reward.reward_model.rollout.tensor_model_parallel_size``;
    a causal LM of 4 heads, split 2 a rank): its ``rm_score`` stage gives both ranks the same rows and takes the
    first's verdicts, each once; each iteration's ``critic/rm_score/mean`` is the mean of the verdicts the verdict
    function gave for that iteration's samples, and the kept samples hold each verdict and its score."""
    from hybridflow.engine.tiny import build_tiny_model
    from hybridflow.flows.rlhf import rlhf_flow
    from hybridflow.flows.store.run_store import RunStore

    judge_model = build_tiny_model(tmp_path / "judge128", hidden_size=128, head_dim=32, seed=1)
    path = _write_judge(tmp_path)
    pools = "{train: {roles: [actor, rollout, reward]}, judge: {roles: [reward_model], tasks_per_node: 2}}"
    extra = [*_judge_keys(path, "vllm", judge_model), "trainer.total_iterations=2", f"placement.pools={pools}"]
    extra += ["trainer.log_train_generations=3", "reward_model.judge.tensor_parallel_size=2"]
    extra += ["reward_model.judge.vllm_kv_cache_gb=0.25", "trainer.num_threads=1"]
    cfg = tiny_run_config(tmp_path, tiny_model_dir, "grpo", extra)
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = store.create_run(cfg.model_dump(mode="json"), "judge-pool")
    rlhf_flow(run_id=run_id, db_url=store.url)
    placed = {p.role: p for p in store.placements(run_id)}
    assert placed["reward_model"].group_name == "judge" and placed["actor"].group_name == "train"
    logged = [json.loads(line) for line in path.with_name("verdicts.jsonl").read_text().splitlines()]
    assert len(logged) == 16  # 2 iterations x 4 prompts x 2 samples, each judged once
    assert len({x["pid"] for x in logged}) == 1  # one engine over both ranks: its first rank gives every verdict
    metrics = {(m.step, m.name): m.value for m in store.metrics(run_id)}
    for step, judged in ((1, logged[:8]), (2, logged[8:])):
        verdict_mean = sum(len(x["judge_text"]) / 10 for x in judged) / len(judged)
        assert metrics[(step, "critic/rm_score/mean")] == pytest.approx(verdict_mean, rel=1e-6)
        words = sum(len(x["judge_text"].split()) for x in judged) / len(judged)
        assert metrics[(step, "reward_extra/judge_words/mean")] == pytest.approx(words, rel=1e-6)
    assert any(x["judge_text"] for x in logged)
    # hf runs samples: what the judge said of each kept sample, and the score it gave
    kept = store.samples(run_id, step=2, kind="train")
    assert len(kept) == 3
    assert [s.judge_text for s in kept] == [x["judge_text"] for x in logged[8:11]]
    assert [s.rm_score for s in kept] == pytest.approx([len(x["judge_text"]) / 10 for x in logged[8:11]], rel=1e-6)
