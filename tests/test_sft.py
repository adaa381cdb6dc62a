"""Supervised fine-tuning (``hf sft train``, issue 31's warm-up): conversations tokenized exactly as an agent rollout
lays out its trajectories, tool-use demonstrations made with the real tool (wrong labels left out), and `hf sft
train` end to end on the tiny model (real CLI, Prefect server, SQLite store): the held-out loss falls, the run is on
record as kind ``sft``, `hf resume -o trainer.total_epochs=2` continues it exactly as an uninterrupted 2-epoch run,
and the result loads as an RL run's ``model.path``."""

from pathlib import Path

import pytest
import torch
import yaml
from tiny_runs import hf_cli, metrics_by_step
from transformers import AutoModelForCausalLM

from hybridflow.engine.agent.chat_format import ChatFormat
from hybridflow.engine.agent.demonstrations import build_demonstrations, tool_call_text
from hybridflow.engine.agent.rollout import run_tools
from hybridflow.engine.config import ConfigError, SFTTrainingConfig, load_config
from hybridflow.engine.data import build_prompt_rows, encode_prompt
from hybridflow.engine.sft.conversations import load_conversations, tokenize_conversation
from hybridflow.flows.store.run_store import RunStore

ROOT = Path(__file__).resolve().parent.parent


def rl_config(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """An RL config with the calculator tool on small arithmetic prompts: the demonstrations' source."""
    tree = {
        "model": {"path": str(tiny_model_dir)},
        "data": {
            "reasoning_gym": {
                "name": "basic_arithmetic",
                "config": {"min_terms": 2, "max_terms": 2, "operators": ["+", "-", "*"]},
                "train_size": 72,
                "val_size": 8,
                "instruction": "Use the calculator.",
            },
            "max_prompt_length": 1024,
        },
        "rollout": {
            "multi_turn": {"enable": True, "tool_config_path": str(ROOT / "examples" / "tools" / "calculator.yaml")}
        },
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def sft_config(tmp_path: Path, tiny_model_dir: Path, *extra: str) -> SFTTrainingConfig:
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.demonstrations.rl_config={rl_config(tmp_path, tiny_model_dir)}",
            "data.val_fraction=0.125",
            "data.max_length=1024",
            "data.train_batch_size=8",
            "data.micro_batch_size=4",
            "optim.lr=1e-3",
            "trainer.num_threads=1",
            f"trainer.output_dir={tmp_path / 'out'}",
            *extra,
        ],
        SFTTrainingConfig,
    )


def test_a_conversation_is_tokenized_as_the_agent_rollout_lays_it_out(tiny_tokenizer):
    tok = tiny_tokenizer
    fmt = ChatFormat(tok, [tok.eos_token_id])
    tools = run_tools(load_config(None, ["rollout.multi_turn.enable=true", "data.train_files=[x.jsonl]",
        f"rollout.multi_turn.tool_config_path={ROOT / 'examples' / 'tools' / 'calculator.yaml'}"]))  # fmt: skip
    prompt = [{"role": "user", "content": "Calculate 12 * 34."}]
    call = tool_call_text("calculator", {"expression": "12 * 34"})
    conversation = {
        "messages": [*prompt, {"role": "assistant", "content": call}, {"role": "tool", "content": "408"},
                     {"role": "assistant", "content": "408"}],
        "tools": tools.schemas,
    }  # fmt: skip
    ids, mask = tokenize_conversation(conversation, tok, fmt, tok.eos_token_id)
    head = encode_prompt(prompt, tok, True, tools.schemas)  # the rollout's prompt, tools offered
    turn1 = tok.encode(call, add_special_tokens=False) + [tok.eos_token_id]
    tool = fmt.tool_turn_ids(["408"])  # what the agent loop appends after the model's end token
    turn2 = tok.encode("408", add_special_tokens=False) + [tok.eos_token_id]
    assert ids == head + turn1 + tool + turn2
    assert mask == [0] * len(head) + [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    # a trailing message after the last assistant turn teaches nothing and is not kept
    longer = {**conversation, "messages": [*conversation["messages"], {"role": "user", "content": "thanks"}]}
    assert tokenize_conversation(longer, tok, fmt, tok.eos_token_id) == (ids, mask)


def test_demonstrations_run_the_tool_and_leave_out_wrong_labels(tmp_path, tiny_model_dir):
    rl = load_config(rl_config(tmp_path, tiny_model_dir))
    rows, _ = build_prompt_rows(rl.data)
    rows[0] = {**rows[0], "reward_model": {"ground_truth": "-1"}}  # a false label
    made, counts = build_demonstrations(rows, "calculator", run_tools(rl))
    assert counts == {"made": len(rows) - 1, "no_call": 0, "tool_error": 0, "wrong_label": 1}
    first = made[0]["messages"]
    assert [m["role"] for m in first] == ["user", "assistant", "tool", "assistant"]
    assert first[2]["content"] == first[3]["content"] == rows[1]["reward_model"]["ground_truth"]
    assert rows[1]["extra_info"]["entry"]["metadata"]["expression"] in first[1]["content"]
    with pytest.raises(ValueError, match="unknown data.demonstrations.builder"):
        build_demonstrations(rows, "nope", run_tools(rl))


def test_python_demonstrations_run_real_code_in_the_sandbox(tiny_model_dir):
    # the interpreter example's own config: a products generator over grpo_smollm2.yaml's basic_arithmetic, whose
    # generator options (operators, ...) it does not inherit
    rl = load_config(ROOT / "examples" / "tool_python_smollm2.yaml", [f"model.path={tiny_model_dir}",
        "data.reasoning_gym.train_size=6", "data.reasoning_gym.val_size=2"])  # fmt: skip
    assert rl.data.reasoning_gym.name == "products" and "operators" not in rl.data.reasoning_gym.config
    rows, _ = build_prompt_rows(rl.data)
    rows[0] = {**rows[0], "reward_model": {"ground_truth": "7"}}  # a false label
    made, counts = build_demonstrations(rows, "python", run_tools(rl))
    assert counts == {"made": len(rows) - 1, "no_call": 0, "tool_error": 0, "wrong_label": 1}
    for demo, row in zip(made, rows[1:], strict=True):
        call, output = demo["messages"][-3]["content"], demo["messages"][-2]["content"]
        expression = row["extra_info"]["entry"]["metadata"]["expression"]
        assert tool_call_text("python", {"code": f"print({expression})"}) == call
        assert output.strip() == row["reward_model"]["ground_truth"]  # what the sandboxed code printed
        assert [t["function"]["name"] for t in demo["tools"]] == ["python"]


def test_conversation_files_and_config_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match="row 0: the conversation has no assistant turn"):
        load_conversations(path)
    with pytest.raises(ConfigError, match="data.train_files .conversations. or data.demonstrations"):
        load_config(None, ["data.val_fraction=0.1"], SFTTrainingConfig)


def hf_sft_train(prefect_api: str, tmp_path: Path, cfg: SFTTrainingConfig):
    """``hf sft train`` of `cfg` written to a file, into a store under `tmp_path`; asserts that it succeeded.
    Returns (the process, the store's URL, the store, the run's record)."""
    config_file = tmp_path / "sft.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    trained = hf_cli(prefect_api, "sft", "train", str(config_file), "--db", db)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    store = RunStore(db)
    [run] = store.list_runs()
    return trained, db, store, run


def test_hf_sft_train_under_fsdp_lowers_the_held_out_loss_and_resumes_as_one_rank_trains(
    prefect_api, tmp_path, tiny_model_dir
):
    """``hf sft train`` on two ranks with ``model.strategy=fsdp`` (weights and Adam states sharded) and its ``hf
    resume`` train step for step as the uninterrupted one-rank run does (every token weighs the same however a step
    is split; within float rounding), and the result is the whole model."""
    from test_dpo import FSDP_REL

    from hybridflow.flows.sft import sft_flow

    (tmp_path / "ref").mkdir()
    reference_cfg = sft_config(tmp_path / "ref", tiny_model_dir, "trainer.total_epochs=2")
    reference_store = RunStore(f"sqlite:///{tmp_path / 'ref' / 'runs.db'}")
    reference_id = reference_store.create_run(reference_cfg.model_dump(mode="json"), "sft", kind="sft")
    sft_flow(run_id=reference_id, db_url=reference_store.url)
    reference = metrics_by_step(reference_store, reference_id)

    sharded = ["placement.tasks_per_node=2", "model.strategy=fsdp"]
    cfg = sft_config(tmp_path, tiny_model_dir, "trainer.total_epochs=1", *sharded)
    trained, db, store, run = hf_sft_train(prefect_api, tmp_path, cfg)
    assert run.kind == "sft" and run.status == "completed"
    metrics = metrics_by_step(store, run.id)
    steps = max(metrics)  # one epoch of whole batches of 8 demonstrations (about 60 of them)
    assert steps >= 6 and sorted(metrics) == list(range(steps + 1))  # step 0: the initial model's held-out loss
    before, after = metrics[0]["val/loss"], metrics[steps]["val/loss"]
    assert after < before - 0.4, (before, after)  # measured: 5.91 -> 5.14 nats per learned token
    [placed] = store.placements(run.id)
    assert placed.role == "actor" and placed.parallel["strategy"] == "fsdp", placed.parallel
    folder = Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name / run.id / "model"
    assert f"model.path={folder.resolve()}" in " ".join(trained.stdout.split())

    resumed = hf_cli(prefect_api, "resume", run.id, "--db", db, "-o", "trainer.total_epochs=2")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"from step {steps}" in resumed.stdout
    metrics = metrics_by_step(store, run.id)
    assert sorted(metrics) == list(range(2 * steps + 1))
    assert [c.step for c in store.checkpoints(run.id)] == [steps, 2 * steps]
    for step in range(1, 2 * steps + 1):  # the same run as the uninterrupted one, step for step
        for name in ("train/loss", "train/grad_norm"):
            assert metrics[step][name] == pytest.approx(reference[step][name], rel=FSDP_REL, abs=1e-6), (step, name)
    assert metrics[2 * steps]["val/loss"] == pytest.approx(reference[2 * steps]["val/loss"], rel=FSDP_REL)

    # the result is a causal LM folder an RL run starts from, its weights the last checkpoint's
    assert not (folder / "optim.pt").exists()
    model = AutoModelForCausalLM.from_pretrained(folder)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert any(
        not torch.equal(a, b) for a, b in zip(model.state_dict().values(), initial.state_dict().values(), strict=True)
    )


def test_lora_sft_trains_an_adapter_that_an_rl_run_starts_from(prefect_api, tmp_path, tiny_model_dir):
    """``hf sft train -o model.lora_rank=8``: the held-out loss falls with only the adapter trained, the result is the
    adapter in PEFT's layout, and the command prints the overrides an RL run starts from it with; an RL config with
    them loads the adapter onto the base model."""
    from hybridflow.engine.backends.lora import ADAPTER_WEIGHTS, LoraAdapter
    from hybridflow.engine.models import load_model

    cfg = sft_config(tmp_path, tiny_model_dir, "trainer.total_epochs=1", "model.lora_rank=8", "optim.lr=1e-2")
    trained, db, store, run = hf_sft_train(prefect_api, tmp_path, cfg)
    metrics = metrics_by_step(store, run.id)
    assert metrics[max(metrics)]["val/loss"] < metrics[0]["val/loss"] - 0.2, metrics
    [placed] = store.placements(run.id)
    assert 0 < placed.parallel["trainable_params"] < placed.parallel["params"]
    folder = (Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name / run.id / "model").resolve()
    assert (folder / ADAPTER_WEIGHTS).is_file() and not (folder / "model.safetensors").exists()
    printed = " ".join(trained.stdout.split())
    assert f"-o model.lora_rank=8 -o model.lora_adapter_path={folder}" in printed, printed[-2000:]
    start = load_config(None, [f"model.path={tiny_model_dir}", "model.lora_rank=8", f"model.lora_adapter_path={folder}",
                               "data.train_files=x.parquet"])  # fmt: skip
    adapter = LoraAdapter(load_model(tiny_model_dir, torch.float32, "cpu"), start.model)
    assert adapter.trainable_parameters() == placed.parallel["trainable_params"]
