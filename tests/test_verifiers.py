"""Environments written for verifiers, unmodified (`hybridflow.engine.agent.verifiers_env`): a single-turn one with
a rubric, a ToolEnv with a function tool and a MultiTurnEnv subclass, each loaded by its load_environment(), run by
our agent rollout on the tiny model; on the same completions our rewards equal verifiers' own scoring (its
``run_rollout`` replaying them).

Real packages (verifiers, installed by .ci/setup), the real hf engine, no stand-ins."""

from __future__ import annotations

import asyncio
import json

import pytest

from hybridflow.engine.agent.loop import agent_loop
from hybridflow.engine.agent.parsers import ParsedTurn, ToolCall, register_tool_parser
from hybridflow.engine.agent.verifiers_env import load_environment, prompt_schemas, verifiers_rows
from hybridflow.engine.config import validate_config
from hybridflow.engine.data import collate_prompts, encode_prompt
from hybridflow.engine.models import load_model, load_tokenizer
from hybridflow.engine.reward.rewards import default_compute_score

vf = pytest.importorskip("verifiers", reason="verifiers: pip install --no-deps verifiers==0.3.1 (.ci/setup)")

ENVS = {
    "vf_rubric_env": '''
import verifiers as vf
from datasets import Dataset


def load_environment(bonus: float = 0.0):
    """Single turn: a rubric of two weighted reward functions."""
    rows = [{"question": "Say a word", "answer": "a"}, {"question": "Name a fruit", "answer": "e"}]
    parser = vf.Parser()

    def has_answer(parser, completion, answer) -> float:
        return float(answer in (parser.parse_answer(completion) or ""))

    def vowel_share(completion) -> float:
        text = completion[-1].content or ""
        return sum(c in "aeiou" for c in text) / max(len(text), 1) + bonus

    rubric = vf.Rubric(funcs=[has_answer, vowel_share], weights=[1.0, 0.5], parser=parser)
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:1]), system_prompt="Answer briefly.",
        parser=parser, rubric=rubric,
    )
''',
    "vf_tool_env": '''
import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def load_environment():
    """A ToolEnv: the reward is the sum of what the tool answered, over 100."""

    def tool_total(completion) -> float:
        return sum(int(m.content) for m in completion if m.role == "tool") / 100

    rows = [{"question": "Add 2 and 3", "answer": "5"}, {"question": "Add 7 and 8", "answer": "15"}]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], max_turns=3, rubric=vf.Rubric(funcs=[tool_total]))
''',
    "vf_guess_env": '''
import verifiers as vf
from datasets import Dataset


class Guess(vf.MultiTurnEnv):
    """Asks again after each answer, up to max_turns."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": f"Not that ({len(state['trajectory'])}). Again."}]


def load_environment(max_turns: int = 2):
    def letters(completion) -> float:
        return sum(len(m.content or "") for m in completion if m.role == "assistant") / 1000

    rows = [{"question": "Guess my number", "answer": "7"}]
    return Guess(dataset=Dataset.from_list(rows), max_turns=max_turns, rubric=vf.Rubric(funcs=[letters]))
''',
}


@register_tool_parser("vf_add_every_turn")
def add_every_turn(text: str) -> ParsedTurn:
    """The test's format: every turn calls `add` with the turn's length and 1."""
    return ParsedTurn([ToolCall("add", {"a": len(text), "b": 1})])


@pytest.fixture(scope="module")
def env_modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vf_envs")
    for name, text in ENVS.items():
        (folder / f"{name}.py").write_text(text)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        yield folder


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def rollout_of(tiny, tiny_model_dir, env_id: str, **multi_turn):
    from tiny_runs import environment_rollout

    data = {"verifiers": {"env_id": env_id}}
    return environment_rollout(tiny, tiny_model_dir, f"verifiers/{env_id}", data, **multi_turn)


def batch(tokenizer, rows, env):
    """The rows as the trainer's dataset feeds them: prompts offering the environment's tools."""
    items = [
        {**row, "input_ids": encode_prompt(row["prompt"], tokenizer, tools=prompt_schemas(env)), "index": i}
        for i, row in enumerate(rows)
    ]
    return collate_prompts(items, tokenizer)


def segments(out, i):
    """Row i's response as (trained, ids) runs: the model's turns (mask 1) and the environment's (mask 0)."""
    ids = out.batch["responses"][i][out.batch["attention_mask"][i, out.batch["prompts"].shape[1] :].bool()].tolist()
    mask = out.batch["response_mask"][i].tolist()[: len(ids)]
    runs: list[tuple[int, list[int]]] = []
    for token, trained in zip(ids, mask, strict=True):
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(token)
        else:
            runs.append((trained, [token]))
    return runs


class Replay(vf.Client):
    """verifiers' side: a client that answers the recorded texts, in order (tool calls as the test's format reads
    them), so that verifiers' own run_rollout scores the same completions."""

    def __init__(self, texts, calls_of=None):
        super().__init__(None)
        self.texts, self.calls_of = list(texts), calls_of

    def setup_client(self, config):
        return None

    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        if not self.texts:
            raise vf.OverlongPromptError("the recorded trajectory ends here")
        text = self.texts.pop(0)
        calls = self.calls_of(text) if tools and self.calls_of else None
        message = vf.ResponseMessage(
            content=text, tool_calls=calls, finish_reason="tool_calls" if calls else "stop", is_truncated=False
        )
        return vf.Response(id="replay", created=0, model=model, message=message)

    async def raise_from_native_response(self, response):
        return None

    async def from_native_response(self, response):
        return response

    async def close(self):
        return None


def own_score(env, row, texts, calls_of=None):
    """verifiers' reward and metrics of `texts` as the completion of `row` (its run_rollout, scoring included)."""
    given = row["extra_info"]["verifiers"]
    rollout_input = {"prompt": row["prompt"], **{k: given[k] for k in ("example_id", "answer") if k in given}}
    output = asyncio.run(env.run_rollout(rollout_input, Replay(texts, calls_of), "replay", {}))
    return output["reward"], output["metrics"]


def check_same_scores(out, rows, env, tokenizer, calls_of=None):
    for i, extra in enumerate(out.non_tensor_batch["extra_info"]):
        agent = extra["agent"]
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for trained, ids in segments(out, i) if trained]
        reward, metrics = own_score(env, rows[i // 2], texts, calls_of)
        assert agent["env_reward"] == pytest.approx(reward, abs=1e-12)
        assert agent["env_metrics"] == pytest.approx(metrics, abs=1e-12)
        source = out.non_tensor_batch["data_source"][i]
        scored = default_compute_score(source, texts[-1], None, extra)
        assert scored == {"score": pytest.approx(reward), "acc": float(reward >= env.pass_threshold)}


def test_a_single_turn_environment_with_a_rubric_scores_as_verifiers_does(env_modules, tiny, tiny_model_dir):
    _, tokenizer = tiny
    env = load_environment("vf_rubric_env", {"bonus": 0.25})
    rows, val = verifiers_rows("vf_rubric_env", {"bonus": 0.25})
    assert [r["prompt"] for r in rows] == [
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q}]
        for q in ("Say a word", "Name a fruit")
    ]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["a", "e"] and len(val) == 1
    assert rows[0]["data_source"] == "verifiers/vf_rubric_env"
    rollout = rollout_of(tiny, tiny_model_dir, "vf_rubric_env")
    out = rollout.generate_sequences(batch(tokenizer, rows, env))
    assert (out.batch["agent/num_turns"] == 2).all()  # the prompt and one answer
    for i in range(len(out)):
        [(trained, ids)] = segments(out, i)  # one model turn: every response token trained on
        assert trained == 1 and ids
    check_same_scores(out, rows, env, tokenizer)
    # the rubric's weights and the bonus argument reached the environment
    assert all(extra["agent"]["env_metrics"]["vowel_share"] >= 0.25 for extra in out.non_tensor_batch["extra_info"])


def add_calls(text):
    return [vf.ToolCall(id="c", name="add", arguments=json.dumps({"a": len(text), "b": 1}))]


def test_a_tool_env_runs_its_tool_with_exact_tokens(env_modules, tiny, tiny_model_dir):
    _, tokenizer = tiny
    env = load_environment("vf_tool_env")
    rows, val = verifiers_rows("vf_tool_env", {})
    assert val == []  # no eval dataset: no validation rows (not the training rows again)
    schemas = prompt_schemas(env)
    assert [s["function"]["name"] for s in schemas] == ["add"]
    assert schemas[0]["function"]["parameters"]["properties"].keys() == {"a", "b"}
    rollout = rollout_of(tiny, tiny_model_dir, "vf_tool_env", format="vf_add_every_turn")
    out = rollout.generate_sequences(batch(tokenizer, rows, env))
    assert (out.batch["agent/num_turns"] > 2).any()  # the tool answered and the model went on
    assert (out.batch["agent/tool_calls/add"] >= 1).all()
    for i in range(len(out)):
        runs = segments(out, i)
        for (trained, ids), (_, answer) in zip(runs[::2], runs[1::2], strict=False):
            assert trained == 1  # a model turn, then the ToolEnv's answer to its call, as the template writes it
            total = len(tokenizer.decode(ids, skip_special_tokens=True)) + 1
            assert answer == rollout.chat_format.turn_ids([{"role": "tool", "content": str(total)}])
        assert sum(trained for trained, _ in runs) <= 3  # its max_turns
    check_same_scores(out, rows, env, tokenizer, add_calls)


def test_a_multi_turn_env_of_the_users_asks_again(env_modules, tiny, tiny_model_dir):
    _, tokenizer = tiny
    env = load_environment("vf_guess_env", {"max_turns": 3})
    rows, _ = verifiers_rows("vf_guess_env", {"max_turns": 3})
    rollout = rollout_of(tiny, tiny_model_dir, "vf_guess_env")
    out = rollout.generate_sequences(batch(tokenizer, rows, env))
    for i in range(len(out)):
        runs = segments(out, i)
        model_turns = [ids for trained, ids in runs if trained]
        assert 1 <= len(model_turns) <= 3
        for k, (trained, ids) in enumerate(runs[1::2]):
            assert not trained
            assert ids == rollout.chat_format.turn_ids([{"role": "user", "content": f"Not that ({k + 1}). Again."}])
    assert (out.batch["agent/num_turns"] >= 4).any()  # asked again and answered
    check_same_scores(out, rows, env, tokenizer)


def test_unknown_environments_and_configs_are_refused(env_modules):
    with pytest.raises(ValueError, match="'vf_nope'.*did not load.*PYTHONPATH"):
        verifiers_rows("vf_nope", {})
    with pytest.raises(ValueError, match="verifiers/<env_id>"):
        agent_loop("verifiers/")
    multi_turn = {"enable": True, "default_agent_loop": "single_turn"}
    tree = {"data": {"verifiers": {"env_id": "vf_rubric_env"}}, "rollout": {"multi_turn": multi_turn}}
    with pytest.raises(ValueError, match="default_agent_loop=verifiers/vf_rubric_env"):
        validate_config(tree)


def test_hf_run_trains_on_a_verifiers_environments_reward(
    env_modules, prefect_api, tmp_path, tiny_model_dir, monkeypatch
):
    """`hf run` from a config that names the environment: its dataset the prompts, its rubric the training score."""
    from tiny_runs import hf_run_metrics

    monkeypatch.setenv("PYTHONPATH", str(env_modules))  # where the environment's module is, for every process
    overrides = [
        "data.reasoning_gym=null",  # tiny_run_config's prompts: the environment's dataset instead
        "data.verifiers.env_id=vf_rubric_env",
        "data.verifiers.env_args={bonus: 1.0}",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.default_agent_loop=verifiers/vf_rubric_env",
        "reward.custom_function=null",
        "data.train_batch_size=2",
        "rollout.response_length=24",
        "trainer.total_iterations=2",
        "trainer.test_freq=2",
    ]
    metrics = hf_run_metrics(prefect_api, tmp_path, tiny_model_dir, overrides)
    for step in (1, 2):
        # the rubric's: has_answer (0 or 1) + 0.5 x (vowel share + the bonus of 1.0)
        assert 0.5 <= metrics[step]["critic/score/mean"] <= 2.0
        assert "reward_extra/acc/mean" in metrics[step]
    assert any(name.startswith("val") for name in metrics[2])  # validated on the environment's eval dataset
