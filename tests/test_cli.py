"""The installed `hf` command, run as a user would (a subprocess of the console script)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"


def _hf(*args, env_extra=None, cwd=ROOT):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([HF, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_models_prepare_tiny_is_idempotent(tmp_path):
    env = {"HYBRIDFLOW_HOME": str(tmp_path)}
    first = _hf("models", "prepare", "tiny", env_extra=env)
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.strip().splitlines()[-1])
    assert path == tmp_path / "models" / "tiny"
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    second = _hf("models", "prepare", "tiny", env_extra=env)
    assert second.returncode == 0 and Path(second.stdout.strip().splitlines()[-1]) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp, "a prepared model was rebuilt"
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.endswith(".tmp")], "temporary folder left"


def test_models_prepare_unknown_name():
    result = _hf("models", "prepare", "gpt-17")
    assert result.returncode == 2
    assert "smollm2" in result.stdout + result.stderr


def test_run_example_writes_metrics(tmp_path):
    out = tmp_path / "outputs"
    result = _hf(
        "run",
        "examples/grpo_tiny.yaml",
        "-o",
        f"trainer.output_dir={out}",
        "-o",
        "trainer.total_iterations=1",
        env_extra={"HYBRIDFLOW_HOME": str(tmp_path / "home")},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (out / "grpo_tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert "actor/pg_loss" in records[1] and "val/reasoning_gym/basic_arithmetic/acc" in records[0]
    assert "step 1" in result.stdout


def test_run_bad_key_names_it(tmp_path):
    result = _hf("run", "examples/grpo_tiny.yaml", "-o", "actor.ppo_epoch=2")
    assert result.returncode == 2
    assert "actor.ppo_epoch: unknown key" in result.stdout


@pytest.mark.parametrize("name", ["hf", "hybridflow"])
def test_both_entry_points_show_help(name):
    exe = shutil.which(name, path=str(Path(sys.executable).parent))
    assert exe, f"console script {name} not installed"
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    # huggingface_hub installs a command named `hf` too: the one on the venv's PATH must be ours.
    assert result.returncode == 0 and "HybridFlow" in result.stdout and "run" in result.stdout
