"""Agent loops (issue 31): tools and their failures, the hermes parser, the chat template's tool-turn ids, and
multi-turn rollouts on the real tiny model whose training rows are the engine's tokens, token for token.

The tiny random model never writes a ``<tool_call>``, so the rollout tests register a tool-call format of their own
(``every_turn``, through the same `register_tool_parser` a user's format uses) that reads a call to the test's tool
from every assistant turn: the model's tokens are the engine's, the tool turns the template's, and the trajectories
get several turns. Sixty extra EOS ids (about one token in six) make turns end early, as in tests/test_rollout.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridflow.engine.agent.calculator import calculator
from hybridflow.engine.agent.chat_format import ChatFormat, render_prompt
from hybridflow.engine.agent.loop import agent_loop_names
from hybridflow.engine.agent.parsers import ParsedTurn, ToolCall, parse_hermes, register_tool_parser
from hybridflow.engine.agent.rollout import AgentLoopRollout
from hybridflow.engine.agent.tools import ToolBox, ToolResult, tool_from_function
from hybridflow.engine.algorithms.estimators import get_adv_estimator_fn
from hybridflow.engine.backends.actor import actor_loss
from hybridflow.engine.config import ActorConfig, validate_config
from hybridflow.engine.generations import TOOL_OPEN, decode_generations
from hybridflow.engine.metrics import compute_data_metrics
from hybridflow.engine.models import load_model, load_tokenizer, response_log_probs
from hybridflow.engine.packing import pack_rows
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollout.hf import HFRollout
from hybridflow.engine.torch_ops import AGG_LOSS_MODES, agg_loss, last_positions

EXTRA_EOS = list(range(100, 160))


# ---------------------------------------------------------------------------------------------------- tools


def echo(text: str) -> str:
    """Say `text` back.

    Args:
        text: what to say
    """
    return f"echo:{text}"


def fails(text: str) -> str:
    """Always raises.

    Args:
        text: ignored
    """
    raise RuntimeError("the tool broke")


def hangs(text: str) -> str:
    """Never answers in time.

    Args:
        text: ignored
    """
    time.sleep(30)
    return "late"


def floods(text: str) -> str:
    """Answers one megabyte.

    Args:
        text: ignored
    """
    return "x" * 2**20


def test_calculator_is_exact_and_safe():
    assert calculator("123 * 456 + 7") == "56095"
    assert calculator("(3 - 5) * 2") == "-4"
    assert calculator("0.1 + 0.2") == "0.3" and calculator("7 / 2") == "3.5"
    for bad in ("2 ** 99999999", "__import__('os')", "abc", "'a' * 9"):
        with pytest.raises(Exception):  # noqa: B017 - simpleeval's own error types
            calculator(bad)


def test_count_letter_counts_any_character_ignoring_case():
    from hybridflow.engine.agent.letters import count_letter

    assert count_letter("Hundred thousand names and then Mr Fritz", "h") == "3"
    assert count_letter("room 11, floor 1", "1") == "3"  # reasoning-gym asks for digits too
    with pytest.raises(ValueError, match="one character"):
        count_letter("abc", "ab")


def call(box: ToolBox, name: str, arguments: dict) -> ToolResult:
    """One call in a trajectory's session of `box`."""

    async def once() -> ToolResult:
        async with box.session() as session:
            return await session.call(name, arguments)

    return asyncio.run(once())


def test_a_failing_tool_answers_a_bounded_error_and_the_call_returns():
    box = ToolBox([tool_from_function(f, timeout_s=0.5) for f in (echo, fails, hangs, floods)], max_response_chars=100)
    assert call(box, "echo", {"text": "hi"}).text == "echo:hi" and call(box, "echo", {"text": "hi"}).error is None
    started = time.monotonic()
    results = {
        "raised": call(box, "fails", {"text": "a"}),
        "timeout": call(box, "hangs", {"text": "a"}),
        "bad_arguments": call(box, "echo", {"words": "a"}),
        "unknown_tool": call(box, "nope", {}),
    }
    assert time.monotonic() - started < 5  # the hanging tool was abandoned after its 0.5 s
    for kind, result in results.items():
        assert result.error == kind and result.text.startswith("Error:") and len(result.text) <= 100 + 40
    assert "the tool broke" in results["raised"].text
    flood = call(box, "floods", {"text": "a"})
    assert flood.error is None and len(flood.text) < 150 and "characters cut" in flood.text
    assert box.schemas[0]["function"]["name"] == "echo"
    assert box.schemas[0]["function"]["parameters"]["properties"]["text"]["description"] == "what to say"


def naps(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "rested"


def test_the_tool_calls_of_many_trajectories_run_at_once():
    box = ToolBox([tool_from_function(naps, timeout_s=5)])

    async def batch() -> list[ToolResult]:
        sessions = [box.session() for _ in range(8)]
        return await asyncio.gather(*(s.call("naps", {"seconds": 1.0}) for s in sessions))

    started = time.monotonic()
    results = asyncio.run(batch())
    assert [r.text for r in results] == ["rested"] * 8
    assert time.monotonic() - started < 2.5  # 8 calls of 1 s at once, not one after another (8 s)


def test_a_tool_without_a_described_argument_is_refused():
    def undocumented(x: int) -> str:
        return str(x)

    with pytest.raises(ValueError, match="cannot be described"):
        tool_from_function(undocumented)


def test_hermes_parser_reads_calls_and_reports_bad_ones():
    text = (
        'I will compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call><tool_call>"
    )
    parsed = parse_hermes(text)
    assert parsed.calls == [
        ToolCall("calculator", {"expression": "12 * 34"}),
        ToolCall("calculator", {"expression": "1+1"}),
    ]
    assert len(parsed.errors) == 3 and all(e.startswith("Error:") for e in parsed.errors)
    assert parse_hermes("The answer is 42.") == ParsedTurn()


# ---------------------------------------------------------------------------------------------------- the template


def test_tool_turn_ids_follow_the_assistant_end_token(tiny_tokenizer):
    tok = tiny_tokenizer
    fmt = ChatFormat(tok, [tok.eos_token_id])
    ids = fmt.tool_turn_ids(["56095"])
    assert tok.decode(ids) == "\n<|im_start|>tool\n56095<|im_end|>\n<|im_start|>assistant\n"
    two = tok.decode(fmt.tool_turn_ids(["1", "2"]))
    assert two.count("<|im_start|>tool") == 2 and two.endswith("<|im_start|>assistant\n")
    # the tiny template ignores tools=: the tools are offered in a system message
    text = render_prompt([{"role": "user", "content": "hi"}], tok, [tool_from_function(echo).schema])
    assert text.startswith("<|im_start|>system\n") and '"name": "echo"' in text and text.endswith("assistant\n")


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    # an assistant turn's content is shown only while it is the last message: later turns rewrite it
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}[hidden]{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok.name_or_path = "rewriting-template"
    with pytest.raises(ValueError, match="rewriting-template is not prefix-stable"):
        ChatFormat(tok, [tok.eos_token_id])


# ---------------------------------------------------------------------------------------------------- rollouts


@register_tool_parser("every_turn")
def every_turn(text: str) -> ParsedTurn:
    """The test's format: every turn calls `echo` with the turn's last characters; a turn of a length divisible by 3
    also holds a malformed call, one of a length divisible by 4 a call of a tool that does not exist."""
    errors = ["Error: a malformed call"] if len(text) % 3 == 0 else []
    calls = [ToolCall("echo", {"text": text[-5:]})]
    if len(text) % 4 == 0:  # a tool the run does not have, named by the model (here: no name at all)
        calls.append(ToolCall("", {}))
    return ParsedTurn(calls, errors)


TOOL_FILE = '''
def echo(text: str) -> str:
    """Say `text` back.

    Args:
        text: what to say
    """
    return f"echo:{text}"


def floods(text: str) -> str:
    """Answers one megabyte.

    Args:
        text: ignored
    """
    return "x" * 2**20
'''


def write_tools(folder, name: str):
    """A tool config listing `name` from a file of tools (loaded as `path.py:name`, as a user's would be)."""
    (folder / "my_tools.py").write_text(TOOL_FILE)
    path = folder / f"{name}.yaml"
    path.write_text(f"tools:\n  - function: {folder / 'my_tools.py'}:{name}\n")
    return path


@pytest.fixture(scope="module")
def tool_config(tmp_path_factory):
    return write_tools(tmp_path_factory.mktemp("tools"), "echo")


def agent_config(model_dir, tool_config, **rollout):
    tree = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "data": {"train_files": ["unused.jsonl"]},
        "rollout": {
            "n": 2,
            "response_length": 48,
            "micro_batch_size": 4,
            "multi_turn": {"enable": True, "tool_config_path": str(tool_config), "format": "every_turn"},
            **rollout,
        },
        "trainer": {"seed": 3},
    }
    return validate_config(tree)


class Spy:
    """The real engine, with each token call's requests and answers kept (nothing is changed)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @contextlib.contextmanager
    def token_engine(self, temperature, stream="train"):
        with self.engine.token_engine(temperature, stream) as serve:

            def spied(requests):
                answers = serve(requests)
                self.calls += list(zip(requests, answers, strict=True))
                return answers

            yield spied


def prompts(tokenizer, tools, questions, **columns):
    from hybridflow.engine.data import collate_prompts, encode_prompt

    items = [
        {
            "input_ids": encode_prompt([{"role": "user", "content": q}], tokenizer, tools=tools),
            "index": i,
            "prompt": [{"role": "user", "content": q}],
            "data_source": "test",
            "reward_model": {"ground_truth": "7"},
            **{k: v[i] for k, v in columns.items()},
        }
        for i, q in enumerate(questions)
    ]
    return collate_prompts(items, tokenizer)


def agent_rollout(model, tokenizer, cfg):
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *EXTRA_EOS]
    engine = Spy(HFRollout(model, tokenizer, cfg.rollout, seed=cfg.trainer.seed))
    return AgentLoopRollout(engine, cfg, tokenizer), engine


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    questions=st.lists(
        st.sampled_from(["What is 3 + 4?", "Hi", "Compute 12 - 5", "1 2 3 4 5 6"]), min_size=1, max_size=3
    ),
    step=st.integers(0, 1000),
    max_turns=st.one_of(st.none(), st.integers(1, 4)),
    length=st.integers(8, 64),
)
def test_training_rows_are_the_tokens_the_engine_was_fed(
    tiny, tiny_model_dir, tool_config, questions, step, max_turns, length
):
    model, tokenizer = tiny
    cfg = agent_config(tiny_model_dir, tool_config, response_length=length)
    cfg.rollout.multi_turn.max_assistant_turns = max_turns
    rollout, engine = agent_rollout(model, tokenizer, cfg)
    batch = prompts(tokenizer, rollout.tools.schemas, questions)
    batch.meta_info["global_steps"] = step
    out = rollout.generate_sequences(batch)
    b, p = len(out), out.batch["prompts"].shape[1]
    assert out.batch["responses"].shape == (b, length)
    real = out.batch["attention_mask"].bool()
    rows = [out.batch["input_ids"][i][real[i]].tolist() for i in range(b)]
    trained = [out.batch["response_mask"][i][real[i, p:]].tolist() for i in range(b)]
    prompt_len = [int(real[i, :p].sum()) for i in range(b)]
    engine_tokens = [set() for _ in range(b)]  # response positions the engine sampled, per row
    assistant_turns = [0] * b
    for request, answer in engine.calls:
        # the row the request belongs to: the one whose training row starts with the ids the engine was fed
        row = next(i for i in range(b) if rows[i][: len(request.prompt_ids)] == request.prompt_ids
                   and rows[i][len(request.prompt_ids) : len(request.prompt_ids) + len(answer.ids)] == answer.ids
                   and len(request.prompt_ids) - prompt_len[i] not in engine_tokens[i])  # fmt: skip
        start = len(request.prompt_ids) - prompt_len[row]
        engine_tokens[row] |= set(range(start, start + len(answer.ids)))
        assistant_turns[row] += 1
    for i in range(b):
        # the mask is 1 on exactly the engine's tokens: 0 on every tool and template token
        assert trained[i] == [1 if t in engine_tokens[i] else 0 for t in range(len(trained[i]))]
        assert len(trained[i]) <= length
    assert out.batch["agent/num_turns"].tolist() >= [2] * b
    assert max(assistant_turns) <= (max_turns or length) and min(assistant_turns) >= 1
    # a second rollout of the same step samples the same trajectories (seeded by step, stream, row and turn)
    again, _ = agent_rollout(model, tokenizer, cfg)
    assert torch.equal(again.generate_sequences(batch).batch["input_ids"], out.batch["input_ids"])


def test_multi_turn_rows_train_only_on_the_model_tokens(tiny, tiny_model_dir, tool_config):
    model, tokenizer = tiny
    cfg = agent_config(tiny_model_dir, tool_config)
    rollout, _ = agent_rollout(model, tokenizer, cfg)
    questions = ["What is 3 + 4?", "Hi", "Compute 12 - 5"]
    out = rollout.generate_sequences(
        prompts(tokenizer, rollout.tools.schemas, questions, agent_name=["tool_agent", "single_turn", "tool_agent"])
    )
    mask, p = out.batch["response_mask"], out.batch["prompts"].shape[1]
    real = out.batch["attention_mask"][:, p:]
    gaps = (real == 1) & (mask == 0)
    assert gaps[[0, 1, 4, 5]].any() and not gaps[[2, 3]].any()  # tool turns in tool_agent rows only
    assert (out.batch["agent/num_turns"][[2, 3]] == 2).all() and (out.batch["agent/tool_calls/echo"][[2, 3]] == 0).all()
    assert (
        int(out.batch["agent/tool_calls/echo"][[0, 1, 4, 5]].min()) >= 1
    )  # (a row whose answers did not fit: 2 turns)
    keys = set(out.batch.keys())  # noqa: SIM118 (a TensorDict iterates its values)
    counted = {k.removeprefix("agent/tool_calls/") for k in keys if k.startswith("agent/tool_calls/")}
    assert counted == {"echo", "malformed_call", "unknown_tool"}  # the run's names only, never the model's
    assert {"agent/tool_errors/echo", "rollout_log_probs"} <= keys

    # the actor's recomputed log-probs equal the engine's (fp32 both: within 2e-5), and none is computed on a tool
    # or template token: the LM head runs at the response_mask positions only
    packed = pack_rows(out)
    assert len(packed.predict) == int(mask.sum())
    log_probs, _ = response_log_probs(model, out, temperature=1.0)
    engine = out.batch["rollout_log_probs"]
    assert torch.allclose(log_probs[mask.bool()], engine[mask.bool()], atol=2e-5, rtol=0)
    assert (log_probs[~mask.bool()] == 0).all()

    # the gradient of the PPO loss reaches no masked position, in every aggregation mode
    for mode in AGG_LOSS_MODES:
        model.zero_grad()
        lp, entropy = response_log_probs(model, out, temperature=1.0, calculate_entropy=True)
        lp.retain_grad(), entropy.retain_grad()
        batch = {"advantages": torch.randn(mask.shape) * mask, "response_mask": mask, "ref_log_prob": engine}
        config = ActorConfig(loss_agg_mode=mode, use_kl_loss=True, entropy_coeff=0.01)
        loss, _ = actor_loss(config, engine.detach(), lp, batch, entropy=entropy)
        loss.backward()
        assert (lp.grad[~mask.bool()] == 0).all() and (entropy.grad[~mask.bool()] == 0).all()
        assert lp.grad[mask.bool()].abs().sum() > 0

    # metrics in verl's names, and the samples show the tool turns
    scored = out.union(DataProto.from_dict({
        "token_level_scores": torch.zeros(mask.shape), "token_level_rewards": torch.zeros(mask.shape),
        "advantages": torch.zeros(mask.shape), "returns": torch.zeros(mask.shape)}))  # fmt: skip
    metrics = compute_data_metrics(scored, cfg.rollout.response_length)
    assert metrics["num_turns/min"] == 2 and metrics["num_turns/max"] > 2
    assert metrics["tool_calls/echo/mean"] > 0 and metrics["tool_calls/echo/error_rate"] == 0.0
    assert metrics["tool_calls/malformed_call/error_rate"] in (0.0, 1.0)
    assert metrics["response_length/with_tools/mean"] > metrics["response_length/mean"]
    assert metrics["response_length/tool_tokens/mean"] == pytest.approx(float((gaps.sum(-1)).float().mean()))
    samples = decode_generations(scored, tokenizer, step=1)
    with_tools = [i for i in range(len(samples)) if gaps[i].any()]
    assert all(TOOL_OPEN in samples[i]["response"] and "echo:" in samples[i]["response"] for i in with_tools)
    assert TOOL_OPEN not in samples[2]["response"]


def test_tool_answers_that_do_not_fit_end_the_trajectory(tiny, tiny_model_dir, tmp_path):
    model, tokenizer = tiny
    cfg = agent_config(tiny_model_dir, write_tools(tmp_path, "floods"), response_length=24)
    cfg.rollout.multi_turn.max_tool_response_length = 400  # ~200 tokens: never fits 24
    rollout, _ = agent_rollout(model, tokenizer, cfg)
    out = rollout.generate_sequences(prompts(tokenizer, rollout.tools.schemas, ["Hi", "What is 3 + 4?"]))
    assert torch.equal(out.batch["response_mask"], out.batch["attention_mask"][:, -24:])  # no tool tokens fitted


ENVIRONMENT_FILE = '''
from hybridflow.engine.agent.environment import Environment, EnvStep


class Quiz(Environment):
    """Asks twice more whatever the model says, 0.25 a turn, then ends; records its episodes."""

    episodes = []

    async def reset(self, row):
        self.truth, self.turns = row["reward_model"]["ground_truth"], []
        Quiz.episodes.append(self)

    async def step(self, text, last):
        self.turns.append(text)
        if last or len(self.turns) == 3:
            return EnvStep(reward=0.25, done=True, metadata={"turns": len(self.turns)})
        return EnvStep([{"role": "user", "content": f"Not {self.truth} yet: try {len(self.turns)}"}], reward=0.25)

    async def close(self):
        self.closed = True
'''


def test_an_environment_of_the_users_steps_on_each_turn_with_exact_tokens(tiny, tiny_model_dir, tool_config, tmp_path):
    from hybridflow.engine.imports import load_object

    (tmp_path / "quiz.py").write_text(ENVIRONMENT_FILE)
    spec = f"{tmp_path / 'quiz.py'}:Quiz"
    model, tokenizer = tiny
    cfg = agent_config(tiny_model_dir, tool_config, response_length=64)
    cfg.rollout.multi_turn.default_agent_loop = spec
    cfg.rollout.multi_turn.tool_config_path = None  # an environment needs no tools
    rollout, engine = agent_rollout(model, tokenizer, cfg)
    questions = ["What is 3 + 4?", "Hi", "Compute 12 - 5"]
    out = rollout.generate_sequences(prompts(tokenizer, None, questions, extra_info=[{"q": i} for i in range(3)]))
    episodes = load_object(spec, "test").episodes
    assert len(episodes) == 6 and all(e.closed and e.truth == "7" for e in episodes)
    p, mask = out.batch["prompts"].shape[1], out.batch["response_mask"]
    real = out.batch["attention_mask"][:, p:].bool()
    for i, extra in enumerate(out.non_tensor_batch["extra_info"]):
        turns = len(extra["agent"]["env_rewards"])  # the environment stepped on each of the model's turns
        assert extra["q"] == i // 2 and extra["agent"]["env_rewards"] == [0.25] * turns and 1 <= turns <= 3
        assert extra["agent"]["env_reward"] == 0.25 * turns
        assert int(out.batch["agent/num_turns"][i]) == 2 * turns  # prompt, model turns, observations between
        observed = tokenizer.decode(out.batch["responses"][i][real[i] & (mask[i] == 0)].tolist())
        assert ("Not 7 yet: try 1" in observed) == (turns > 1)
    assert (out.batch["agent/num_turns"] > 2).any()  # some trajectories went on after an observation
    # the trained positions are exactly the engine's tokens
    sampled = sum(len(answer.ids) for _, answer in engine.calls)
    assert int(mask.sum()) == sampled


def test_unknown_agent_names_and_configs_are_refused(tiny, tiny_model_dir, tool_config):
    model, tokenizer = tiny
    rollout, _ = agent_rollout(model, tokenizer, agent_config(tiny_model_dir, tool_config))
    batch = prompts(tokenizer, None, ["Hi"], agent_name=["nope"])
    with pytest.raises(ValueError, match="unknown agent_name 'nope'"):
        rollout.generate_sequences(batch)
    assert {"single_turn", "tool_agent"} <= set(agent_loop_names())
    with pytest.raises(ValueError, match="tool_config_path"):
        validate_config({"model": {"path": "x"}, "data": {"train_files": ["a.jsonl"]},
                         "rollout": {"multi_turn": {"enable": True}}})  # fmt: skip


# ---------------------------------------------------------------------------------------------------- estimators


def compacted(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's masked entries moved to the front (in order), zeros after: the row without its gaps."""
    out = torch.zeros_like(x)
    for i in range(len(x)):
        kept = x[i][mask[i].bool()]
        out[i, : len(kept)] = kept
    return out


GAPPED = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0, 0], [1, 0, 1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 1, 0, 0, 0],
                       [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.float32)  # fmt: skip


def test_returns_carry_across_tool_turns_by_hand():
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 9.0, 9.0, 0.0, 2.0, 0.0]])  # rewards on masked positions are ignored
    gamma = 0.5
    _, returns = get_adv_estimator_fn("reinforce_plus_plus")(rewards, mask, gamma=gamma)
    # G at the model's tokens 0, 3, 4: the gap is not a step -> 2 * 0.5^2, 2 * 0.5, 2
    assert torch.allclose(returns, torch.tensor([[0.5, 0, 0, 1.0, 2.0, 0]]))
    values = torch.tensor([[1.0, 7.0, 7.0, 0.5, 0.25, 7.0]])
    adv, ret = get_adv_estimator_fn("gae")(rewards, mask, values=values, gamma=gamma, lam=1.0)
    # GAE over steps 0 -> 3 -> 4: delta_4 = 2 - 0.25, delta_3 = 0 + 0.5 * 0.25 - 0.5, delta_0 = 0 + 0.5 * 0.5 - 1
    a4 = 2 - 0.25
    a3 = (0.5 * 0.25 - 0.5) + 0.5 * a4
    a0 = (0.5 * 0.5 - 1.0) + 0.5 * a3
    assert torch.allclose(ret, torch.tensor([[a0 + 1.0, 0, 0, a3 + 0.5, a4 + 0.25, 0]]))


@pytest.mark.parametrize(
    "name", ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "remax"]
)
def test_estimators_on_rows_with_gaps_equal_the_rows_without(name):
    torch.manual_seed(0)
    mask = GAPPED
    rewards = torch.randn(mask.shape)
    rewards = torch.where(mask.bool() & (torch.arange(10) == last_positions(mask)[:, None]), rewards, 0.0)
    rewards += 0.1 * torch.randn(mask.shape) * mask  # token-level terms too (a KL penalty in the reward)
    kwargs = {"index": ["a", "a", "b", "b"], "values": torch.randn(mask.shape), "gamma": 0.9, "lam": 0.95,
              "reward_baselines": torch.randn(4)}  # fmt: skip
    fn = get_adv_estimator_fn(name)
    adv, ret = fn(rewards, mask, **kwargs)
    dense_mask = compacted(mask, mask)
    dense_kwargs = {**kwargs, "values": compacted(kwargs["values"], mask)}
    dense_adv, dense_ret = fn(compacted(rewards, mask), dense_mask, **dense_kwargs)
    assert torch.allclose(compacted(adv, mask), dense_adv, atol=1e-6)
    assert torch.allclose(compacted(ret, mask), dense_ret, atol=1e-6)
    assert (adv[~mask.bool()] == 0).all()


@pytest.mark.parametrize("mode", AGG_LOSS_MODES)
def test_loss_aggregation_on_rows_with_gaps_equals_the_rows_without(mode):
    losses = torch.randn(GAPPED.shape)
    assert torch.allclose(
        agg_loss(losses, GAPPED, mode), agg_loss(compacted(losses, GAPPED), compacted(GAPPED, GAPPED), mode)
    )


def test_scores_sit_on_the_last_model_token():
    from hybridflow.engine.reward.reward_model import place_on_last_token

    assert last_positions(GAPPED).tolist() == [7, 4, 6, 6]
    placed = place_on_last_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), GAPPED)
    assert placed.sum(-1).tolist() == [1.0, 2.0, 3.0, 4.0] and placed[0, 7] == 1.0 and placed[1, 4] == 2.0


# ---------------------------------------------------------------------------------------------------- the flow


AGENT_LAYOUTS = {
    "fsdp-2-local": ["actor.strategy=fsdp", "placement.tasks_per_node=2"],
    "fsdp-2-slurm": ["actor.strategy=fsdp", "placement.tasks_per_node=2", "placement.executor=slurm"],
    "megatron-tp2-pp2-gen-tp2": [
        "actor.strategy=megatron",
        "actor.tp=2",
        "actor.pp=2",
        "rollout.gen_tp=2",
        "placement.tasks_per_node=4",
    ],
}


@pytest.mark.parametrize("layout", list(AGENT_LAYOUTS))
def test_multi_turn_grpo_in_the_flow(layout, request, prefect_api, tmp_path, tiny_model_dir):
    """The Prefect flow with its worker group (each rank running the agent loops of its share of the rows): 2 FSDP
    processes, locally and as a Slurm job, and 4 megatron processes (tp2 x pp2, generating at tp2 through the
    3D-HybridEngine, the two ranks of a generation TP group running the same loops in lockstep). The iterations
    record the agent metrics, the engine's log-probs are the actor's, and the samples in the store show the tool
    turns."""
    from tiny_runs import agent_overrides, metrics_by_step, tiny_run_config

    from hybridflow.flows.rlhf import rlhf_flow
    from hybridflow.flows.store.run_store import RunStore

    slurm = "slurm" in layout
    if slurm:
        request.getfixturevalue("slurm_cluster")
    extra = [*agent_overrides(tmp_path), "trainer.total_iterations=2", *AGENT_LAYOUTS[layout]]
    extra += ["trainer.log_train_generations=2", "trainer.num_threads=1"]
    cfg = tiny_run_config(tmp_path, tiny_model_dir, "grpo", extra)
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = store.create_run(cfg.model_dump(mode="json"), "agent")
    rlhf_flow(run_id=run_id, db_url=store.url)
    assert store.get_run(run_id).status == "completed"
    placed = store.placements(run_id)[0]
    assert placed.executor == ("slurm" if slurm else "local") and bool(placed.slurm_job_id) == slurm
    assert placed.ranks == list(range(4 if "megatron" in layout else 2))
    metrics = metrics_by_step(store, run_id)
    for step in (1, 2):
        assert metrics[step]["num_turns/min"] > 2 and metrics[step]["tool_calls/echo/mean"] >= 1
        assert metrics[step]["response_length/tool_tokens/mean"] > 0
        assert abs(metrics[step]["rollout/log_prob_diff_mean"]) < 1e-3  # the engine's log-probs are the actor's
    samples = store.samples(run_id)
    assert any(TOOL_OPEN in s.response and "echo:" in s.response for s in samples if s.kind == "train")
