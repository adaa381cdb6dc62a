"""A rollout pool of its own (``placement.pools`` with the rollout apart from the actor): its vLLM engines get the
actor's weights published by the actor's pool after every update (shared memory), sample what the colocated engine
samples, and serve the restored actor after a resume; generation ahead of training (``trainer.mode: one_step_off |
async``) within the staleness bound, its queue kept across a SIGKILL of the controller."""

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from hybridflow.engine.config import ConfigError, OffPolicyWarning, load_config
from hybridflow.engine.generations import TOOL_OPEN
from hybridflow.engine.tiny import build_tiny_model
from hybridflow.engine.worker import process_threads

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
APART = {"train": {"roles": ["actor", "ref"]}, "generate": {"roles": ["rollout", "reward"]}}


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["rollout.name=hf"], r"rollout \(pool generate\) apart from actor \(pool train\) needs .*rollout.name=vllm"),
        (
            ["rollout.name=vllm", "actor.strategy=megatron", "actor.tp=2", "placement.pools.train.tasks_per_node=2"],
            r"actor.strategy=megatron publishes .* \(generation tp 1; got 2\): set rollout.gen_tp=1",
        ),
        (["rollout.name=vllm", "model.lora_rank=8"], r"a LoRA actor \(model.lora_rank\) syncs its rollout in process"),
    ],
)
def test_a_rollout_pool_apart_needs_an_engine_fed_by_a_hugging_face_actor(extra, error):
    with pytest.raises(ConfigError, match=error):
        load_config(ROOT / "examples" / "grpo_tiny.yaml", [f"placement.pools={json.dumps(APART)}", *extra])
    apart = load_config(
        ROOT / "examples" / "grpo_tiny.yaml", [f"placement.pools={json.dumps(APART)}", "rollout.name=vllm"]
    )
    assert apart.rollout_apart() and apart.pool_of("reward").name == "generate"
    assert not load_config(ROOT / "examples" / "grpo_tiny.yaml", ["rollout.name=vllm"]).rollout_apart()


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")


def run_config(tmp_path: Path, name: str, extra: list[str]):
    """The config of `_run`'s runs: a 3-iteration GRPO run of the tiny vLLM-compatible model, checkpointed every
    iteration, with `extra` overrides."""
    from tiny_runs import write_reward

    return load_config(
        ROOT / "examples" / "grpo_tiny.yaml",
        [
            f"model.path={build_tiny_model(tmp_path / 'tiny32', hidden_size=64, head_dim=32)}",
            "rollout.name=vllm",
            "rollout.vllm_kv_cache_gb=0.25",
            "rollout.vllm_dtype=float32",  # the probe's tight bound (bf16 is the same path, half the bytes)
            "trainer.total_iterations=3",
            "trainer.save_freq=1",
            "actor.optim.lr=1e-3",
            f"trainer.output_dir={tmp_path / name}",
            f"reward.custom_function={write_reward(tmp_path)}",
            *extra,
        ],
    )


def _run(store, tmp_path: Path, name: str, extra: list[str], resume_from_step: int | None = None, run_id=None):
    """Train (or, with `run_id`, resume) a 3-iteration GRPO run of the tiny vLLM-compatible model; returns the run
    id and its metrics by step."""
    from hybridflow.flows.rlhf import rlhf_flow

    if run_id is None:
        run_id = store.create_run(run_config(tmp_path, name, extra).model_dump(mode="json"), name)
    rlhf_flow(run_id=run_id, db_url=store.url, resume_from_step=resume_from_step)
    assert store.get_run(run_id).status == "completed"
    metrics: dict[int, dict[str, float]] = {}
    for point in store.metrics(run_id):
        metrics.setdefault(point.step, {})[point.name] = point.value
    return run_id, metrics


SAMPLED = ("response_length/mean", "critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm")


@needs_vllm
def test_a_rollout_pool_apart_samples_what_the_colocated_engine_samples_and_resumes(prefect_api, tmp_path):
    from hybridflow.engine.rollout.published import weights_folder
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    _, together = _run(store, tmp_path, "together", [])
    run_id, apart = _run(store, tmp_path, "apart", [f"placement.pools={json.dumps(APART)}"])
    for step in (1, 2, 3):
        # the same tokens sampled from the same seeds: the published weights are the actor's, to the bit
        assert {k: apart[step][k] for k in SAMPLED} == {k: together[step][k] for k in SAMPLED}
        assert apart[step]["rollout/weight_probe_diff"] < 1e-4
        assert apart[step]["rollout/weight_sync_bytes"] == together[step]["rollout/weight_sync_bytes"]
        assert apart[step]["timing_s/publish_weights"] > 0
        assert "timing_s/publish_weights" not in together[step]
    placements = {p.role: p for p in store.placements(run_id)}
    assert (placements["rollout"].group_name, placements["actor"].group_name) == ("generate", "train")
    assert placements["rollout"].parallel == {"engine": "vllm", "dp": 1, "weights": "file"}
    wide = {**os.environ, "COLUMNS": "250"}
    shown = subprocess.run([HF, "runs", "show", run_id, "--db", store.url], capture_output=True, text=True, env=wide)
    assert "vllm x1, weights by a file" in shown.stdout, shown.stdout
    data_dir = tmp_path / "apart" / "grpo_tiny" / run_id / "data"
    assert not weights_folder(data_dir, local=True).exists()  # each file loaded, then removed with its folder

    # resumed after iteration 1: the rollout pool's engine must serve the restored actor, not its last weights
    _, resumed = _run(store, tmp_path, "apart", [], resume_from_step=1, run_id=run_id)
    for step in (2, 3):
        assert {k: resumed[step][k] for k in SAMPLED} == {k: apart[step][k] for k in SAMPLED}

    # the rollout pool on 2 ranks with one vLLM engine tensor-parallel over both (rollout.gen_tp=2): each rank loads
    # the whole published weights and keeps its shard; it samples what the one engine sampled
    two_ranks = {**APART, "generate": {**APART["generate"], "tasks_per_node": 2}}
    tp_id, tp2 = _run(store, tmp_path, "apart_tp2", [f"placement.pools={json.dumps(two_ranks)}", "rollout.gen_tp=2"])
    for step in (1, 2, 3):
        assert {k: tp2[step][k] for k in SAMPLED} == {k: apart[step][k] for k in SAMPLED}
        assert tp2[step]["rollout/weight_probe_diff"] < 1e-4
    rollout = next(p for p in store.placements(tp_id) if p.role == "rollout")
    assert rollout.parallel == {"engine": "vllm", "dp": 1, "weights": "file", "tp": 2}
    shown = subprocess.run([HF, "runs", "show", tp_id, "--db", store.url], capture_output=True, text=True, env=wide)
    assert "vllm tp2 x1, weights by a file" in shown.stdout, shown.stdout


OFF = {"train": {"roles": ["actor", "ref", "reward"]}, "generate": {"roles": ["rollout"]}}


def test_a_published_version_waits_for_its_load_behind_newer_ones(tmp_path):
    """Async: the push of version 2 may come before the rollout's pool has loaded version 1 (its load is queued
    behind generations). Version 1's file must still be there; loading version 2 removes both and the folder."""
    import torch

    from hybridflow.engine.models import load_model
    from hybridflow.engine.rollout.published import publish, remove_published

    model = load_model(str(build_tiny_model(tmp_path / "tiny32", hidden_size=64, head_dim=32)))
    folder = tmp_path / "weights"
    first = publish(model, [1, 2, 3], folder, 1, torch.bfloat16)
    second = publish(model, [1, 2, 3], folder, 2, torch.bfloat16)
    assert Path(first["path"]).is_file() and Path(second["path"]).is_file()
    remove_published(first["path"])  # the load of version 1, in its turn
    assert not Path(first["path"]).exists() and Path(second["path"]).is_file()
    publish(model, [1, 2, 3], folder, 3, torch.bfloat16)
    remove_published(folder / "actor-v3.safetensors")  # a load of version 3 clears every earlier one
    assert not folder.exists()


def _receive_pushes(address: dict, rank: int, folder: str) -> None:
    """A rollout rank's end of the broadcast test, in a process of its own: reads two tensors of v1 and stops, then
    all of v2 (saved to `folder`), then asks for v4 when v3 comes (its error saved)."""
    from safetensors.torch import save_file

    from hybridflow.engine.rollout.broadcast import WeightReceiver

    receiver = WeightReceiver(address, rank)
    weights, _ = receiver.receive(1)
    for _, (_, tensor) in zip(range(2), weights, strict=False):
        assert tensor.dtype.is_floating_point
    weights.close()  # a reader that stops early
    weights, probe = receiver.receive(2)
    received = {name: tensor.clone() for name, tensor in weights}
    save_file({**received, "probe": probe}, f"{folder}/rank{rank}.safetensors")
    try:
        receiver.receive(4)
    except RuntimeError as error:
        Path(folder, f"rank{rank}.error").write_text(str(error))


def test_a_gloo_broadcast_carries_every_tensor_bit_exact_in_buckets_to_every_rollout_rank(tmp_path):
    """``rollout.checkpoint_engine.backend: gloo``: pushes queued before the rollout's ranks join reach each of
    them, in order, bit for bit in the engine's dtype, in buckets smaller than the largest tensor, and a rank that
    stops reading a push early stays in step for the next; a push received out of order is refused."""
    import multiprocessing

    import torch
    from safetensors.torch import load_file

    from hybridflow.engine.models import load_model
    from hybridflow.engine.rollout.broadcast import WeightSender
    from hybridflow.engine.rollout.published import full_weights

    model = load_model(str(build_tiny_model(tmp_path / "tiny32", hidden_size=64, head_dim=32)))
    largest = max(t.numel() for t in model.state_dict().values()) * 2
    sender = WeightSender(receivers=2, bucket_bytes=largest // 2)
    probe = torch.randn(50)
    first = sender.send(full_weights(model), probe, 1, torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    second = sender.send(full_weights(model), probe * 2, 2, torch.bfloat16)
    expected = {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}  # copies: bf16 from fp32
    with torch.no_grad():  # the caller updates its model at once: a queued push holds its own copy
        for p in model.parameters():
            p.add_(1.0)
    sender.send(full_weights(model), probe, 3, torch.bfloat16)
    assert first["bytes"] == second["bytes"] == sum(t.numel() * 2 for t in expected.values())
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_receive_pushes, args=(first, r, str(tmp_path))) for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
        assert process.exitcode == 0
    for rank in range(2):
        received = load_file(tmp_path / f"rank{rank}.safetensors")
        assert torch.equal(received.pop("probe"), probe * 2)
        assert received.keys() == expected.keys()
        for name, tensor in received.items():
            assert torch.equal(tensor, expected[name]), name
        error = (tmp_path / f"rank{rank}.error").read_text()
        assert "received weights v3 where v4 was due" in error


def test_one_step_off_needs_the_rollout_alone_in_its_pool_and_corrects_by_default():
    path = ROOT / "examples" / "grpo_tiny.yaml"
    base = ["rollout.name=vllm", "trainer.mode=one_step_off"]
    with pytest.raises(ConfigError, match=r"needs|put rollout in a pool of its own"):
        load_config(path, base)
    with pytest.raises(ConfigError, match=r"move reward out of placement.pools.generate"):
        load_config(path, [*base, f"placement.pools={json.dumps(APART)}"])
    with pytest.raises(ConfigError, match=r"backend=gloo carries weights to a rollout in a pool of its own"):
        load_config(path, ["rollout.name=vllm", "rollout.checkpoint_engine.backend=gloo"])
    off = load_config(path, [*base, f"placement.pools={json.dumps(OFF)}"])
    assert process_threads(off, ["rollout"]) == 0  # torch's default unless the pool or the trainer sets them
    split = {name: {**pool, "num_threads": 1} for name, pool in OFF.items()}  # a core each
    one_each = load_config(path, [*base, f"placement.pools={json.dumps(split)}", "trainer.num_threads=2"])
    assert process_threads(one_each, ["rollout"]) == process_threads(one_each, ["actor", "ref", "reward"]) == 1
    assert process_threads(one_each, one_each.roles()) == 2  # every role in one process: the trainer's
    correction = off.algorithm.rollout_correction
    assert (correction.rollout_is, correction.rollout_is_threshold) == ("token", 2.0)  # decoupled PPO + TIS
    assert not off.skips_old_log_prob()  # the proximal policy's log-probs, recomputed
    off_null = [*base, f"placement.pools={json.dumps(OFF)}", "algorithm.rollout_correction.rollout_is=null"]
    with pytest.warns(OffPolicyWarning):
        assert load_config(path, off_null).algorithm.rollout_correction.rollout_is is None


def test_a_call_running_past_its_iteration_is_timed_once_in_the_next_and_busy_shares_clip_to_the_window():
    """A generation admitted ahead starts in one iteration and ends in the next: while it runs it counts in its
    first iteration's busy share up to that iteration's end, and once it ends its span and seconds land in the
    second iteration's timer only (the first one's timeline was already recorded)."""
    import threading
    import time

    from hybridflow.engine.metrics import Span, Timer, busy_fractions

    first = Timer()
    started, release = threading.Event(), threading.Event()

    def generate() -> None:
        with first("gen", "generate"):
            started.set()
            release.wait(10)

    ahead = threading.Thread(target=generate)
    ahead.start()
    started.wait(10)
    time.sleep(0.05)
    now = time.time()
    [running] = first.open_spans(now)
    assert (running.name, running.pool, running.end) == ("gen", "generate", now)
    window = (running.start - 1.0, now)  # the iteration began 1 s before the generation
    shares = busy_fractions([*first.spans, running, Span("update_actor", "train", running.start - 1.0, now)], window)
    assert shares["perf/busy/train"] == 1.0 and 0.0 < shares["perf/busy/generate"] < 1.0
    second = first.hand_over()
    release.set()
    ahead.join(10)
    assert first.spans == [] and "timing_s/gen" not in first.metrics()
    assert [s.name for s in second.spans] == ["gen"] and second.metrics()["timing_s/gen"] > 0
    assert second.open_spans(time.time()) == []
    # a span from before the window counts only inside it
    assert busy_fractions([Span("gen", "generate", 0.0, 15.0)], (10.0, 20.0)) == {"perf/busy/generate": 0.5}


@needs_vllm
def test_one_step_off_trains_each_batch_one_version_late_overlapped_and_resumes_its_buffer(prefect_api, tmp_path):
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    # the weights go by gloo broadcast: the actor's rank 0 sends from a thread, the load waits behind a generation
    extra = [
        f"placement.pools={json.dumps(OFF)}",
        "trainer.mode=one_step_off",
        "rollout.checkpoint_engine.backend=gloo",
    ]
    run_id, off = _run(store, tmp_path, "off", extra)
    # the first iteration generates its own batch; each later one trains the batch generated during the update before
    assert (off[1]["off_policy/staleness_mean"], off[1]["off_policy/staleness_max"]) == (0.0, 0.0)
    for step in (2, 3):
        assert (off[step]["off_policy/staleness_mean"], off[step]["off_policy/staleness_max"]) == (1.0, 1.0)
        assert off[step]["rollout_corr/rollout_is_mean"] > 0  # the truncated IS correction is on by default
        assert "timing_s/old_log_prob" in off[step]  # the proximal policy's log-probs, recomputed
    # the next batch's generation (generate pool) runs beside a stage on the train pool: the timeline records each
    # call once, in the iteration it ended in (one generated ahead may end in the next)
    spans = store.stage_times(run_id)
    gens = [s for s in spans if s.stage == "gen"]
    train = [s for s in spans if s.pool == "train"]
    # one generation per iteration, none lost, none ahead of the last (the one for iteration 3 may end in it)
    assert len(gens) == 3
    assert any(g.started_at < t.ended_at and t.started_at < g.ended_at for g in gens for t in train)
    for step in (2, 3):  # the generation admitted at its start runs (or waits for its turn) inside its window
        assert 0 < off[step]["perf/busy/generate"] < 1 and 0 < off[step]["perf/busy/train"] <= 1
    logs = tmp_path / "off" / "grpo_tiny" / run_id / "submitit"
    sent = "".join(path.read_text() for path in (logs / "train").glob("*_log.err"))
    received = "".join(path.read_text() for path in (logs / "generate").glob("*_log.err"))
    for version in (1, 2, 3):
        assert f"weights v{version} sent by gloo broadcast" in sent
        assert f"rank 0: weights v{version} received by gloo broadcast" in received
    assert off[version]["rollout/weight_probe_diff"] < 1e-4  # the engine serves the actor's weights

    # resumed after iteration 1: the batch generated ahead comes from the checkpoint, so iterations 2-3 repeat exactly
    _, resumed = _run(store, tmp_path, "off", [], resume_from_step=1, run_id=run_id)
    for step in (2, 3):
        assert {k: resumed[step][k] for k in SAMPLED} == {k: off[step][k] for k in SAMPLED}
        assert resumed[step]["off_policy/staleness_max"] == 1.0


def test_async_bounds_its_staleness_by_configuration():
    path = ROOT / "examples" / "grpo_tiny.yaml"
    base = ["rollout.name=vllm", f"placement.pools={json.dumps(OFF)}"]
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=2 applies to trainer.mode=async \(got sync\)"):
        load_config(path, [*base, "rollout.max_staleness=2"])
    with pytest.raises(ConfigError, match=r"trainer.weight_sync_every=2 applies to trainer.mode=async"):
        load_config(path, [*base, "trainer.mode=one_step_off", "trainer.weight_sync_every=2"])
    with pytest.raises(ConfigError, match=r"set trainer.weight_sync_every <= 2 or raise rollout.max_staleness"):
        load_config(path, [*base, "trainer.mode=async", "rollout.max_staleness=1", "trainer.weight_sync_every=3"])
    with pytest.raises(ConfigError, match=r"put rollout in a pool of its own"):
        load_config(path, ["rollout.name=vllm", "trainer.mode=async"])
    one_step = ["actor.ppo_mini_batch_size=4"]  # one optimizer step per iteration: on-policy skips old_log_prob
    on_policy = load_config(path, [*base, *one_step, "trainer.mode=async", "rollout.max_staleness=0"])
    assert on_policy.max_staleness() == 0 and on_policy.skips_old_log_prob()
    assert on_policy.algorithm.rollout_correction.rollout_is is None
    stale = load_config(path, [*base, *one_step, "trainer.mode=async", "rollout.max_staleness=3"])
    assert stale.max_staleness() == 3 and stale.algorithm.rollout_correction.rollout_is == "token"
    assert not stale.skips_old_log_prob()
    with pytest.warns(OffPolicyWarning, match=r"up to 3 updates stale with the off-policy correction off"):
        load_config(
            path,
            [*base, "trainer.mode=async", "rollout.max_staleness=3", "algorithm.rollout_correction.rollout_is=null"],
        )


@needs_vllm
def test_async_at_staleness_0_samples_what_sync_samples(prefect_api, tmp_path):
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    pools = f"placement.pools={json.dumps(OFF)}"
    _, sync = _run(store, tmp_path, "sync", [pools])
    _, zero = _run(store, tmp_path, "zero", [pools, "trainer.mode=async", "rollout.max_staleness=0"])
    for step in (1, 2, 3):
        # each batch admitted only once the engine holds the weights it is trained with: the same tokens, to the bit
        assert {k: zero[step][k] for k in SAMPLED} == {k: sync[step][k] for k in SAMPLED}
        assert zero[step]["off_policy/staleness_max"] == 0.0 and "rollout_corr/rollout_is_mean" not in zero[step]
        assert zero[step]["rollout/weight_probe_diff"] < 1e-4  # each push's check read in its own iteration


@needs_vllm
def test_async_dapo_draws_more_behind_the_admitted_generations_within_the_bound_and_resumes(prefect_api, tmp_path):
    """DAPO's dynamic sampling at staleness 1: 2 prompts a draw for a batch of 4, so every iteration draws again
    beyond the batch admitted ahead; those draws queue on the rollout's pool behind the admitted generations and
    their rows too are at most 1 update stale. A run resumed after iteration 1 (its sampler past the prompts drawn
    ahead) repeats iterations 2 and 3."""
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    dapo = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward", "data.gen_batch_size=2"]
    extra = [f"placement.pools={json.dumps(OFF)}", "trainer.mode=async", *dapo, "trainer.log_train_generations=16"]
    run_id, ahead = _run(store, tmp_path, "dapo", extra)
    for step in (1, 2, 3):
        assert ahead[step]["train/num_gen_batches"] >= 2 and ahead[step]["off_policy/staleness_max"] <= 1.0
        assert ahead[step]["rollout_corr/rollout_is_mean"] > 0
    assert max(ahead[step]["off_policy/staleness_max"] for step in (2, 3)) == 1.0  # generated ahead, and trained
    lags = {s.step - 1 - s.rollout_version for s in store.samples(run_id, kind="train")}
    assert lags <= {0, 1} and 1 in lags, lags  # row by row, on the recorded versions
    _, resumed = _run(store, tmp_path, "dapo", [], resume_from_step=1, run_id=run_id)
    for step in (2, 3):
        assert {k: resumed[step][k] for k in (*SAMPLED, "train/num_gen_batches")} == {
            k: ahead[step][k] for k in (*SAMPLED, "train/num_gen_batches")
        }


@needs_vllm
def test_async_ppo_trains_its_critic_beside_the_actor(prefect_api, tmp_path):
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    pools = {
        "train": {"roles": ["actor", "ref", "reward"]},
        "critic": {"roles": ["critic"]},
        **{"generate": OFF["generate"]},
    }
    extra = [f"placement.pools={json.dumps(pools)}", "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=2"]
    sequence_level = "algorithm.rollout_correction.rollout_is=sequence"
    _, ppo = _run(store, tmp_path, "ppo", [*extra, "trainer.mode=async", "rollout.max_staleness=2", sequence_level])
    assert [ppo[step]["off_policy/staleness_max"] for step in (1, 2, 3)] == [0.0, 1.0, 2.0]
    for step in (1, 2, 3):  # the critic's values and update on the stale batch, the actor corrected per response
        assert "critic/vf_loss" in ppo[step] and "timing_s/values" in ppo[step]
        assert (
            ppo[step]["rollout_corr/rollout_is_mean"] > 0 and ppo[step]["rollout_corr/rollout_is_eff_sample_size"] > 0
        )
    # a response's weight is the product of its tokens' ratios: at staleness 2 some pass the cap that few tokens do
    assert (
        ppo[3]["rollout_corr/rollout_is_ratio_fraction_high"] + ppo[3]["rollout_corr/rollout_is_ratio_fraction_low"] > 0
    )


@needs_vllm
def test_agent_loops_generate_one_step_off_on_their_own_pool_and_resume_their_buffer(prefect_api, tmp_path):
    """Multi-turn rollouts with a tool on the rollout's own pool, one step off: the loops run on the engine the
    actor's pool pushes weights to (the probe checks each push), every trained row is at most 1 update stale and
    corrected, tool turns are in the samples and never trained on, and a run resumed after iteration 1 (its batch
    of trajectories generated ahead in the checkpoint) repeats iterations 2 and 3."""
    from tiny_runs import agent_overrides

    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    extra = [f"placement.pools={json.dumps(OFF)}", "trainer.mode=one_step_off", *agent_overrides(tmp_path)]
    long_model = build_tiny_model(tmp_path / "tiny32-1024", hidden_size=64, head_dim=32, max_positions=1024)
    extra.append(f"model.path={long_model}")  # the tool schemas make the prompts ~500 tokens: vLLM holds 512 + 64
    run_id, ahead = _run(store, tmp_path, "agent", [*extra, "trainer.log_train_generations=16"])
    for step in (1, 2, 3):
        assert ahead[step]["num_turns/min"] > 2 and ahead[step]["tool_calls/echo/mean"] >= 1
        assert ahead[step]["response_length/tool_tokens/mean"] > 0
        assert ahead[step]["rollout_corr/rollout_is_mean"] > 0
    assert [ahead[step]["off_policy/staleness_max"] for step in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert ahead[3]["rollout/weight_probe_diff"] < 1e-4  # the loops' engine serves the weights pushed (read late)
    samples = store.samples(run_id, kind="train")
    assert {s.step - 1 - s.rollout_version for s in samples} == {0, 1}  # row by row, on the recorded versions
    assert any(TOOL_OPEN in s.response and "echo:" in s.response for s in samples)
    _, resumed = _run(store, tmp_path, "agent", [], resume_from_step=1, run_id=run_id)
    exact = ("response_length/mean", "critic/score/mean", "num_turns/mean", "tool_calls/echo/mean")
    for step in (2, 3):  # the same trajectories, scored the same
        assert {k: resumed[step][k] for k in exact} == {k: ahead[step][k] for k in exact}
        # the losses agree to float32 rounding (2e-8 relative measured; two uninterrupted runs agree to the bit)
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "rollout/log_prob_diff_mean"):
            assert resumed[step][k] == pytest.approx(ahead[step][k], rel=1e-5), (step, k)


@needs_vllm
def test_remax_one_step_off_takes_its_greedy_baseline_from_the_weights_of_its_batch_and_resumes_it(
    prefect_api, tmp_path
):
    """ReMax one step off: each batch's greedy responses are generated ahead right behind it, on the same engine
    and weights (no push between them), so its baseline is the behaviour policy's; a checkpoint holds both, and a
    run resumed after iteration 1 repeats iterations 2 and 3 with the same baselines."""
    from hybridflow.engine.checkpoint import AHEAD_DIR
    from hybridflow.engine.protocol import DataProto
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    extra = [f"placement.pools={json.dumps(OFF)}", "trainer.mode=one_step_off", "algorithm.adv_estimator=remax"]
    run_id, ahead = _run(store, tmp_path, "remax", extra)
    assert [ahead[step]["off_policy/staleness_max"] for step in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for step in (1, 2, 3):
        assert "critic/reward_baseline/mean" in ahead[step] and ahead[step]["rollout_corr/rollout_is_mean"] > 0
    checkpoint = Path(next(c.path for c in store.checkpoints(run_id) if c.step == 1)) / AHEAD_DIR
    assert sorted(p.name for p in checkpoint.iterdir()) == ["1.greedy.safetensors", "1.safetensors"]  # iteration 2's
    greedy, batch = (DataProto.load(checkpoint / name) for name in ("1.greedy.safetensors", "1.safetensors"))
    assert set(greedy.batch["rollout_version"].tolist()) == set(batch.batch["rollout_version"].tolist()) == {0}
    _, resumed = _run(store, tmp_path, "remax", [], resume_from_step=1, run_id=run_id)
    for step in (2, 3):  # the baseline restored with its batch, not generated again by newer weights
        exact = (*SAMPLED[:2], "critic/reward_baseline/mean")
        assert {k: resumed[step][k] for k in exact} == {k: ahead[step][k] for k in exact}


@needs_vllm
@pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None and os.environ.get("CI") != "true",
    reason="megatron-core is not installed (bash .ci/setup installs it)",
)
def test_a_megatron_actor_reshards_to_whole_weights_for_a_rollout_pool_of_its_own(prefect_api, tmp_path):
    """The 3D-HybridEngine across pools: a megatron actor training in two pipeline stages on its pool's two ranks
    reshards to its generation layout (tp 1: the whole model on each rank) and publishes from it; the rollout's
    own vLLM engine loads each push one step off (its probe log-probs equal the actor's), and the update corrects
    the lag with truncated importance sampling on the megatron loss."""
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    pools = {"train": {**OFF["train"], "tasks_per_node": 2}, "generate": OFF["generate"]}
    megatron = ["actor.strategy=megatron", "actor.pp=2", "rollout.gen_tp=1", "trainer.mode=one_step_off"]
    run_id, off = _run(store, tmp_path, "megatron", [f"placement.pools={json.dumps(pools)}", *megatron])
    placed = {p.role: p.parallel for p in store.placements(run_id)}
    assert placed["actor"]["train"] == {"pp": 2, "tp": 1, "dp": 1} and placed["actor"]["strategy"] == "megatron"
    assert [off[step]["off_policy/staleness_max"] for step in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for step in (1, 2, 3):
        assert off[step]["rollout_corr/rollout_is_mean"] > 0 and math.isfinite(off[step]["actor/pg_loss"])
    for step in (2, 3):  # the reshard of the push after the previous update, reported with this one
        assert off[step]["hybrid_engine/received_mib"] > 0  # each rank gathered the other stage's layers
    assert off[3]["rollout/weight_probe_diff"] < 1e-4  # the engine serves the weights the actor published


ASYNC = ["trainer.mode=async", "rollout.max_staleness=2", "trainer.weight_sync_every=2", "trainer.total_iterations=6"]


@needs_vllm
def test_async_never_trains_a_batch_staler_than_its_bound_and_a_sigkill_loses_no_prompt(prefect_api, tmp_path):
    """Staleness 2, a weight push every 2 updates: every trained row's recorded version is at most 2 behind the
    actor's, and the rollout's pool runs ahead that far. The same run through ``hf run``, SIGKILLed inside
    iteration 4 (two batches generated ahead are in the checkpoint of iteration 3, others in flight), then ``hf
    resume``d, trains the same prompts in the same iterations as the uninterrupted run: each exactly once. So does
    a run whose rollout rank is SIGKILLed inside iteration 4: it recovers by itself inside its flow."""
    import yaml
    from tiny_runs import killed_inside_iteration, rank_pids, wait_inside_iteration

    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    extra = [f"placement.pools={json.dumps(OFF)}", *ASYNC, "trainer.log_train_generations=16"]
    run_id, ahead = _run(store, tmp_path, "ahead", extra)
    stale = {step: ahead[step]["off_policy/staleness_max"] for step in range(1, 7)}
    assert max(stale.values()) == 2.0 and min(stale.values()) == 0.0, stale  # the bound reached, never passed
    assert all(ahead[step]["rollout_corr/rollout_is_mean"] > 0 for step in range(1, 7))
    samples = store.samples(run_id, kind="train")
    lags = Counter(s.step - 1 - s.rollout_version for s in samples)  # iteration s trains at actor version s - 1
    assert set(lags) == {0, 1, 2}, lags  # checked row by row on the versions the store recorded
    wide = {**os.environ, "COLUMNS": "250"}
    shown = subprocess.run(
        [HF, "runs", "samples", run_id, "--step", "3", "--db", store.url], capture_output=True, text=True, env=wide
    )
    assert "generated by the actor after 0 updates (2 stale)" in shown.stdout, shown.stdout
    trained = {step: Counter(s.uid for s in samples if s.step == step) for step in range(1, 7)}  # prompt ids
    assert all(sum(c.values()) == 16 for c in trained.values())  # 4 prompts x 4 responses each iteration
    everything = sum(trained.values(), Counter())
    assert len(everything) == 24 and set(everything.values()) == {4}  # 24 prompts, each trained once

    config_file = tmp_path / "ahead.yaml"
    config_file.write_text(yaml.safe_dump(store.get_run(run_id).config))
    killed, killed_id = killed_inside_iteration(store.get_run(run_id).config, tmp_path, prefect_api, 4)
    db = killed.url
    assert killed.latest_checkpoint(killed_id).step == 3
    checkpoint = Path(killed.latest_checkpoint(killed_id).path)
    assert sorted(p.name for p in (checkpoint / "rollout_ahead").iterdir()) == ["3.safetensors", "4.safetensors"]
    resumed = subprocess.run(
        [HF, "resume", killed_id, "--db", db, "--prefect-api", prefect_api], capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    again = {step: Counter(s.uid for s in killed.samples(killed_id, step, "train")) for step in range(1, 7)}
    assert again == trained  # by prompt id: the same prompts in the same iterations, none lost or repeated
    for point in killed.metrics(killed_id):
        if point.step in (4, 5, 6) and point.name in SAMPLED:
            assert point.value == ahead[point.step][point.name], (point.step, point.name)

    # a rollout rank SIGKILLed inside iteration 4: the run recovers by itself inside its flow (the rollout's queue
    # restored from global_step_3) and trains the same prompts, with the same metrics
    db = f"sqlite:///{tmp_path / 'rank.db'}"
    log = tmp_path / "rank.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                HF,
                "run",
                str(config_file),
                "-o",
                "trainer.recovery_backoff_s=0",
                "--db",
                db,
                "--prefect-api",
                prefect_api,
            ],
            stdout=out,
        )
    healed = RunStore(db)
    healed_id = wait_inside_iteration(proc, healed, 4, log=log)
    [rank] = rank_pids(healed_id, "generate")
    os.kill(rank, signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, log.read_text()
    assert healed.get_run(healed_id).status == "completed"
    [recovery] = healed.recoveries(healed_id)
    assert (recovery.group_name, recovery.resumed_from) == ("generate", 3) and "SIGKILL" in recovery.cause, recovery
    again = {step: Counter(s.uid for s in healed.samples(healed_id, step, "train")) for step in range(1, 7)}
    assert again == trained
    for point in healed.metrics(healed_id):
        if point.step in (4, 5, 6) and point.name in SAMPLED:
            assert point.value == ahead[point.step][point.name], (point.step, point.name)
