"""`hf run` checks its inputs before it records a run or starts anything: each mistake gives one message naming the
config key and the fix, exit code 2, no traceback, and no run in the store. Real files, the real tiny model, a real
SQLite store, the real CLI (typer's runner, in process); the Slurm partition check runs against the real cluster."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridflow.cli.main import app
from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "grpo_tiny.yaml"


def _row(source: str = "openai/gsm8k", **drop) -> dict:
    row = {
        "data_source": source,
        "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {},
    }
    for key in drop:
        row.pop(key)
    return row


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(tmp_path: Path, model_dir: Path, *overrides: str, model: bool = True) -> tuple[int, str]:
    """`hf run examples/grpo_tiny.yaml -o ...` with its own store; returns (exit code, output) after checking that
    no run was recorded."""
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    args = ["run", str(EXAMPLE), "--db", db, "-o", f"trainer.output_dir={tmp_path / 'out'}"]
    if model:
        args += ["-o", f"model.path={model_dir}"]
    for item in overrides:
        args += ["-o", item]
    result = CliRunner().invoke(app, args)
    assert "Traceback" not in result.output, result.output
    assert RunStore(db).list_runs() == [], "a refused run was recorded"
    assert "hf resume" not in result.output  # resuming cannot help a bad input
    return result.exit_code, " ".join(result.output.split())


def test_hub_id_is_refused_with_the_way_out(tmp_path, tiny_model_dir):
    code, out = _run(tmp_path, tiny_model_dir, "model.path=Qwen/Qwen2.5-0.5B-Instruct", model=False)
    assert code == 2
    assert "model.path" in out and "no model hub here" in out and "download it elsewhere" in out


def test_folder_without_config_is_refused(tmp_path, tiny_model_dir):
    (tmp_path / "empty").mkdir()
    code, out = _run(tmp_path, tiny_model_dir, f"model.path={tmp_path / 'empty'}", model=False)
    assert code == 2 and "model.path" in out and "config.json" in out


def test_unprepared_embedded_model_names_the_command(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "fresh_home"))
    code, out = _run(tmp_path, tiny_model_dir, "model.path=smollm2", model=False)
    assert code == 2 and "hf models prepare smollm2" in out


def test_critic_model_path_is_checked_too(tmp_path, tiny_model_dir):
    code, out = _run(tmp_path, tiny_model_dir, "critic.model_path=org/critic-7b")
    assert code == 2 and "critic.model_path" in out and "no model hub here" in out


def test_missing_data_file(tmp_path, tiny_model_dir):
    code, out = _run(tmp_path, tiny_model_dir, f"data.train_files={tmp_path / 'nope.parquet'}")
    assert code == 2 and "does not exist" in out and "data.train_files" in out


def test_data_file_without_a_required_column(tmp_path, tiny_model_dir):
    path = _jsonl(tmp_path / "train.jsonl", [_row(reward_model=True)] * 8)
    code, out = _run(tmp_path, tiny_model_dir, f"data.train_files={path}")
    assert code == 2 and "no column 'reward_model'" in out and str(path) in out


def test_data_source_without_a_reward(tmp_path, tiny_model_dir):
    path = _jsonl(tmp_path / "train.jsonl", [_row("my/own_task")] * 8)
    code, out = _run(tmp_path, tiny_model_dir, f"data.train_files={path}")
    assert code == 2 and "my/own_task" in out and "reward.custom_function" in out


def test_fewer_prompts_than_a_batch(tmp_path, tiny_model_dir):
    path = _jsonl(tmp_path / "train.jsonl", [_row()] * 2)
    code, out = _run(tmp_path, tiny_model_dir, f"data.train_files={path}")
    assert code == 2 and "data.train_batch_size=4 is larger than the dataset (2 prompts" in out


def test_prompts_longer_than_the_limit(tmp_path, tiny_model_dir):
    code, out = _run(tmp_path, tiny_model_dir, "data.max_prompt_length=3")
    assert code == 2 and "data.max_prompt_length" in out


def test_unknown_reasoning_gym_generator(tmp_path, tiny_model_dir):
    code, out = _run(tmp_path, tiny_model_dir, "data.reasoning_gym.name=basic_arithmetik")
    assert code == 2 and "basic_arithmetik" in out and "basic_arithmetic" in out  # the close match is offered


def test_custom_reward_that_does_not_import(tmp_path, tiny_model_dir):
    code, out = _run(tmp_path, tiny_model_dir, "reward.custom_function=no_such_module:score")
    assert code == 2 and "reward.custom_function" in out and "not importable" in out


def test_custom_reward_file_without_the_function(tmp_path, tiny_model_dir):
    (tmp_path / "my_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 0.0\n"
    )
    code, out = _run(tmp_path, tiny_model_dir, f"reward.custom_function={tmp_path / 'my_reward.py'}:compute_scor")
    assert code == 2 and "has no attribute 'compute_scor'" in out and "did you mean compute_score" in out


def test_batch_sizes_that_do_not_divide(tmp_path, tiny_model_dir):
    code, out = _run(tmp_path, tiny_model_dir, "data.train_batch_size=6", "actor.ppo_mini_batch_size=4")
    assert code == 2 and "data.train_batch_size (6) must be a multiple of actor.ppo_mini_batch_size (4)" in out


def test_output_dir_that_cannot_be_written(tmp_path, tiny_model_dir):
    (tmp_path / "a_file").write_text("not a folder")
    code, out = _run(tmp_path, tiny_model_dir, f"trainer.output_dir={tmp_path / 'a_file' / 'out'}")
    assert code == 2 and "trainer.output_dir" in out


def test_an_mlflow_server_that_does_not_answer(tmp_path, tiny_model_dir):
    from hybridflow.slurm.network import free_port

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, out = _run(tmp_path, tiny_model_dir, "trainer.logger=[console,mlflow]", f"trainer.mlflow_tracking_uri={uri}")
    assert code == 2
    assert f"MLflow tracking server {uri} does not answer" in out and "trainer.mlflow_tracking_uri" in out


def test_slurm_partition_that_does_not_exist(tmp_path, tiny_model_dir, slurm_cluster):
    code, out = _run(tmp_path, tiny_model_dir, "placement.executor=slurm", "placement.slurm.partition=gpu-nope")
    assert code == 2 and "placement.slurm.partition" in out and "gpu-nope" in out and "debug" in out


def test_a_pool_with_more_nodes_than_its_partition_has(tmp_path, tiny_model_dir, slurm_cluster):
    pools = '{"actor_rollout": {"roles": ["actor", "rollout"]}, "ref": {"roles": ["ref"], "nodes": 2}}'
    code, out = _run(
        tmp_path, tiny_model_dir, "placement.executor=slurm", f"placement.pools={pools}", "actor.use_kl_loss=true"
    )
    assert code == 2 and "placement.pools.ref.nodes: pool ref asks for 2 nodes, and partition 'debug' has 1" in out


@pytest.mark.parametrize("single_path", [True, False])
def test_your_data_replaces_the_examples_source(tmp_path, tiny_model_dir, single_path):
    """``-o data.train_files=...`` on an example with reasoning-gym prompts trains on the given file alone (and a
    single path is taken where a list is expected): a file of 2 rows is too small for a batch of 4, which could not
    happen if the example's 64 reasoning-gym prompts were still mixed in."""
    path = _jsonl(tmp_path / "train.jsonl", [_row()] * 2)
    code, out = _run(tmp_path, tiny_model_dir, f"data.train_files={path if single_path else [path]}")
    assert code == 2 and "(2 prompts after filtering)" in out


@pytest.mark.parametrize("cpu", ["this", "emulating"])
def test_bf16_on_a_cpu_that_emulates_it_warns_with_the_fix(tmp_path, tiny_model_dir, monkeypatch, cpu):
    """Warned where the CPU has no bf16 instructions (AVX512-BF16, AMX: torch and vLLM emulate them, 23x and 5x
    slower on an AMD EPYC), for every dtype key of an RL run and for ``hf sft train``'s; silent where it has them
    and for float32 and ``native`` (which picks float32 there); a warning, not a refusal: bf16 still computes
    correctly. ``cpu="emulating"`` makes this machine report no bf16 instructions (`cpu_has_native_bf16`, torch's
    CPUID check: the one input that cannot be had here otherwise), so the warning path runs on every CPU."""
    import importlib.util
    import warnings

    import torch
    from test_sft import sft_config
    from tiny_runs import tiny_run_config

    from hybridflow.engine import models
    from hybridflow.flows import preflight

    if cpu == "emulating":
        monkeypatch.setattr(preflight, "cpu_has_native_bf16", lambda: False)
        monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)
    emulated = not preflight.cpu_has_native_bf16()
    assert models.pick_dtype("native", torch.device("cpu")) == (torch.float32 if emulated else torch.bfloat16)
    cases = [("model.dtype", dtype, warned) for dtype, warned in [("bfloat16", emulated), ("float32", False)]]
    cases += [("model.dtype", "native", False)]
    if importlib.util.find_spec("vllm") is not None:
        cases += [
            ("rollout.vllm_dtype", d, w) for d, w in [("bfloat16", emulated), ("float32", False), ("native", False)]
        ]
    for key, dtype, warned in cases:
        other = "rollout.vllm_dtype" if key == "model.dtype" else "model.dtype"
        overrides = [f"{key}={dtype}", f"{other}=float32", "rollout.name=vllm" if "vllm" in key else "rollout.name=hf"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            preflight.check_run_inputs(tiny_run_config(tmp_path, tiny_model_dir, "grpo", overrides))
        slow = [str(w.message) for w in caught if issubclass(w.category, preflight.SlowDtypeWarning)]
        assert len(slow) == int(warned), (key, dtype, slow)
        assert all(f"set {key}=native" in message and "or float32" in message for message in slow)
    for dtype, warned in [("bfloat16", emulated), ("native", False)]:  # hf sft train (and hf rm train) alike
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            preflight.check_sft_inputs(sft_config(tmp_path, tiny_model_dir, f"model.dtype={dtype}"))
        slow = [str(w.message) for w in caught if issubclass(w.category, preflight.SlowDtypeWarning)]
        assert len(slow) == int(warned) and all("set model.dtype=native" in m for m in slow), (dtype, slow)


def test_a_network_interface_this_host_does_not_have(tmp_path, tiny_model_dir, slurm_cluster):
    code, out = _run(tmp_path, tiny_model_dir, "placement.executor=slurm", "placement.slurm.interface=ib7")
    assert code == 2 and "placement.slurm.interface: network interface 'ib7' has no IPv4 address on" in out, out
    assert "lo (127.0.0.1)" in out  # the interfaces it could be
