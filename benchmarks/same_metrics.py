"""Benchmark for refactors: do two revisions train to the same metrics, bit for bit?

Checks out `--before` and `--after` (default: the working tree) as git worktrees and runs the same runs in each, with
that revision's code on ``PYTHONPATH`` (this venv's packages):

- single-process trainer, 3 iterations of the tiny model with the tests' dense reward: GRPO, PPO with GAE,
  Safe-RLHF with a cost function, ReMax, DAPO (2 draws per iteration);
- Prefect flow (``hf run``, its own ``HYBRIDFLOW_HOME``): ``examples/grpo_tiny.yaml`` and ``ppo_tiny.yaml``, 3
  iterations;
- with ``--main-job``: ``examples/grpo_smollm2.yaml`` as the README's front door runs it (about 5 minutes each).

Then it compares every recorded metric but the wall-clock ones (``timing_s/*``, ``perf/throughput``,
``perf/time_per_step``, ``perf/gen_throughput``, ``perf/mfu/*``) and prints, per run, how many values it compared
and how many differ. Exit status 1 when any differs.

    .venv/bin/python benchmarks/same_metrics.py --before 3b4d0ea [--after HEAD] [--main-job] [--keep DIR]

Works on revisions of every layout: before the folders by concept of issue 20, those folders, and the design card's
``hybridflow/`` package of issue 30 (it finds each tree's packages).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
WALL_CLOCK = ("timing_s/", "perf/throughput", "perf/gen_throughput", "perf/mfu", "perf/time_per_step")
RUN_BODY = """
import json, sys
from pathlib import Path
sys.path.insert(0, "tests")
from tiny_runs import LENGTH_COST, write_reward
try:  # the design card's layout (issue 30), and the revisions before the folders by concept (issue 20)
    from hybridflow.engine.config import load_config
    from hybridflow.engine.trainer import SingleProcessTrainer
except ImportError:  # the folders by concept
    from hybridflow.core.config import load_config
    from hybridflow.core.trainer import SingleProcessTrainer
out_dir = Path(sys.argv[1])
reward = write_reward(out_dir)
(out_dir / "cost.py").write_text(LENGTH_COST)
cost = f"{out_dir / 'cost.py'}:length_cost"
dapo = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score", "data.gen_batch_size=2",
        "algorithm.filter_groups.max_num_gen_batches=10"]
cases = {
    "trainer/grpo": ("grpo_tiny", []),
    "trainer/ppo": ("ppo_tiny", []),
    "trainer/safe_rlhf": ("ppo_tiny", [f"reward.cost_function={cost}", "algorithm.cost_limit=0.1"]),
    "trainer/remax": ("grpo_tiny", ["algorithm.adv_estimator=remax"]),
    "trainer/dapo": ("grpo_tiny", dapo),
}
records = {}
for name, (example, extra) in cases.items():
    overrides = ["rollout.name=hf", f"reward.custom_function={reward}", "trainer.logger=[jsonl]",
                 "trainer.total_iterations=3", f"trainer.output_dir={out_dir / name}", *extra]
    trainer = SingleProcessTrainer(load_config(f"examples/{example}.yaml", overrides))
    records[name] = [[r["step"], k, v] for r in trainer.fit() for k, v in r.items() if k != "step"]
(out_dir / "trainer.json").write_text(json.dumps(records))
"""
STORE_BODY = """
import json, sys
try:
    from hybridflow.flows.store.run_store import RunStore
except ImportError:
    try:
        from hybridflow.store.run_store import RunStore
    except ImportError:
        from hybridflow.store import RunStore
store = RunStore()
runs = {"flow/" + r.config["trainer"]["experiment_name"]: [[m.step, m.name, m.value] for m in store.metrics(r.id)]
        for r in store.list_runs()}
open(sys.argv[1], "w").write(json.dumps(runs))
"""


def package_root(tree: Path, scratch: Path) -> Path:
    """The folder to put on ``PYTHONPATH`` for `tree`'s code: the tree itself where it holds the ``hybridflow/``
    package (issue 30 on); else a folder whose ``hybridflow/`` links every package folder of `tree` (a folder with an
    ``__init__.py``), as ``package-dir`` mapped them."""
    if (tree / "hybridflow" / "__init__.py").is_file():
        return tree
    root = scratch / "pythonpath"
    (root / "hybridflow").mkdir(parents=True)
    (root / "hybridflow" / "__init__.py").touch()  # a regular package: found before an installed checkout's
    for folder in tree.iterdir():
        if (folder / "__init__.py").is_file() and folder.name not in ("tests", "benchmarks"):
            (root / "hybridflow" / folder.name).symlink_to(folder)
    return root


def run_revision(tree: Path, out: Path, main_job: bool) -> dict[str, list]:
    """Every run on `tree`'s code; returns run name -> [step, metric, value] rows."""
    env = {**os.environ, "PYTHONPATH": str(package_root(tree, out)), "HYBRIDFLOW_HOME": str(out / "home")}
    (out / "home").mkdir()
    models = Path.home() / ".cache" / "hybridflow" / "models"
    if models.is_dir():  # the embedded models already prepared: no conversion per revision
        (out / "home" / "models").symlink_to(models)
    python, hf = str(VENV_BIN / "python"), str(VENV_BIN / "hf")
    quiet = {"cwd": tree, "env": env, "check": True, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    subprocess.run([python, "-c", RUN_BODY, str(out)], **quiet)
    rows = json.loads((out / "trainer.json").read_text())
    reward = str(out / "my_reward.py") + ":digit_share"
    examples = [("grpo_tiny", [f"reward.custom_function={reward}", "trainer.total_iterations=3"]),
                ("ppo_tiny", [f"reward.custom_function={reward}", "trainer.total_iterations=3"])]  # fmt: skip
    if main_job:
        examples.append(("grpo_smollm2", []))
    try:
        for example, overrides in examples:
            command = [hf, "run", f"examples/{example}.yaml", "-o", f"trainer.output_dir={out / 'outputs'}"]
            subprocess.run(command + [a for o in overrides for a in ("-o", o)], **quiet)
        subprocess.run([python, "-c", STORE_BODY, str(out / "flow.json")], cwd=tree, env=env, check=True)
    finally:
        subprocess.run([hf, "server", "stop"], cwd=tree, env=env, stdout=subprocess.DEVNULL)
    return {**rows, **json.loads((out / "flow.json").read_text())}


def compare(before: dict[str, list], after: dict[str, list]) -> bool:
    """Print each run's compared and differing values; True when every run matches."""
    same = True
    for name in sorted(set(before) | set(after)):
        a = {(s, k): v for s, k, v in before.get(name, []) if not k.startswith(WALL_CLOCK)}
        b = {(s, k): v for s, k, v in after.get(name, []) if not k.startswith(WALL_CLOCK)}
        differ = [key for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
        same &= not differ and bool(a)
        print(f"{name:20s} {len(a):5d} values  {'identical' if not differ else f'{len(differ)} differ'}")
        for step, key in differ[:5]:
            print(f"    step {step} {key}: {a.get((step, key))} -> {b.get((step, key))}")
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="git revision to compare against")
    parser.add_argument("--after", default=None, help="git revision (default: the working tree)")
    parser.add_argument("--main-job", action="store_true", help="also run examples/grpo_smollm2.yaml")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' files here")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="same_metrics-", dir=args.keep))
    results = {}
    for label, revision in (("before", args.before), ("after", args.after)):
        tree = scratch / f"{label}-tree"
        if revision is None:  # the working tree as it is, tracked and untracked files
            tree.mkdir()
            files = subprocess.run(
                ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.split()
            for name in files:
                if (ROOT / name).is_file():
                    (tree / name).parent.mkdir(parents=True, exist_ok=True)
                    (tree / name).write_bytes((ROOT / name).read_bytes())
        else:
            subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), revision], cwd=ROOT, check=True)
        out = scratch / label
        out.mkdir()
        print(f"{label}: {revision or 'working tree'} ...", flush=True)
        try:
            results[label] = run_revision(tree, out, args.main_job)
        finally:
            if revision is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)
    same = compare(results["before"], results["after"])
    print("same metrics bit for bit" if same else "the metrics differ", f"(runs under {scratch})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
