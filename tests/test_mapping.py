"""The auto-mapping planner (`hybridflow.mapping`, `hf plan`): placements, the cost model's memory and seconds,
bad input refused with the numbers, and a written plan run through `hf run` on local worker groups."""

import os
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
from hybridflow.mapping.render import ROLES_OF, apply_plan
from hybridflow.mapping.shapes import PRESETS, run_models

ROOT = Path(__file__).resolve().parent.parent
HF = shutil.which("hf", path=str(Path(sys.executable).parent)) or "hf"
A100 = BUILTIN["a100-80gb"]
WIDE = {**os.environ, "COLUMNS": "250"}
QUIET = {"capture_output": True, "text": True, "timeout": 600}
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
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    shown = _plan(str(config), "--gpus-per-node", "2", "--gpu", "a100-80gb", "--output", str(planned), "--db", db)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "5 placements" in shown.stdout and "chosen:" in shown.stdout
    written = yaml.safe_load(planned.read_text())
    pools = written["placement"]["pools"]
    owner = {role: name for name, pool in pools.items() for role in pool["roles"]}
    assert set(owner) == {"actor", "rollout", "ref", "critic"}
    store = RunStore(db)
    [plan] = store.plans()
    assert written["placement"]["plan"] == plan.id and plan.source == str(config)
    ran = subprocess.run(
        [HF, "run", str(planned), "--db", db, "--prefect-api", prefect_api], capture_output=True, text=True, timeout=600
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    [run] = store.list_runs()
    assert run.status == "completed" and run.plan_id == plan.id
    placed = {p.role: p for p in store.placements(run.id)}
    assert {role: placed[role].group_name for role in owner} == owner
    for role in owner:
        assert len(placed[role].ranks) == pools[owner[role]]["tasks_per_node"]
    listed = subprocess.run([HF, "plans", "list", "--db", db], capture_output=True, text=True, timeout=60)
    assert plan.id in " ".join(listed.stdout.split())
    shown_again = subprocess.run(
        [HF, "plans", "show", plan.id, "--db", db], capture_output=True, text=True, timeout=60, env=WIDE
    )
    assert shown_again.returncode == 0 and "chosen:" in shown_again.stdout, shown_again.stdout + shown_again.stderr
    missing = subprocess.run([HF, "plans", "show", "plan-x", "--db", db], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "unknown plan id 'plan-x'" in missing.stdout


def test_placement_auto_plans_at_hf_run_and_records_the_plan(prefect_api, tmp_path, tiny_model_dir):
    """`placement: auto` (with placement.hardware and the devices as placement.tasks_per_node) plans at `hf run`:
    the run records the planned pools in its config and the plan's id; without hardware it is refused first."""
    config = tmp_path / "auto.yaml"
    tree = yaml.safe_load((ROOT / "examples" / "ppo_tiny.yaml").read_text())
    tree["model"]["path"] = str(tiny_model_dir)
    tree["trainer"].update(total_iterations=0, output_dir=str(tmp_path / "out"), val_before_train=False)
    tree["placement"] = "auto"
    config.write_text(yaml.safe_dump(tree))
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    refused = subprocess.run([HF, "run", str(config), "--db", db, "--prefect-api", prefect_api], **QUIET)
    assert refused.returncode == 2 and "placement.auto needs placement.hardware" in refused.stdout, refused.stdout
    store = RunStore(db)
    assert store.list_runs() == []
    overrides = ["-o", "placement.hardware=h100-80gb", "-o", "placement.tasks_per_node=2"]
    ran = subprocess.run([HF, "run", str(config), *overrides, "--db", db, "--prefect-api", prefect_api], **QUIET)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    [plan] = store.plans()
    [run] = store.list_runs()
    assert "placement.auto: plan " + plan.id in " ".join(ran.stdout.split())
    assert run.plan_id == plan.id and run.config["placement"]["plan"] == plan.id
    assert run.config["placement"]["auto"] is False and plan.inputs["hardware"]["name"] == "h100-80gb"
    pools = run.config["placement"]["pools"]
    assert [pool["roles"] for pool in pools.values()] == [
        [r for m in ms for r in ROLES_OF[m]] for ms in plan.chosen["placement"]
    ]
    placed = {p.role: p.group_name for p in store.placements(run.id)}
    assert {role: placed[role] for role in ("actor", "rollout", "critic")} == {
        role: name for name, pool in pools.items() for role in pool["roles"]
    }


def test_calibration_recovers_the_efficiencies_and_overheads_that_made_the_timings():
    """Stage and iteration seconds made by the cost model with a known profile, for a small and a large model at
    two batch sizes, fit back to that profile; this machine's device measures positive peaks."""
    from hybridflow.mapping.calibrate import FITTED, Measured, fit_profile, measure_device, predict

    truth = A100.model_copy(
        update={"train_efficiency": 0.3, "infer_efficiency": 0.45, "decode_efficiency": 0.2, "stage_overhead_s": 1.5,
                "decode_step_overhead_s": 0.004, "iteration_overhead_s": 4.0}
    )  # fmt: skip
    runs = []
    for model, prompts in (("llama-7b", 8), ("llama-7b", 16), ("llama-13b", 16)):
        cfg = _ppo(f"data.train_batch_size={prompts}", f"model.path={model}")
        estimate = predict(cfg, truth, 200, 100)
        runs.append(Measured(cfg, estimate.stage_s, estimate.seconds, prompt_length=200, response_length=100))
    fitted = fit_profile(A100, runs, "fitted")
    for key in (*FITTED, "iteration_overhead_s"):
        assert getattr(fitted, key) == pytest.approx(getattr(truth, key), rel=1e-3), key
    peaks = measure_device(threads=1)
    assert peaks["flops"] > 1e8 and peaks["memory_bandwidth"] > 1e8 and peaks["intra_node_bandwidth"] > 1e6, peaks
