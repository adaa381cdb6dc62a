"""Benchmark: what grouping an iteration's stages under a Prefect subflow costs, against the local Prefect server.

The RLHF flow runs each iteration as the subflow ``iteration N`` (`hybridflow.flows.reporting.IterationSubflows`)
so that the Prefect UI's timeline groups its stages. This times, inside one flow run, `--iterations` loop turns of
five Prefect tasks (an iteration's stages, each sleeping `--stage-s`) run directly, and the same turns each inside
its subflow: the difference per turn is the subflow's cost (creating its flow run and the task run that stands for
it in the run's, their state changes, its task runner). Medians of the per-turn seconds. With no work in the stages
(`--stage-s 0`) the subflow's start waits on the server's SQLite, busy writing the task runs' events of the turn
before: seconds, a cost real stages (seconds each) never see. It uses the Prefect server of ``$HYBRIDFLOW_HOME``
(started if none runs, as ``hf run`` does).

    .venv/bin/python benchmarks/iteration_subflow.py [--iterations 20] [--stage-s 0.5]
"""

import argparse
import os
import statistics
import time

from hybridflow.cli import server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--stage-s", type=float, default=0.5, help="seconds each stage task sleeps")
    args = parser.parse_args()
    info = server.status() or server.start()
    os.environ["PREFECT_API_URL"] = info.api_url

    from prefect import flow, task

    from hybridflow.flows.reporting import IterationSubflows

    @task
    def stage(x: int) -> int:
        time.sleep(args.stage_s)
        return x + 1

    def stages() -> int:
        return sum(stage(i) for i in range(5))

    @flow(name="subflow-benchmark")
    def loop() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {"flat": [], "subflow": []}
        subflows = IterationSubflows()
        for i in range(args.iterations):
            began = time.perf_counter()
            stages()
            times["flat"].append(time.perf_counter() - began)
            began = time.perf_counter()
            subflows.run(i + 1, stages)
            times["subflow"].append(time.perf_counter() - began)
        return times

    times = loop()
    flat, grouped = statistics.median(times["flat"]), statistics.median(times["subflow"])
    print(f"{args.iterations} turns of 5 tasks of {args.stage_s} s, median seconds per turn: flat {flat:.3f}, "
          f"in a subflow {grouped:.3f}: the subflow costs {grouped - flat:.3f} s per iteration")  # fmt: skip


if __name__ == "__main__":
    main()
