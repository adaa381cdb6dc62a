"""On-policy distillation (``teacher``, issue 56): the per-token reverse KL, its two uses and the top-k KL checked
against an independent full-vocabulary computation (on hand tensors and on the tiny models); the single-process
trainer distilling a trained tiny teacher into the tiny student (the exact KL to the teacher on fixed sequences
falls) and resuming exactly; the Prefect flow with the teacher in a pool of its own and the top-k KL as a loss; a
teacher of another tokenizer refused before any work."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_runs import metrics_by_step, resumed_runs, tiny_run_config

from hybridflow.engine.algorithms.distillation import (
    distillation_loss,
    distillation_metrics,
    distilled_advantages,
    reverse_kl_tokens,
    top_k_forward_kl,
    top_k_reverse_kl,
)
from hybridflow.engine.config import ConfigError, load_config
from hybridflow.engine.models import load_model
from hybridflow.engine.trainer import SingleProcessTrainer

VOLATILE = ("timing_s/", "perf/")
PURE = ["teacher.task_coef=0", "actor.optim.lr=1e-2", "actor.ppo_mini_batch_size=4", "rollout.temperature=1.0"]
TEACHER = ["actor.optim.lr=1e-2", "trainer.total_iterations=6", "actor.ppo_mini_batch_size=4"]


def trained_teacher(student_dir: Path, root: Path) -> Path:
    """A teacher of the student's tokenizer that knows something the student does not: the tiny model after 6
    iterations of GRPO on the tiny runs' reward (lr 1e-2), saved under `root` with the tokenizer."""
    trainer = SingleProcessTrainer(tiny_run_config(root, student_dir, "grpo", TEACHER))
    trainer.fit(log=lambda r: None)
    folder = root / "teacher"
    trainer.actor.model.save_pretrained(folder)
    trainer.tokenizer.save_pretrained(folder)
    return folder


def exact_reverse_kl(student, teacher, batch) -> float:
    """KL(student || teacher) per response token from the full next-token distributions of both models on the
    batch's sequences (no sampling): the figure distillation lowers, computed apart from the code under test."""
    with torch.no_grad():
        ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
        t = batch.batch["responses"].shape[1]
        s = torch.log_softmax(student(input_ids=ids, attention_mask=mask).logits[:, -t - 1 : -1].float(), -1)
        q = torch.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits[:, -t - 1 : -1].float(), -1)
        kl = (s.exp() * (s - q)).sum(-1)
        response = batch.batch["response_mask"].float()
        return float((kl * response).sum() / response.sum())


# ---------------------------------------------------------------------------------------------------- the loss


def test_the_reverse_kl_and_its_uses_match_an_independent_computation():
    """On hand values: the dense reward is task_coef x A - kl_coef x (log p - log q), 0 off the mask. Over a small
    vocabulary: the k1 and k3 estimates on the student's own samples average to the exact KL(p || q); the
    policy-gradient surrogate with the dense reward as each token's advantage has, in expectation over the student's
    tokens (enumerated, not sampled), the gradient of -KL(p || q) (GKD, section 3); as a loss, k2's gradient in
    expectation is that of KL(p || q) too (the default), while k3's is the forward KL(q || p)'s (Tang and Munos 2025,
    "On a few pitfalls in KL divergence gradient estimation for RL")."""
    adv = torch.tensor([[1.0, 1.0, 7.0]])
    lp, lq = torch.tensor([[-1.0, -2.0, 5.0]]), torch.tensor([[-0.5, -3.0, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    out = distilled_advantages(adv, lp, lq, mask, kl_coef=2.0, task_coef=0.5)
    assert out.tolist() == [[1.5, -1.5, 0.0]]
    assert reverse_kl_tokens(lp, lq, mask).tolist() == [[-0.5, 1.0, 0.0]]
    metrics = distillation_metrics(lp, lq, mask)
    assert metrics["distill/reverse_kl"] == pytest.approx(0.25) and metrics["distill/seq_reverse_kl"] == 0.5
    assert metrics["distill/teacher_log_prob"] == pytest.approx(-1.75)

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, generator=generator, requires_grad=True)
    teacher = torch.randn(7, generator=generator) * 2
    q = torch.log_softmax(teacher, -1)

    def student():  # log p, a fresh graph for each gradient
        return torch.log_softmax(logits, -1)

    def grad(value: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(value, logits)[0]

    p = student().detach()
    exact = float((p.exp() * (p - q)).sum())
    n = 400_000
    tokens = torch.multinomial(p.exp(), n, replacement=True, generator=generator)
    ones = torch.ones(1, n)
    k1 = float(reverse_kl_tokens(p[tokens][None], q[tokens][None], ones).mean())
    k3 = float(distillation_loss(p[tokens][None], q[tokens][None], ones, "low_var_kl", "token-mean"))
    assert k1 == pytest.approx(exact, abs=0.02) and k3 == pytest.approx(exact, abs=0.02)

    reverse = grad((student().exp() * (student() - q)).sum())  # d KL(p || q)
    forward = grad((q.exp() * (q - student())).sum())  # d KL(q || p)
    reward = distilled_advantages(torch.zeros(1, 7), p[None], q[None], torch.ones(1, 7), 1.0, 0.0)[0]
    # E_y~p[A(y) d log p(y)], each token once weighted by its probability (enumerated, not sampled), A held fixed
    assert torch.allclose(grad((p.exp() * reward * student()).sum()), -reverse, atol=1e-6)
    weights = p.exp()[None]  # as the mask, with token-sum: the expectation over the student's tokens
    k2_loss = distillation_loss(student()[None], q[None], weights, "k2", "token-sum")
    assert torch.allclose(grad(k2_loss), reverse, atol=1e-6)  # teacher.kl_loss_type's default: the reverse KL's
    k3_loss = distillation_loss(student()[None], q[None], weights, "k3", "token-sum")
    assert torch.allclose(grad(k3_loss), forward, atol=1e-6)  # k3 as a loss: the forward KL's (Tang & Munos 2025)


def test_kl_clamp_bounds_each_tokens_kl_as_verls_loss_max_clamp():
    """``teacher.kl_clamp`` = c (verl's ``distillation_loss.loss_max_clamp``) clamps each token's KL estimate to
    [-c, c] before it is a reward or a loss: a token the teacher finds unlikely by 30 nats weighs c, not 30, and
    passes no gradient; within the bound nothing changes. It is refused with top_k (the KL there is exact)."""
    adv, mask = torch.zeros(1, 3), torch.ones(1, 3)
    lp, lq = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-31.0, -1.0, -0.5]])  # log p - log q: 30, -1, 0
    assert distilled_advantages(adv, lp, lq, mask, 1.0, 0.0).tolist() == [[-30.0, 1.0, 0.0]]
    assert distilled_advantages(adv, lp, lq, mask, 1.0, 0.0, kl_clamp=10.0).tolist() == [[-10.0, 1.0, 0.0]]
    student = lp.clone().requires_grad_(True)
    loss = distillation_loss(student, lq, mask, "k1", "token-sum", kl_clamp=10.0)
    assert float(loss) == pytest.approx(10.0 - 1.0)
    (grad,) = torch.autograd.grad(loss, student)
    assert grad.tolist() == [[0.0, 1.0, 1.0]]  # the clamped token passes none
    from hybridflow.engine.config import TeacherConfig

    with pytest.raises(ValueError, match="teacher.kl_clamp clamps the estimate"):
        TeacherConfig(model_path="/m", use_as="loss", top_k=4, kl_clamp=10.0)


def test_the_top_k_reverse_kl_is_the_exact_kl_of_the_merged_distributions():
    """``teacher.top_k``: over the whole vocabulary the top-k KL is the exact KL(p || q) and its gradient the exact
    KL's; over fewer tokens it is the KL of p and q merged onto the k tokens and the rest, computed here apart (so
    between 0 and the full KL), and the student's mass outside the teacher's support counts."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=generator, requires_grad=True)
    q = torch.log_softmax(torch.randn(3, 5, 11, generator=generator) * 2, -1)
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    p = torch.log_softmax(logits, -1)
    exact = (p.exp() * (p - q)).sum(-1) * mask
    order = q.argsort(-1, descending=True)  # the teacher's likeliest first
    full = top_k_reverse_kl(p.gather(-1, order), q.gather(-1, order), mask)
    assert torch.allclose(full, exact, atol=1e-5) and full[2, 3:].eq(0).all()
    (grad_full,) = torch.autograd.grad(full.sum(), logits, retain_graph=True)
    (grad_exact,) = torch.autograd.grad(exact.sum(), logits, retain_graph=True)
    assert torch.allclose(grad_full, grad_exact, atol=1e-5)
    top = order[..., :4]
    kl = top_k_reverse_kl(p.gather(-1, top), q.gather(-1, top), mask)
    ps, qs = p.exp().gather(-1, top), q.exp().gather(-1, top)
    merged_p = torch.cat([ps, 1 - ps.sum(-1, keepdim=True)], -1)
    merged_q = torch.cat([qs, 1 - qs.sum(-1, keepdim=True)], -1)
    merged = (merged_p * (merged_p.log() - merged_q.log())).sum(-1) * mask
    assert torch.allclose(kl, merged, atol=1e-5)
    assert (kl >= -1e-6).all() and (kl <= exact + 1e-5).all() and (kl < exact - 1e-3).any()
    # a student that puts its mass where the teacher's top-2 do not: paid for in the rest's bucket
    student = torch.log(torch.tensor([[[0.05, 0.05, 0.9]]]))
    teacher = torch.log(torch.tensor([[[0.6, 0.39, 0.01]]]))
    paid = top_k_reverse_kl(student[..., :2], teacher[..., :2], torch.ones(1, 1))
    by_hand = 0.05 * math.log(0.05 / 0.6) + 0.05 * math.log(0.05 / 0.39) + 0.9 * math.log(0.9 / 0.01)
    assert float(paid) == pytest.approx(by_hand, rel=1e-5)  # 3.82 nats; over the two tokens alone: -0.23


def test_the_top_k_forward_kl_is_verls_forward_kl_topk():
    """``teacher.top_k_kl: forward`` (verl's forward_kl_topk): over the whole vocabulary the exact KL(q || p) and its
    gradient; over the teacher's top-k, sum q (log q - log p) by hand, floored at 0 (where the student holds the
    support's mass and the teacher less); with ``log_prob_floor`` both log-probs floored first."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 9, generator=generator, requires_grad=True)
    q = torch.log_softmax(torch.randn(2, 4, 9, generator=generator) * 2, -1)
    mask = torch.ones(2, 4)
    mask[1, 2:] = 0
    p = torch.log_softmax(logits, -1)
    exact = (q.exp() * (q - p)).sum(-1) * mask
    full = top_k_forward_kl(p, q, mask)
    assert torch.allclose(full, exact, atol=1e-6) and full[1, 2:].eq(0).all()
    (grad_full,) = torch.autograd.grad(full.sum(), logits, retain_graph=True)
    (grad_exact,) = torch.autograd.grad(exact.sum(), logits)
    assert torch.allclose(grad_full, grad_exact, atol=1e-6)
    student = torch.log(torch.tensor([[[0.5, 0.45, 0.05]]]))  # the student holds more of the support than the teacher
    teacher = torch.log(torch.tensor([[[0.3, 0.2, 0.5]]]))
    by_hand = 0.3 * math.log(0.3 / 0.5) + 0.2 * math.log(0.2 / 0.45)  # -0.32: floored at 0
    assert by_hand < 0 and float(top_k_forward_kl(student[..., :2], teacher[..., :2], torch.ones(1, 1))) == 0.0
    tiny = torch.log(torch.tensor([[[1e-9, 0.5]]]))
    floored = top_k_forward_kl(tiny, torch.log(torch.tensor([[[0.4, 0.5]]])), torch.ones(1, 1), floor=-3.0)
    assert float(floored) == pytest.approx(0.4 * (math.log(0.4) + 3.0), rel=1e-5)


def test_teacher_settings_are_checked_before_any_work(tmp_path, tiny_model_dir):
    """A teacher of another tokenizer (the embedded SmolLM2's), or a dead symbolic link, stops hf run's checks naming
    teacher.model_path; teacher settings without the teacher and an unknown use are refused naming the key and the
    fix."""
    from hybridflow.flows.preflight import InputError, check_run_inputs

    cfg = tiny_run_config(tmp_path, tiny_model_dir, "grpo", ["teacher.model_path=smollm2"])
    assert cfg.roles()[-1] == "teacher" and not cfg.skips_old_log_prob()
    with pytest.raises(InputError, match=r"teacher.model_path: the teacher's tokenizer is not the actor's"):
        check_run_inputs(cfg)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "teacher").symlink_to(Path("links") / "elsewhere")  # read from links/: a dead link
    dead = tiny_run_config(tmp_path, tiny_model_dir, "grpo", [f"teacher.model_path={tmp_path / 'links' / 'teacher'}"])
    with pytest.raises(InputError, match=r"teacher.model_path: .* is a symbolic link to links/elsewhere, which does"):
        check_run_inputs(dead)
    with pytest.raises(ConfigError, match=r"teacher.top_k=8 needs teacher.use_as=loss"):
        tiny_run_config(tmp_path, tiny_model_dir, "grpo", ["teacher.model_path=x", "teacher.top_k=8"])
    wide = [f"teacher.model_path={tiny_model_dir}", "teacher.use_as=loss", "teacher.top_k=100000"]
    with pytest.raises(InputError, match=r"teacher.top_k=100000: the teacher's vocabulary has \d+ tokens"):
        check_run_inputs(tiny_run_config(tmp_path, tiny_model_dir, "grpo", wide))
    with pytest.raises(ConfigError, match=r"teacher.task_coef set without teacher.model_path"):
        tiny_run_config(tmp_path, tiny_model_dir, "grpo", ["teacher.task_coef=0"])
    with pytest.raises(ConfigError, match=r"teacher.use_as: Input should be 'reward' or 'loss'"):
        load_config(None, [f"model.path={tiny_model_dir}", "data.train_files=x.parquet", "teacher.use_as=both"])


# ---------------------------------------------------------------------------------------------------- one process


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """Pure distillation (the dense reward alone) from the trained teacher: 4 iterations uninterrupted (saved at 2
    and 4), and 2 iterations then a resumed trainer for iterations 3 and 4."""
    teacher = trained_teacher(tiny_model_dir, tmp_path_factory.mktemp("teacher"))
    roots = tmp_path_factory.mktemp("distil_a"), tmp_path_factory.mktemp("distil_b")
    extra = [*PURE, f"teacher.model_path={teacher}", "trainer.save_freq=2"]
    a, records_a, _, records_b2 = resumed_runs(roots, tiny_model_dir, extra, total=4, cut=2)
    return SimpleNamespace(a=a, records_a=records_a, b2=records_b2, teacher=teacher)


def sampled(runs, student_dir: Path):
    """Sequences the distilled student samples for 4 training prompts (2 each), the teacher and the untrained
    student, both loaded afresh in float32."""
    from hybridflow.engine.data import collate_prompts

    trainer = runs.a
    prompts = collate_prompts([trainer.train_dataset[i] for i in range(4)], trainer.tokenizer)
    prompts.meta_info["global_steps"] = 1
    batch = trainer.rollout.generate_sequences(prompts, n=2)
    return batch, load_model(runs.teacher, torch.float32, "cpu"), load_model(student_dir, torch.float32, "cpu")


def test_distillation_moves_the_student_toward_the_teacher(runs, tiny_model_dir):
    """The exact per-token KL(student || teacher) on fixed sampled sequences is lower after 4 iterations of the
    dense reward alone than at the start; the teacher role is the teacher's model, not the student's; each
    iteration reports distill/reverse_kl, and the task reward did not train (task_coef 0: every advantage is the
    teacher's)."""
    trainer = runs.a
    batch, teacher, student0 = sampled(runs, tiny_model_dir)
    before, after = exact_reverse_kl(student0, teacher, batch), exact_reverse_kl(trainer.actor.model, teacher, batch)
    assert after < 0.5 * before, (before, after)  # measured: 0.44 -> 0.06 at 8 iterations
    assert trainer.worker.teacher.column == "teacher_log_prob"
    assert torch.equal(trainer.worker.teacher.model.model.norm.weight, teacher.model.norm.weight)
    trained = [r for r in runs.records_a if "actor/pg_loss" in r]
    assert len(trained) == 4 and all("distill/teacher_log_prob" in r for r in trained)
    for record in trained:  # every advantage is the teacher's dense reward: their token mean is minus the KL's
        assert record["critic/advantages/mean"] == pytest.approx(-record["distill/reverse_kl"], abs=1e-5)


def test_the_top_k_loss_on_real_models_is_their_exact_kl(runs, tiny_model_dir):
    """The teacher stage's top-k support (``teacher.top_k``) and the actor's log-probs at it, on the tiny models and
    sampled sequences: over the whole vocabulary the loss's per-token KL averages to the exact KL of the two
    models' full distributions (computed apart, unpacked); over 16 tokens it is less, and more than 0."""
    from hybridflow.engine.backends.actor import RefPolicy
    from hybridflow.engine.models import response_token_stats
    from hybridflow.engine.torch_ops import masked_mean

    batch, teacher, student = sampled(runs, tiny_model_dir)
    mask = batch.batch["response_mask"]
    exact = exact_reverse_kl(student, teacher, batch)
    kls = {}
    for k in (teacher.config.vocab_size, 16):
        scored = RefPolicy(teacher, 3, column="teacher_log_prob", top_k=k).compute_ref_log_prob(batch).batch
        assert scored["teacher_top_k_ids"].shape == (*mask.shape, k)
        ours = response_token_stats(student, batch, support=scored["teacher_top_k_ids"])["support_log_probs"]
        kls[k] = float(masked_mean(top_k_reverse_kl(ours, scored["teacher_top_k_log_probs"], mask), mask))
    assert kls[teacher.config.vocab_size] == pytest.approx(exact, rel=1e-4, abs=1e-6), (kls, exact)
    assert 0 < kls[16] < exact


def test_a_distillation_run_resumes_exactly(runs):
    """Iterations 3 and 4 of the resumed run equal the uninterrupted run's, metric for metric (timings aside)."""
    assert len(runs.b2) == 2
    for a, b in zip(runs.records_a[-2:], runs.b2, strict=True):
        keep = sorted(k for k in a if not k.startswith(VOLATILE))
        assert {k: a[k] for k in keep} == {k: b[k] for k in keep}


# ---------------------------------------------------------------------------------------------------- the flow


def test_the_teacher_in_a_pool_of_its_own_trains_the_actor_by_its_loss(prefect_api, tmp_path, tiny_model_dir):
    """The Prefect flow with the teacher in a pool of its own and the KL as the actor's loss (``teacher.top_k=8``,
    combined with the task reward): the teacher's support travels to the actor's pool, the run completes, the
    placement records the teacher's pool, the distillation loss is in every update's metrics and positive (a KL;
    the models differ), the advantages are the task's alone (reward/score trains, distill/* reported from the old
    log-probs)."""
    from hybridflow.flows.rlhf import rlhf_flow
    from hybridflow.flows.store.run_store import RunStore

    teacher = trained_teacher(tiny_model_dir, tmp_path)
    pools = "{actor_rollout_ref: {roles: [actor, rollout, reward]}, teacher: {roles: [teacher]}}"
    extra = [f"teacher.model_path={teacher}", "teacher.use_as=loss", "teacher.kl_coef=0.5", "teacher.top_k=8"]
    extra += [f"placement.pools={pools}"]
    extra += ["trainer.total_iterations=2", "trainer.num_threads=1", "actor.recompute_log_prob=true"]
    cfg = tiny_run_config(tmp_path, tiny_model_dir, "grpo", extra)
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = store.create_run(cfg.model_dump(mode="json"), "distil")
    rlhf_flow(run_id=run_id, db_url=store.url)
    assert store.get_run(run_id).status == "completed"
    placed = {p.role: p.group_name for p in store.placements(run_id)}
    assert placed["teacher"] == "teacher" and placed["actor"] == "actor_rollout_ref"
    metrics = metrics_by_step(store, run_id)
    for step in (1, 2):
        assert metrics[step]["actor/distill_loss"] > 0 and metrics[step]["distill/reverse_kl"] != 0
        assert "timing_s/teacher" in metrics[step]


# ---------------------------------------------------------------------------------------------------- several teachers


def two_source_prompts(path: Path, rows: int = 16) -> Path:
    """A verl-layout prompt file whose rows alternate between two data sources, ``math`` and ``code``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = [
        {
            "data_source": "math" if i % 2 == 0 else "code",
            "prompt": [{"role": "user", "content": f"What is {i} + {i + 1}?"}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {"index": i},
        }
        for i in range(rows)
    ]
    pq.write_table(pa.Table.from_pylist(table), path)
    return path


def test_several_teachers_score_each_row_with_the_teacher_of_its_data_source(runs, tiny_model_dir):
    """``teacher.routes``: rows of data source ``math`` get the trained teacher's log-probs (and top-k support),
    rows of ``code`` the untrained model's, each equal to what that teacher alone gives the row; a data source
    without a teacher is refused naming it."""
    import numpy as np

    from hybridflow.engine.backends.actor import RefPolicy
    from hybridflow.engine.backends.teachers import RoutedTeachers

    batch, teacher, student = sampled(runs, tiny_model_dir)
    rows = len(batch)
    batch.non_tensor_batch["data_source"] = np.array(["math", "math", "code", "code"] * (rows // 4), dtype=object)
    alone = {
        "math": RefPolicy(teacher, 3, column="teacher_log_prob", top_k=4),
        "code": RefPolicy(student, 3, column="teacher_log_prob", top_k=4),
    }
    routed = RoutedTeachers(alone, "data_source").compute_ref_log_prob(batch).batch
    for source, scorer in alone.items():
        own = scorer.compute_ref_log_prob(batch).batch
        picked = torch.as_tensor(np.flatnonzero(batch.non_tensor_batch["data_source"] == source))
        for key in ("teacher_log_prob", "teacher_top_k_log_probs"):
            torch.testing.assert_close(routed[key][picked], own[key][picked], rtol=1e-5, atol=1e-5)
        assert torch.equal(routed["teacher_top_k_ids"][picked], own["teacher_top_k_ids"][picked])
    mask = batch.batch["response_mask"].bool()
    assert not torch.allclose(routed["teacher_log_prob"][0][mask[0]], routed["teacher_log_prob"][2][mask[2]])
    batch.non_tensor_batch["data_source"][0] = "poetry"
    with pytest.raises(ValueError, match=r"teacher.routes has no teacher for data_source 'poetry'"):
        RoutedTeachers(alone, "data_source").compute_ref_log_prob(batch)


def test_a_run_distils_from_two_teachers_routed_by_data_source(runs, tmp_path, tiny_model_dir):
    """A run over prompts of two data sources with a teacher for each (``teacher.routes``) trains 2 iterations
    with the distillation reward; its teacher role holds both teachers; a prompt file with a data source that has
    no teacher is refused before any work, naming the source, its rows and the key to add."""
    from hybridflow.flows.preflight import InputError, check_run_inputs

    prompts = two_source_prompts(tmp_path / "two.parquet")
    routes = f"teacher.routes={{math: {runs.teacher}, code: {tiny_model_dir}}}"
    extra = [f"data.train_files=[{prompts}]", "data.reasoning_gym=null", "trainer.total_iterations=2", routes]
    cfg = tiny_run_config(tmp_path, tiny_model_dir, "grpo", extra)
    check_run_inputs(cfg)
    assert cfg.roles()[-1] == "teacher"
    trainer = SingleProcessTrainer(cfg)
    records = []
    trainer.fit(log=records.append)
    assert sorted(trainer.worker.teacher.teachers) == ["code", "math"]
    trained = [r for r in records if "actor/pg_loss" in r]
    assert len(trained) == 2 and all(r["distill/reverse_kl"] != 0 for r in trained)
    one_teacher = tiny_run_config(
        tmp_path, tiny_model_dir, "grpo", [*extra[:3], f"teacher.routes={{math: {runs.teacher}}}"]
    )
    with pytest.raises(InputError, match=r"data_source values 'code' \(8 rows\) have no teacher .* teacher.routes"):
        check_run_inputs(one_teacher)
    with pytest.raises(ConfigError, match=r"teacher.model_path .* and teacher.routes .* give one of them"):
        tiny_run_config(tmp_path, tiny_model_dir, "grpo", [routes, f"teacher.model_path={tiny_model_dir}"])
