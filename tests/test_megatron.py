"""The megatron-core backend on CPU (gloo, through `hybridflow.engine.backends.megatron_cpu`): the Hugging Face <->
megatron
bridge round-trips exactly (GQA, SwiGLU, tied embeddings, Qwen2 q/k/v biases; also through TP shards), and on 2 real
processes the language-model loss of megatron's GPTModel equals the Hugging Face model's with TP=1, TP=2 and PP=2."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from saved_activations import PeakSavedBytes
from transformers import AutoModelForCausalLM, Qwen2Config

from hybridflow.engine.backends.megatron_bridge import hf_to_mcore, mcore_to_hf, shard, unshard
from hybridflow.engine.config import RolloutCorrectionConfig
from hybridflow.engine.tiny import build_tiny_model

if os.environ.get("CI") != "true":  # CI installs megatron-core: there the tests must run, never skip
    pytest.importorskip("megatron.core", reason="megatron-core not installed (see .ci/setup)")


_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def _qwen2():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(**_TINY))


def _qwen3():
    """A tiny Qwen3 (per-head query and key RMSNorm before RoPE), its norms' weights random (not all ones)."""
    from transformers import Qwen3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**_TINY, head_dim=16, max_position_embeddings=64))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    return model


def test_bridge_round_trips_exactly(tmp_path):
    tiny = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "tiny", hidden_size=128, head_dim=16))
    assert "decoder.layers.1.self_attention.q_layernorm.weight" in hf_to_mcore(
        dict(_qwen3().named_parameters()), _qwen3().config
    )
    for model in (tiny, _qwen2(), _qwen3()):
        hf = {n: p.detach() for n, p in model.named_parameters()}
        mcore = hf_to_mcore(hf, model.config)
        assert ("output_layer.weight" in mcore) == (not model.config.tie_word_embeddings)
        back = mcore_to_hf(mcore, model.config)
        assert set(back) == set(hf)
        for name, tensor in hf.items():
            assert torch.equal(back[name], tensor), name
        for name, tensor in mcore.items():  # TP=2 shards and back
            assert torch.equal(unshard(name, [shard(name, tensor, r, 2) for r in range(2)]), tensor), name
    layer0 = hf_to_mcore({n: p.detach() for n, p in tiny.named_parameters()}, tiny.config)
    qkv = layer0["decoder.layers.0.self_attention.linear_qkv.weight"]
    q = tiny.model.layers[0].self_attn.q_proj.weight
    k = tiny.model.layers[0].self_attn.k_proj.weight
    # group 0 = query heads 0..1 (8 heads / 4 groups), then key head 0: megatron's interleaving
    assert torch.equal(qkv[: 2 * 16], q[: 2 * 16]) and torch.equal(qkv[2 * 16 : 3 * 16], k[:16])


LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (tp, pp) on 2 processes; (1, 1) is data-parallel there (D=2)


def _join(rank: int, store: str) -> None:
    """This spawned process joins the 2-process gloo world, patched for megatron on CPU."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from hybridflow.engine.backends.megatron_cpu import install

    install()


def _layouts(hf_model, recompute: bool = False):
    """For each of `LAYOUTS`: megatron's parallel state set up, this rank's GPTModel loaded from `hf_model` (with
    full activation recompute if `recompute`); yields ``(tp, pp, model)`` and tears the parallel state down after
    each."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from hybridflow.engine.backends.megatron_model import build_gpt_model, load_hf_weights

    state = {n: p.detach() for n, p in hf_model.named_parameters()}
    for tp, pp in LAYOUTS:
        parallel_state.initialize_model_parallel(tp, pp)
        model_parallel_cuda_manual_seed(0)
        model = build_gpt_model(hf_model.config, recompute=recompute)
        load_hf_weights(model, state, hf_model.config)
        yield tp, pp, model
        parallel_state.destroy_model_parallel()


def _unsharded(model, tensor_of) -> dict[str, torch.Tensor]:
    """``tensor_of(param)`` (the weight, its grad) of every parameter, gathered over the TP group and unsharded."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, param in model.named_parameters():
        local = tensor_of(param).detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        out[name] = unshard(name, parts)
    return out


def _worker(rank: int, store: str, model_dir: str, results) -> None:
    _join(rank, store)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(0, hf_model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    for tp, pp, model in _layouts(hf_model):
        model.eval()

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            output = model(batch["ids"], batch["positions"], attention_mask=None, labels=batch["labels"])
            return output, lambda out: (out.mean(), {"loss": out.mean().detach()})

        with torch.no_grad():
            losses = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([{"ids": inputs, "positions": positions, "labels": labels}]),
                model=[model],
                num_microbatches=1,
                seq_length=inputs.shape[1],
                micro_batch_size=inputs.shape[0],
                forward_only=True,
            )
        if parallel_state.is_pipeline_last_stage():
            results[f"{tp}-{pp}-{rank}"] = float(losses[0]["loss"])
    dist.destroy_process_group()


def test_tp2_and_pp2_losses_equal_tp1_and_hugging_face(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=128, head_dim=16, num_layers=2)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(0, hf_model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = float(
            hf_model(ids[:, :-1], labels=None).logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).neg().mean()
        )
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(str(tmp_path / "store"), str(model_dir), results), nprocs=2, join=True)
        results = dict(results)
    assert set(results) == {"1-1-0", "1-1-1", "2-1-0", "2-1-1", "1-2-1"}
    for key, loss in results.items():
        assert loss == pytest.approx(want, rel=1e-5, abs=1e-5), (key, loss, want)


def test_a_qwen3_model_on_megatron_gives_hugging_faces_loss(tmp_path):
    """Qwen3's per-head query and key RMSNorm (megatron-core's qk_layernorm, its weights mapped by the bridge): the
    language-model loss with TP=1, TP=2 and PP=2 equals the Hugging Face model's."""
    model = _qwen3().eval()
    model.save_pretrained(tmp_path / "qwen3")
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = float(model(ids[:, :-1]).logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).neg().mean())
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path / "qwen3"), results), nprocs=2, join=True)
        results = dict(results)
    assert set(results) == {"1-1-0", "1-1-1", "2-1-0", "2-1-1", "1-2-1"}
    for key, loss in results.items():
        assert loss == pytest.approx(want, rel=1e-5, abs=1e-5), (key, loss, want)


def _policy_batch(model, generator):
    """A PPO mini-batch in the rollout layout: left-padded prompts (4 tokens), right-padded responses (5 tokens)."""
    from hybridflow.engine.protocol import DataProto
    from hybridflow.engine.rollout.hf import assemble_rollout

    rows, vocab = 4, model.config.vocab_size
    prompts = torch.randint(4, vocab, (rows, 4), generator=generator)
    prompt_mask = torch.ones(rows, 4, dtype=torch.long)
    prompt_mask[1, :2] = 0  # a left-padded prompt
    prompts = prompts.masked_fill(prompt_mask == 0, 0)
    responses = torch.randint(4, vocab, (rows, 5), generator=generator)
    responses[2, 3] = 1  # an early EOS
    tensors = assemble_rollout(prompts, prompt_mask, responses, [1], 0, 5)
    tensors["old_log_probs"] = torch.randn(rows, 5, generator=generator) * 0.1 - 5.0
    tensors["advantages"] = torch.randn(rows, 5, generator=generator)
    # the engine's: ratios exp(old - rollout) from 0.2 to 5, some past the truncation at 2
    tensors["rollout_log_probs"] = tensors["old_log_probs"] + torch.randn(rows, 5, generator=generator) * 0.8
    return DataProto.from_dict(tensors, meta_info={"temperature": 0.7})


def _grad_worker(rank: int, store: str, model_dir: str, results) -> None:
    _join(rank, store)
    from megatron.core import parallel_state

    from hybridflow.engine.backends.megatron_actor import policy_gradient
    from hybridflow.engine.config import ActorConfig

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir)
    data = _policy_batch(hf_model, torch.Generator().manual_seed(1))
    config = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    for variant in (0, 1, 2):  # plain, activation recompute, the rollout correction's bypass mode
        correction = _BYPASS if variant == 2 else None
        for tp, pp, model in _layouts(hf_model, recompute=variant == 1):
            model.train()
            with PeakSavedBytes().watch() as meter:
                metrics = policy_gradient(model, data.split(2), [0.5, 0.5], config, correction)
            results[f"{tp}-{pp}-{rank}-{variant}"] = {
                "grads": _unsharded(model, lambda p: p.grad),
                "metrics": metrics,
                "stage": parallel_state.get_pipeline_model_parallel_rank(),
                "saved_bytes": meter.peak,
            }
    dist.destroy_process_group()


_BYPASS = RolloutCorrectionConfig(
    rollout_is="token", bypass_mode=True, loss_type="reinforce", rollout_rs="token_k1", rollout_rs_threshold="0.2_5"
)


def _hf_gradient(hf_model, data, correction=None) -> tuple[dict[str, torch.Tensor], float]:
    """The Hugging Face model's gradient of the mean over 2 micro-batches of the PPO loss (or, with `correction`,
    bypass mode's), in megatron's names, and the loss."""
    from hybridflow.engine.algorithms.losses import compute_policy_loss
    from hybridflow.engine.algorithms.rollout_correction import bypass_policy_loss
    from hybridflow.engine.config import ActorConfig
    from hybridflow.engine.models import response_log_probs

    hf_model.zero_grad()
    losses = []
    for micro in data.split(2):
        log_prob, _ = response_log_probs(hf_model, micro, temperature=0.7)
        b = micro.batch
        if correction is None:
            loss, *_ = compute_policy_loss(b["old_log_probs"], log_prob, b["advantages"], b["response_mask"], 0.2, 0.28)
        else:
            config = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
            (loss, *_), stats = bypass_policy_loss(
                config, correction, log_prob, b["rollout_log_probs"], b["advantages"], b["response_mask"]
            )
            assert 0 < stats["rollout_rs_masked_fraction"] < 1  # some tokens rejected, not all
        losses.append(loss)
    loss = sum(losses) / len(losses)
    loss.backward()
    return hf_to_mcore({n: p.grad.clone() for n, p in hf_model.named_parameters()}, hf_model.config), float(loss)


def test_policy_gradient_with_tp2_and_pp2_equals_hugging_face(tmp_path):
    """The PPO loss's gradient on megatron (TP=1, TP=2, PP=2; 2 micro-batches through megatron's schedule), mapped
    back to Hugging Face names, equals the gradient of the same loss computed on the Hugging Face model; so does it
    with full activation recompute (``model.gradient_checkpointing``), which keeps far fewer bytes for the backward
    pass at its peak, and in the rollout correction's bypass mode (REINFORCE with truncated weights and rejected
    tokens, from the current policy against the rollout's log-probs)."""
    from hybridflow.engine.backends.megatron_bridge import stage_names

    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=128, head_dim=16, num_layers=2)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir)
    data = _policy_batch(hf_model, torch.Generator().manual_seed(1))
    wants = [_hf_gradient(hf_model, data), _hf_gradient(hf_model, data, _BYPASS)]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_grad_worker, args=(str(tmp_path / "store"), str(model_dir), results), nprocs=2, join=True)
        results = dict(results)
    assert len(results) == 18
    for key, result in results.items():
        tp, pp, rank, variant = (int(x) for x in key.split("-"))
        want, loss = wants[variant == 2]
        if variant == 1:  # measured 0.44 of the bytes (0.51 on PP's first stage, 0.77 on its last, which keeps logits)
            bound = 0.6 if result["stage"] == 0 else 0.8
            assert result["saved_bytes"] < bound * results[f"{tp}-{pp}-{rank}-0"]["saved_bytes"], key
        for name, grad in want.items():
            stage, local = stage_names(name, hf_model.config.num_hidden_layers, pp)
            if stage != result["stage"]:
                continue
            torch.testing.assert_close(result["grads"][local], grad, rtol=1e-4, atol=1e-6, msg=f"{key} {name}")
        assert any(g.abs().sum() > 0 for g in result["grads"].values())
        if result["stage"] == pp - 1:  # the last stage reports the loss
            assert result["metrics"]["actor/pg_loss"] == pytest.approx(loss, rel=1e-5), key
            if variant == 2:
                assert 0 < result["metrics"]["rollout_corr/rollout_rs_masked_fraction"] < 1, key


def _update_worker(rank: int, store: str, model_dir: str, results) -> None:
    _join(rank, store)
    from megatron.core import parallel_state

    from hybridflow.engine.backends.megatron_actor import MegatronActor

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir)
    data = _policy_batch(hf_model, torch.Generator().manual_seed(1))
    data.meta_info["global_steps"] = 3
    for tp, pp, model in _layouts(hf_model):
        actor = MegatronActor(model, _update_config(), rollout_n=2, seed=0, correction=_CORRECTION)
        dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        rows = len(data) // dp
        mine = data[dp_rank * rows : (dp_rank + 1) * rows]
        old = actor.compute_log_prob(mine)  # before the update: the weights loaded from Hugging Face
        metrics = actor.update_policy(mine)
        results[f"{tp}-{pp}-{rank}"] = {
            "weights": _unsharded(model, lambda p: p),
            "metrics": metrics,
            "stage": parallel_state.get_pipeline_model_parallel_rank(),
            "old_log_probs": None if old is None else old.batch["old_log_probs"],
            "rows": (dp_rank * rows, (dp_rank + 1) * rows),
        }
    dist.destroy_process_group()


_CORRECTION = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)


def _update_config(**overrides):
    """Two AdamW steps (lr 1e-2) over one global mini-batch of the 4 sequences; `overrides`: other ActorConfig keys."""
    from hybridflow.engine.config import ActorConfig

    defaults = {"ppo_mini_batch_size": 2, "ppo_micro_batch_size": 2, "ppo_epochs": 2, "clip_ratio_high": 0.28}
    return ActorConfig(**{**defaults, "optim": {"lr": 1e-2, "grad_clip": 1.0}, **overrides})


def test_megatron_actor_update_equals_the_hugging_face_actor(tmp_path):
    """On megatron with DP=2, TP=2 and PP=2: the response log-probs, then two AdamW steps of the PPO update
    (token-weighted micro-batches, grad clipping, the rollout correction's truncated importance weights), equal what
    the Hugging Face `Actor` gets on the same batch (lr 1e-2: the weights move by up to 2e-2; Adam turns
    summation-order noise in near-zero gradients into element differences of 1e-4 on one CPU and 2.4e-4 on another,
    hence an element tolerance of 1e-3 beside a tight check of the whole update)."""
    from hybridflow.engine.backends.actor import Actor
    from hybridflow.engine.backends.megatron_bridge import stage_names

    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=128, head_dim=16, num_layers=2)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir)
    before = hf_to_mcore({n: p.detach().clone() for n, p in hf_model.named_parameters()}, hf_model.config)
    data = _policy_batch(hf_model, torch.Generator().manual_seed(1))
    data.meta_info["global_steps"] = 3
    hf_actor = Actor(hf_model, _update_config(), rollout_n=2, seed=0, rollout_correction=_CORRECTION)
    want_log_probs = hf_actor.compute_log_prob(data).batch["old_log_probs"]
    want_metrics = hf_actor.update_policy(data)
    want = hf_to_mcore({n: p.detach() for n, p in hf_model.named_parameters()}, hf_model.config)
    assert max(float((want[n] - before[n]).abs().max()) for n in want) > 1e-3  # the update moved the weights
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_update_worker, args=(str(tmp_path / "store"), str(model_dir), results), nprocs=2, join=True)
        results = dict(results)
    assert len(results) == 6
    for key, result in results.items():
        tp, pp, _ = (int(x) for x in key.split("-"))
        for name, weight in want.items():
            stage, local = stage_names(name, hf_model.config.num_hidden_layers, pp)
            if stage == result["stage"]:
                got = result["weights"][local]
                # The update as a whole equals HF's: the difference is under 0.1% of how far the weights moved
                # (measured: at most 6e-5 of it) ...
                moved = float((weight - before[name]).norm())
                assert float((got - weight).norm()) <= 1e-3 * moved, (key, name)
                # ... and so does every element, up to the summation-order noise Adam amplifies in near-zero
                # gradients (elements whose gradient is ~0 move by up to lr = 1e-2 in either direction).
                torch.testing.assert_close(
                    got, weight, rtol=1e-4, atol=1e-3, msg=lambda m, key=key, name=name: f"{key} {name}: {m}"
                )
        if result["stage"] == pp - 1:  # log-probs come from the last stage (None elsewhere)
            begin, end = result["rows"]
            mask = data.batch["response_mask"][begin:end].bool()
            got_lp, want_lp = result["old_log_probs"][mask], want_log_probs[begin:end][mask]
            torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
        else:
            assert result["old_log_probs"] is None
        got = result["metrics"]["actor/grad_norm"]
        assert got == pytest.approx(want_metrics["actor/grad_norm"], rel=1e-4), key
        if result["stage"] == pp - 1:  # the truncated importance weights of the same tokens (on this rank's rows)
            assert 0 < result["metrics"]["rollout_corr/rollout_is_ratio_fraction_high"] < 1, key


def _distill_teacher():
    from hybridflow.engine.config import TeacherConfig

    return TeacherConfig(
        model_path="teacher", use_as="loss", kl_coef=0.5, top_k=6, top_k_kl="forward", log_prob_floor=-7.0, kl_clamp=2.0
    )


def _distill_batch(hf_model):
    """`_policy_batch` with a teacher's columns: its top-6 support (random ids, one of them the sampled token) and
    its log-probs there, as the teacher stage returns them."""
    batch = _policy_batch(hf_model, torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    rows, width = batch.batch["responses"].shape
    ids = torch.randint(0, hf_model.config.vocab_size, (rows, width, 6), generator=generator)
    ids[..., 0] = batch.batch["responses"]
    log_probs = torch.log_softmax(torch.randn(rows, width, 7, generator=generator) * 3, -1)[..., :6]
    batch.batch["teacher_top_k_ids"], batch.batch["teacher_top_k_log_probs"] = ids, log_probs
    batch.batch["teacher_log_prob"] = log_probs[..., 0]
    return batch


def _distill_worker(rank: int, store: str, model_dir: str, results) -> None:
    _join(rank, store)
    from megatron.core import parallel_state

    from hybridflow.engine.backends.megatron_actor import policy_gradient
    from hybridflow.engine.config import ActorConfig

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir)
    data = _distill_batch(hf_model)
    config = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    for tp, pp, model in _layouts(hf_model):
        model.train()
        metrics = policy_gradient(model, data.split(2), [0.5, 0.5], config, teacher=_distill_teacher())
        results[f"{tp}-{pp}-{rank}"] = {
            "grads": _unsharded(model, lambda p: p.grad),
            "metrics": metrics,
            "stage": parallel_state.get_pipeline_model_parallel_rank(),
        }
    dist.destroy_process_group()


def test_the_distillation_loss_on_megatron_equals_hugging_faces(tmp_path):
    """The actor's loss with the teacher's top-k forward KL (verl's forward_kl_topk, floored log-probs, clamped), on
    megatron with TP=1, TP=2 (the support's log-probs from vocabulary-parallel logits) and PP=2, gives the gradient
    and the ``actor/distill_loss`` the Hugging Face actor's loss gives on the same batch."""
    from hybridflow.engine.backends.actor import actor_loss
    from hybridflow.engine.backends.megatron_bridge import stage_names
    from hybridflow.engine.config import ActorConfig
    from hybridflow.engine.models import response_token_stats

    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=128, head_dim=16, num_layers=2)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir)
    data = _distill_batch(hf_model)
    losses, distills = [], []
    for micro in data.split(2):
        stats = response_token_stats(hf_model, micro, 0.7, support=micro.batch["teacher_top_k_ids"])
        batch = {**dict(micro.batch.items()), "support_log_probs": stats["support_log_probs"]}
        config = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
        loss, terms = actor_loss(config, batch["old_log_probs"], stats["log_probs"], batch, teacher=_distill_teacher())
        losses.append(loss)
        distills.append(float(terms["distill_loss"]))
    hf_model.zero_grad()
    (sum(losses) / len(losses)).backward()
    want = hf_to_mcore({n: p.grad.clone() for n, p in hf_model.named_parameters()}, hf_model.config)
    assert sum(distills) > 0
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_distill_worker, args=(str(tmp_path / "store"), str(model_dir), results), nprocs=2, join=True)
        results = dict(results)
    assert len(results) == 2 * len(LAYOUTS)
    for key, result in results.items():
        tp, pp, _ = (int(x) for x in key.split("-"))
        for name, grad in want.items():
            stage, local = stage_names(name, hf_model.config.num_hidden_layers, pp)
            if stage == result["stage"]:
                torch.testing.assert_close(result["grads"][local], grad, rtol=1e-4, atol=1e-6, msg=f"{key} {name}")
        if result["stage"] == pp - 1:
            assert result["metrics"]["actor/distill_loss"] == pytest.approx(sum(distills) / 2, rel=1e-5), key
