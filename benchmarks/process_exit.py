"""How long a process that imported what a rank imports (torch, transformers, tensordict, HybridFlow's worker) takes
to end after its last line: the interpreter's usual exit against `hybridflow.engine.fast_exit.exit_process`.

    .venv/bin/python benchmarks/process_exit.py --repeats 5

Prints the median seconds from the last line to the process's end, for each way.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROGRAM = """
import time
import hybridflow.slurm.rank, hybridflow.engine.worker
from hybridflow.engine.fast_exit import exit_process
open({stamp!r}, "w").write(repr(time.time()))
{last}
"""
WAYS = {"interpreter's exit": "pass", "exit_process": "exit_process(0)"}


def exit_seconds(last: str, stamp: Path) -> float:
    """Seconds between the program's last line (its time stamp written to `stamp`) and its process's end."""
    subprocess.run([sys.executable, "-c", PROGRAM.format(stamp=str(stamp), last=last)], check=True)
    ended = time.time()
    return ended - float(stamp.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        stamp = Path(folder) / "stamp"
        for way, last in WAYS.items():
            times = [exit_seconds(last, stamp) for _ in range(args.repeats)]
            print(f"{way}: median {statistics.median(times):.2f} s to end ({', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
