"""The 3D-HybridEngine's resharding between training and generation layouts: the paper's rank groups, and on 4 real
processes (torch.distributed, gloo) for training layouts t=4 and p=2,t=2 with generation t_g in {1, 2} (and p_g=2):
megatron-core training shards (fused QKV and gate/up) become generation shards that, in Hugging Face names, equal
the right slices of the full model; zero redundancy in ``hybridflow`` mode (training shards live inside the
generation buffers) and Table 2's communication; after returning the next optimizer step equals one that never
resharded."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from hybridflow.engine.backends.hybrid_engine import (
    HybridEngine,
    megatron_shard_specs,
    model_bytes,
    shard_parameters,
    table2,
)
from hybridflow.engine.backends.megatron_bridge import generation_hf_weights, generation_order, hf_to_mcore
from hybridflow.engine.parallel_layout import HybridLayout
from hybridflow.engine.transfer import Dispatch, register

WORLD = 4
CASES = [  # (p, t, p_g, t_g)
    (1, 4, 1, 1),
    (1, 4, 1, 2),
    (2, 2, 1, 1),
    (2, 2, 1, 2),
    (2, 2, 2, 1),
]


def test_groups_follow_the_paper_example():
    """8 devices, training 1-4-2, generation 1-2-2-2 (paper, section 5.2)."""
    layout = HybridLayout(p=1, t=4, d=2, p_g=1, t_g=2)
    assert layout.d_g == 2
    assert layout.gen_tp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.micro_dp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.coords(3).gen_tp == 1 and layout.coords(3).micro_tp == 1
    pipeline = HybridLayout(p=2, t=2, d=1, p_g=1, t_g=2)  # megatron order: rank = (pp * d + dp) * t + tp
    assert pipeline.micro_dp_groups() == [[0, 2], [1, 3]]
    assert pipeline.gen_tp_groups() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"rollout.gen_tp \(3\) must divide the training actor.tp \(4\)"):
        HybridLayout(p=1, t=4, d=1, p_g=1, t_g=3)


def test_table2_formulas():
    layout = HybridLayout(p=1, t=8, d=1, p_g=1, t_g=2)
    costs = table2(layout, 800.0)
    assert costs["hybridflow"]["received_bytes"] == pytest.approx((8 - 2) / (2 * 8) * 800)  # M/t_g - M/t
    assert costs["naive"]["received_bytes"] == pytest.approx(7 / 8 * 800)
    assert costs["hybridflow"]["peak_gathered_bytes"] == 400 and costs["naive"]["redundancy_bytes"] == 100


def _model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _hf_slice(name: str, full: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Generation TP rank `index` of `parts`'s slice of a Hugging Face parameter, by Megatron's rules written out
    independently of the code under test: column-parallel q/k/v/gate/up and the vocabulary on dim 0, row-parallel
    o/down on dim 1, norms whole."""
    if name.endswith("norm.weight"):
        return full
    dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
    return full.chunk(parts, dim=dim)[index]


def _engine(full_hf, config, layout, rank, mode):
    """A HybridEngine over this rank's megatron training shards of the full Hugging Face weights."""
    specs = megatron_shard_specs(config, layout.p)
    params = shard_parameters(hf_to_mcore(full_hf, config), specs, layout, rank)
    regroup = functools.partial(generation_order, config=config)
    return HybridEngine(params, specs, layout, mode, regroup=regroup), params, specs


def _worker(rank: int, store_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model = _model()
    full = {n: p.detach() for n, p in model.named_parameters()}
    for p, t, p_g, t_g in CASES:
        layout = HybridLayout(p=p, t=t, d=1, p_g=p_g, t_g=t_g)
        specs = megatron_shard_specs(model.config, p)
        expected = table2(layout, model_bytes(specs.values(), 4))
        for mode in ("hybridflow", "naive"):
            case = f"p={p} t={t} -> p_g={p_g} t_g={t_g} {mode}"
            engine, params, _ = _engine(full, model.config, layout, rank, mode)
            originals = {n: x.detach().clone() for n, x in params.items()}
            reference = {n: torch.nn.Parameter(x.clone()) for n, x in originals.items()}
            optim = torch.optim.AdamW(params.values(), lr=0.1)
            ref_optim = torch.optim.AdamW(reference.values(), lr=0.1)
            _step(params, optim, 1)
            _step(reference, ref_optim, 1)
            trained = {n: x.detach().clone() for n, x in params.items()}
            stats = engine.to_generation()
            c = layout.coords(rank)
            names = engine.gen_names()
            assert {s.stage for n, s in specs.items() if n in names} == set(
                range(c.gen_pp * layout.s_p, (c.gen_pp + 1) * layout.s_p)
            )
            for name, weight in generation_hf_weights(engine.gen_weights, model.config).items():
                assert weight.shape == _hf_slice(name, full[name], c.gen_tp, t_g).shape, (case, name)
            own = sum(x.numel() * 4 for x in params.values())
            if mode == "hybridflow":
                assert stats.training_copy_bytes == 0, case  # zero redundancy
                for name, param in params.items():  # each training shard is a slot of its generation buffer
                    assert param.data_ptr() != originals[name].data_ptr()
                    assert param.untyped_storage().data_ptr() == engine.gen_weights[name].untyped_storage().data_ptr()
                    assert param.is_contiguous() == (specs[name].dim != 1)  # a row-parallel slot is transposed
            else:
                assert stats.training_copy_bytes == own, case
            assert stats.gen_param_bytes == sum(w.numel() * 4 for w in engine.gen_weights.values())
            if p == p_g:  # balanced: every rank's stage has the same bytes, so Table 2 holds to the byte ...
                tolerance = 0.01  # ... up to the replicated norms (not split, not sent)
                assert stats.received_bytes == pytest.approx(expected[mode]["received_bytes"], rel=tolerance), case
            engine.to_training()
            for name, param in params.items():
                assert torch.equal(param, trained[name]), (case, name)  # the training shard is intact
                assert param.untyped_storage().nbytes() == param.numel() * 4  # and owns exactly its storage again
                assert param.is_contiguous()  # in megatron's own layout
            _step(params, optim, 2)
            _step(reference, ref_optim, 2)
            for name in params:  # the next step equals one that never resharded (same Parameter, optimizer state)
                assert torch.equal(params[name], reference[name]), (case, name)
    _check_pipeline_stages_exchange(full, model.config)
    dist.destroy_process_group()


def _step(params, optim, step):
    """One optimizer step with a fixed pseudo-gradient (a function of the name and step)."""
    for i, (_name, param) in enumerate(sorted(params.items())):
        g = torch.Generator().manual_seed(1000 * step + i)
        param.grad = torch.randn(param.shape, generator=g)
    optim.step()
    optim.zero_grad()


def _check_pipeline_stages_exchange(full, config):
    """No training between sharding and gathering: every generation weight, including those another stage or TP
    rank sent, equals the full model's slice exactly."""
    rank = dist.get_rank()
    for p, t, p_g, t_g in CASES:
        layout = HybridLayout(p=p, t=t, d=1, p_g=p_g, t_g=t_g)
        for mode in ("hybridflow", "naive"):
            engine, _, _ = _engine(full, config, layout, rank, mode)
            engine.to_generation()
            c = layout.coords(rank)
            gen = generation_hf_weights(engine.gen_weights, config)
            if p_g == 1:  # one generation stage: the whole model, every name
                assert set(gen) == set(full), (p, t, p_g, t_g, mode)
            for name, weight in gen.items():
                assert torch.equal(weight, _hf_slice(name, full[name], c.gen_tp, t_g)), (p, t, p_g, t_g, mode, name)
            del gen
            engine.to_training()


def test_resharding_on_four_processes(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)


def _generation_worker(rank: int, store_path: str) -> None:
    """Greedy generation from the generation shards (TP over the generation TP group) equals the single-process
    model's, for training layouts t=4 and p=2,t=2 resharded to t_g=1 and t_g=2."""
    from hybridflow.engine.backends.tp_generation import build_tp_generation_model

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model = _model()
    with torch.no_grad():  # sharper than random init, so the greedy tokens depend on the context
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.weight.mul_(10.0)
        model.get_input_embeddings().weight.mul_(5.0)
    model.eval()
    full = {n: p.detach() for n, p in model.named_parameters()}
    prompts = torch.tensor([[5, 17, 99, 3, 200, 41], [7, 7, 130, 12, 60, 250]])
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(prompts, attention_mask=torch.ones_like(prompts), **settings)
        want_logits = model(prompts).logits
    assert len(set(want[0, 6:].tolist())) > 1  # not one token repeated
    for p, t, p_g, t_g in [(1, 4, 1, 1), (1, 4, 1, 2), (2, 2, 1, 2)]:
        layout = HybridLayout(p=p, t=t, d=1, p_g=p_g, t_g=t_g)
        engine, _, specs = _engine(full, model.config, layout, rank, "hybridflow")
        engine.to_generation()
        weights = generation_hf_weights(engine.gen_weights, model.config)
        gen = build_tp_generation_model(model.config, weights, engine.gen_tp_group, layout.coords(rank).gen_tp)
        sliced = [w.numel() < full[n].numel() for n, w in weights.items() if not n.endswith("norm.weight")]
        assert all(sliced) == (t_g > 1) and any(sliced) == (t_g > 1)
        del weights
        with torch.no_grad():
            got = gen.generate(prompts, attention_mask=torch.ones_like(prompts), **settings)
            logits = gen(prompts).logits
        assert torch.equal(got, want), (p, t, t_g, got, want)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        del gen
        engine.to_training()
    dist.destroy_process_group()


def test_greedy_generation_from_resharded_weights_equals_one_process(tmp_path):
    mp.spawn(_generation_worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)


def test_mesh_coords_give_each_backend_its_replicas():
    """The transfer protocol's meshes (`hybridflow.engine.transfer`): which rows a rank computes, who returns them."""
    # the paper's example, 8 ranks, training 1-4-2, generation 1-2-2-2 (generation TP groups [0,2] [1,3] [4,6] [5,7])
    layout = HybridLayout(p=1, t=4, d=2, p_g=1, t_g=2)
    assert [layout.mesh_coords(r, "train") for r in range(8)] == [
        (0, 2, True), (0, 2, False), (0, 2, False), (0, 2, False),
        (1, 2, True), (1, 2, False), (1, 2, False), (1, 2, False),
    ]  # fmt: skip
    assert [layout.mesh_coords(r, "generate") for r in range(8)] == [
        (0, 4, True), (1, 4, True), (0, 4, False), (1, 4, False),
        (2, 4, True), (3, 4, True), (2, 4, False), (3, 4, False),
    ]  # fmt: skip
    # two pipeline stages: the last stage returns the replica's rows
    pipeline = HybridLayout(p=2, t=1, d=2, p_g=1, t_g=1)
    assert [pipeline.mesh_coords(r, "train") for r in range(4)] == [
        (0, 2, False),
        (1, 2, False),
        (0, 2, True),
        (1, 2, True),
    ]
    # fsdp with actor.tp=2 on 4 ranks: a TP group shares its rows on both meshes, its first rank returns them
    fsdp = HybridLayout(p=1, t=2, d=2, p_g=1, t_g=2)
    for mesh in ("train", "generate"):
        assert [fsdp.mesh_coords(r, mesh) for r in range(4)] == [
            (0, 2, True),
            (0, 2, False),
            (1, 2, True),
            (1, 2, False),
        ]
    # ddp: every rank a replica of its own
    ddp = HybridLayout(p=1, t=1, d=3, p_g=1, t_g=1)
    assert [ddp.mesh_coords(r, m) for m in ("train", "generate") for r in range(3)] == [
        (r, 3, True) for r in range(3)
    ] * 2
    with pytest.raises(ValueError, match="unknown mesh 'critic'"):
        ddp.mesh_coords(0, "critic")
    with pytest.raises(ValueError, match="splits over one of"):
        register(Dispatch.ONE_TO_ALL, mesh="train")
