"""The auto-mapping planner (`hybridflow.mapping`, `hf plan`): placements, the cost model's memory and seconds,
bad input refused with the numbers, and a written plan run through `hf run` on local worker groups."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_runs import write_reward

from hybridflow.engine.config import load_config
from hybridflow.flows.store import RunStore
from hybridflow.mapping.cost import Strategy, Workload, estimate
from hybridflow.mapping.hardware import BUILTIN, GB
from hybridflow.mapping.planner import PlanError, Planner, set_partitions
from hybridflow.mapping.render import apply_plan
from hybridflow.mapping.shapes import PRESETS, run_models

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
A100 = BUILTIN["a100-80gb"]
PAPER = Workload(  # the paper's workload (section 8.1): 1,024-token prompts and responses
    sequences=1024, prompt_length=1024, response_length=1024, actor_steps=1, critic_steps=1,
    train_micro_batch=2, critic_micro_batch=2, infer_micro_batch=8, gen_micro_batch=64,
)  # fmt: skip


def _ppo(*extra: str):
    """PPO with a critic, a KL loss (ref) and, with reward_model.enable, a reward model; the models at preset size."""
    return load_config(ROOT / "examples" / "ppo_tiny.yaml", ["actor.use_kl_loss=true", *extra])


@pytest.mark.parametrize(
    ("extra", "models", "bell"),
    [
        (["algorithm.adv_estimator=grpo", "actor.use_kl_loss=false"], ["actor"], 1),
        (["algorithm.adv_estimator=grpo"], ["actor", "ref"], 2),
        ([], ["actor", "critic", "ref"], 5),
        (["reward_model.enable=true", "reward_model.path=x"], ["actor", "critic", "ref", "reward_model"], 15),
    ],
)
def test_placements_are_the_bell_number_of_the_models_with_actor_and_rollout_together(extra, models, bell):
    cfg = _ppo(*extra)
    shapes = run_models(cfg, "llama-7b")
    assert list(shapes) == models
    planner = Planner(shapes, PAPER, A100, nodes=16, gpus_per_node=8, space="all")
    result = planner.search()
    assert result.placements == bell == len(list(set_partitions(models)))
    assert {c.placement for c in result.candidates} | {r.placement for r in result.rejected} == {
        tuple(sorted(p, key=lambda b: models.index(b[0]))) for p in set_partitions(models)
    }
    tree = yaml.safe_load((ROOT / "examples" / "ppo_tiny.yaml").read_text())
    for candidate in result.candidates[:20]:
        pools = apply_plan(tree, candidate, 8)["placement"]["pools"]
        owner = {role: name for name, pool in pools.items() for role in pool["roles"]}
        assert owner["actor"] == owner["rollout"]  # the rollout generates with the actor's weights
        assert sorted(owner) == sorted({*models, "rollout"})


def test_the_cost_model_counts_parameters_memory_and_decode_time():
    assert PRESETS["llama-7b"].params() == 6_738_415_616  # Llama-2-7b-hf's parameter count
    assert PRESETS["llama-70b"].params() == 68_976_648_192  # Llama-2-70b-hf's
    shape = PRESETS["llama-7b"]
    ddp = estimate("actor", shape, Strategy("ddp", dp=8), PAPER, A100, 8)
    megatron = estimate("actor", shape, Strategy("megatron", tp=8, dp=1, gen_tp=8), PAPER, A100, 8)
    assert ddp.static_bytes == pytest.approx(16 * shape.params())  # ZeRO's 16 bytes per trained parameter
    assert megatron.static_bytes == pytest.approx(16 * shape.params() / 8)
    ref = estimate("ref", shape, Strategy("ddp", dp=8), PAPER, A100, 8)
    assert ref.static_bytes == pytest.approx(2 * shape.params())  # bf16 weights only
    # decoding is memory-bound: each of the 1,024 steps of a wave of 64 sequences reads the weights and the wave's
    # KV cache (Llama-2-7B: 0.5 MB per token) once; 8 replicas of 128 sequences decode 2 waves each
    weights = 2 * (shape.params() - shape.vocab * shape.hidden)
    kv = 64 * (1024 + 512) * shape.kv_bytes_per_token(2)
    decode_s = 2 * 1024 * (weights + kv) / (A100.memory_bandwidth * A100.decode_efficiency)
    assert decode_s < ddp.stage_s["gen"] < 1.15 * decode_s  # prefill adds 128 x 1,024 tokens at 2 FLOPs per weight
    assert ddp.transient_bytes["gen"] == pytest.approx(64 * 2048 * shape.kv_bytes_per_token(2))
    assert megatron.stage_s["update_actor"] > 0 and ddp.stage_s["update_actor"] > 0


def test_memory_infeasible_plans_are_rejected_and_too_small_a_cluster_is_an_error_with_the_numbers():
    llama = PRESETS["llama-34b"]
    models = {"actor": llama, "critic": llama, "ref": llama, "reward_model": llama}
    result = Planner(models, PAPER, A100, nodes=4, gpus_per_node=8, space="all").search()
    for candidate in result.candidates:
        assert max(candidate.peak_bytes) <= A100.capacity_bytes
    assert result.rejected and all("the cluster has 32" in r.reason for r in result.rejected)
    on_two_nodes = Planner(models, PAPER, A100, nodes=2, gpus_per_node=8, space="all")
    with pytest.raises(PlanError) as err:
        on_two_nodes.search()
    message = str(err.value)
    assert "16 devices of 72.0 GB usable" in message and "GB per device" in message and "--nodes" in message
    assert "actor (llama-34b, 33.74 B parameters) alone" in message
    big = A100.model_copy(update={"memory_bytes": 160 * GB})
    assert Planner(models, PAPER, big, nodes=2, gpus_per_node=8, space="all").search().candidates


def test_planning_1024_gpus_takes_seconds():
    llama = PRESETS["llama-70b"]
    models = {"actor": llama, "critic": llama, "ref": llama, "reward_model": llama}
    import time

    started = time.perf_counter()
    result = Planner(models, PAPER, A100, nodes=128, gpus_per_node=8, space="all").search()
    assert time.perf_counter() - started < 10
    assert result.placements == 15 and len(result.candidates) > 100


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HF, "plan", *args], capture_output=True, text=True, timeout=300)


def test_hf_plan_refuses_bad_input_naming_the_fix(tmp_path):
    config = str(ROOT / "examples" / "ppo_tiny.yaml")
    unknown = _plan(config, "--gpus-per-node", "8", "--gpu", "v100")
    assert unknown.returncode == 2 and "no hardware profile named 'v100'" in unknown.stdout
    assert "a100-80gb" in unknown.stdout and "--gpu-memory-gb" in unknown.stdout
    local = _plan(config, "--gpus-per-node", "8", "--gpu", "h100-80gb", "--nodes", "2")
    assert local.returncode == 2 and "--executor slurm" in local.stdout
    small = _plan(config, "--gpus-per-node", "2", "--gpu", "a100-80gb", "--model", "llama-70b")
    assert small.returncode == 2 and "no placement fits 2 devices of 72.0 GB usable" in small.stdout, small.stdout
    preset = _plan(config, "--gpus-per-node", "2", "--gpu", "a100-80gb", "--model", "llama-9b")
    assert preset.returncode == 2 and "no model preset 'llama-9b'" in preset.stdout


def test_a_plan_written_by_hf_plan_runs_through_hf_run(prefect_api, tmp_path, tiny_model_dir):
    """`hf plan --output` writes the config with its pools and strategies; `hf run` of that file places every role
    where the plan said."""
    config = tmp_path / "ppo.yaml"
    tree = yaml.safe_load((ROOT / "examples" / "ppo_tiny.yaml").read_text())
    tree["model"]["path"] = str(tiny_model_dir)
    tree["actor"]["use_kl_loss"] = True
    tree["trainer"].update(total_iterations=1, output_dir=str(tmp_path / "out"), val_before_train=False)
    tree["reward"] = {"custom_function": write_reward(tmp_path)}
    config.write_text(yaml.safe_dump(tree))
    planned = tmp_path / "planned.yaml"
    shown = _plan(str(config), "--gpus-per-node", "2", "--gpu", "a100-80gb", "--output", str(planned))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "5 placements" in shown.stdout and "chosen:" in shown.stdout
    pools = yaml.safe_load(planned.read_text())["placement"]["pools"]
    owner = {role: name for name, pool in pools.items() for role in pool["roles"]}
    assert set(owner) == {"actor", "rollout", "ref", "critic"}
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    ran = subprocess.run(
        [HF, "run", str(planned), "--db", db, "--prefect-api", prefect_api], capture_output=True, text=True, timeout=600
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    store = RunStore(db)
    [run] = store.list_runs()
    assert run.status == "completed"
    placed = {p.role: p for p in store.placements(run.id)}
    assert {role: placed[role].group_name for role in owner} == owner
    for role in owner:
        assert len(placed[role].ranks) == pools[owner[role]]["tasks_per_node"]
