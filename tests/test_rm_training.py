"""Reward-model training: the Bradley-Terry loss against hand-computed values, the preference layout and its errors,
a DP=2 update equal to DP=1 (real worker groups, gloo), and `hf rm train` end to end on the tiny model (real CLI,
Prefect server, SQLite store): held-out pairwise accuracy rises on a separable synthetic set, the run is on record
as kind ``rm``, `hf resume -o trainer.total_epochs=2` continues it exactly as an uninterrupted 2-epoch run, and the
result loads as a reward model."""

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tiny_runs import hf_cli, metrics_by_step, rank_pids, worker_group
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hybridflow.engine.config import ConfigError, RMTrainingConfig, load_config
from hybridflow.engine.epochs import epoch_batches
from hybridflow.engine.reward.preference import collate_pairs, load_preference_rows, pair_texts
from hybridflow.engine.reward.reward_model import load_reward_model, score_texts
from hybridflow.engine.reward.rm_training import bradley_terry_loss
from hybridflow.flows.store.run_store import RunStore

HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
WORDS = ["apple", "river", "stone", "cloud", "table", "green", "light", "music", "paper", "window", "garden"]


def _pairs(count: int, seed: int) -> list[dict]:
    """Separable pairs: random filler, then "so it is good." (chosen) or "so it is bad." (rejected). The filler
    differs within a pair, so an untrained model prefers either side about as often."""
    rng = random.Random(seed)

    def text(word: str) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) + f", so it is {word}."

    prompts = [[{"role": "user", "content": f"Describe item {i}."}] for i in range(count)]
    return [{"prompt": p, "chosen": text("good"), "rejected": text("bad")} for p in prompts]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path: Path, tiny_model_dir: Path, *extra: str) -> RMTrainingConfig:
    train = _jsonl(tmp_path / "train.jsonl", _pairs(64, seed=0))
    val = _jsonl(tmp_path / "val.jsonl", _pairs(32, seed=1))
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files={train}",
            f"data.val_files={val}",
            "data.train_batch_size=8",
            "data.micro_batch_size=4",
            "optim.lr=1e-3",
            "trainer.num_threads=1",
            f"trainer.output_dir={tmp_path / 'out'}",
            *extra,
        ],
        RMTrainingConfig,
    )


def test_bradley_terry_loss_by_hand():
    chosen = torch.tensor([2.0, 0.0], requires_grad=True)
    rejected = torch.tensor([0.0, 1.0])
    loss = bradley_terry_loss(chosen, rejected)
    assert float(loss.detach()) == pytest.approx((math.log1p(math.exp(-2.0)) + math.log1p(math.exp(1.0))) / 2, rel=1e-6)
    loss.backward()
    # d/dc of -log sigmoid(c - r) / N = -(1 - sigmoid(c - r)) / N: raising the chosen score lowers the loss
    assert chosen.grad.tolist() == pytest.approx([-(1 - 1 / (1 + math.exp(-2))) / 2, -(1 - 1 / (1 + math.exp(1))) / 2])


def test_preference_layouts_and_their_errors(tmp_path, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [
        {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "5"},
        {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
         "rejected": [{"role": "assistant", "content": "5"}]},
        {"prompt": "Q: 2+2? A:", "chosen": " 4", "rejected": " 5"},
        {"chosen": "all of it", "rejected": "none"},
    ]  # fmt: skip
    loaded = load_preference_rows(_jsonl(tmp_path / "p.jsonl", rows))
    conversational = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], tokenize=False
    )
    assert pair_texts(loaded[0], tokenizer)[0] == conversational == pair_texts(loaded[1], tokenizer)[0]
    assert pair_texts(loaded[2], tokenizer) == ("Q: 2+2? A: 4", "Q: 2+2? A: 5")
    assert pair_texts(loaded[3], tokenizer) == ("all of it", "none")
    batch = collate_pairs(loaded, tokenizer, max_length=5)
    assert batch.batch["chosen_input_ids"].shape[1] <= 5  # each text keeps its last 5 tokens
    tail = tokenizer("all of it", add_special_tokens=False)["input_ids"][-5:]
    assert batch.batch["chosen_input_ids"][3, : len(tail)].tolist() == tail  # the end is kept, right-padded

    bad = [
        ([{"chosen": "a"}], "needs columns chosen and rejected"),
        ([{"chosen": "a", "rejected": 3}], "column 'rejected' is int, not a string or a chat list"),
        ([{"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}], "a string prompt"),
    ]
    for i, (content, message) in enumerate(bad):
        with pytest.raises(ValueError, match=message):
            load_preference_rows(_jsonl(tmp_path / f"bad{i}.jsonl", content))
    with pytest.raises(FileNotFoundError, match="check data.train_files"):
        load_preference_rows(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match=r"data.train_batch_size \(6 pairs\) must be a multiple of the group's 4"):
        _config(tmp_path, tiny_model_dir, "data.train_batch_size=6", "placement.tasks_per_node=4")
    orders = [epoch_batches(10, 4, epoch, seed=0, shuffle=True) for epoch in (0, 0, 1)]
    assert [len(o) for o in orders] == [2, 2, 2] and all(len(b) == 4 for b in orders[0])  # the last 2 are dropped
    assert [b.tolist() for b in orders[0]] == [b.tolist() for b in orders[1]] != [b.tolist() for b in orders[2]]


def test_dp2_update_equals_dp1(tmp_path, tiny_model_dir):
    from hybridflow.flows.rm import RM_WORKER_CLS
    from hybridflow.slurm.channel import create_secret
    from hybridflow.slurm.handles import DataHandle

    cfg = _config(tmp_path, tiny_model_dir, "data.micro_batch_size=2")
    create_secret(tmp_path / "secret")
    rows = load_preference_rows(tmp_path / "train.jsonl")[:8]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = DataHandle.put(collate_pairs(rows, tokenizer, 512), tmp_path / "data")
    metrics, weights = {}, {}
    for ranks in (1, 2):
        group = worker_group(tmp_path, f"rm{ranks}", RM_WORKER_CLS, ranks, cfg, ["reward_model"])
        try:
            group.init_model()
            if ranks == 1:
                (tmp_path / "before").mkdir()
                group.save_checkpoint_part(str(tmp_path / "before"))
            metrics[ranks] = group.update_reward_model(pairs)
            folder = tmp_path / f"after{ranks}"
            folder.mkdir()
            assert group.save_checkpoint_part(str(folder)) == ["reward_model"]
            weights[ranks] = load_file(folder / "reward_model" / "model.safetensors")
        finally:
            group.shutdown()
    assert len(metrics[2]) == 2
    # one gradient for the step's 8 pairs: the same norm on both ranks as on one rank
    assert [m["rm/grad_norm"] for m in metrics[2]] == pytest.approx([metrics[1][0]["rm/grad_norm"]] * 2, rel=1e-5)
    mean2 = {k: sum(m[k] for m in metrics[2]) / 2 for k in ("rm/loss", "rm/acc", "rm/margin")}
    for key, value in mean2.items():  # the flow's average of the ranks' equal shares = the whole step's
        assert value == pytest.approx(metrics[1][0][key], rel=1e-5, abs=1e-7), key
    initial = load_file(tmp_path / "before" / "reward_model" / "model.safetensors")
    moved = max((weights[1][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4 and "score.weight" in initial, "the update did not move the weights: nothing compared"
    for name, tensor in weights[1].items():
        torch.testing.assert_close(weights[2][name], tensor, rtol=0, atol=5e-5, msg=name)


def test_hf_rm_train_raises_held_out_accuracy_resumes_exactly_and_recovers_a_killed_rank_by_itself(
    prefect_api, tmp_path, tiny_model_dir
):
    from hybridflow.flows.rm import rm_flow

    # the uninterrupted 2-epoch run, in process
    (tmp_path / "ref").mkdir()
    reference_cfg = _config(tmp_path / "ref", tiny_model_dir, "trainer.total_epochs=2")
    reference_store = RunStore(f"sqlite:///{tmp_path / 'ref' / 'runs.db'}")
    reference_id = reference_store.create_run(reference_cfg.model_dump(mode="json"), "rm", kind="rm")
    rm_flow(run_id=reference_id, db_url=reference_store.url)
    reference = metrics_by_step(reference_store, reference_id)

    # hf rm train for 1 epoch, then hf resume for a second one
    cfg = _config(tmp_path, tiny_model_dir, "trainer.total_epochs=1")
    config_file = tmp_path / "rm.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    trained = hf_cli(prefect_api, "rm", "train", str(config_file), "--db", db)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    store = RunStore(db)
    [run] = store.list_runs()
    assert run.kind == "rm" and run.status == "completed"
    metrics = metrics_by_step(store, run.id)
    assert sorted(metrics) == list(range(9))  # step 0: the initial model's evaluation; 8 steps of 8 pairs
    before, after = metrics[0]["val/rm/acc"], metrics[8]["val/rm/acc"]
    assert before < 0.8 and after >= 0.9, (before, after)  # measured: 0.66 -> 0.97
    assert metrics[8]["val/rm/margin"] > metrics[0]["val/rm/margin"] + 1.0
    assert {p.role for p in store.placements(run.id)} == {"reward_model"}
    assert [c.step for c in store.checkpoints(run.id)] == [8]
    folder = Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name / run.id / "reward_model"
    assert f"reward_model.path={folder.resolve()}" in " ".join(trained.stdout.split())

    # hf resume for a second epoch, its rank SIGKILLed inside it: the flow recovers by itself (no second hf resume)
    # from global_step_8, on record, and trains the uninterrupted run's steps
    args = ["resume", run.id, "--db", db, "-o", "trainer.total_epochs=2", "-o", "trainer.recovery_backoff_s=0"]
    resumed = subprocess.Popen(
        [HF, *args, "--prefect-api", prefect_api], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    while not any(i.step >= 10 for i in store.iterations(run.id)):
        assert resumed.poll() is None, resumed.stdout.read()
        time.sleep(0.05)
    [pid] = rank_pids(run.id, "reward_model")
    os.kill(pid, signal.SIGKILL)
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, output
    assert "resuming" in output and "from step 8" in output
    assert "recovering by itself (1 of 2, trainer.max_recoveries)" in output, output
    [recovery] = store.recoveries(run.id)
    assert recovery.group_name == "reward_model" and recovery.resumed_from == 8 and 10 <= recovery.step <= 16
    assert f"pid {pid}) was killed by SIGKILL" in recovery.cause
    metrics = metrics_by_step(store, run.id)
    assert sorted(metrics) == list(range(17)) and [c.step for c in store.checkpoints(run.id)] == [8, 16]
    for step in range(1, 17):  # the same run as the uninterrupted one, step for step
        for name in ("rm/loss", "rm/acc", "rm/margin", "rm/grad_norm"):
            assert metrics[step][name] == pytest.approx(reference[step][name], rel=1e-6, abs=1e-9), (step, name)
    assert metrics[16]["val/rm/acc"] == pytest.approx(reference[16]["val/rm/acc"])

    # the result is a reward model: AutoModelForSequenceClassification and reward_model.path load it
    assert not (folder / "optim.pt").exists()
    AutoModelForSequenceClassification.from_pretrained(folder)
    model, tokenizer = load_reward_model(folder)
    pair = load_preference_rows(tmp_path / "val.jsonl")[0]
    chosen, rejected = score_texts(model, tokenizer, list(pair_texts(pair, tokenizer)), 512, 2).tolist()
    assert chosen > rejected


def test_hf_rm_train_on_slurm_with_two_ranks(slurm_cluster, prefect_api, tmp_path, tiny_model_dir):
    """The same training as a Slurm job of 2 data-parallel ranks (``--executor slurm``): it completes, its placement
    names the job and both ranks, Slurm's accounting has the job completed, and it learns as on one local rank."""
    cfg = _config(tmp_path, tiny_model_dir, "placement.tasks_per_node=2", "placement.slurm.time_min=30")
    config_file = tmp_path / "rm.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    log = tmp_path / "rm.log"
    with log.open("wb") as out:  # a file, not a pipe: no Slurm-side process holds the test's pipe open
        code = subprocess.run(
            [HF, "rm", "train", str(config_file), "--executor", "slurm", "--db", db, "--prefect-api", prefect_api],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=600,
        ).returncode
    assert code == 0, log.read_text()
    store = RunStore(db)
    [run] = store.list_runs()
    assert run.kind == "rm" and run.status == "completed"
    [placed] = store.placements(run.id)
    assert (placed.role, placed.executor, placed.ranks) == ("reward_model", "slurm", [0, 1]) and placed.slurm_job_id
    accounting = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobID,JobName,State", "-j", placed.slurm_job_id],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"{placed.slurm_job_id}|hybridflow-reward_model|COMPLETED" in accounting
    metrics = metrics_by_step(store, run.id)
    assert metrics[0]["val/rm/acc"] < 0.8 and metrics[8]["val/rm/acc"] >= 0.9
    assert (Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name / run.id / "reward_model").is_dir()
