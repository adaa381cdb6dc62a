"""Benchmark: GRPO runs across 1, 2 and 3 nodes of a Slurm partition, beside the cost model's estimate.

For each model (the tiny one, SmolLM2-135M) and each node count N: ``hf run examples/grpo_<model>.yaml --executor
slurm`` with the actor's pool (actor, its rollout, ref and reward, colocated) on N nodes x 1 rank (data parallel
across the nodes: the gradients' all-reduce crosses them, every batch handle is read across them), a batch of 6
prompts x 4 samples; and for SmolLM2 on 2 nodes, a split placement: the actor's pool on one node, a vLLM rollout
pool on the other, the weights sent by gloo broadcast after every update (``rollout.checkpoint_engine.backend:
gloo``; the time the actor's pool spends publishing them and the rollout's loading them is the cross-node weight
transfer). Prints per run the median seconds per iteration and of its stages (the first iteration, which warms
caches up, left out), and the cost model's estimate for the same placement
(`hybridflow.flows.placement.calibrate.predict`) under a hardware profile fitted (`fit_profile`) to the 1-node runs
of both models: how well the model, fitted on one node, predicts the runs across nodes.

    .venv/bin/python benchmarks/multi_node.py [--models tiny,smollm2] [--nodes 1,2,3] [--iterations 4]

Needs a Slurm partition of 3 nodes (``bash hybridflow/slurm/dev_cluster.sh start`` as root: partition ``multi``,
three nodes of their own host names and loopback addresses on this machine, so the "network" between them is this
machine's loopback interface and every node shares its cores: the figures say what the stack costs across nodes,
not what a real network does).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HF = str(Path(sys.executable).parent / "hf")
STAGES = ("gen", "old_log_prob", "ref", "update_actor", "publish_weights", "weight_sync")
SPLIT = [
    'placement.pools={"train": {"roles": ["actor", "ref", "reward"]}, "generate": {"roles": ["rollout"]}}',
    'placement.slurm.sbatch={"exclusive": true}',
    "rollout.name=vllm",
    "rollout.vllm_kv_cache_gb=0.25",
    "rollout.vllm_dtype=float32",
    "rollout.checkpoint_engine.backend=gloo",
]


def run(model: str, layout: str, nodes: int, iterations: int, partition: str, folder: Path) -> str:
    """One ``hf run`` on Slurm; returns its run id (its store: ``folder/runs.db``)."""
    overrides = [
        f"trainer.output_dir={folder / 'out'}",
        f"trainer.total_iterations={iterations}",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "data.reasoning_gym.val_size=0",  # no validation, the last iteration's included
        "trainer.logger=[console]",
        f"trainer.experiment_name=multi-{model}-{layout}-{nodes}",
        "data.train_batch_size=6",
        "actor.ppo_mini_batch_size=6",
        f"placement.slurm.partition={partition}",
        "placement.tasks_per_node=1",
    ]
    overrides += SPLIT if layout == "split" else [f"placement.nodes={nodes}"]
    args = [HF, "run", str(ROOT / "examples" / f"grpo_{model}.yaml"), "--executor", "slurm"]
    args += ["--db", f"sqlite:///{folder / 'runs.db'}", *(a for o in overrides for a in ("-o", o))]
    log = folder / f"{model}-{layout}-{nodes}.log"
    with log.open("wb") as out:
        done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}); the end of its output:\n{tail}")
    return re.search(r"run (run-\S+) recorded", log.read_text()).group(1)


def stage_medians(store, run_id: str) -> dict[str, float]:
    """Median seconds of each of `STAGES` the run timed (``timing_s/<stage>``), iterations 2.. (the first warms
    caches up)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for m in store.metrics(run_id):
        if m.name.startswith("timing_s/") and m.value is not None:
            series.setdefault(m.name.removeprefix("timing_s/"), []).append((m.step, m.value))
    return {name: statistics.median(v for _, v in sorted(points)[1:] or points) for name, points in series.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--nodes", default="1,2,3")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--partition", default="multi")
    args = parser.parse_args()

    from hybridflow.flows.placement.calibrate import Measured, fit_profile, measure_device
    from hybridflow.flows.placement.hardware import HardwareProfile
    from hybridflow.flows.store.run_store import RunStore

    models, counts = args.models.split(","), [int(n) for n in args.nodes.split(",")]
    with tempfile.TemporaryDirectory(dir=ROOT / ".cache") as tmp:
        folder = Path(tmp)
        runs = {}
        for model in models:
            for nodes in counts:
                runs[(model, "dp", nodes)] = run(model, "dp", nodes, args.iterations, args.partition, folder)
                print(f"ran {model} dp on {nodes} node(s): {runs[(model, 'dp', nodes)]}", flush=True)
            if 2 in counts and model != "tiny":  # vLLM's CPU kernels need a head size the tiny model lacks
                runs[(model, "split", 2)] = run(model, "split", 2, args.iterations, args.partition, folder)
                print(f"ran {model} split on 2 nodes: {runs[(model, 'split', 2)]}", flush=True)
        store = RunStore(f"sqlite:///{folder / 'runs.db'}")
        measured = {key: Measured.from_store(store, run_id) for key, run_id in runs.items()}
        stages = {key: stage_medians(store, run_id) for key, run_id in runs.items()}
        hosts = {key: sorted({h for p in store.placements(run_id) for h in p.hosts}) for key, run_id in runs.items()}

    one_node = [measured[(m, "dp", 1)] for m in models if (m, "dp", 1) in measured]
    profile = None
    if len(one_node) >= 2:  # two workloads separate a fixed overhead from work
        peaks = measure_device(threads=1)
        base = HardwareProfile(
            name="multi-node-bench",
            memory_bytes=float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (os.cpu_count() or 1)),
            dtype_bytes=4,
            inter_node_bandwidth=peaks["intra_node_bandwidth"],  # the nodes' "network": this machine's loopback
            source="benchmarks/multi_node.py: the 1-node runs",
            **peaks,
        )
        profile = fit_profile(base, one_node, base.name)

    header = ["model", "layout", "nodes", "hosts", "s/iter", "estimate", *(f"{s} s" for s in STAGES)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for (model, layout, nodes), m in measured.items():
        estimate = m.predict(profile).seconds if profile is not None else None
        timed = stages[(model, layout, nodes)]
        row = [model, layout, str(nodes), ", ".join(hosts[(model, layout, nodes)]), f"{m.step_s:.3g}"]
        row += ["-" if estimate is None else f"{estimate:.3g}"]
        row += [f"{timed[s]:.3g}" if s in timed else "-" for s in STAGES]
        print("| " + " | ".join(row) + " |")
    if profile is not None:
        print(f"estimate: the cost model under a profile fitted to the 1-node runs ({', '.join(models)})")
    print("medians over iterations 2.. of each run; weight transfer across nodes: publish_weights + weight_sync")


if __name__ == "__main__":
    main()
