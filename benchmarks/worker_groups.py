"""Benchmark: worker-group overheads, locally and on Slurm.

1. Round trip of a no-op method call on a 2-rank group (median, p90, over --calls calls; goal: median < 2 ms).
2. Moving a 100 MB batch between two groups: a 2-rank producer writes it (each rank its half, as a stage result),
   a 1-rank consumer reads all of it and a 2-rank consumer each its half (many-to-many through the run's data
   folder); MB/s of each step, wall clock in the controller.

    .venv/bin/python benchmarks/worker_groups.py [--executor local|slurm|both] [--calls 1000] [--mb 100]

Slurm needs a cluster (``bash hybridflow/slurm/dev_cluster.sh start`` as root gives a one-node one).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridflow.engine.protocol import DataProto
from hybridflow.slurm.channel import create_secret
from hybridflow.slurm.worker_group import GroupSpec, WorkerGroup, slurm_parameters

WORKER = f"{Path(__file__).resolve().parent / 'bench_worker.py'}:BenchWorker"


def _group(tmp: Path, name: str, ranks: int, executor: str) -> WorkerGroup:
    secret = tmp / "secret"
    if not secret.exists():
        create_secret(secret)
    spec = GroupSpec(
        name=name,
        worker_cls=WORKER,
        tasks_per_node=ranks,
        executor=executor,
        slurm=slurm_parameters(cpus_per_task=1) if executor == "slurm" else {},
        timeout_min=60,
    )
    return WorkerGroup(spec, run_dir=tmp, data_dir=tmp / "data", secret_path=secret)


def round_trip(executor: str, calls: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, _group(Path(tmp), "noop", 2, executor) as group:
        for _ in range(50):  # warm-up
            group.noop()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            group.noop()
            times.append((time.perf_counter() - start) * 1e3)
        times.sort()
        print(
            f"[{executor}] no-op call on 2 ranks: median {statistics.median(times):.3f} ms, "
            f"p90 {times[int(0.9 * len(times))]:.3f} ms, min {times[0]:.3f} ms ({calls} calls)"
        )


def transfer(executor: str, megabytes: int) -> None:
    rows, row_bytes = 1000, megabytes * 1_000_000 // 1000
    with tempfile.TemporaryDirectory(dir=Path.cwd() / ".cache") as tmp:
        tmp = Path(tmp)
        groups = []
        try:
            for name, ranks in (("producer", 2), ("consumer1", 1), ("consumer2", 2)):
                groups.append(_group(tmp, name, ranks, executor))
            producer, one, two = groups
            index = DataProto.from_dict({"i": torch.arange(rows)})
            for attempt in range(3):
                start = time.perf_counter()
                batch = producer.produce(index, row_bytes)
                produced = time.perf_counter() - start
                size = batch.nbytes / 1e6
                start = time.perf_counter()
                got1 = one.consume(batch)
                to_one = time.perf_counter() - start
                start = time.perf_counter()
                got2 = two.consume(batch)
                to_two = time.perf_counter() - start
                assert got1[0]["bytes"] == sum(g["bytes"] for g in got2) == rows * row_bytes
                print(
                    f"[{executor}] {size:.0f} MB batch, try {attempt + 1}: produce (DP=2 write) {produced:.2f} s "
                    f"= {size / produced:.0f} MB/s; DP=2 -> DP=1 {to_one:.2f} s = {size / to_one:.0f} MB/s; "
                    f"DP=2 -> DP=2 {to_two:.2f} s = {size / to_two:.0f} MB/s"
                )
                batch.delete()
        finally:
            for group in groups:
                group.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executor", choices=["local", "slurm", "both"], default="both")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--mb", type=int, default=100)
    args = parser.parse_args()
    (Path.cwd() / ".cache").mkdir(exist_ok=True)
    for executor in ["local", "slurm"] if args.executor == "both" else [args.executor]:
        round_trip(executor, args.calls)
        transfer(executor, args.mb)


if __name__ == "__main__":
    main()
