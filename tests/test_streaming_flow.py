"""``rollout.streaming`` in the flow: the rollout's pool generates every admitted prompt continuously (between
calls too) and hands over whole finished groups within ``rollout.max_staleness``; a weight push interrupts and
continues the samples in flight (``rollout.partial_rollout``); the stream is checkpointed with its samples' tokens
and a SIGKILLed run resumes it, training every prompt once."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from test_rollout_pool import HF, OFF, ROOT, SAMPLED, _run, needs_vllm, run_config

from hybridflow.engine.config import ConfigError, load_config

TWO_ENGINES = {**OFF, "generate": {**OFF["generate"], "tasks_per_node": 2}}  # a stream on each rollout rank
SINGLE_TURN_AGENTS = ["rollout.multi_turn.enable=true", "rollout.multi_turn.default_agent_loop=single_turn"]
STREAM = [
    "trainer.mode=async",
    "rollout.streaming=true",
    "rollout.max_staleness=2",
    "trainer.total_iterations=6",
    "trainer.log_train_generations=16",
    "trainer.test_freq=3",  # a validation generates on the engines while the streams hold prompts
    f"placement.pools={json.dumps(TWO_ENGINES)}",
]


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["trainer.mode=one_step_off"], r"rollout.streaming=true needs trainer.mode=async \(got one_step_off\)"),
        (["algorithm.filter_groups.enable=true"], r"needs algorithm.filter_groups.enable=false"),
        (
            ["data.train_batch_size=3", "actor.ppo_mini_batch_size=3", f"placement.pools={json.dumps(TWO_ENGINES)}"],
            r"data.train_batch_size=3 divisible by the 2 engines of placement.pools.generate",
        ),
        (
            ["rollout.gen_tp=2", f"placement.pools={json.dumps(TWO_ENGINES)}", *SINGLE_TURN_AGENTS],
            r"rollout.gen_tp=1 with rollout.multi_turn.enable",
        ),
    ],
)
def test_streaming_refuses_what_it_does_not_carry_by_its_key(extra, error):
    pools = f"placement.pools={json.dumps(OFF)}"
    base = ["rollout.name=vllm", "trainer.mode=async", pools, "rollout.streaming=true"]
    with pytest.raises(ConfigError, match=error):
        load_config(ROOT / "examples" / "grpo_tiny.yaml", [*base, *extra])
    with pytest.raises(ConfigError, match=r"rollout.partial_rollout=false applies to rollout.streaming=true"):
        load_config(ROOT / "examples" / "grpo_tiny.yaml", ["rollout.partial_rollout=false"])


@needs_vllm
def test_streaming_at_staleness_0_samples_what_sync_samples(prefect_api, tmp_path):
    """At staleness 0 the stream admits a batch only once the engine holds the weights it is trained with and
    hands it over whole: each sample its own request with its row's seed, the same tokens as one batched call."""
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    pools = f"placement.pools={json.dumps(OFF)}"
    _, sync = _run(store, tmp_path, "sync", [pools])
    zero = ["trainer.mode=async", "rollout.streaming=true", "rollout.max_staleness=0"]
    _, streamed = _run(store, tmp_path, "zero", [pools, *zero])
    for step in (1, 2, 3):
        assert {k: streamed[step][k] for k in SAMPLED} == {k: sync[step][k] for k in SAMPLED}
        assert streamed[step]["off_policy/staleness_max"] == 0.0
        assert streamed[step]["rollout/partial_fraction"] == 0.0


@needs_vllm
def test_a_streamed_run_trains_every_prompt_once_within_its_bound_and_resumes_its_stream_after_a_sigkill(
    prefect_api, tmp_path
):
    from tiny_runs import killed_inside_iteration

    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id, streamed = _run(store, tmp_path, "streamed", STREAM)
    assert all(streamed[step]["off_policy/staleness_max"] <= 2 for step in range(1, 7)), streamed
    assert all(streamed[step]["timing_s/gen"] > 0 for step in range(1, 7))
    samples = store.samples(run_id, kind="train")
    lags = Counter(s.step - 1 - s.rollout_version for s in samples)  # iteration s trains at actor version s - 1
    assert set(lags) <= {0, 1, 2} and max(lags) >= 1, lags  # row by row, the oldest token's version
    trained = Counter(s.uid for s in samples)
    assert len(trained) == 24 and set(trained.values()) == {4}, trained  # 24 prompts, each group whole, once
    assert all(sum(1 for s in samples if s.step == step) == 16 for step in range(1, 7))
    # each sample's tokens by the version that sampled them, in the store; its oldest is its rollout_version
    # (more than one run: a partial rollout continued under newer weights, never newer than the trained actor's)
    for s in samples:
        versions = [version for version, _ in s.token_versions]
        assert versions[0] == s.rollout_version and versions == sorted(set(versions)) and versions[-1] <= s.step - 1
    for step in range(1, 7):
        assert 0 <= streamed[step]["rollout/partial_fraction"] <= 1
        assert 0 <= streamed[step]["off_policy/token_staleness_mean"] <= streamed[step]["off_policy/staleness_max"]

    # SIGKILLed inside iteration 4: the checkpoint of iteration 3 holds the stream (samples with their tokens so
    # far, the admission's bookkeeping); the resumed run continues it and trains every prompt exactly once
    killed, killed_id = killed_inside_iteration(store.get_run(run_id).config, tmp_path, prefect_api, 4)
    db = killed.url
    checkpoint = Path(killed.latest_checkpoint(killed_id).path)
    assert checkpoint.name == "global_step_3"
    streams = [json.loads((checkpoint / "rollout_ahead" / f"stream-{r}.json").read_text()) for r in (0, 1)]
    for saved in streams:  # each engine's share: 2 of every batch's 4 prompts
        assert saved["admission"]["trained"] == 3 and saved["admission"]["admitted_total"] > 6  # ahead of training
        assert len(saved["groups"]) == saved["admission"]["admitted_total"] - 6
    in_stream = {g["uid"]: g for saved in streams for g in saved["groups"]}
    env = {**os.environ, "COLUMNS": "250"}
    resumed = subprocess.run(
        [HF, "resume", killed_id, "--db", db, "--prefect-api", prefect_api],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    again = killed.samples(killed_id, kind="train")
    assert Counter(s.uid for s in again) == trained  # the same 24 prompts, each trained once: none lost or repeated
    # every sample in the stream at the checkpoint was trained with the tokens it had then as its response's start
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(store.get_run(run_id).config["model"]["path"])
    responses = {(s.uid, s.response) for s in again if s.step > 3}
    for uid, group in in_stream.items():
        for sample in group["samples"]:
            prefix = tokenizer.decode(sample["ids"], skip_special_tokens=True)
            assert any(u == uid and r.startswith(prefix) for u, r in responses), (uid, prefix)


def test_the_store_keeps_each_samples_tokens_by_version_and_hf_runs_samples_shows_a_partial_rollout(tmp_path):
    import torch

    from hybridflow.engine.generations import version_runs
    from hybridflow.flows.store.run_store import RunStore

    assert version_runs(torch.tensor([2, 2, 3, 3, 3, -1, -1])) == [(2, 2), (3, 3)]
    assert version_runs(torch.tensor([-1, -1])) == []
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = store.create_run({"trainer": {"project_name": "p"}}, "streamed")
    base = {"prompt": "1+1?", "score": 1.0, "uid": "0-1", "rollout_version": 2}
    store.record_samples(
        run_id,
        4,
        "train",
        [{**base, "response": "2", "token_versions": [(2, 5), (3, 7)]}, {**base, "response": "two"}],
    )
    partial, whole = store.samples(run_id, 4, "train")
    assert partial.token_versions == [(2, 5), (3, 7)] and whole.token_versions is None
    env = {**os.environ, "COLUMNS": "250"}
    shown = subprocess.run(
        [HF, "runs", "samples", run_id, "--step", "4", "--db", store.url], capture_output=True, text=True, env=env
    )
    assert shown.returncode == 0, shown.stderr
    assert "sampled by version 2 (5 tokens), then version 3 (7 tokens)" in shown.stdout, shown.stdout
    assert shown.stdout.count("sampled by") == 1  # the sample of one call says nothing more


def _agent_extra(tmp_path: Path) -> list[str]:
    """Multi-turn rollouts with a tool on the rollout's own pool (`tiny_runs.agent_overrides`), on a tiny model that
    holds the tool schemas' ~500-token prompts."""
    from tiny_runs import agent_overrides

    from hybridflow.engine.tiny import build_tiny_model

    long_model = build_tiny_model(tmp_path / "tiny32-1024", hidden_size=64, head_dim=32, max_positions=1024)
    return [f"placement.pools={json.dumps(OFF)}", *agent_overrides(tmp_path), f"model.path={long_model}"]


@needs_vllm
def test_agent_loops_stream_at_staleness_0_as_sync_samples_them(prefect_api, tmp_path):
    """Each turn of each trajectory is one stream request seeded as the batch call seeds it: at staleness 0 the
    streamed agent loops sample and train what sync's do."""
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    agents = _agent_extra(tmp_path)
    _, sync = _run(store, tmp_path, "sync", agents)
    zero = ["trainer.mode=async", "rollout.streaming=true", "rollout.max_staleness=0"]
    _, streamed = _run(store, tmp_path, "zero", [*agents, *zero])
    keys = (*SAMPLED, "num_turns/mean", "tool_calls/echo/mean", "response_length/tool_tokens/mean")
    for step in (1, 2, 3):
        assert {k: streamed[step][k] for k in keys} == {k: sync[step][k] for k in keys}
        assert streamed[step]["num_turns/min"] > 2 and streamed[step]["off_policy/staleness_max"] == 0.0


@needs_vllm
def test_streamed_agent_loops_span_pushes_and_resume_their_trajectories_after_a_sigkill(prefect_api, tmp_path):
    """Agent loops on the stream (staleness 2, partial rollouts): trajectories are admitted ahead and their turns
    generate across pushes; SIGKILLed inside iteration 3, the checkpoint of iteration 2 holds every trajectory not
    handed over with its engine calls so far, and the resumed run replays them and trains every prompt once, each
    trajectory with at least the model tokens it had at the checkpoint."""
    from tiny_runs import killed_inside_iteration
    from transformers import AutoTokenizer

    from hybridflow.engine.generations import TOOL_OPEN

    stream = ["trainer.mode=async", "rollout.streaming=true", "rollout.max_staleness=2"]
    extra = [*_agent_extra(tmp_path), *stream, "trainer.total_iterations=5", "trainer.log_train_generations=16"]
    config = run_config(tmp_path, "agents", extra).model_dump(mode="json")
    killed, run_id = killed_inside_iteration(config, tmp_path, prefect_api, 3)
    checkpoint = Path(killed.latest_checkpoint(run_id).path)
    assert checkpoint.name == "global_step_2"
    saved = json.loads((checkpoint / "rollout_ahead" / "stream-0.json").read_text())
    assert saved["admission"]["trained"] == 2 and saved["admission"]["admitted_total"] > 8  # ahead of training
    recorded = {(g["uid"], run["row"]): run["turns"] for g in saved["groups"] for run in g["samples"]}
    assert len(recorded) == 4 * len(saved["groups"]) and any(len(turns) >= 2 for turns in recorded.values())
    resumed = subprocess.run(
        [HF, "resume", run_id, "--db", killed.url, "--prefect-api", prefect_api],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    samples = killed.samples(run_id, kind="train")
    trained = Counter(s.uid for s in samples)
    assert len(trained) == 20 and set(trained.values()) == {4}, trained  # 5 batches of 4 prompts, each once, whole
    assert {s.step - 1 - s.rollout_version for s in samples} <= {0, 1, 2}
    assert any(TOOL_OPEN in s.response and "echo:" in s.response for s in samples)
    tokenizer = AutoTokenizer.from_pretrained(config["model"]["path"])
    by_uid = {}
    for s in samples:
        by_uid.setdefault(s.uid, []).append((s.response, sum(tokens for _, tokens in s.token_versions)))
    for (uid, _), turns in recorded.items():  # its recorded calls replayed, not sampled anew: none lost
        first = tokenizer.decode(turns[0]["ids"], skip_special_tokens=True)
        model_tokens = sum(len(t["ids"]) for t in turns)
        assert any(r.startswith(first) and n >= model_tokens for r, n in by_uid[uid]), (uid, first, model_tokens)


@needs_vllm
def test_a_stream_on_an_engine_over_two_ranks_steps_them_in_lockstep(prefect_api, tmp_path):
    """``rollout.gen_tp=2`` on a rollout pool of 2 ranks: one engine tensor-parallel over both, each rank stepping
    its shard of every request in lockstep (`hybridflow.engine.rollout.lockstep`), the first rank's batch the
    engine's. At staleness 0 it trains what sync trains on the same engine; at staleness 2 every prompt once."""
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    tp2 = [f"placement.pools={json.dumps(TWO_ENGINES)}", "rollout.gen_tp=2"]
    _, sync = _run(store, tmp_path, "sync", tp2)
    zero = ["trainer.mode=async", "rollout.streaming=true", "rollout.max_staleness=0"]
    _, streamed = _run(store, tmp_path, "zero", [*tp2, *zero])
    for step in (1, 2, 3):
        assert {k: streamed[step][k] for k in SAMPLED} == {k: sync[step][k] for k in SAMPLED}
    ahead = ["trainer.mode=async", "rollout.streaming=true", "rollout.max_staleness=2"]
    run_id, metrics = _run(
        store, tmp_path, "ahead", [*tp2, *ahead, "trainer.total_iterations=5", "trainer.log_train_generations=16"]
    )
    samples = store.samples(run_id, kind="train")
    trained = Counter(s.uid for s in samples)
    assert len(trained) == 20 and set(trained.values()) == {4}, trained  # 5 batches of 4 prompts, each once, whole
    assert max(metrics[step]["off_policy/staleness_max"] for step in range(1, 6)) >= 1  # generated ahead
