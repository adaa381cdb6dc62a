"""Checkpoints: exact resume of the single-process trainer, atomic and verifiable folders, Hugging Face layout.

Each variant trains the tiny random model three ways (module-scoped, shared by the tests):
A runs 3 iterations uninterrupted with ``save_freq=2``; B1 runs 1 iteration (saved at the end of fit); B2 is a new
trainer that resumes from B1's checkpoint and runs iterations 2 and 3. The variants cover GRPO with the KL loss,
entropy bonus, LR warm-up and *sampled* validation (resumed with ``resume_from=auto``), and PPO with GAE, a critic
and an adaptive in-reward KL coefficient (resumed from an explicit folder), and multi-turn agent trajectories with
DAPO's dynamic sampling.
"""

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_runs import agent_overrides, tiny_run_config
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from hybridflow.engine.checkpoint import (
    CheckpointError,
    begin_checkpoint,
    finish_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    role_states,
    save_checkpoint,
    save_role,
    verify_checkpoint,
)
from hybridflow.engine.disk_space import format_bytes, safetensors_bytes, torch_save_bytes
from hybridflow.engine.trainer import SingleProcessTrainer

VARIANTS = {
    "grpo": (
        "grpo",
        [
            "actor.use_kl_loss=true",
            "actor.entropy_coeff=0.001",
            "actor.optim.warmup_steps=4",
            "rollout.val_temperature=1.0",
        ],
        "auto",
    ),
    "gae": (
        "gae",
        [
            "algorithm.gamma=0.99",
            "algorithm.lam=0.95",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.horizon=100",
            "critic.optim.warmup_steps=4",
        ],
        "path",
    ),
    # multi-turn agent trajectories (tool turns between the model's, issue 31) with DAPO's dynamic sampling
    "agent": (
        "grpo",
        lambda root: [
            *agent_overrides(root),
            "actor.use_kl_loss=true",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=seq_reward",
            "data.gen_batch_size=2",
        ],
        "auto",
    ),
}
# Timings (and the throughputs derived from them) are the only metrics allowed to differ between runs.
VOLATILE = ("timing_s/", "perf/throughput", "perf/gen_throughput", "perf/mfu", "perf/time_per_step")  # wall-clock


def _config(root, tiny_model_dir, estimator, extra=()):
    return tiny_run_config(root, tiny_model_dir, estimator, extra)


def _quiet(record):
    pass


@pytest.fixture(scope="module", params=list(VARIANTS))
def runs(request, tmp_path_factory, tiny_model_dir):
    estimator, extra, resume_mode = VARIANTS[request.param]
    a_root = tmp_path_factory.mktemp(f"{estimator}_a")
    extra = extra(tmp_path_factory.mktemp("agent")) if callable(extra) else extra
    trainer_a = SingleProcessTrainer(
        _config(a_root, tiny_model_dir, estimator, [*extra, "trainer.total_iterations=3", "trainer.save_freq=2"])
    )
    records_a = trainer_a.fit(log=_quiet)

    b_root = tmp_path_factory.mktemp(f"{estimator}_b")
    b1_config = _config(b_root, tiny_model_dir, estimator, [*extra, "trainer.total_iterations=1"])
    trainer_b1 = SingleProcessTrainer(b1_config)
    trainer_b1.fit(log=_quiet)
    resume_from = "auto" if resume_mode == "auto" else str(trainer_b1.checkpoints[-1].path)
    b2_extra = [*extra, "trainer.total_iterations=3", f"trainer.resume_from={resume_from}"]
    trainer_b2 = SingleProcessTrainer(_config(b_root, tiny_model_dir, estimator, b2_extra))
    records_b2 = trainer_b2.fit(log=_quiet)
    return SimpleNamespace(
        variant=request.param,
        estimator=estimator,
        a=trainer_a,
        records_a=records_a,
        b1=trainer_b1,
        b2=trainer_b2,
        records_b2=records_b2,
    )


def _deterministic(record):
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}


def _assert_same_weights(model_a, model_b):
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    different = [k for k in state_a if not torch.equal(state_a[k], state_b[k])]
    assert not different, f"weights differ: {different[:5]}"


def test_resume_reproduces_the_uninterrupted_run(runs):
    # B2 resumed at step 1: no pre-training validation, one record per iteration 2 and 3.
    assert [r["step"] for r in runs.records_b2] == [2, 3]
    by_step_a = {r["step"]: r for r in runs.records_a if "training/global_step" in r}
    assert sorted(by_step_a) == [1, 2, 3]
    must_have = [
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/lr",
        "actor/entropy",
        "critic/score/mean",
        "critic/advantages/mean",
        "response_length/mean",
    ]
    if runs.estimator == "gae":
        must_have += ["critic/vf_loss", "critic/grad_norm", "critic/lr", "actor/reward_kl_penalty_coeff"]
    else:
        must_have.append("actor/kl_loss")
    if runs.variant == "agent":  # the trajectories really were multi-turn, and DAPO drew more prompts
        must_have += ["num_turns/mean", "tool_calls/echo/mean", "response_length/tool_tokens/mean"]
        assert all(r["num_turns/min"] > 2 for r in runs.records_b2)
    for record_b in runs.records_b2:
        record_a = by_step_a[record_b["step"]]
        expected, got = _deterministic(record_a), _deterministic(record_b)
        assert got.keys() == expected.keys()
        for name in must_have:
            assert name in got, name
        # the last iteration validated; in the grpo variant with sampling (val_temperature=1), under a forked RNG
        assert ("val/reasoning_gym/basic_arithmetic/score" in got) == (record_b["step"] == 3)
        # On CPU a resumed iteration runs the same kernels on the same inputs as the uninterrupted one, so the
        # values are bitwise equal; rel=1e-6 only leaves room for non-deterministic GPU kernels. Any lost state
        # (RNG -> other sampled tokens, optimizer moments, LR step, sampler cursor, KL coefficient) moves these
        # metrics by far more than 1e-6.
        assert got == pytest.approx(expected, rel=1e-6), record_b["step"]

    _assert_same_weights(runs.a.actor.model, runs.b2.actor.model)
    if runs.estimator == "gae":
        _assert_same_weights(runs.a.critic.model, runs.b2.critic.model)
        assert runs.b2.kl_ctrl.value == runs.a.kl_ctrl.value
        assert runs.b2.kl_ctrl.value != runs.b1.kl_ctrl.value  # the adaptive coefficient did move after step 1
    assert runs.b2.sampler.state_dict() == runs.a.sampler.state_dict()
    assert runs.b2.global_steps == runs.a.global_steps == 3


def test_save_freq_saves_every_k_and_at_the_end(runs):
    # total_iterations=3, save_freq=2: after iteration 2 and after the last.
    assert [step for step, _ in list_checkpoints(runs.a.checkpoint_dir)] == [2, 3]
    assert [info.step for info in runs.a.checkpoints] == [2, 3]
    # save_freq=0 saves only at the end of each fit: B1 at 1, the resumed B2 at 3.
    assert [step for step, _ in list_checkpoints(runs.b2.checkpoint_dir)] == [1, 3]
    assert runs.a.checkpoint_dir == Path(runs.a.config.trainer.output_dir) / "hybridflow" / "checkpoints"

    info = runs.a.checkpoints[-1]
    files = [p for p in info.path.rglob("*") if p.is_file()]
    assert info.bytes == sum(p.stat().st_size for p in files)
    assert info.sha256 == hashlib.sha256((info.path / "manifest.json").read_bytes()).hexdigest()
    assert verify_checkpoint(info.path) == info
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert set(manifest["files"]) == {p.relative_to(info.path).as_posix() for p in files} - {"manifest.json"}
    state = json.loads((info.path / "trainer_state.json").read_text())
    assert state["global_steps"] == 3 and state["format_version"] == 1
    assert state["sampler"] == runs.a.sampler.state_dict()
    assert (state["kl_ctrl_value"] is None) == (runs.estimator != "gae")
    # weights are only in the safetensors files, never a second copy in optim.pt
    optim = torch.load(info.path / "actor" / "optim.pt", weights_only=True)
    assert set(optim) == {"optimizer", "lr_scheduler"}
    assert (info.path / "critic").is_dir() == (runs.estimator == "gae")


def test_saved_folders_load_with_plain_transformers(runs):
    folder = runs.a.checkpoints[-1].path
    input_ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    model = AutoModelForCausalLM.from_pretrained(folder / "actor")
    with torch.no_grad():
        expected = runs.a.actor.model.eval()(input_ids=input_ids).logits
        torch.testing.assert_close(model.eval()(input_ids=input_ids).logits, expected)
    tokenizer = AutoTokenizer.from_pretrained(folder / "actor")
    assert tokenizer.encode("What is 3 + 4?") == runs.a.tokenizer.encode("What is 3 + 4?")
    if runs.estimator == "gae":
        critic = AutoModelForTokenClassification.from_pretrained(folder / "critic")
        with torch.no_grad():
            expected = runs.a.critic.model.eval()(input_ids=input_ids).logits
            torch.testing.assert_close(critic.eval()(input_ids=input_ids).logits, expected)


def _load_into(trainer, path):
    return load_checkpoint(path, **role_states(trainer.actor, trainer.critic))


def test_incomplete_checkpoints_are_ignored_and_refused(runs, tmp_path):
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(runs.a.checkpoint_dir, ckpts)
    # a crash during the save of step 4: its temporary sibling folder holds files but no final name
    shutil.copytree(ckpts / "global_step_3", ckpts / ".tmp-global_step_4-deadbeef")
    (ckpts / "global_step_3" / "manifest.json").unlink()  # a step-3 folder that never got its manifest
    assert latest_checkpoint(ckpts) == ckpts / "global_step_2"
    assert [step for step, _ in list_checkpoints(ckpts)] == [2]

    with pytest.raises(CheckpointError, match=r"global_step_3 is incomplete: manifest\.json is missing"):
        _load_into(runs.a, ckpts / "global_step_3")
    with pytest.raises(CheckpointError, match=r"global_step_3 is incomplete: manifest\.json is missing"):
        runs.a.load_checkpoint(ckpts / "global_step_3")
    with pytest.raises(CheckpointError, match="looks like a checkpoint_dir"):
        runs.a.load_checkpoint(ckpts)
    (ckpts / "global_step_2" / "actor" / "optim.pt").unlink()
    with pytest.raises(CheckpointError, match=r"global_step_2 is incomplete: actor/optim\.pt is missing"):
        runs.a.load_checkpoint(ckpts / "global_step_2")
    assert latest_checkpoint(tmp_path / "nowhere") is None


def test_verify_names_the_corrupted_file(runs, tmp_path):
    folder = tmp_path / "global_step_3"
    shutil.copytree(runs.a.checkpoints[-1].path, folder)
    assert verify_checkpoint(folder).sha256 == runs.a.checkpoints[-1].sha256
    weights = folder / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in a weight, same size
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"global_step_3 is corrupt: the sha256 of actor/model\.safetensors"):
        verify_checkpoint(folder)
    with pytest.raises(CheckpointError, match=r"actor/model\.safetensors"):
        runs.a.load_checkpoint(folder)


def _actor_parts(trainer) -> dict:
    """`save_checkpoint`'s actor arguments from a trainer."""
    return dict(
        actor_model=trainer.actor.model,
        actor_optimizer=trainer.actor.optimizer,
        actor_scheduler=trainer.actor.lr_scheduler,
        tokenizer=trainer.tokenizer,
    )


def test_failed_save_leaves_no_folder_and_rng_round_trips(runs, tmp_path):
    trainer = runs.a
    actor = _actor_parts(trainer)
    # A failure after the actor is fully written (a critic that cannot save_pretrained): nothing is left behind.
    linear = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1)
    with pytest.raises(AttributeError):
        save_checkpoint(
            tmp_path,
            7,
            **actor,
            trainer_state={},
            critic_model=linear,
            critic_optimizer=optimizer,
            critic_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        )
    assert list(tmp_path.iterdir()) == []

    # RNG: draws after a load repeat the draws after the save.
    info = save_checkpoint(tmp_path, 7, **actor, trainer_state={"global_steps": 7})
    draws = (torch.rand(4), np.random.rand(4), random.random())
    state = load_checkpoint(info.path, **role_states(trainer.actor))
    assert state["global_steps"] == 7
    again = (torch.rand(4), np.random.rand(4), random.random())
    assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1]) and draws[2] == again[2]

    with pytest.raises(FileExistsError, match="global_step_7"):
        save_checkpoint(tmp_path, 7, **actor, trainer_state={})
    for step in (8, 9):
        save_checkpoint(tmp_path, step, **actor, trainer_state={}, keep_last=2)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [8, 9]


@pytest.fixture(scope="module")
def tiny_actor(tiny_model_dir) -> dict:
    """`save_checkpoint`'s actor arguments for the tiny model after one AdamW step (its optimizer state filled)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[5, 17, 42, 99]])).logits.sum().backward()
    optimizer.step()
    return dict(
        actor_model=model,
        actor_optimizer=optimizer,
        actor_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
    )


@contextlib.contextmanager
def _tmpfs(folder: Path, size: int):
    """A tmpfs of `size` bytes mounted on `folder` (a real file system that fills up); skipped without root."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)])
    if mounted.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("mounting a tmpfs needs root")
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
_SIZES = re.compile(r"needs about (\S+) (\S+) \(.*\) and (\S+) (\S+) is free on ")


def _printed_sizes(message: str) -> tuple[float, float]:
    """(needed, free) in bytes as the disk-full message prints them, after checking each is printed in the unit
    that fits: 1 <= value < 1000 (bytes excepted), 3 significant digits."""
    match = _SIZES.search(message)
    assert match, message
    sizes = []
    for value, unit in (match.group(1, 2), match.group(3, 4)):
        assert unit in _UNITS, message
        digits = value.replace(".", "").lstrip("0")
        assert (1 <= float(value) < 1000 and len(digits) == 3) or (unit == "B" and "." not in value), message
        sizes.append(float(value) * _UNITS[unit])
    return sizes[0], sizes[1]


def _disk_bytes(*paths: Path) -> int:
    """What files (and the files under folders) take on disk, in bytes (their allocated blocks)."""
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
    return sum(f.stat().st_blocks * 512 for f in files)


def test_sizes_are_printed_in_the_unit_that_fits():
    cases = {
        0: "0 B",
        812: "812 B",
        999: "999 B",
        1000: "1.00 KB",
        12_345: "12.3 KB",
        123_456: "123 KB",
        720_000: "720 KB",
        999_999: "1.00 MB",
        1_180_000: "1.18 MB",
        3.4e9: "3.40 GB",
        1.2e13: "12.0 TB",
    }
    assert {size: format_bytes(size) for size in cases} == cases


def test_the_size_estimate_is_what_the_files_take(tiny_actor, tmp_path):
    """The weights file's size is computed exactly (header and tensors, the tied embedding once), optim.pt's within
    the 64-byte alignment of each of its storages, without serializing a tensor."""
    model, optimizer = tiny_actor["actor_model"], tiny_actor["actor_optimizer"]
    assert model.config.tie_word_embeddings  # the tied weight is in the state dict twice, in the file once
    model.save_pretrained(tmp_path)
    assert safetensors_bytes(model.state_dict()) == (tmp_path / "model.safetensors").stat().st_size
    optim = {"optimizer": optimizer.state_dict(), "lr_scheduler": tiny_actor["actor_scheduler"].state_dict()}
    torch.save(optim, tmp_path / "optim.pt")
    storages = 3 * len(optimizer.state)  # step, exp_avg, exp_avg_sq of each parameter
    assert abs(torch_save_bytes(optim) - (tmp_path / "optim.pt").stat().st_size) <= 64 * storages


def test_a_checkpoint_that_does_not_fit_its_disk_says_so_and_keeps_the_earlier_ones(tiny_actor, tmp_path):
    """On a file system with room for one checkpoint (a tmpfs of 1.5 checkpoints), the second save fails before
    it writes its weights, saying the disk is full, where, how much it needs and how much is free, in the unit that
    fits (it said "0.001 GB" for 1.18 MB); the first stays verifiable and the folder holds nothing else (torch's own
    message was "unexpected pos 284800 vs 284752")."""
    size = save_checkpoint(tmp_path / "sized", 1, **tiny_actor, trainer_state={}).bytes
    with _tmpfs(tmp_path / "disk", size * 3 // 2) as disk:
        first = save_checkpoint(disk, 1, **tiny_actor, trainer_state={"global_steps": 1})
        free = shutil.disk_usage(disk).free
        with pytest.raises(CheckpointError, match=r"the disk is full: actor/ of checkpoint .* needs about") as failed:
            save_checkpoint(disk, 2, **tiny_actor, trainer_state={"global_steps": 2})
        message = str(failed.value)
        assert f"free on {disk}" in message and "trainer.checkpoint_dir" in message and "hf resume" in message
        need, printed_free = _printed_sizes(message)
        # what actor/ takes on this disk, its tokenizer's files included (3 significant digits: 0.5 % of rounding)
        assert need == pytest.approx(_disk_bytes(first.path / "actor"), rel=0.01)
        assert printed_free == pytest.approx(free, rel=0.005)
        assert verify_checkpoint(first.path).sha256 == first.sha256
        assert [p.name for p in disk.iterdir()] == ["global_step_1"]


def test_a_disk_that_fills_at_the_last_writes_says_so_and_keeps_the_earlier_ones(tiny_actor, tmp_path):
    """The roles fit but trainer_state.json, rng.pt and manifest.json do not (a filler file leaves 8 KB): the
    controller's last writes fail with the same CheckpointError as a role that does not fit (the write's ENOSPC
    under it), the staging folder is gone, the earlier checkpoint verifies, and once space is freed the save
    succeeds."""
    size = save_checkpoint(tmp_path / "sized", 1, **tiny_actor, trainer_state={}).bytes
    model, optimizer, scheduler, tokenizer = tiny_actor.values()
    with _tmpfs(tmp_path / "disk", size * 3) as disk:
        first = save_checkpoint(disk, 1, **tiny_actor, trainer_state={"global_steps": 1})
        staging = begin_checkpoint(disk, 2)
        save_role(staging, "actor", model, optimizer, scheduler, tokenizer)
        filler = disk / "filler"
        filler.write_bytes(bytes(shutil.disk_usage(disk).free - 8192))
        free = shutil.disk_usage(disk).free
        with pytest.raises(
            CheckpointError, match=r"the disk is full: finishing checkpoint \S*global_step_2 "
        ) as failed:
            finish_checkpoint(staging, {"global_steps": 2})
        assert isinstance(failed.value.__cause__, OSError) and failed.value.__cause__.errno == errno.ENOSPC
        message = str(failed.value)
        assert "trainer_state.json, rng.pt and manifest.json" in message and f"free on {disk}" in message
        assert "trainer.checkpoint_dir" in message and "hf resume" in message
        need, printed_free = _printed_sizes(message)
        last_files = [first.path / name for name in ("trainer_state.json", "rng.pt", "manifest.json")]
        assert need == pytest.approx(_disk_bytes(*last_files), rel=0.2)
        assert printed_free == pytest.approx(free, rel=0.005) and printed_free < need
        assert not staging.exists() and sorted(p.name for p in disk.iterdir()) == ["filler", "global_step_1"]
        assert verify_checkpoint(first.path).sha256 == first.sha256

        filler.unlink()  # space freed: the same save now goes through
        second = save_checkpoint(disk, 2, **tiny_actor, trainer_state={"global_steps": 2})
        assert verify_checkpoint(second.path) == second
        assert [step for step, _ in list_checkpoints(disk)] == [1, 2]


def test_fit_refuses_to_mix_with_another_runs_checkpoints(runs, tmp_path, tiny_model_dir):
    estimator, extra, _ = VARIANTS[runs.estimator]
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(runs.a.checkpoint_dir, ckpts)
    trainer = SingleProcessTrainer(
        _config(tmp_path, tiny_model_dir, estimator, [*extra, f"trainer.checkpoint_dir={ckpts}"])
    )
    with pytest.raises(FileExistsError, match="trainer.resume_from=auto"):
        trainer.fit(log=_quiet)
    assert trainer.global_steps == 0 and not (tmp_path / "outputs" / "hybridflow" / "metrics.jsonl").exists()
