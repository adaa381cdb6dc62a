"""Shared by the tests that train the tiny model: a dense custom reward and a small run configuration.

The tiny random model never answers arithmetic right, so a reward that varies across samples (the share of digit
characters) is needed for non-zero advantages; it is written to a file and loaded as ``path.py:function``.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hybridflow.engine.config import HybridFlowConfig, load_config


def wait_inside_iteration(proc: subprocess.Popen, store, step: int, log: Path | None = None, timeout_s=240) -> str:
    """Wait until the run of `proc` (``hf run``, the only run in `store`) is inside iteration `step` (started,
    not ended); returns the run id. Its output (for a failure's message) is its stdout pipe, or the file `log`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = store.list_runs()
        if runs:
            started = {i.step: i for i in store.iterations(runs[0].id)}
            if step in started and started[step].ended_at is None:
                return runs[0].id
        assert proc.poll() is None, log.read_text() if log is not None else proc.stdout.read().decode()
        time.sleep(0.05)
    raise AssertionError(f"hf run never reached iteration {step}")


def killed_inside_iteration(config: dict, tmp_path: Path, prefect_api: str, step: int) -> tuple[Any, str]:
    """The run of `config` through ``hf run`` in a store of its own (``killed.db`` in `tmp_path`), its controller
    SIGKILLed inside iteration `step`: the store and the run's id, for ``hf resume``."""
    import yaml

    from hybridflow.flows.store.run_store import RunStore

    config_file = tmp_path / "killed.yaml"
    config_file.write_text(yaml.safe_dump(config))
    db = f"sqlite:///{tmp_path / 'killed.db'}"
    hf = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
    proc = subprocess.Popen(
        [hf, "run", str(config_file), "--db", db, "--prefect-api", prefect_api],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    store = RunStore(db)
    run_id = wait_inside_iteration(proc, store, step)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return store, run_id


def rank_pids(run_id: str, group: str = "") -> list[int]:
    """The pids of worker group `group`'s ranks of run `run_id`, every group's by default (local executor: the
    processes whose stderr is a log file in the group's log folder ``<run>/submitit/<group>/``; wherever they were
    forked from: the controller's fork server, or a warm process's)."""
    folder = f"/{run_id}/submitit/{group}/" if group else f"/{run_id}/submitit/"
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stderr = os.readlink(proc / "fd" / "2")
        except OSError:
            continue
        if folder in stderr and re.search(r"_\d+_log\.err$", stderr):  # not a node's task
            pids.append(int(proc.name))
    return [pid for pid in pids if _parent(pid) not in pids]  # not a rank's own children (its scoring processes)


def _parent(pid: int) -> int | None:
    """The parent pid of `pid` (None: it has ended)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def write_reward_model(folder: Path, tokenizer, seed: int = 0) -> Path:
    """A random one-label Llama sequence classifier over `tokenizer`'s vocabulary, saved with it in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_labels=1, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )  # fmt: skip
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def worker_group(root: Path, name: str, worker_cls: str, ranks: int, config, roles: list[str]):
    """A local worker group of `ranks` processes serving `worker_cls` with `config` and `roles`, its files under
    `root` (which needs the channel's ``secret``: `hybridflow.slurm.channel.create_secret`)."""
    from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup

    return WorkerGroup(
        GroupSpec(name=name, worker_cls=worker_cls, tasks_per_node=ranks),
        run_dir=root,
        data_dir=root / "data",
        secret_path=root / "secret",
        worker_kwargs={"config": config.model_dump(mode="json"), "roles": roles},
    )


DENSE_REWARD = '''
def digit_share(data_source, solution_str, ground_truth, extra_info):
    """Fraction of characters that are digits: varies across samples, so advantages are non-zero."""
    return {"score": sum(c.isdigit() for c in solution_str) / max(1, len(solution_str)), "acc": 0.0}
'''


COMPARED = ("response_length/mean", "critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm")
"""The metrics a run is compared by with the same run elsewhere (interrupted, resubmitted, on other nodes)."""


def write_reward(root: Path) -> str:
    """Write the dense reward into `root`; returns its ``reward.custom_function`` spec."""
    reward_file = Path(root) / "my_reward.py"
    reward_file.write_text(DENSE_REWARD)
    return f"{reward_file}:digit_share"


LENGTH_COST = '''
def length_cost(data_source, solution_str, ground_truth, extra_info):
    """Safe-RLHF's cost: the response's characters / 20 (the tiny model's responses vary in length)."""
    return len(solution_str) / 20
'''


def write_cost(root: Path) -> str:
    """Write the length cost into `root`; returns its ``reward.cost_function`` spec."""
    cost_file = Path(root) / "my_cost.py"
    cost_file.write_text(LENGTH_COST)
    return f"{cost_file}:length_cost"


def tiny_run_config(root: Path, model_dir: Path, estimator: str, extra: list[str] | tuple = ()) -> HybridFlowConfig:
    """A one-line-per-key small run: 4 prompts x 2 samples, 12 new tokens, outputs under `root`."""
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            "data.reasoning_gym.name=basic_arithmetic",
            "data.reasoning_gym.train_size=32",
            "data.reasoning_gym.val_size=4",
            "data.train_batch_size=4",
            "rollout.n=2",
            "rollout.response_length=12",
            "actor.ppo_mini_batch_size=2",
            "actor.ppo_micro_batch_size=2",
            "actor.optim.lr=1e-3",
            "critic.ppo_mini_batch_size=2",
            "critic.optim.lr=1e-3",
            f"algorithm.adv_estimator={estimator}",
            f"reward.custom_function={write_reward(root)}",
            f"trainer.output_dir={Path(root) / 'outputs'}",
            *extra,
        ],
    )


def resumed_runs(roots: tuple[Path, Path], model_dir: Path, extra: list[str], total: int, cut: int, saves=()):
    """The single-process trainer (GRPO, `tiny_run_config` with `extra`) for `total` iterations uninterrupted
    (`saves`: its further overrides, e.g. a save_freq) in ``roots[0]``, and for `cut` iterations then resumed to
    `total` by a new trainer in ``roots[1]``. Returns (uninterrupted trainer, its records, resumed trainer, its
    records)."""
    from hybridflow.engine.trainer import SingleProcessTrainer

    def fit(root: Path, *more: str):
        trainer = SingleProcessTrainer(tiny_run_config(root, model_dir, "grpo", [*extra, *more]))
        return trainer, trainer.fit(log=lambda r: None)

    a, records_a = fit(roots[0], f"trainer.total_iterations={total}", *saves)
    fit(roots[1], f"trainer.total_iterations={cut}")
    b, records_b = fit(roots[1], f"trainer.total_iterations={total}", "trainer.resume_from=auto")
    return a, records_a, b, records_b


AGENT = '''
from hybridflow.engine.agent.loop import AgentLoop, AgentLoopOutput


def echo(text: str) -> str:
    """Say `text` back.

    Args:
        text: what to say
    """
    return f"echo:{text}"


class ShortTurns(AgentLoop):
    """Turns of at most 4 tokens, each followed by an echo tool turn while the budget lasts: the random tiny model
    never writes a tool call or stops, so this loop makes its trajectories multi-turn."""

    async def run(self, sampling_params, **row):
        out = AgentLoopOutput(self.prompt_ids(row))
        budget = sampling_params.max_tokens
        while True:
            turn = await self.engine.generate(out.prompt_ids + out.response_ids, min(4, budget - len(out.response_ids)))
            out.add_model_turn(turn)
            if turn.stopped or len(out.response_ids) >= budget:
                break
            answer = await self.context.tools.call("echo", {"text": self.context.tokenizer.decode(turn.ids)[-3:]})
            out.tool_calls["echo"] += 1
            ids = self.context.chat_format.tool_turn_ids([answer.text])
            if len(out.response_ids) + len(ids) >= budget:
                break
            out.add_tool_turns(ids, 1)
        return out
'''


def agent_overrides(root: Path) -> list[str]:
    """Config overrides for multi-turn rollouts on the tiny model: the `ShortTurns` loop and its echo tool, written
    into `root` and named by path, as a user's own loop and tools would be."""
    agent_file = Path(root) / "my_agent.py"
    agent_file.write_text(AGENT)
    tools = Path(root) / "tools.yaml"
    tools.write_text(f"tools:\n  - function: {agent_file}:echo\n")
    return [
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config_path={tools}",
        f"rollout.multi_turn.default_agent_loop={agent_file}:ShortTurns",
        "rollout.response_length=64",
        "data.max_prompt_length=512",
    ]


HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"


def hf_cli(prefect_api: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``hf ARGS --prefect-api URL`` as a separate process, its output captured."""
    return subprocess.run([HF, *args, "--prefect-api", prefect_api], capture_output=True, text=True, timeout=timeout)


def metrics_by_step(store, run_id: str) -> dict[int, dict[str, float]]:
    """A run's metrics from the store: step -> {name: value}."""
    out: dict[int, dict[str, float]] = {}
    for p in store.metrics(run_id):
        out.setdefault(p.step, {})[p.name] = p.value
    return out


def hf_run_metrics(prefect_api: str, root: Path, model_dir: Path, overrides: list[str]) -> dict[int, dict[str, float]]:
    """``hf run`` of `tiny_run_config` (GRPO) with `overrides`, from a config file as a user runs one, into a store
    of its own under `root`; asserts that it succeeded and returns its recorded metrics (`metrics_by_step`)."""
    import yaml

    from hybridflow.flows.store.run_store import RunStore

    config_file = root / "run.yaml"
    config_file.write_text(yaml.safe_dump(tiny_run_config(root, model_dir, "grpo", overrides).model_dump(mode="json")))
    db = f"sqlite:///{root / 'runs.db'}"
    done = hf_cli(prefect_api, "run", str(config_file), "--db", db)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    store = RunStore(db)
    [run] = store.list_runs()
    return metrics_by_step(store, run.id)


def environment_rollout(tiny, model_dir: Path, loop: str, data: dict | None = None, **multi_turn):
    """An agent rollout of the tiny model (`tiny`: its model and tokenizer, as loaded) running `loop` on every row:
    2 samples per prompt, 64 response tokens, turns that stop early (ids 5-39 end a turn too), the config's
    `data` section (unused files by default) and ``rollout.multi_turn`` keys `multi_turn`."""
    from hybridflow.engine.agent.rollout import AgentLoopRollout
    from hybridflow.engine.config import validate_config
    from hybridflow.engine.rollout.hf import HFRollout

    model, tokenizer = tiny
    tree = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "data": data or {"train_files": ["unused.jsonl"]},
        "rollout": {
            "n": 2,
            "response_length": 64,
            "micro_batch_size": 4,
            "multi_turn": {"enable": True, "default_agent_loop": loop, **multi_turn},
        },
        "trainer": {"seed": 5},
    }
    cfg = validate_config(tree)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *range(5, 40)]  # turns that stop early
    return AgentLoopRollout(HFRollout(model, tokenizer, cfg.rollout, seed=5), cfg, tokenizer)
