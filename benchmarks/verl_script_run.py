"""Benchmark: one of verl's example scripts trained end to end with ``hf verl``, scaled down the way its user would.

verl's scripts take their settings from environment variables (``MODEL_PATH``, ``NGPUS_PER_NODE``,
``TRAIN_BATCH_SIZE``, ...) and pass any further Hydra overrides on (``"$@"``). This runs the script as
`verl_examples` does (stand-ins on ``PATH``, the overrides recorded where the script calls
``python3 -m verl.trainer.main_ppo``), with the variables given here, makes the data files it names (verl's gsm8k
layout), and trains with ``hf verl`` on those overrides plus the ones given after ``--`` (``trainer.total_training_
steps=2``), recorded in a run store of its own. Then it prints the run's metrics of its last iteration, and checks
their names against verl's: the names verl's trainer logs for such a run (`VERL_NAMES`, read from verl's
``metric_utils.py``, ``ray_trainer.py`` and its actor's update), present or missing.

    .venv/bin/python benchmarks/verl_script_run.py /path/to/verl examples/grpo_trainer/run_qwen3_4b_fsdp.sh \\
        --env MODEL_PATH=/path/to/model --env NGPUS_PER_NODE=2 --env TRAIN_BATCH_SIZE=8 ... \\
        -- trainer.total_training_steps=2

The model is the user's local folder (no model hub here). Needs a machine that runs ``hf run`` (it starts its own
Prefect server, as ``hf run`` does).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import verl_examples  # noqa: E402  (the survey's stand-ins and data, shared)

VERL_NAMES = {
    # verl/trainer/ppo/metric_utils.py::compute_data_metrics (no critic: GRPO)
    **{
        f"critic/{k}/{s}": "data" for k in ("score", "rewards", "advantages", "returns") for s in ("mean", "max", "min")
    },
    **{f"{k}/{s}": "data" for k in ("response_length", "prompt_length") for s in ("mean", "max", "min", "clip_ratio")},
    # compute_throughout_metrics
    "perf/total_num_tokens": "throughput",
    "perf/throughput": "throughput",
    "perf/time_per_step": "throughput",
    # compute_timing_metrics: the stages ray_trainer.py times (marked_timer names)
    **{f"timing_s/{k}": "timing" for k in ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "step")},
    # the actor's update (verl/workers/utils/losses.py, dp_actor.py)
    **{
        f"actor/{k}": "actor"
        for k in ("pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "kl_loss", "grad_norm", "lr", "entropy")
    },
}
"""verl's metric names for a GRPO run with the KL loss and gsm8k validation (the validation's: `VAL_CORE`)."""

VAL_CORE = "val-core/openai/gsm8k/"
"""verl's validation metric of a gsm8k run: ``reward/mean@1``, or ``acc/mean@1`` when the score function reports
``acc`` (``ray_trainer.py::_val_metrics_update``; the built-in gsm8k score function here does)."""

NOT_HERE = {
    "timing_s/old_log_prob": "the old_log_prob stage is skipped when the update is on-policy (one mini-batch of one "
    "epoch: its log-probs are the update's own, detached); verl runs it anyway",
}
"""verl's names a run here leaves out, and why."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl", type=Path, help="a verl checkout (working tree or bare git directory)")
    parser.add_argument("script", help="the script, relative to the checkout (examples/grpo_trainer/...)")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the script (repeatable)")
    parser.add_argument("--rows", type=int, default=256, help="rows of each data file made")
    parser.add_argument("--keep", type=Path, help="keep the run store and outputs in this folder")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    opts = parser.parse_args(argv[:cut])
    opts.overrides = argv[cut + 1 :]  # after --: further Hydra overrides (the script's "$@")
    variables = dict(item.split("=", 1) for item in opts.env)
    with tempfile.TemporaryDirectory(prefix="verl-run-") as tmp:
        scratch = opts.keep.resolve() if opts.keep else Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        tree = verl_examples.checkout_tree(opts.verl.resolve(), scratch / "verl")
        bin_dir = verl_examples.stand_ins(scratch / "bin")
        home = scratch / "home"
        home.mkdir(exist_ok=True)
        args = verl_examples.captured_command(tree / opts.script, tree, home, bin_dir, variables)
        if args is None:
            sys.exit(f"{opts.script} calls no python3 -m verl.trainer.main_ppo")
        options, overrides = verl_examples.split_args(args)
        given = verl_examples.values(overrides)
        for key, default in zip(verl_examples.DATA_KEYS, verl_examples.VERL_DATA_DEFAULTS, strict=True):
            for file in verl_examples.as_list(given.get(key)) or [str(home / default)]:
                path = Path(os.path.expanduser(file.replace("$HOME", str(home))))
                verl_examples.make_data(path if path.is_absolute() else tree / path, opts.rows)
        db = f"sqlite:///{scratch / 'runs.db'}"
        ours = ["-o", f"trainer.output_dir={scratch / 'outputs'}"]
        command = [verl_examples.HF, "verl", *options, *overrides, *opts.overrides, *ours, "--db", db]
        print("hf verl " + " ".join(command[2:]), flush=True)
        started = time.perf_counter()
        env = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(command, cwd=tree, env=env, stdin=subprocess.DEVNULL)
        seconds = time.perf_counter() - started
        print(f"\nhf verl exited {done.returncode} after {seconds:.0f} s")
        report(db)
        if done.returncode:
            sys.exit(done.returncode)


def report(db: str) -> None:
    """The last iteration's metrics, and verl's names present in the run or missing."""
    from hybridflow.flows.store.run_store import RunStore

    store = RunStore(db)
    runs = store.list_runs()
    if not runs:
        print("no run recorded")
        return
    run = runs[-1]
    metrics = store.metrics(run.id)
    last = max(m.step for m in metrics)
    print(f"run {run.id}: {run.status}, {last} iterations")
    at_last = {m.name: m.value for m in metrics if m.step == last}
    for name in sorted(at_last):
        print(f"  {name:<48} {at_last[name]:.6g}")
    recorded = {m.name for m in metrics}
    val = sorted(n for n in recorded if n.startswith(VAL_CORE))
    wanted = set(VERL_NAMES) | ({val[0]} if val else {VAL_CORE + "reward/mean@1"})
    present, missing = sorted(wanted & recorded), sorted(wanted - recorded)
    print(f"\nverl's metric names: {len(present)} of {len(wanted)} recorded under the same name")
    for name in missing:
        print(f"  missing: {name}" + (f" ({NOT_HERE[name]})" if name in NOT_HERE else ""))


if __name__ == "__main__":
    main()
