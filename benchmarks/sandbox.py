"""Benchmark: the sandboxed Python interpreter tool (`hybridflow.engine.agent.code_interpreter`).

Printed (medians of `--repeats`): a cold call (a fresh trajectory's first call: the sandbox starts, then the code
runs), a warm call (the same interpreter's next call), and `--concurrent` trajectories each making one call at once
(all interpreters alive together, wall seconds for the batch). Targets of issue 54: warm <= 50 ms, cold <= 200 ms,
32 interpreters at once on the 2-core machine.

    .venv/bin/python benchmarks/sandbox.py [--repeats 20] [--concurrent 32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from hybridflow.engine.agent.code_interpreter import PythonInterpreter
from hybridflow.engine.agent.tools import ToolBox, tool_from_class


async def one_trajectory(box: ToolBox) -> tuple[float, float]:
    """Seconds of the first (cold) and the second (warm) call of one trajectory."""
    async with box.session() as session:
        started = time.perf_counter()
        first = await session.call("python", {"code": "x = sum(range(1000))"})
        cold = time.perf_counter() - started
        started = time.perf_counter()
        second = await session.call("python", {"code": "x + 1"})
        warm = time.perf_counter() - started
    assert first.error is None and second.text == "499501\n", (first, second)
    return cold, warm


async def concurrent(box: ToolBox, n: int) -> float:
    """Wall seconds for `n` trajectories' first calls at once (n interpreters alive together)."""
    sessions = [box.session() for _ in range(n)]
    started = time.perf_counter()
    try:
        results = await asyncio.gather(*(s.call("python", {"code": f"{i} * {i}"}) for i, s in enumerate(sessions)))
        took = time.perf_counter() - started
    finally:
        await asyncio.gather(*(s.close() for s in sessions))
    assert [r.text for r in results] == [f"{i * i}\n" for i in range(n)], results
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--concurrent", type=int, default=32)
    args = parser.parse_args()
    box = ToolBox([tool_from_class(PythonInterpreter, {}, timeout_s=30)])
    runs = [asyncio.run(one_trajectory(box)) for _ in range(args.repeats)]
    cold = statistics.median(c for c, _ in runs) * 1000
    warm = statistics.median(w for _, w in runs) * 1000
    together = statistics.median(asyncio.run(concurrent(box, args.concurrent)) for _ in range(5))
    print(f"cold call (sandbox start + code): {cold:.1f} ms median of {args.repeats} (target <= 200 ms)")
    print(f"warm call: {warm:.2f} ms median of {args.repeats} (target <= 50 ms)")
    print(f"{args.concurrent} interpreters at once, one call each: {together:.3f} s median of 5")


if __name__ == "__main__":
    main()
