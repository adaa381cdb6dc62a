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


def test_run_then_query_history(tmp_path, prefect_api):
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    env = {"HYBRIDFLOW_HOME": str(tmp_path / "home")}
    result = _hf(
        "run",
        "examples/grpo_tiny.yaml",
        "-o",
        f"trainer.output_dir={tmp_path / 'out'}",
        "-o",
        "trainer.total_iterations=1",
        "--db",
        db,
        "--prefect-api",
        prefect_api,
        env_extra=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = result.stdout.split("run ", 1)[1].split()[0]
    assert f"{prefect_api.removesuffix('/api')}/runs/flow-run/" in result.stdout  # the UI link of the flow run
    assert "step 1" in result.stdout and "completed" in result.stdout
    listed = _hf("runs", "list", "--db", db, env_extra=env)
    assert run_id in listed.stdout and "completed" in listed.stdout and "1/1" in listed.stdout
    shown = _hf("runs", "show", run_id, "--db", db, env_extra=env)
    assert shown.returncode == 0 and "actor_rollout_ref" in shown.stdout and "global_step_1" in shown.stdout
    assert "ddp p1-t1-d1" in shown.stdout  # the placement's parallel layout
    summary = shown.stdout.splitlines()[1]
    assert summary.startswith("grpo on tiny (actor ddp, sync), 1/1 iterations"), shown.stdout  # summary first
    assert "max_prompt_length" not in shown.stdout  # the config only with --config
    with_config = _hf("runs", "show", run_id, "--config", "--db", db, env_extra=env).stdout
    assert "max_prompt_length: 128" in with_config
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(db)
    other = store.get_run(run_id).config
    other["actor"]["optim"]["lr"] = 5.0e-5
    other_id = store.create_run(other, "grpo_tiny")  # recorded, never trained
    compared = _hf("runs", "compare", run_id, other_id, "--db", db, env_extra=env)
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert "config: 1 keys differ" in compared.stdout and "actor.optim.lr" in compared.stdout
    assert "5e-05" in compared.stdout and "critic/score/mean" in compared.stdout
    exported = _hf("runs", "metrics", run_id, "--name", "actor/pg_loss", "--format", "json", "--db", db)
    points = json.loads(exported.stdout)
    assert [(p["step"], p["name"]) for p in points] == [(1, "actor/pg_loss")]
    unknown = _hf("runs", "show", "run-nope", "--db", db)
    assert unknown.returncode == 2 and "hf runs list" in unknown.stdout


def test_other_subcommands_go_to_huggingface_hub():
    result = _hf("download", "--help")
    assert result.returncode == 0 and "repo" in result.stdout.lower()  # huggingface_hub's download command
    ours = _hf("models", "prepare", "--help")
    assert ours.returncode == 0 and "embedded model" in ours.stdout


def test_run_bad_key_names_it(tmp_path):
    result = _hf("run", "examples/grpo_tiny.yaml", "-o", "actor.ppo_epoch=2")
    assert result.returncode == 2
    assert "actor.ppo_epoch: unknown key" in result.stdout


def test_brackets_in_a_message_are_printed_as_written(tmp_path):
    """Text the CLI did not write (a path in an error, gloo's ``[/__w/pytorch/.../pair.cc:553]``) is printed as
    is: rich markup would raise MarkupError on ``[/x]`` and swallow ``[bold]``."""
    for path in ("/data/[/x]", "/data/[bold]x"):
        result = _hf("run", "examples/grpo_tiny.yaml", "-o", f"model.path={path}")
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stdout + result.stderr and "MarkupError" not in result.stderr
        assert path in result.stdout


def test_runs_show_gives_a_failed_runs_cause_not_the_last_line_of_its_log(tmp_path):
    """A worker's failure is recorded with the tail of its log; `hf runs show` prints the error line (with its
    brackets), not that tail's last line."""
    from hybridflow.engine.config import load_config
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = store.create_run(load_config(ROOT / "examples" / "grpo_tiny.yaml").model_dump(mode="json"), "grpo_tiny")
    store.set_status(
        run_id,
        "failed",
        error='Traceback (most recent call last):\n  File "rlhf.py", line 1, in run\n'
        "hybridflow.slurm.worker_group.WorkerGroupError: worker group 'actor_rollout_ref' (job 7, local): rank 0 "
        "raised in compute_reward: ValueError: row 3 [/x] has no answer\n"
        "--- last lines of /tmp/7_0_log.err ---\n  rank 0: generate_sequences done in 2.70 s\n",
    )
    shown = _hf("runs", "show", run_id, "--db", store.url)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert (
        "WorkerGroupError: worker group 'actor_rollout_ref' (job 7, local): rank 0 raised in compute_reward: "
        "ValueError: row 3 [/x] has no answer" in shown.stdout
    )
    assert "done in 2.70 s" not in shown.stdout


def test_malformed_yaml_and_an_unreachable_store_get_one_line(tmp_path):
    """Malformed YAML names the file, line and column; an unreachable PostgreSQL store gets one line naming the URL
    and what to check; neither prints a traceback."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: tiny\ndata: [1, 2\ntrainer: {a: 1}\n")
    result = _hf("run", str(bad))
    assert result.returncode == 2
    assert result.stdout.strip() == f"{bad} is not valid YAML: line 4, column 8: expected ',' or ']', but got ':'"
    unreachable = _hf("runs", "list", "--db", "postgresql://user:secret@127.0.0.1:1/runs")
    assert unreachable.returncode == 2 and "Traceback" not in unreachable.stdout + unreachable.stderr
    [line] = unreachable.stdout.strip().splitlines()
    assert "cannot open the run store postgresql+psycopg://user:***@127.0.0.1:1/runs" in line
    assert "PostgreSQL server is running and reachable" in line and "writable" not in line


@pytest.mark.parametrize("name", ["hf", "hybridflow"])
def test_both_entry_points_show_help(name):
    exe = shutil.which(name, path=str(Path(sys.executable).parent))
    assert exe, f"console script {name} not installed"
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    # huggingface_hub installs a command named `hf` too: the one on the venv's PATH must be ours.
    assert result.returncode == 0 and "HybridFlow" in result.stdout and "run" in result.stdout


def test_the_package_and_hf_help_introduce_the_project_alike():
    """``hf --help`` and the package's summary (pyproject's description, what ``pip show`` says) are one text."""
    import tomllib

    from hybridflow.cli.main import HELP

    described = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    assert described == HELP
    shown = " ".join(_hf("--help").stdout.replace("│", " ").split())
    assert " ".join(HELP.split()) in shown, shown
