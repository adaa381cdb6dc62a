"""Benchmark: verl's own example scripts through ``hf verl --dry-run``, as a verl user would run them.

Takes a verl checkout (a working tree, or a bare git directory such as the one ``git clone --mirror`` makes), and
for every shell script under its ``examples/`` (and ``recipe/`` where the checkout has it):

1. runs the script with ``bash`` in a scratch ``$HOME``, with stand-ins on ``PATH`` for what a script calls besides
   verl (``python3``, ``ray job submit``, ``srun``, ``torchrun``, ``huggingface-cli``, ``nvidia-smi``, ...): the
   stand-in ``python3`` records the command line of ``-m verl.trainer.main_ppo`` (its overrides, ``--config-path`` and
   ``--config-name``) instead of running it, and does nothing for any other program; so the script's own shell
   logic (variables, arrays, ``${VAR:-default}``) resolves the overrides exactly as it would in verl;
2. swaps the entry point: the same overrides to ``hf verl --dry-run``;
3. makes the data files the overrides name (``data.train_files``, ``data.val_files``: parquet files of 64 rows in
   verl's layout: ``prompt`` chat messages, ``data_source``, ``reward_model.ground_truth``) and a stand-in model at
   ``actor_rollout_ref.model.path`` (and the critic's and reward model's): the tiny model of the test suite, or
   for a mixture-of-experts model (``Qwen3-30B-A3B``, ``Moonlight-16B-A3B``, ...: `MOE_MODELS`) a tiny one of its
   architecture, saved where a local path points; a hub id (``Qwen/Qwen2-7B-Instruct``) is swapped for a local
   folder of that name, as a user gives the folder they downloaded it to (there is no model hub here); the hardware
   a script asks for (8 GPUs a node, 7B) is its own business, but a script across nodes (``trainer.nnodes`` > 1)
   gets ``--executor=slurm``;
4. prints, per script, accepted or refused with the reasons, and the totals over the scripts in scope.

In scope: the scripts that run ``verl.trainer.main_ppo`` with ``rollout.name=vllm`` on text. Left aside, as issue
53 says, and listed as such: sglang and TRT-LLM rollouts, NPU scripts (``trainer.device=npu``, or ``npu`` or
``ascend`` in the path), vision-language models (``VL``/``-V``/``minicpmo``/``glm4.1v`` model ids, ``geo3k``
data), and scripts that run no PPO trainer (SFT, generation).

    .venv/bin/python benchmarks/verl_examples.py /path/to/verl [--markdown] [--only SUBSTRING ...] [--jobs 2]

The checkout is not fetched by the script (no internet here): clone verl where you can and pass its path.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

HF = str(Path(sys.executable).parent / "hf")
ENTRIES = ("verl.trainer.main_ppo", "verl.trainer.main_ppo_sync")
"""verl's PPO entry points (``main_ppo_sync``: the same trainer, run synchronously; both take the same overrides)."""

# The stand-in for python3 / python / torchrun: records main_ppo's arguments (one JSON list per call) in $CAPTURE;
# ``python3 -c CODE`` runs for real (scripts probe ``import torch_npu`` to pick the device: it fails here, as on a GPU
# machine).
STAND_IN_PYTHON = f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
if args[:1] == ["-c"]:
    os.execv({sys.executable!r}, [{sys.executable!r}, *args])
entry = next((a for a in args if a in {ENTRIES!r}), None)
if entry:
    rest = args[args.index(entry) + 1:]
    with open(os.environ["CAPTURE"], "a") as out:
        out.write(json.dumps(rest) + "\\n")
"""
# uv run [options] python3 -m ...: run the command from its program on (verl's scripts launch through uv).
STAND_IN_UV = """#!/bin/bash
while [ $# -gt 0 ]; do
  case "$1" in python|python3) exec "$@";; esac
  shift
done
exit 0
"""
# ray job submit ... -- python3 -m verl.trainer.main_ppo ...: hand what follows "--" to the python3 stand-in.
STAND_IN_RAY = """#!/bin/bash
for ((i = 1; i <= $#; i++)); do
  if [ "${!i}" = "--" ]; then shift "$i"; exec "$@"; fi
done
exit 0
"""
# srun [options] python3 -m ...: run the command from its program on (the options are Slurm's).
STAND_IN_SRUN = """#!/bin/bash
while [ $# -gt 0 ]; do
  case "$1" in python|python3|torchrun|bash|sh) exec "$@";; esac
  shift
done
exit 0
"""
NO_OPS = ("huggingface-cli", "hf", "nvidia-smi", "wandb", "pip", "pip3", "wget", "curl", "modelscope", "git", "sleep")
NO_OPS += ("sbatch", "scontrol", "squeue", "sinfo")
DATA_KEYS = ("data.train_files", "data.val_files")
VERL_DATA_DEFAULTS = ("data/rlhf/gsm8k/train.parquet", "data/rlhf/gsm8k/test.parquet")
"""verl's defaults of `DATA_KEYS` (``ppo_trainer.yaml``: ``~/data/rlhf/gsm8k/...``), under the script's home."""
MODEL_KEYS = (
    "actor_rollout_ref.model.path",
    "critic.model.path",
    "reward_model.model.path",
    "reward.reward_model.model_path",
)
TEACHER_PATH = re.compile(r"distillation\.teacher_models\.[^.]+\.model_path")
"""verl main's teachers (``distillation.teacher_models.<name>.model_path``): the tiny model stands in for each."""
ADAPTER_KEY = "actor_rollout_ref.model.lora_adapter_path"


def checkout_tree(source: Path, into: Path) -> Path:
    """The verl tree to run the scripts in: `source` itself if it is a working tree, else its ``HEAD`` exported
    (``git archive``) into `into`."""
    if (source / "examples").is_dir():
        return source
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "--git-dir", str(source), "archive", "HEAD"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def stand_ins(folder: Path) -> Path:
    """The folder of stand-in programs put first on the scripts' ``PATH``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in [("python3", STAND_IN_PYTHON), ("python", STAND_IN_PYTHON), ("torchrun", STAND_IN_PYTHON)]:
        (folder / name).write_text(text)
    (folder / "ray").write_text(STAND_IN_RAY)
    (folder / "srun").write_text(STAND_IN_SRUN)
    (folder / "uv").write_text(STAND_IN_UV)
    for name in NO_OPS:
        (folder / name).write_text("#!/bin/sh\nexit 0\n")
    for program in folder.iterdir():
        program.chmod(0o755)
    # bash reads $BASH_ENV first: `ulimit -n 32768` (a GPU machine's raised limit) is a no-op, not the end of the script
    (folder / "bash_env").write_text("ulimit() { return 0; }\n")
    return folder


def captured_command(
    script: Path, tree: Path, home: Path, bin_dir: Path, variables: dict[str, str] | None = None
) -> list[str] | None:
    """The arguments the script gives ``python3 -m verl.trainer.main_ppo`` (the first such call), or None if it
    makes none. The script runs from the tree's root, as verl's docs run them, for at most 60 s, with the
    environment `variables` (``MODEL_PATH=...``: how verl's scripts take their settings) set."""
    capture = home / "capture.jsonl"
    capture.unlink(missing_ok=True)
    env = {
        **(variables or {}),
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(home),
        "CAPTURE": str(capture),
        "TERM": "dumb",
        "BASH_ENV": str(bin_dir / "bash_env"),
    }
    subprocess.run(["bash", str(script)], cwd=tree, env=env, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    if not capture.is_file() or not capture.read_text().strip():
        return None
    return json.loads(capture.read_text().splitlines()[0])


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(Hydra options such as ``--config-path=config``, overrides ``key=value``) of a captured command line."""
    options, overrides, it = [], [], iter(args)
    for arg in it:
        if arg.startswith("--"):
            options.append(arg if "=" in arg else f"{arg}={next(it, '')}")
        elif arg.strip():
            overrides.append(arg)
    return options, overrides


def values(overrides: list[str]) -> dict[str, object]:
    """The overrides' values, parsed as YAML (as Hydra does, near enough for paths and names)."""
    out = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep:
            try:
                out[key.lstrip("+")] = yaml.safe_load(value) if value else None
            except yaml.YAMLError:
                out[key.lstrip("+")] = value
    return out


def out_of_scope(name: str, given: dict[str, object]) -> str | None:
    """Why a script is left aside (issue 53: sglang, TRT-LLM, NPU, vision-language), or None."""
    rollout = str(given.get("actor_rollout_ref.rollout.name", "vllm"))
    if rollout != "vllm":
        return f"rollout {rollout}"
    if re.search(r"npu|ascend", name.lower()) or str(given.get("trainer.device", "")) == "npu":
        return "NPU"
    model = str(given.get("actor_rollout_ref.model.path", ""))
    data = " ".join(str(given.get(k, "")) for k in DATA_KEYS)
    if re.search(r"(?i)([-_.]vl([-_.]|$)|minicpm-?o|glm-?4\.?1v)", model + " " + Path(name).stem) or "geo3k" in data:
        return "vision-language"
    if any(key in given for key in ("data.image_key", "data.video_key")):  # it names its images' column
        return "vision-language"
    return None


def make_data(path: Path, rows: int = 8192) -> None:
    """A prompt file of `rows` rows (more than any script's batch) in verl's layout at `path` (parquet; JSON lines
    for .jsonl/.json)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}? Put the answer after ####."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(rows)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix in (".jsonl", ".json"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)


def as_list(value: object) -> list[str]:
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def local_model(name: str, model: Path, scratch: Path, cwd: Path) -> str:
    """Where the stand-in `model` lies for a script's model path `name`: a local path gets it there; a hub id
    (``Qwen/Qwen2-7B-Instruct``), which ``hf verl`` refuses (no model hub: download it and name the folder), becomes
    ``<scratch>/models/<id>``, as a user names the folder they downloaded it to. Returns the path to give."""
    local = Path(os.path.expanduser(name))
    if name.startswith(("/", "~", ".")) or local.is_absolute():
        target = local if local.is_absolute() else cwd / local
    else:
        target = scratch / "models" / name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(model, target)
    return str(target)


def swap_value(item: str, values: dict[str, str]) -> str:
    """`item` (``key=value``) with its value replaced where `values` names its key (with or without Hydra's ``+``)."""
    key = item.partition("=")[0]
    return f"{key}={values[key.lstrip('+')]}" if key.lstrip("+") in values else item


def dry_run(options: list[str], overrides: list[str], home: Path, cwd: Path) -> tuple[int, str]:
    """``hf verl --dry-run`` of the overrides; (exit code, output)."""
    env = {
        **os.environ,
        "HOME": str(home),
        "HF_HOME": str(home / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HYBRIDFLOW_WARM_START_S": "0",  # each script's HF_HOME differs: a warm process each would pile up
        "COLUMNS": "400",
        "NO_COLOR": "1",
    }
    try:
        done = subprocess.run(
            [HF, "verl", "--dry-run", *options, *overrides],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        return -1, f"{(e.stdout or b'').decode(errors='replace')}\nno answer from hf verl --dry-run within 300 s"
    return done.returncode, done.stdout + done.stderr


def reasons(output: str) -> list[str]:
    """The refusal lines of ``hf verl``'s output, each cut to its key and cause."""
    lines = [line.strip() for line in output.splitlines()]
    keyed = [line for line in lines if line.startswith("verl key ") and "no effect here" not in line]
    if keyed:
        return keyed
    return [line for line in lines if line and not line.endswith(":") and not line.startswith("verl key")][-3:]


def reason_group(line: str) -> str:
    """A refusal line's key (``verl key K=V is not supported`` / ``verl key K is not supported``), else the line."""
    match = re.match(r"verl key ([\w.\-+*]+)", line)
    return match.group(1) if match else line.removeprefix("<root>: Value error, ")[:110]


def tiny_model(folder: Path) -> Path:
    """The test suite's tiny model (`hybridflow.engine.tiny`), saved once in `folder`."""
    from hybridflow.engine.tiny import build_tiny_model

    return build_tiny_model(folder, seed=0)


MOE_MODELS = (
    (r"Qwen3\.5-.*A\d+B|Qwen3_5.*a\d+b", "qwen3_5_moe"),
    (r"Qwen3-Next|qwen3_next", "qwen3_next"),
    (r"Qwen3-.*A\d+B|qwen3_.*a\d+b", "qwen3_moe"),
    (r"Qwen1\.5-MoE|Qwen2-57B-A14B", "qwen2_moe"),
    (r"Mixtral", "mixtral"),
    (r"Moonlight|DeepSeek-V3|Kimi-K2", "deepseek_v3"),
    (r"DeepSeek-V4", "deepseek_v4"),
    (r"gpt-oss|gpt_oss", "gpt_oss"),
    (r"GLM-4\.[56]|GLM-5", "glm4_moe"),
    (r"Nemotron-H|Nemotron-Nano-3|NVIDIA-Nemotron-3", "nemotron_h"),
)
"""Mixture-of-experts model ids (or folder names) in verl's scripts, and the transformers ``model_type`` of the
architecture each names (first match wins); the stand-in of such a model path is a tiny model of that architecture
(`moe_stand_ins`), so ``hf verl`` sees what the user's folder holds."""

RUNNABLE_MOE = ("qwen3_moe", "qwen2_moe", "mixtral")
"""The architectures of `MOE_MODELS` that `hybridflow.engine.tiny.build_tiny_moe_model` builds (and HybridFlow runs)."""


def moe_stand_ins(model: Path, folder: Path) -> dict[str, Path]:
    """One tiny stand-in per architecture of `MOE_MODELS`: for those HybridFlow runs, a random tiny MoE model of
    transformers' own classes; for the others, the tiny dense `model`'s folder with a ``config.json`` of that
    architecture (transformers' defaults, its ``architectures`` set), as much as ``hf verl`` reads before it refuses
    the architecture."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hybridflow.engine.tiny import build_tiny_moe_model

    out = {}
    for model_type in dict.fromkeys(kind for _, kind in MOE_MODELS):
        target = folder / model_type
        if model_type in RUNNABLE_MOE:
            out[model_type] = build_tiny_moe_model(target, architecture=model_type)
            continue
        shutil.copytree(model, target)
        config = CONFIG_MAPPING[model_type](architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]])
        config.save_pretrained(target)
        out[model_type] = target
    return out


def stand_in_for(name: str, model: Path, moe: dict[str, Path]) -> Path:
    """The stand-in for a script's model path `name`: the MoE stand-in of the architecture `name` names
    (`MOE_MODELS`), else `model`."""
    return next((moe[kind] for pattern, kind in MOE_MODELS if re.search(pattern, name, re.IGNORECASE)), model)


def tiny_reward_model(model: Path, folder: Path) -> Path:
    """The tiny model with a one-label sequence-classification head (a reward model's layout), saved in `folder`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    AutoModelForSequenceClassification.from_pretrained(model, num_labels=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(model).save_pretrained(folder)
    return folder


def tiny_adapter(model: Path, folder: Path) -> Path:
    """A LoRA adapter of the tiny model (PEFT's ``save_pretrained`` layout: adapter_config.json and weights), the
    stand-in for a script's ``model.lora_adapter_path`` (a folder the user saved)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    get_peft_model(AutoModelForCausalLM.from_pretrained(model), adapter).save_pretrained(folder)
    return folder


def check_script(
    script: Path,
    tree: Path,
    scratch: Path,
    bin_dir: Path,
    model: Path,
    reward_model: Path,
    adapter: Path,
    moe: dict[str, Path],
    partition: str | None = None,
) -> dict:
    """One script's row: its name, scope, and (in scope) the dry run's verdict and reasons."""
    name = str(script.relative_to(tree))
    home = scratch / re.sub(r"\W", "_", name)
    home.mkdir(parents=True)
    text = script.read_text(errors="replace")
    # ${VAR:?must set VAR}: a setting the user must give (a folder): a placeholder path, swapped below as any path
    required = {var: str(home / "required" / var) for var in re.findall(r"\$\{(\w+):\?", text)}
    args = captured_command(script, tree, home, bin_dir, required)
    if args is None and any(entry in text for entry in ENTRIES):
        return {"script": name, "scope": "stopped by the script before main_ppo (a file or setting it checks for)"}
    if args is None:
        return {"script": name, "scope": "no PPO run (SFT, generation, or a helper script)"}
    options, overrides = split_args(args)
    given = values(overrides)
    aside = out_of_scope(name, given)
    if aside:
        return {"script": name, "scope": aside}
    for key, default in zip(DATA_KEYS, VERL_DATA_DEFAULTS, strict=True):
        if key not in given:  # verl reads its default path, where its user keeps that file
            make_data(home / default)
        for file in as_list(given.get(key)):
            path = Path(os.path.expanduser(file))
            path = path if path.is_absolute() else tree / path
            if file.strip() and not path.is_dir():  # an unset variable names no file: hf verl says so
                make_data(path)
    model_keys = [*MODEL_KEYS, *(key for key in given if TEACHER_PATH.fullmatch(key))]
    models = {
        key: local_model(
            str(given[key]),
            reward_model if "reward_model" in key else stand_in_for(str(given[key]), model, moe),
            home,
            tree,
        )
        for key in model_keys
        if given.get(key)
    }
    if given.get(ADAPTER_KEY):  # a folder the user saved with a LoRA run: the tiny model's adapter stands in
        models[ADAPTER_KEY] = str(shutil.copytree(adapter, home / "adapter"))  # never at the script's own path
    overrides = [swap_value(item, models) for item in overrides]
    if int(given.get("trainer.nnodes") or 1) > 1:  # a run across nodes is a Slurm run here
        options.append("--executor=slurm")
        if partition:  # the cluster's partition with that many nodes, as its user names it
            options += ["-o", f"placement.slurm.partition={partition}"]
    rc, output = dry_run(options, overrides, home, tree)
    return {"script": name, "scope": "in", "accepted": rc == 0, "reasons": [] if rc == 0 else reasons(output)}


def checked(script: Path, tree: Path, scratch: Path, bin_dir: Path, models: tuple, partition: str | None) -> dict:
    """`check_script`, a failure of the benchmark itself on one script reported as that script's row."""
    try:
        return check_script(script, tree, scratch, bin_dir, *models, partition)
    except Exception as e:  # noqa: BLE001 - one script's problem must not end the survey
        return {"script": str(script.relative_to(tree)), "scope": f"benchmark error: {type(e).__name__}: {e}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl", type=Path, help="a verl checkout (working tree or bare git directory)")
    parser.add_argument(
        "--only", action="append", default=[], help="only the scripts whose path contains this (repeatable: any)"
    )
    parser.add_argument("--jobs", type=int, default=2, help="dry runs at once")
    parser.add_argument("--markdown", action="store_true", help="print the per-script table in Markdown")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument(
        "--partition",
        help="the Slurm partition the scripts of trainer.nnodes > 1 run on (placement.slurm.partition); without it "
        "they go to the cluster's default partition (on a machine without Slurm: refused, Slurm does not answer)",
    )
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="verl-examples-") as tmp:
        scratch = Path(tmp)
        tree = checkout_tree(opts.verl.resolve(), scratch / "verl")
        bin_dir = stand_ins(scratch / "bin")
        tiny = tiny_model(scratch / "tiny")
        models = tiny, tiny_reward_model(tiny, scratch / "tiny_rm"), tiny_adapter(tiny, scratch / "tiny_lora")
        models += (moe_stand_ins(tiny, scratch / "moe"),)
        scripts = sorted(
            p
            for top in ("examples", "recipe")
            for p in (tree / top).rglob("*.sh")
            if not opts.only or any(part in str(p) for part in opts.only)
        )
        with ThreadPoolExecutor(opts.jobs) as pool:
            rows = list(
                pool.map(lambda s: checked(s, tree, scratch / "homes", bin_dir, models, opts.partition), scripts)
            )
        coverage = schema_coverage(tree)
    report(rows, opts.markdown)
    print(coverage)
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1))


def schema_coverage(tree: Path) -> str:
    """How `hybridflow.engine.config.verl_keys` covers the leaf keys of the checkout's own generated configs
    (``verl/trainer/config/_generated_ppo_*.yaml``, every key verl's trainers know, at verl's defaults): those not in
    the table, and those whose default value the table refuses (a verl config file holding them would be refused)."""
    from hybridflow.engine.config.loading import ConfigError, dotted_leaves
    from hybridflow.engine.config.verl_keys import find_key

    keys: dict[str, object] = {}
    for path in sorted((tree / "verl" / "trainer" / "config").glob("_generated_ppo_*.yaml")):
        for key, value in dotted_leaves(yaml.safe_load(path.read_text()) or {}).items():
            keys.setdefault(key, value)
    keys = {k: v for k, v in keys.items() if not k.endswith("_target_")}
    missing, refused = [], []
    for key, value in sorted(keys.items()):
        try:
            entry = find_key(key)
        except ConfigError:
            missing.append(key)
            continue
        if isinstance(value, str) and (value.startswith("${") or value == "???"):  # filled by interpolation or the user
            continue
        try:
            entry.convert(value, key)
        except (ConfigError, TypeError, ValueError):
            refused.append(f"{key}={value!r}")
    lines = [
        f"verl's generated schema: {len(keys)} leaf keys; {len(missing)} not in the table; {len(refused)} refused at "
        "verl's default value"
    ]
    lines += [f"  not in the table: {key}" for key in missing] + [
        f"  refused at its default: {item}" for item in refused
    ]
    return "\n".join(lines)


def report(rows: list[dict], markdown: bool) -> None:
    """Per script: accepted / refused (reasons) / left aside (why); then the totals and the refusals by key."""
    inside = [r for r in rows if r["scope"] == "in"]
    accepted = [r for r in inside if r["accepted"]]
    if markdown:
        print("| script | `hf verl --dry-run` |\n| --- | --- |")
    for row in rows:
        if row["scope"] != "in":
            verdict = f"left aside: {row['scope']}"
        elif row["accepted"]:
            verdict = "accepted"
        else:
            verdict = "refused: " + "; ".join(reason_group(r) for r in row["reasons"])
        print(f"| `{row['script']}` | {verdict} |" if markdown else f"{row['script']:<80} {verdict}")
    print()
    print(f"scripts: {len(rows)}; in scope (text, vLLM rollout, main_ppo): {len(inside)}")
    share = 100 * len(accepted) / max(1, len(inside))
    print(f"accepted by hf verl --dry-run: {len(accepted)} of {len(inside)} ({share:.0f} %)")
    by_key = collections.Counter(reason_group(r) for row in inside if not row["accepted"] for r in row["reasons"])
    if by_key:
        print("refusals by key (scripts):")
        for key, count in by_key.most_common():
            print(f"  {count:3d}  {key}")
    aside = collections.Counter(r["scope"] for r in rows if r["scope"] != "in")
    print("left aside: " + ", ".join(f"{why} {n}" for why, n in aside.most_common()))


if __name__ == "__main__":
    main()
