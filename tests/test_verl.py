"""verl's command lines: ``hf verl`` runs a verl example script's overrides (the entry point swapped) and trains
exactly what the equivalent native config trains; unsupported keys are refused before anything runs; ``hf config
show --as-verl`` writes a config in verl's keys; docs/verl-keys.md is the code's table."""

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_runs import write_reward

from hybridflow.engine.config import ConfigError, load_config
from hybridflow.engine.config.verl import translate
from hybridflow.engine.config.verl_keys import VERL_KEYS, key_table
from hybridflow.engine.data import reasoning_gym_rows
from hybridflow.flows.store.run_store import RunStore

HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
ROOT = Path(__file__).resolve().parents[1]
COMPARED = ["critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "actor/kl_loss"]
ADDITION = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}


def _data(tmp_path: Path) -> tuple[Path, Path]:
    """reasoning-gym addition in verl's layout (jsonl): 8 training rows, 4 validation rows."""
    rows = reasoning_gym_rows("basic_arithmetic", 12, seed=0, config=ADDITION)
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[8:]))
    return train, val


def _verl_grpo(tmp_path: Path, tiny_model_dir: Path) -> list[str]:
    """verl's examples/grpo_trainer/run_qwen2-7b.sh, key for key, with the data, the model, the sizes (prompts,
    tokens, GPUs) swapped for the tiny model on one CPU rank, the rollout on transformers and the logger on the
    console."""
    train, val = _data(tmp_path)
    reward_path, _, reward_name = write_reward(tmp_path).rpartition(":")
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.train_batch_size=4",
        "data.max_prompt_length=128",
        "data.max_response_length=16",
        "data.filter_overlong_prompts=True",
        "data.truncation='error'",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=['console']",
        "trainer.project_name='verl_grpo_example_gsm8k'",
        "trainer.experiment_name='qwen2_7b_function_rm'",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=1",
        f"custom_reward_function.path={reward_path}",
        f"custom_reward_function.name={reward_name}",
    ]


def _native(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """The same run written in HybridFlow's keys, verl's defaults spelled out where they differ from ours."""
    tree = {
        "model": {"path": str(tiny_model_dir), "gradient_checkpointing": True},
        "data": {
            "train_files": [str(tmp_path / "train.jsonl")],
            "val_files": [str(tmp_path / "val.jsonl")],
            "train_batch_size": 4,
            "max_prompt_length": 128,
        },
        "rollout": {"name": "hf", "n": 4, "response_length": 16, "gen_tp": 1, "gpu_memory_utilization": 0.6},
        "actor": {
            "strategy": "fsdp",
            "optim": {"lr": 1e-4},
            "ppo_mini_batch_size": 2,
            "ppo_micro_batch_size": 4,
            "log_prob_micro_batch_size": 8,
            "shuffle": False,
            "use_kl_loss": True,
            "kl_loss_coef": 0.001,
            "kl_loss_type": "low_var_kl",
            "entropy_coeff": 0,
            "policy_loss": {"ppo_kl_coef": 0.1},
        },
        "ref": {"log_prob_micro_batch_size": 8},
        "critic": {"strategy": "fsdp", "ppo_mini_batch_size": 2, "shuffle": False},
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "reward": {"custom_function": write_reward(tmp_path)},
        "placement": {"nodes": 1, "tasks_per_node": 1},
        "trainer": {
            "total_iterations": 2,  # 1 epoch of 8 rows, 4 a batch
            "logger": ["console"],
            "project_name": "verl_grpo_example_gsm8k",
            "experiment_name": "qwen2_7b_function_rm",
            "save_freq": 20,
            "test_freq": 5,
            "num_threads": 1,
            "output_dir": str(tmp_path / "out"),
        },
    }
    path = tmp_path / "native.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _hf(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([HF, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ})


def test_a_verl_grpo_script_runs_with_hf_verl_and_trains_what_the_native_config_trains(
    prefect_api, tmp_path, tiny_model_dir
):
    """verl's GRPO example (run_qwen2-7b.sh) through ``hf verl``: recorded like hf run, every metric of its two
    iterations equal, bit for bit, to those of the same run written in our keys; each key with no effect here is
    named when the run starts."""
    ours = ["-o", "trainer.num_threads=1", "-o", f"trainer.output_dir={tmp_path / 'out'}"]
    verl_db, native_db = f"sqlite:///{tmp_path / 'verl.db'}", f"sqlite:///{tmp_path / 'native.db'}"
    verl = _hf("verl", *_verl_grpo(tmp_path, tiny_model_dir), *ours, "--db", verl_db, "--prefect-api", prefect_api)
    assert verl.returncode == 0, verl.stdout + verl.stderr
    assert "verl key actor_rollout_ref.model.use_remove_padding: no effect here" in verl.stdout, verl.stdout
    assert "verl key actor_rollout_ref.actor.fsdp_config.param_offload: no effect here" in verl.stdout
    native = _hf("run", str(_native(tmp_path, tiny_model_dir)), "--db", native_db, "--prefect-api", prefect_api)
    assert native.returncode == 0, native.stdout + native.stderr

    def metrics(db: str) -> dict:
        store = RunStore(db)
        (run,) = store.list_runs()
        assert run.status == "completed"
        return {(m.step, m.name): m.value for m in store.metrics(run.id) if m.name in COMPARED}

    from_verl, from_native = metrics(verl_db), metrics(native_db)
    assert {step for step, _ in from_verl} == {1, 2}  # trainer.total_epochs=1: 8 rows // 4 a batch
    assert from_verl == from_native
    assert from_verl[(2, "actor/kl_loss")] != 0.0  # the run trained: the policy left the reference


def test_a_verl_grpo_script_with_vllm_tensor_parallel_beside_fsdp_trains_end_to_end(prefect_api, tmp_path):
    """The same script as verl's 7B runs set it: ``rollout.name=vllm`` with ``rollout.tensor_model_parallel_size=2``
    beside the FSDP actor, on 2 ranks: one vLLM engine over both (vLLM's SPMD mode), fed the actor's whole weights
    after every update. The run completes, the placement records the engine's layout, every weight sync passes its
    probe, the engine's log-probs stay those of the actor, and the policy trains."""
    from hybridflow.engine.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny128", hidden_size=128, head_dim=32)  # 4 heads of 32: split in 2
    script = [
        arg
        for arg in _verl_grpo(tmp_path, model)
        if not arg.startswith(("actor_rollout_ref.rollout.name=", "actor_rollout_ref.rollout.tensor_model_parallel"))
        and not arg.startswith("trainer.n_gpus_per_node=")
    ]
    script += [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.dtype=float32",
        "trainer.n_gpus_per_node=2",
    ]
    ours = ["-o", "trainer.num_threads=1", "-o", f"trainer.output_dir={tmp_path / 'out'}"]
    db = f"sqlite:///{tmp_path / 'verl.db'}"
    verl = _hf("verl", *script, *ours, "-o", "rollout.vllm_kv_cache_gb=0.25", "--db", db, "--prefect-api", prefect_api)
    assert verl.returncode == 0, verl.stdout + verl.stderr
    store = RunStore(db)
    (run,) = store.list_runs()
    assert run.status == "completed"
    (actor,) = [p for p in store.placements(run.id) if p.role == "actor"]
    assert actor.parallel["rollout_engine"] == {"tp": 2, "replicas": 1}, actor.parallel
    metrics = {(m.step, m.name): m.value for m in store.metrics(run.id)}
    assert {step for step, name in metrics if name == "actor/pg_loss"} == {1, 2}
    probes = [v for (_, name), v in metrics.items() if name == "rollout/weight_probe_diff"]
    assert probes and max(probes) < 1e-4, probes
    assert metrics[(2, "rollout/log_prob_diff_mean")] < 1e-3  # the engine samples from the actor's distribution
    assert metrics[(2, "actor/kl_loss")] != 0.0  # the run trained: the policy left the reference


def test_unsupported_verl_keys_are_refused_with_the_nearest_one_before_anything_runs(tmp_path, tiny_model_dir):
    """A misspelt key, an engine that is not here and a value that would change the computation: one message
    names each (with the nearest supported key), exit 2, no run recorded; --dry-run prints the resolved config."""
    db = tmp_path / "store.db"
    command = _verl_grpo(tmp_path, tiny_model_dir)
    bad = [
        *command,
        "actor_rollout_ref.actor.optim.lrr=1e-6",
        "actor_rollout_ref.rollout.name=sglang",
        "trainer.critic_warmup=3",
    ]
    refused = _hf("verl", *bad, "--db", f"sqlite:///{db}")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    out = refused.stdout
    assert "actor_rollout_ref.actor.optim.lrr is not supported by hf verl: the nearest supported key is " in out
    assert "actor_rollout_ref.actor.optim.lr\n" in out, out
    assert "actor_rollout_ref.rollout.name='sglang' is not supported here" in out and "use vllm" in out, out
    assert "trainer.critic_warmup=3 is not supported here" in out, out
    assert not db.exists()
    ours_key = _hf("verl", *command, "actor.optim.lr=1e-6")
    assert ours_key.returncode == 2 and "HybridFlow's own key: give it with -o actor.optim.lr=" in ours_key.stdout

    dry = _hf("verl", *command, "-o", "trainer.num_threads=1", "--dry-run", "--db", f"sqlite:///{db}")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "dry run: the config above is valid" in dry.stdout
    assert "# placement (local executor):\n#   pool actor_rollout_ref: 1 x 1 ranks: actor, rollout" in dry.stdout
    assert "#   actor: fsdp, training p1-t1-d1, generation p1-t1\n#   rollout: hf" in dry.stdout, dry.stdout
    body = [line for line in dry.stdout.splitlines() if not line.startswith(("verl key ", "dry run:"))]
    resolved = yaml.safe_load("\n".join(body))
    assert resolved["algorithm"]["adv_estimator"] == "grpo" and resolved["rollout"]["top_k"] == 0
    assert resolved["actor"]["shuffle"] is False and resolved["trainer"]["total_iterations"] == 2  # verl's defaults
    assert resolved["reward"]["custom_function"] == write_reward(tmp_path)
    assert not db.exists()


def test_the_keys_of_verls_7b_and_megatron_scripts_translate_or_are_refused_naming_what_to_do():
    """Keys verl's example scripts use beyond the first ten (issue 53): the ones that change the computation are
    translated to what computes it here, memory-only ones are accepted as no effect, and what is not implemented
    (mixture-of-experts and context parallelism, validation sampling with do_sample off above temperature 0, an
    overlong buffer ending elsewhere than the response length) is refused with the fix."""
    arr = "actor_rollout_ref"
    script = [
        "trainer.total_training_steps=50",
        "data.max_response_length=1024",
        f"{arr}.actor.optim.lr_warmup_steps_ratio=0.1",  # verl: int(0.1 x 50) iterations of warm-up
        "critic.optim.lr_warmup_steps_ratio=0.05",
        f"{arr}.rollout.tensor_model_parallel_size=2",
        f"{arr}.rollout.val_kwargs.top_p=0.7",
        f"{arr}.rollout.val_kwargs.top_k=-1",
        f"{arr}.rollout.val_kwargs.temperature=1.0",
        f"{arr}.rollout.val_kwargs.do_sample=True",
        f"{arr}.actor.policy_loss.loss_mode=geo_mean",
        "algorithm.adv_estimator=gpg",
        "reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "reward_model.reward_kwargs.overlong_buffer_cfg.len=256",
        "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
        "reward_model.reward_kwargs.max_resp_len=1024",
        f"{arr}.model.lora.rank=32",
        f"{arr}.model.lora.alpha=64",
        f"{arr}.model.lora.target_modules=[linear_qkv,linear_fc1]",
        f"{arr}.actor.megatron.param_offload=True",
        f"{arr}.actor.megatron.use_mbridge=True",
        f"+{arr}.actor.megatron.override_transformer_config.recompute_granularity=full",
        f"+{arr}.actor.megatron.override_transformer_config.apply_rope_fusion=True",
        f"{arr}.actor.megatron.expert_model_parallel_size=1",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=2.0",
    ]
    translation = translate(script)
    ours = dict(o.split("=", 1) for o in translation.overrides)
    expected = {
        "actor.optim.warmup_iterations": "5",
        "critic.optim.warmup_iterations": "2",
        "rollout.gen_tp": "2",
        "rollout.val_top_p": "0.7",
        "rollout.val_top_k": "0",
        "rollout.val_temperature": "1.0",
        "actor.policy_loss.loss_mode": "geo_mean",
        "algorithm.adv_estimator": "gpg",
        "reward.overlong_buffer.enable": "true",
        "reward.overlong_buffer.len": "256",
        "reward.overlong_buffer.penalty": "0.5",
        "model.lora_rank": "32",
        "model.target_modules": "[q_proj, k_proj, v_proj, gate_proj, up_proj]",
        "algorithm.rollout_correction.rollout_is": "token",
        "model.gradient_checkpointing": "true",  # megatron's recompute_granularity=full
    }
    assert {k: ours.get(k) for k in expected} == expected
    said = {key for key, _ in translation.no_effect}
    assert f"{arr}.actor.megatron.param_offload" in said and f"{arr}.actor.megatron.use_mbridge" in said
    assert f"{arr}.actor.megatron.override_transformer_config.recompute_granularity" not in said  # it has effect
    explicit = translate([*script, f"{arr}.model.enable_gradient_checkpointing=False"]).overrides
    assert "model.gradient_checkpointing=false" in explicit and "model.gradient_checkpointing=true" not in explicit
    split = translate([*script, f"{arr}.rollout.expert_parallel_size=2"]).overrides  # experts over the engine's ranks
    assert "rollout.expert_parallel_size=2" in split

    refused = {
        f"{arr}.rollout.data_parallel_size=2": "vLLM's data parallelism",
        f"+{arr}.actor.megatron.override_transformer_config.moe_pad_expert_input_to_capacity=True": "not impl",
        f"{arr}.actor.megatron.context_parallel_size=2": "context parallelism is not implemented",
        f"{arr}.actor.ulysses_sequence_parallel_size=2": "split the model with tensor parallelism instead",
        "reward_model.reward_kwargs.max_resp_len=512": "the overlong buffer ends at data.max_response_length",
        f"{arr}.rollout.val_kwargs.do_sample=False": "validation is greedy exactly when the temperature is 0",
        f"{arr}.actor.megatron.use_dist_checkpointing=True": "convert it to a Hugging Face folder",
    }
    for key_value, why in refused.items():
        with pytest.raises(ConfigError, match=why):
            translate([*script, key_value])


def test_a_config_shown_as_verl_translates_back_to_itself(tmp_path, tiny_model_dir):
    """``hf config show CONFIG --as-verl`` prints an hf verl command line; translated back, every key it names
    has the config's value (a round trip through verl's spelling loses nothing it can say)."""
    native = _native(tmp_path, tiny_model_dir)
    _data(tmp_path)
    shown = _hf("config", "show", str(native), "--as-verl")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    words = shlex.split(shown.stdout.replace("\\\n", " "))
    assert words[:2] == ["hf", "verl"] and "actor_rollout_ref.actor.shuffle=false" in words, words
    assert "actor_rollout_ref.rollout.top_k=-1" in words and "trainer.logger=[console]" in words, words
    back = load_config(None, [*translate(words[2:]).overrides, "trainer.output_dir=" + str(tmp_path / "out")])
    original = load_config(native)
    for entry in VERL_KEYS:
        for key in entry.ours:
            if entry.verl in words[2:] or any(w.startswith(entry.verl + "=") for w in words[2:]):
                assert _get(back, key) == _get(original, key), key


def _get(cfg, dotted: str):
    value = cfg.model_dump(mode="json")
    for part in dotted.split("."):
        value = value[part]
    return value


def test_the_docs_table_of_verl_keys_is_the_codes():
    """docs/verl-keys.md is what hf config verl-keys prints (regenerate it with that command)."""
    text = (ROOT / "docs" / "verl-keys.md").read_text()
    assert key_table() in text, "docs/verl-keys.md is stale: hf config verl-keys > the table part of it"
    assert len(key_table().splitlines()) == len(VERL_KEYS) + 2


def test_a_verl_config_file_is_read_with_its_interpolations_and_overridden_by_the_command_line(tmp_path, monkeypatch):
    """A ``ppo_trainer.yaml``-style file (Hydra's defaults list and ``_target_`` classes dropped, ``${a.b}`` and
    ``${oc.env:NAME}`` resolved) under the command line's overrides; an interpolation of nothing given is refused."""
    train, _ = _data(tmp_path)
    verl_file = tmp_path / "my_trainer.yaml"
    verl_file.write_text(
        yaml.safe_dump(
            {
                "defaults": ["ppo_trainer", "_self_"],
                "data": {"train_files": str(train), "train_batch_size": 4, "max_prompt_length": 96},
                "actor_rollout_ref": {
                    "actor": {"optim": {"_target_": "verl.workers.config.FSDPOptimizerConfig", "lr": 3e-6}},
                    "rollout": {"prompt_length": "${data.max_prompt_length}", "n": 2, "top_k": -1},
                },
                "trainer": {"total_epochs": 2},
            }
        )
    )
    overrides = dict(o.split("=", 1) for o in translate(["actor_rollout_ref.rollout.n=6"], verl_file).overrides)
    assert overrides["actor.optim.lr"] == "3.0e-06" and overrides["rollout.top_k"] == "0"
    assert overrides["rollout.n"] == "6" and overrides["data.max_prompt_length"] == "96"
    assert overrides["trainer.total_iterations"] == "4"  # 2 epochs of 8 rows // 4
    verl_file.write_text("data:\n  train_files: ${oc.env:HYBRIDFLOW_TEST_DATA}\n  train_batch_size: 4\n")
    monkeypatch.setenv("HYBRIDFLOW_TEST_DATA", str(train))  # OmegaConf's oc.env resolver, as verl reads its files
    assert f"data.train_files={train}" in translate(["trainer.total_epochs=1"], verl_file).overrides
    verl_file.write_text("data:\n  train_files: ${data.nope}/x.parquet\n")
    with pytest.raises(ConfigError, match=r"data.train_files=.*\$\{data.nope\} names no key given"):
        translate([], verl_file)


def test_verls_megatron_scripts_name_its_own_config_and_need_no_file(tmp_path, tiny_model_dir):
    """verl's megatron scripts (examples/grpo_trainer/run_qwen2-7b_math_megatron.sh, ppo_trainer/
    run_qwen2-7b_math_gsm8k_megatron.sh) start with ``--config-path=config --config-name='ppo_megatron_trainer.yaml'``,
    a file of verl's own tree: hf verl takes the name for what that file sets (the actor's and critic's megatron
    strategy) and refuses a name it does not know with the names it does."""
    from hybridflow.engine.config.verl import VERL_CONFIG_NAMES

    train, val = _data(tmp_path)
    script = [
        "algorithm.adv_estimator=gae", f"data.train_files={train}", f"data.val_files={val}", "data.train_batch_size=4",
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"critic.model.path={tiny_model_dir}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=4",
    ]  # fmt: skip
    cfg = load_config(None, translate(script, None, "ppo_megatron_trainer").overrides)
    assert (cfg.actor.strategy, cfg.critic.strategy, cfg.actor.tp, cfg.actor.pp) == ("megatron", "megatron", 2, 2)
    with pytest.raises(ConfigError, match="use actor.strategy=megatron"):  # verl's ppo_trainer.yaml: fsdp
        load_config(None, translate(script).overrides)
    for name in ("ppo_megatron_trainer.yaml", "ppo_megatron_trainer"):  # as verl's scripts write it
        shown = subprocess.run(
            [HF, "verl", "--dry-run", "--config-path=config", f"--config-name={name}", *script],
            capture_output=True, text=True, cwd=tmp_path, timeout=300,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert "strategy: megatron" in shown.stdout, shown.stdout
    refused = subprocess.run(
        [HF, "verl", "--dry-run", "--config-path=config", "--config-name=ppo_nope", *script],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "config/ppo_nope.yaml is not a file, nor one of verl's own config files" in refused.stdout
    assert all(name in refused.stdout for name in VERL_CONFIG_NAMES)


def test_unset_data_files_are_verls_default_paths_in_the_home_folder(tmp_path, monkeypatch, tiny_model_dir):
    """A command line without data.train_files / val_files reads verl's defaults, ~/data/rlhf/gsm8k/{train,test}
    .parquet, as verl does (PF-PPO's example script loses its data keys to a comment after a line continuation)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("HOME", str(tmp_path))
    rows = reasoning_gym_rows("basic_arithmetic", 12, seed=0, config=ADDITION)
    folder = tmp_path / "data" / "rlhf" / "gsm8k"
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:8]), folder / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[8:]), folder / "test.parquet")
    given = [f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_batch_size=4", "trainer.total_epochs=3"]
    given.append("actor_rollout_ref.actor.ppo_mini_batch_size=4")
    cfg = load_config(None, translate(given).overrides)
    assert cfg.data.train_files == [str(folder / "train.parquet")]
    assert cfg.data.val_files == [str(folder / "test.parquet")]
    assert cfg.trainer.total_iterations == 3 * 8 // 4  # the default file's rows counted


def _each_refused(refusals: dict[str, str], *rest: str) -> None:
    """Each ``key=value`` of `refusals`, translated with `rest`, raises a ConfigError matching its reason."""
    for key_value, why in refusals.items():
        with pytest.raises(ConfigError, match=why):
            translate([key_value, *rest])


def _ours(command_line: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in translate(command_line).overrides)


def test_hydras_override_syntax_in_verl_mains_scripts_is_read_or_refused_in_one_line(tmp_path, tiny_model_dir):
    """verl main's scripts write Hydra's whole grammar: ``+key`` / ``++key``, ``~key``, ``group@package=option``,
    dict values with escaped braces (``'{model.visual.blocks.\\{*\\}:{},lm_head:{}}'``), lists, ``${...}``
    interpolations. Each is read as Hydra reads it; a sweep or a malformed override is refused in one line naming
    it, before anything runs (never a traceback)."""
    arr = "actor_rollout_ref"
    ours = _ours(
        [
            f"+{arr}.actor.fsdp_config.turbo_config.distributed.fsdp_plan.apply_modules="
            r"{model.visual.blocks.\{*\}:{},lm_head:{}}",
            f"++{arr}.actor.optim.lr=3e-6",
            f"{arr}.actor.optim={{weight_decay:0.05,betas:[0.9,0.95]}}",  # a section as a dict: its keys
            f"actor@{arr}.actor=megatron_actor",  # one role's engine in verl's defaults list
            "data.max_response_length=48",
            "reward.reward_kwargs.max_resp_len=${data.max_response_length}",  # OmegaConf's interpolation
            "reward.reward_kwargs.overlong_buffer_cfg.enable=True",
            "trainer.logger=[console,'file']",
            "trainer.total_training_steps=3",
        ]
    )
    assert ours["actor.optim.lr"] == "3.0e-06" and ours["actor.optim.weight_decay"] == "0.05"
    assert ours["actor.optim.betas"] == "[0.9, 0.95]" and ours["actor.strategy"] == "megatron"
    assert ours["reward.overlong_buffer.enable"] == "true" and ours["trainer.logger"] == "[console, jsonl]"
    assert _ours(["~actor_rollout_ref.rollout.n", "trainer.total_training_steps=3"])["rollout.n"] == "1"  # verl's
    refused = {
        "actor_rollout_ref.rollout.n=4,8": r"is a sweep \(Hydra's multirun, one run per value\): give one value",
        "actor_rollout_ref.rollout.n=range(2,8)": "is a sweep",
        "trainer.logger=[console": "is not Hydra's syntax",
        "trainer.project_name=${nope.key}": r"\$\{nope.key\} names no key given on the command line",
        f"actor@{arr}.actor=mlite_actor": "a config group of another package .* is not known here",
    }
    for override, why in refused.items():
        with pytest.raises(ConfigError, match=why):
            translate([override, "trainer.total_training_steps=3"])
    shown = _hf("verl", "--dry-run", f"{arr}.model.path={tiny_model_dir}", "trainer.logger=[console", "x=1,2")
    assert shown.returncode == 2, shown.stdout + shown.stderr
    assert "Traceback" not in shown.stdout + shown.stderr
    assert "override 'trainer.logger=[console' is not Hydra's syntax" in shown.stdout, shown.stdout
    assert "override 'x=1,2' is a sweep" in shown.stdout


def test_verl_mains_engine_reward_and_checkpoint_engine_keys_translate_or_are_refused(tmp_path):
    """verl main's schema beside the older one: ``model_engine`` (the defaults group that replaced
    ``--config-name=ppo_megatron_trainer``) sets every role's strategy beneath an explicit one; the ``reward.*``
    section means what ``reward_model.*`` and ``custom_reward_function.*`` meant; the checkpoint engine's bucket
    size is ours; VeOmni's and FSDP's engine knobs are accepted as tuning, their parallelism refused; VeOmni's
    default lr schedule is its cosine decay."""
    arr, steps = "actor_rollout_ref", "trainer.total_training_steps=3"
    megatron = _ours(["model_engine=megatron", steps])
    assert (megatron["actor.strategy"], megatron["critic.strategy"]) == ("megatron", "megatron")
    assert _ours(["model_engine=megatron", "critic.strategy=fsdp", steps])["critic.strategy"] == "fsdp"
    assert _ours([f"{arr}.actor.model_engine=megatron", steps])["actor.strategy"] == "megatron"
    assert _ours(["model_engine=dp", steps])["actor.strategy"] == "fsdp"
    constant = [f"{role}.optim.lr_scheduler_type=constant" for role in (f"{arr}.actor", "critic")]
    assert _ours(["model_engine=veomni", *constant, steps])["actor.optim.lr_scheduler_type"] == "constant"
    veomni = _ours(["model_engine=veomni", steps])  # verl's optim/veomni.yaml: cosine to lr_min 0 over the run
    assert veomni["actor.strategy"] == "fsdp"
    assert {k: veomni[f"actor.optim.{k}"] for k in ("lr_scheduler_type", "min_lr_ratio", "decay_iterations")} == {
        "lr_scheduler_type": "cosine",
        "min_lr_ratio": "0.0",
        "decay_iterations": "3",
    }
    with pytest.raises(ConfigError, match="verl key model_engine='torchtitan' is not supported here"):
        translate(["model_engine=torchtitan", steps])

    reward = _ours(
        [
            "reward.custom_reward_function.path=/r/score.py",
            "reward.custom_reward_function.name=my_score",
            "reward.reward_manager.name=dapo",
            "reward.num_workers=8",
            "reward.reward_kwargs.overlong_buffer_cfg.enable=True",
            "reward.reward_kwargs.overlong_buffer_cfg.len=128",
            "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
            "reward.reward_kwargs.max_resp_len=512",
            "reward.reward_model.enable=True",
            "reward.reward_model.model_path=/m/rm",
            "reward.reward_model.rollout.tensor_model_parallel_size=2",
            f"{arr}.rollout.checkpoint_engine.update_weights_bucket_megabytes=2048",
            f"{arr}.actor.veomni.param_offload=True",
            "critic.fsdp.optimizer_offload=True",
            f"{arr}.model.lora.merge=True",
            steps,
        ]
    )
    expected = {
        "reward.custom_function": "/r/score.py:my_score",
        "reward.overlong_buffer.enable": "true",
        "reward.overlong_buffer.len": "128",
        "reward.overlong_buffer.penalty": "1.0",
        "reward_model.enable": "true",
        "reward_model.path": "/m/rm",
        "rollout.checkpoint_engine.update_weights_bucket_megabytes": "2048",
        "reward_model.judge.tensor_parallel_size": "2",  # the judge's engine (tests/test_judge.py runs one over 2)
    }
    assert {k: reward.get(k) for k in expected} == expected
    gdpo = _ours(  # examples/gdpo_trainer/run_qwen3_8b_fsdp.sh
        [
            "algorithm.adv_estimator=gdpo",
            "+algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]",
            "reward.reward_manager.name=gdpo",
            steps,
        ]
    )
    assert gdpo["algorithm.gdpo_reward_keys"] == "[accuracy_reward, format_reward]"
    assert gdpo["algorithm.adv_estimator"] == "gdpo"
    resumed = _ours(["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ck/global_step_20", steps])
    assert resumed["trainer.resume_from"] == "/ck/global_step_20"  # a new run from that checkpoint, as verl's
    assert "trainer.resume_from" not in _ours(["trainer.resume_from_path=/ck/global_step_20", steps])  # auto: ignored
    with pytest.raises(ConfigError, match="resume_mode=resume_path needs trainer.resume_from_path"):
        translate(["trainer.resume_mode=resume_path", steps])
    said = {key for key, _ in translate(["reward.num_workers=8", "critic.fsdp.param_offload=True", steps]).no_effect}
    assert said == {"reward.num_workers", "critic.fsdp.param_offload"}
    refused = {
        "reward.reward_manager.name=prime": "reward.reward_manager.name='prime' is not supported here",
        "reward.reward_manager.module.path=/my/manager.py": "write a score function",
        "reward.reward_kwargs.max_resp_len=256": "the overlong buffer ends at data.max_response_length",
        f"{arr}.actor.veomni.expert_parallel_size=8": "this one is not implemented: leave it at 1",
        f"{arr}.actor.fsdp_config.ulysses_sequence_parallel_size=4": f"{arr}.actor.fsdp_config.ulysses_sequence_par",
        "trainer.v1.trainer_mode=separate_async": "trainer.mode=one_step_off",
    }
    for key_value, why in refused.items():
        with pytest.raises(ConfigError, match=why):
            translate([key_value, "data.max_response_length=512", steps])
    from hybridflow.engine.config.verl_keys import find_key

    assert {find_key(k).schema for k in ("model_engine", "reward.num_workers", "distillation.enabled")} == {"current"}
    assert find_key("reward_model.micro_batch_size_per_gpu").schema == "legacy"
    assert find_key("data.train_files").schema == "both"


def test_verls_three_spellings_of_a_cosine_lr_schedule_are_ours():
    """FSDP's ``lr_scheduler_type`` (its older ``warmup_style`` winning when set), megatron-core's
    ``lr_decay_style`` with an absolute ``min_lr`` and ``lr_decay_steps`` (its warm-up ratio of those steps), and
    VeOmni's ``lr_min`` / ``lr_decay_ratio`` (its warm-up always the ratio's, ``lr_warmup_steps`` unread) are our
    cosine by iteration; the decays we do not have are refused by name."""
    actor, steps = "actor_rollout_ref.actor.optim", "trainer.total_training_steps=20"
    keys = ("lr_scheduler_type", "min_lr_ratio", "decay_iterations", "warmup_iterations")

    def schedule(*args: str) -> dict:
        ours = _ours([*args, f"{actor}.lr=1e-6", steps])
        return {k: ours[f"actor.optim.{k}"] for k in keys if f"actor.optim.{k}" in ours}

    fsdp = schedule(f"{actor}.lr_scheduler_type=cosine", f"{actor}.min_lr_ratio=0.1", f"{actor}.lr_warmup_steps=2")
    assert fsdp == {"lr_scheduler_type": "cosine", "min_lr_ratio": "0.1", "warmup_iterations": "2"}
    older = schedule(f"{actor}.warmup_style=cosine", f"{actor}.lr_scheduler_type=constant")
    assert older["lr_scheduler_type"] == "cosine"
    assert schedule(f"{actor}.warmup_style=null", f"{actor}.lr_scheduler_type=cosine")["lr_scheduler_type"] == "cosine"
    megatron = schedule(
        "model_engine=megatron",
        f"{actor}.lr_decay_style=cosine",
        f"{actor}.min_lr=2e-7",
        f"{actor}.lr_decay_steps=8",
        f"{actor}.lr_warmup_steps_ratio=0.25",
    )
    assert megatron == {
        "lr_scheduler_type": "cosine",
        "min_lr_ratio": str(2e-7 / 1e-6),
        "decay_iterations": "8",
        "warmup_iterations": "2",  # int(0.25 x lr_decay_steps)
    }
    veomni = schedule(
        "model_engine=veomni",
        f"{actor}.lr_min=1e-7",
        f"{actor}.lr_decay_ratio=0.5",
        f"{actor}.lr_warmup_steps_ratio=0.1",
        f"{actor}.lr_warmup_steps=7",  # VeOmni's build_lr_scheduler reads the ratio only
    )
    assert veomni == {
        "lr_scheduler_type": "cosine",
        "min_lr_ratio": str(1e-7 / 1e-6),
        "decay_iterations": "10",
        "warmup_iterations": "2",
    }
    _each_refused(
        {
            f"{actor}.lr_decay_style=linear": "linear, inverse-square-root and WSD decays are not implemented",
            f"{actor}.lr_start=1e-8": "the warm-up starts at lr 0",
            f"{actor}.zero_indexed_step=False": "counts iterations from 0",
        },
        steps,
    )


def test_the_rest_of_verl_mains_schema_is_tuning_or_a_feature_taken_only_off():
    """verl main's generated schema beyond its scripts' keys (benchmarks/verl_examples.py checks all 1234 leaf keys
    of verl 1dda039 against the table): engine tuning is accepted and named as having no effect; a feature that is
    not here (MTP, quantisation-aware training, a critic's expert parallelism, a LoRA critic, a row cap, the
    sandbox) is taken only at verl's default, off, and refused otherwise naming it."""
    arr, steps = "actor_rollout_ref", "trainer.total_training_steps=3"
    tuning = [
        f"{arr}.actor.torchtitan.compile=True",
        f"{arr}.rollout.seed=7",
        f"{arr}.actor.megatron.pad_to_length_bucket=256",
        f"{arr}.model.mtp.num_speculative_tokens=2",
        f"{arr}.model.mtp.enable=False",
        f"{arr}.actor.qat.mode=w8a8",
        "critic.optim.muon_momentum=0.9",
        f"{arr}.ref.optim.lr=1e-3",
        f"{arr}.rollout.disaggregation.prefill_replicas=2",
    ]
    said = {key for key, _ in translate([*tuning, steps]).no_effect}
    assert said == {item.split("=")[0] for item in tuning}
    for key_value, why in {
        f"{arr}.model.mtp.enable=True": "multi-token prediction .* is not implemented",
        f"{arr}.actor.qat.enable=True": "quantisation-aware training is not implemented",
        "critic.megatron.expert_model_parallel_size=2": "this one is not implemented: leave it at 1",
        "critic.model.lora_rank=8": "a LoRA critic is not implemented",
        "data.train_max_samples=100": "give a smaller file",
        "reward.sandbox_fusion.url=http://127.0.0.1:8080": "the sandbox-fusion reward is not implemented",
        f"{arr}.actor.optim.exp_avg_dtype=bf16": "AdamW's moments are kept in fp32",
        f"{arr}.rollout.quantization=fp8": "unquantised",
    }.items():
        with pytest.raises(ConfigError, match=why):
            translate([key_value, steps])
    from hybridflow.engine.config.verl_keys import find_key

    assert (find_key(f"{arr}.actor.torchtitan.compile").schema, find_key(f"{arr}.model.mtp.enable").schema) == (
        "current",
        "both",
    )


def test_verls_router_replay_and_moe_loss_keys_are_ours():
    """verl's router replay (the legacy actor's key and the megatron engine's) is actor.router_replay.mode, its
    rollout switch for R3 is said to have no effect (the hf rollout records whenever R3 asks), megatron-core's MoE
    loss coefficients are actor.moe.*, its expert parallelism and dispatcher actor.ep and
    actor.moe.token_dispatcher_type; replay files and another load-balancing type are refused."""
    arr, steps = "actor_rollout_ref", "trainer.total_training_steps=3"
    tc = f"{arr}.actor.megatron.override_transformer_config"
    megatron = [
        f"{arr}.actor.megatron.router_replay.mode=R3",
        f"{arr}.rollout.enable_rollout_routing_replay=True",
        f"+{tc}.moe_aux_loss_coeff=0.01",
        f"+{tc}.moe_z_loss_coeff=0.001",
        f"+{tc}.moe_router_dtype=fp32",
        f"+{tc}.moe_token_dispatcher_type=alltoall",
        f"+{tc}.moe_permute_fusion=True",
        f"{arr}.actor.megatron.expert_model_parallel_size=4",
        f"{arr}.actor.megatron.expert_tensor_parallel_size=null",
        steps,
    ]
    ours = _ours(megatron)
    assert (ours["actor.router_replay.mode"], ours["actor.moe.aux_loss_coeff"], ours["actor.moe.z_loss_coeff"]) == (
        "R3",
        "0.01",
        "0.001",
    )
    assert (ours["actor.ep"], ours["actor.moe.token_dispatcher_type"]) == ("4", "alltoall")
    flex = _ours([f"+{tc}.moe_token_dispatcher_type=flex", steps])
    assert flex["actor.moe.token_dispatcher_type"] == "alltoall"  # DeepEP's path moves the same tokens
    said = {key for key, _ in translate(megatron).no_effect}
    assert {f"{arr}.rollout.enable_rollout_routing_replay", f"{tc}.moe_router_dtype"} <= said
    assert _ours([f"{arr}.actor.router_replay.mode=R2", steps])["actor.router_replay.mode"] == "R2"
    _each_refused(
        {
            f"{arr}.actor.router_replay.record_file=/tmp/routes.pt": "routes travel in the batch",
            f"+{tc}.moe_router_load_balancing_type=seq_aux_loss": "megatron-core's aux_loss",
            f"+{tc}.moe_router_dtype=bf16": "softmax in fp32",
        },
        steps,
    )


def test_sapo_takes_verls_actor_level_temperatures():
    """SAPO (examples/sapo_trainer): ``policy_loss.loss_mode=sapo`` is ours; verl's loss reads ``actor.tau_pos`` /
    ``tau_neg``, which are ours; the ``+policy_loss.tau_*`` its example scripts add are not read by verl, and are
    accepted as having no effect (named when the run starts)."""
    arr, steps = "actor_rollout_ref.actor", "trainer.total_training_steps=3"
    given = [f"{arr}.policy_loss.loss_mode=sapo", f"{arr}.tau_neg=2.0", f"+{arr}.policy_loss.tau_pos=1.0", steps]
    ours = _ours(given)
    assert (ours["actor.policy_loss.loss_mode"], ours["actor.policy_loss.tau_neg"]) == ("sapo", "2.0")
    assert "actor.policy_loss.tau_pos" not in ours
    assert f"{arr}.policy_loss.tau_pos" in {key for key, _ in translate(given).no_effect}


def test_verl_mains_distillation_section_is_our_teacher_or_refused_naming_what_is_not_implemented():
    """``distillation.*`` (verl main's examples/on_policy_distillation_trainer): one teacher is our teacher role.
    Policy-gradient k1 is ``teacher.use_as=reward``, the supervised k2/k3/abs ``use_as=loss``; use_task_rewards
    False trains on the teacher alone (and drops the entropy bonus and KL loss, as verl drops the PPO loss);
    loss_max_clamp clamps each token's KL. Several teachers are ``teacher.routes`` by their keys (teacher_key: the
    route column); forward_kl_topk is ``teacher.top_k_kl=forward``. Several teachers without keys, a policy-gradient
    term over several mini-batches and a rollout temperature other than 1 are refused with what to do."""
    arr, loss = "actor_rollout_ref", "distillation.distillation_loss"
    script = [  # run_qwen3_8b_fsdp.sh's distillation keys
        "distillation.enabled=True",
        "distillation.n_gpus_per_node=4",
        "distillation.nnodes=1",
        "distillation.teacher_models.teacher_model.model_path=/m/teacher",
        "distillation.teacher_models.teacher_model.inference.name=vllm",
        "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=4",
        "distillation.teacher_models.teacher_model.inference.gpu_memory_utilization=0.4",
        f"{loss}.loss_mode=k1",
        f"{loss}.topk=64",
        f"{loss}.use_task_rewards=False",
        f"{loss}.use_policy_gradient=True",
        f"{loss}.loss_max_clamp=10.0",
        f"{loss}.log_prob_min_clamp=-10.0",
        "data.train_batch_size=128",
        f"{arr}.actor.ppo_mini_batch_size=128",
        f"{arr}.actor.entropy_coeff=0.01",
        "trainer.total_training_steps=3",
    ]
    ours = _ours(script)
    expected = {
        "teacher.model_path": "/m/teacher",
        "teacher.use_as": "reward",
        "teacher.task_coef": "0.0",
        "teacher.kl_coef": "1.0",
        "teacher.kl_clamp": "10.0",
        "actor.entropy_coeff": "0.0",  # verl's use_task_rewards=False replaces the whole PPO loss
        "actor.use_kl_loss": "false",
    }
    assert {k: ours.get(k) for k in expected} == expected
    supervised = _ours(
        [*script, f"{loss}.use_policy_gradient=False", f"{loss}.loss_mode=low_var_kl", f"{loss}.use_task_rewards=True"]
        + [f"{loss}.distillation_loss_coef=0.5"]
    )
    assert (supervised["teacher.use_as"], supervised["teacher.kl_loss_type"]) == ("loss", "k3")
    assert (supervised["teacher.task_coef"], supervised["teacher.kl_coef"]) == ("1.0", "0.5")
    assert "teacher.model_path" not in _ours(["distillation.enabled=False", *script[3:]])  # verl ignores the rest
    single_named = [k.replace("teacher_models.teacher_model.", "teacher_models.gsm8k.") for k in script]  # named
    assert _ours(["+distillation.teacher_models.gsm8k.key=openai/gsm8k", *single_named])["teacher.model_path"]
    several = _ours(  # verl's multi-teacher: one teacher per teacher_key value, verl's placeholder teacher dropped
        [
            *script,
            "+distillation.teacher_models.gsm8k.key=openai/gsm8k",
            "+distillation.teacher_models.gsm8k.model_path=/m/math",
            "+distillation.teacher_models.mbpp.key=mbpp",
            "+distillation.teacher_models.mbpp.model_path=/m/code",
        ]
    )
    assert several["teacher.routes"] == "{mbpp: /m/code, openai/gsm8k: /m/math}"
    assert "teacher.model_path" not in several
    assert _ours([*script, "distillation.teacher_key=ability"])["teacher.route_key"] == "ability"
    refused = {
        "+distillation.teacher_models.math.model_path=/m/math": r"several teachers needs its own key, .* \(gsm8k, math",
        f"{loss}.loss_mode=k3": "the policy-gradient term takes k1",
        f"{arr}.actor.ppo_mini_batch_size=32": "one mini-batch of one epoch",
        f"{arr}.rollout.temperature=0.7": "verl's teacher scores at temperature 1",
    }
    for key_value, why in refused.items():
        with pytest.raises(ConfigError, match=why):
            translate([*(single_named if "math" in key_value else script), key_value])
    forward = _ours(  # examples/on_policy_distillation_trainer/run_qwen3_8b_megatron.sh
        [*script, f"{loss}.use_policy_gradient=False", f"{loss}.loss_mode=forward_kl_topk", f"{loss}.topk=16"]
        + [f"{loss}.log_prob_min_clamp=-10.0", "model_engine=megatron"]
    )
    assert {k: forward.get(k) for k in ("teacher.use_as", "teacher.top_k", "teacher.top_k_kl")} == {
        "teacher.use_as": "loss",
        "teacher.top_k": "16",
        "teacher.top_k_kl": "forward",
    }
    assert (forward["teacher.log_prob_floor"], forward["teacher.kl_clamp"]) == ("-10.0", "10.0")
    assert forward["actor.strategy"] == "megatron"  # the loss on megatron (tests/test_megatron.py)
