"""DPO (``hf dpo train``): the loss and its metrics against hand-computed values and TRL's definitions, the pairs'
token layout (the response's tokens after the prompt's, masked), and ``hf dpo train`` end to end on the tiny model
(real CLI, Prefect server, SQLite store, two ranks, the policy sharded by FSDP): the held-out implicit reward's
pairwise accuracy rises on a separable set, the run is on record as kind ``dpo``, and ``hf resume -o
trainer.total_epochs=2`` continues it as an uninterrupted 2-epoch ddp run does, step for step."""

import math
from pathlib import Path

import pytest
import torch
import yaml
from test_rm_training import _jsonl, _pairs
from tiny_runs import hf_cli, metrics_by_step
from transformers import AutoTokenizer

from hybridflow.engine.config import ConfigError, DPOTrainingConfig, load_config
from hybridflow.engine.dpo.loss import dpo_loss, reward_metrics, sequence_log_probs
from hybridflow.engine.dpo.pairs import collate_dpo_pairs, pair_token_ids, prompt_text
from hybridflow.engine.models import load_model
from hybridflow.engine.protocol import DataProto
from hybridflow.flows.store.run_store import RunStore

FSDP_REL = 2e-4
"""How far an fsdp run's metrics may be from ddp's, relative: the same gradients, averaged in another order
(measured: at most 4e-5 over the 16 steps of the test below, and 45 of its 48 figures not bit-equal)."""


def test_the_dpo_and_ipo_losses_and_their_rewards_by_hand():
    pc, pr, rc, rr = (torch.tensor([x]) for x in (-10.0, -12.0, -11.0, -11.0))  # h = 2
    out = dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert out.losses.item() == pytest.approx(math.log(1 + math.exp(-0.2)), rel=1e-6)  # -log sigmoid(0.2)
    smoothed = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.1).losses.item()
    assert smoothed == pytest.approx(0.9 * math.log(1 + math.exp(-0.2)) + 0.1 * math.log(1 + math.exp(0.2)))
    assert dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="ipo").losses.item() == pytest.approx((2 - 5) ** 2)
    assert out.chosen_rewards.item() == pytest.approx(0.1) and out.rejected_rewards.item() == pytest.approx(-0.1)
    metrics = reward_metrics(torch.tensor([0.1, -0.3]), torch.tensor([-0.1, 0.2]))
    assert metrics == pytest.approx(
        {"rewards/chosen": -0.1, "rewards/rejected": 0.05, "rewards/margins": -0.15, "rewards/accuracies": 0.5}
    )
    with pytest.raises(ValueError, match="dpo.loss_type='kto' is not a loss here"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="kto")


def test_the_loss_is_trls_on_random_pairs_and_its_gradient_flows_to_the_policy_only():
    """TRL's ``DPOTrainer.dpo_loss`` (sigmoid: ``-logsigmoid(beta * logits) * (1 - ls) - logsigmoid(-beta * logits)
    * ls`` with ``logits = (pi_w - pi_l) - (ref_w - ref_l)``; ipo: ``(logits - 1 / (2 * beta)) ** 2``), written out
    here independently."""
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(64, generator=g, dtype=torch.float64) * 5 - 30 for _ in range(4))
    pc.requires_grad_(True)
    logits = (pc - pr) - (rc - rr)
    for beta, smoothing in ((0.1, 0.0), (0.5, 0.2)):
        trl = -torch.nn.functional.logsigmoid(beta * logits) * (1 - smoothing)
        trl = trl - torch.nn.functional.logsigmoid(-beta * logits) * smoothing
        ours = dpo_loss(pc, pr, rc, rr, beta, "sigmoid", smoothing).losses
        torch.testing.assert_close(ours, trl.float(), rtol=1e-6, atol=1e-6)
    ipo = dpo_loss(pc, pr, rc, rr, 0.25, "ipo").losses
    torch.testing.assert_close(ipo, ((logits - 2.0) ** 2).float(), rtol=1e-6, atol=1e-5)
    ipo.mean().backward()
    assert pc.grad is not None and pc.grad.abs().sum() > 0
    summed, mean = sequence_log_probs(torch.tensor([[9.0, -1.0, -2.0, -3.0]]), torch.tensor([[1, 0, 1, 1]]))
    assert summed.item() == -5.0 and mean.item() == -2.5  # position 0 predicts nothing; the prompt is not scored


def test_a_pairs_response_tokens_follow_its_prompts_and_only_they_are_scored(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = {"prompt": [{"role": "user", "content": "Is it good?"}], "chosen": "It is good.", "rejected": "No."}
    plain = {"prompt": "Q: 2+2? A:", "chosen": " 4", "rejected": " 5"}
    batch = collate_dpo_pairs([chat, plain], tokenizer, 512).batch
    for i, row in enumerate((chat, plain)):
        head = tokenizer(prompt_text(row["prompt"], tokenizer), add_special_tokens=False)["input_ids"]
        for side in ("chosen", "rejected"):
            ids, mask = batch[f"{side}_input_ids"][i], batch[f"{side}_loss_mask"][i].bool()
            real = batch[f"{side}_attention_mask"][i].bool()
            assert ids[: len(head)].tolist() == head and not mask[: len(head)].any()
            response = tokenizer.decode(ids[mask])
            assert response.startswith(row[side]) and (mask == (real & (torch.arange(len(ids)) >= len(head)))).all()
    assert tokenizer.decode(batch["chosen_input_ids"][0][batch["chosen_loss_mask"][0].bool()]).endswith("<|im_end|>\n")
    long = {"prompt": "x " * 300, "chosen": "y " * 300, "rejected": "z"}
    (chosen, kept), (rejected, kept_rejected) = pair_token_ids(long, tokenizer, 64)
    assert len(chosen) == 64 and kept == 32  # the prompt keeps its end (half the room), the response its start
    assert kept_rejected == len(rejected) - 1 and len(rejected) <= 64  # a short response leaves the prompt more


def test_dpo_configs_refuse_what_they_do_not_carry(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", _pairs(8, seed=0))
    with pytest.raises(ConfigError, match="dpo.loss_type"):
        load_config(None, [f"data.train_files={train}", "dpo.loss_type=kto"], DPOTrainingConfig)


def _config(tmp_path: Path, tiny_model_dir: Path, *extra: str) -> DPOTrainingConfig:
    train = _jsonl(tmp_path / "train.jsonl", _pairs(64, seed=0))
    val = _jsonl(tmp_path / "val.jsonl", _pairs(32, seed=1))
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            f"data.train_files={train}",
            f"data.val_files={val}",
            "data.train_batch_size=8",
            "data.micro_batch_size=2",
            "optim.lr=1e-3",
            "dpo.beta=0.5",
            "trainer.num_threads=1",
            "placement.tasks_per_node=2",
            f"trainer.output_dir={tmp_path / 'out'}",
            *extra,
        ],
        DPOTrainingConfig,
    )


def test_hf_dpo_train_under_fsdp_raises_held_out_accuracy_and_resumes_as_the_ddp_run_trains(
    prefect_api, tmp_path, tiny_model_dir
):
    """``hf dpo train -o model.strategy=fsdp`` (the policy's weights and Adam states sharded over the two ranks) and
    its ``hf resume`` train step for step as the uninterrupted 2-epoch ddp run does (within float rounding: the
    gradients are averaged by a reduce-scatter instead of an all-reduce), and its result is a whole model."""
    from hybridflow.flows.dpo import dpo_flow

    (tmp_path / "ref").mkdir()  # the uninterrupted 2-epoch ddp run, in process
    reference_cfg = _config(tmp_path / "ref", tiny_model_dir, "trainer.total_epochs=2")
    reference_store = RunStore(f"sqlite:///{tmp_path / 'ref' / 'runs.db'}")
    reference_id = reference_store.create_run(reference_cfg.model_dump(mode="json"), "dpo", kind="dpo")
    dpo_flow(run_id=reference_id, db_url=reference_store.url)
    reference = metrics_by_step(reference_store, reference_id)

    cfg = _config(tmp_path, tiny_model_dir, "trainer.total_epochs=1", "model.strategy=fsdp")
    config_file = tmp_path / "dpo.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    trained = hf_cli(prefect_api, "dpo", "train", str(config_file), "--db", db)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    store = RunStore(db)
    [run] = store.list_runs()
    assert run.kind == "dpo" and run.status == "completed"
    metrics = metrics_by_step(store, run.id)
    assert sorted(metrics) == list(range(9))  # step 0: the initial policy's evaluation; 8 steps of 8 pairs
    assert metrics[0]["val/loss"] == pytest.approx(math.log(2), rel=1e-5)  # the policy is the reference
    assert metrics[0]["val/rewards/accuracies"] == 0.0 and metrics[0]["val/rewards/margins"] == 0.0
    assert metrics[8]["val/rewards/accuracies"] >= 0.9 and metrics[8]["val/loss"] < 0.5, metrics[8]
    assert metrics[8]["val/logps/accuracies"] > metrics[0]["val/logps/accuracies"]  # the policy's own preference
    assert metrics[8]["val/rewards/margins"] > 0
    [placed] = store.placements(run.id)
    assert placed.role == "actor" and placed.parallel["strategy"] == "fsdp", placed.parallel
    for name in ("train/loss", "train/rewards/chosen", "train/rewards/accuracies", "train/logps/chosen"):
        assert name in metrics[1]
    folder = Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name / run.id / "model"
    assert f"model.path={folder.resolve()}" in " ".join(trained.stdout.split())

    resumed = hf_cli(prefect_api, "resume", run.id, "--db", db, "-o", "trainer.total_epochs=2")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    metrics = metrics_by_step(store, run.id)
    assert sorted(metrics) == list(range(17)) and [c.step for c in store.checkpoints(run.id)] == [8, 16]
    compared = [
        (step, name) for step in range(1, 17) for name in ("train/loss", "train/rewards/margins", "train/grad_norm")
    ]
    for step, name in compared:  # the same run as the uninterrupted ddp one, step for step
        assert metrics[step][name] == pytest.approx(reference[step][name], rel=FSDP_REL, abs=1e-6), (step, name)
    assert any(metrics[step][name] != reference[step][name] for step, name in compared)  # sharded: another sum order
    assert metrics[16]["val/rewards/accuracies"] == pytest.approx(reference[16]["val/rewards/accuracies"])
    whole = load_model(folder, torch.float32, "cpu")  # gathered from the shards: every weight at its full shape
    initial = load_model(tiny_model_dir, torch.float32, "cpu")
    shapes = {name: tensor.shape for name, tensor in initial.state_dict().items()}
    assert {name: tensor.shape for name, tensor in whole.state_dict().items()} == shapes
    assert any(not torch.equal(whole.state_dict()[name], t) for name, t in initial.state_dict().items())


def test_lora_dpo_trains_the_adapter_alone_against_the_base_model_and_resumes_exactly(
    prefect_api, tmp_path, tiny_model_dir
):
    """``model.lora_rank=8`` on two fsdp ranks (the adapter sharded with the frozen base): the reference is the policy
    with its adapter disabled (no second model: at step 0 the loss is log 2 exactly), only the adapter trains (the
    placement's trainable parameters; every base weight of the result unchanged), the held-out accuracy rises, the
    result is the adapter in PEFT's layout, and a run resumed after its first epoch trains its second as the
    uninterrupted 2-epoch run does, step for step."""
    from peft import PeftModel
    from test_lora import _adapter_bytes

    from hybridflow.engine.backends.lora import ADAPTER_WEIGHTS
    from hybridflow.flows.dpo import dpo_flow

    lora = ["model.lora_rank=8", "model.lora_alpha=16", "optim.lr=1e-2", "model.strategy=fsdp"]
    runs = {}
    for name, epochs in (("whole", 2), ("cut", 1)):
        (tmp_path / name).mkdir()
        cfg = _config(tmp_path / name, tiny_model_dir, *lora, f"trainer.total_epochs={epochs}")
        store = RunStore(f"sqlite:///{tmp_path / name / 'runs.db'}")
        run_id = store.create_run(cfg.model_dump(mode="json"), "dpo-lora", kind="dpo")
        dpo_flow(run_id=run_id, db_url=store.url)
        runs[name] = (cfg, store, run_id)
    cfg, store, run_id = runs["cut"]
    metrics = metrics_by_step(store, run_id)
    assert metrics[0]["val/loss"] == pytest.approx(math.log(2), rel=1e-6)  # the adapter starts as the identity
    assert metrics[8]["val/rewards/accuracies"] >= 0.9, metrics[8]
    [placed] = store.placements(run_id)
    assert placed.parallel["strategy"] == "fsdp"
    base = load_model(tiny_model_dir, torch.float32, "cpu")
    adapter = _adapter_bytes(base, 8) // 4  # fp32 elements of a rank-8 adapter on every decoder linear layer
    assert placed.parallel["trainable_params"] == adapter
    assert placed.parallel["params"] == sum(p.numel() for p in base.parameters()) + adapter
    folder = Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name / run_id / "model"
    assert (folder / ADAPTER_WEIGHTS).is_file() and not (folder / "model.safetensors").exists()
    trained = PeftModel.from_pretrained(load_model(tiny_model_dir, torch.float32, "cpu"), str(folder))
    names = {k: k.replace("base_model.model.", "").replace(".base_layer", "") for k in trained.state_dict()}
    weights = {names[k]: v for k, v in trained.state_dict().items()}
    assert all(torch.equal(weights[name], tensor) for name, tensor in base.state_dict().items())

    cfg, store, run_id = runs["cut"]  # the second epoch, resumed from the first's checkpoint
    resumed = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"total_epochs": 2})})
    store.update_config(run_id, resumed.model_dump(mode="json"))
    dpo_flow(run_id=run_id, db_url=store.url)
    whole = metrics_by_step(runs["whole"][1], runs["whole"][2])
    metrics = metrics_by_step(store, run_id)
    for step in range(9, 17):
        for name in ("train/loss", "train/rewards/margins", "train/grad_norm"):
            assert metrics[step][name] == pytest.approx(whole[step][name], rel=1e-5, abs=1e-7), (step, name)


PRECOMPUTED_REL = 1e-4
"""How far a run on precomputed reference log-probs may be from one running the reference each step, relative: the
reference scored the pairs in held-out-sized batches, padded to other widths than a step's (measured: at most 1.7e-5
over the 50 figures compared below)."""
PRECOMPUTED_NAMES = ("train/loss", "train/rewards/margins", "train/grad_norm", "val/rewards/margins")


def _independent_reference_scores(model_dir: Path, rows: list, max_length: int) -> torch.Tensor:
    """Each pair's chosen and rejected summed response log-probability under the model at `model_dir`, float32
    [pairs, 2], one pair at a time with no padding (log-softmax over the vocabulary, in the test)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, torch.float32, "cpu").eval()
    out = []
    with torch.no_grad():
        for row in rows:
            sums = []
            for ids, prompt in pair_token_ids(row, tokenizer, max_length):
                logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
                token = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
                sums.append(token[prompt - 1 :].sum() if prompt else token.sum())
            out.append(torch.stack(sums))
    return torch.stack(out)


def test_precomputed_reference_log_probs_train_as_the_live_reference_and_are_read_back_on_resume(
    prefect_api, tmp_path, tiny_model_dir, caplog
):
    """``dpo.precompute_ref_log_probs=true``: before the first step every training and held-out pair is scored once
    under the reference (the run folder's files equal an independent computation), the reference is then freed on
    each rank (no step or evaluation can run it: a batch without the scores raises), the run trains step for step as
    one that runs the reference every step, and a run resumed after its first epoch reads the scores back (the files
    untouched) and trains its second epoch as the uninterrupted run does."""
    import logging

    from hybridflow.flows.dpo import REFERENCE_DIR, dpo_flow
    from hybridflow.flows.preflight import preference_sets

    runs, freed = {}, {}
    for name, epochs, extra in (("live", 2, []), ("pre", 1, ["dpo.precompute_ref_log_probs=true"])):
        (tmp_path / name).mkdir()
        cfg = _config(tmp_path / name, tiny_model_dir, f"trainer.total_epochs={epochs}", *extra)
        store = RunStore(f"sqlite:///{tmp_path / name / 'runs.db'}")
        run_id = store.create_run(cfg.model_dump(mode="json"), f"dpo-{name}", kind="dpo")
        dpo_logger = logging.getLogger("hybridflow.flows.dpo")
        level, dpo_logger.level = dpo_logger.level, logging.INFO
        dpo_logger.addHandler(caplog.handler)  # also where the logger does not propagate (its record once per handler)
        caplog.clear()
        try:
            dpo_flow(run_id=run_id, db_url=store.url)
        finally:
            dpo_logger.removeHandler(caplog.handler)
            dpo_logger.setLevel(level)
        runs[name] = (cfg, store, run_id)
        freed[name] = {r.getMessage() for r in caplog.records if "reference is freed" in r.getMessage()}
    cfg, store, run_id = runs["pre"]
    base = load_model(tiny_model_dir, torch.float32, "cpu")
    params = sum(p.numel() for p in base.parameters())
    assert freed == {"live": set(), "pre": {f"the reference is freed on every rank ({params} parameters each)"}}
    folder = Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name / run_id / REFERENCE_DIR
    sets = preference_sets(cfg)
    stamps = {}
    for split, rows in (("train", sets.train), ("val", sets.val)):
        saved = DataProto.load(folder / f"{split}.safetensors")
        assert len(saved) == len(rows) and saved.meta_info["rows"] == len(rows)
        scores = torch.stack([saved.batch["ref_chosen_logps"], saved.batch["ref_rejected_logps"]], -1)
        expected = _independent_reference_scores(tiny_model_dir, rows, cfg.data.max_length)
        torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-4)
        stamps[split] = (folder / f"{split}.safetensors").stat().st_mtime_ns
    metrics = metrics_by_step(store, run_id)
    assert metrics[0]["val/loss"] == pytest.approx(math.log(2), rel=1e-6)  # the policy is the reference, exactly

    resumed = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"total_epochs": 2})})
    store.update_config(run_id, resumed.model_dump(mode="json"))
    dpo_flow(run_id=run_id, db_url=store.url)
    assert {split: (folder / f"{split}.safetensors").stat().st_mtime_ns for split in stamps} == stamps
    live = metrics_by_step(runs["live"][1], runs["live"][2])
    metrics = metrics_by_step(store, run_id)
    assert sorted(metrics) == sorted(live) == list(range(17))
    compared = [(step, name) for step in range(1, 17) for name in PRECOMPUTED_NAMES if name in live[step]]
    worst = max(abs(metrics[s][n] - live[s][n]) / max(abs(live[s][n]), 1e-6) for s, n in compared)
    print(f"precomputed vs live reference: worst relative difference {worst:.2e} over {len(compared)} figures")
    assert worst <= PRECOMPUTED_REL, worst
    assert metrics[16]["val/rewards/accuracies"] >= 0.9
