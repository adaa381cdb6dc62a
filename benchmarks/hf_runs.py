"""What the benchmarks that time whole runs share: one ``hf run`` of an example config in a store of its own, and
the medians of its metrics (imported by the scripts beside it, which run with this folder on ``sys.path``)."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def hf_run(config: str, overrides: list[str], folder: Path, label: str) -> tuple[str, str]:
    """``hf run examples/<config>`` with `overrides` (``key=value``), its store ``folder/runs.db``: (store URL, run
    id). Exits naming `label` with the end of the output when the run fails."""
    db = f"sqlite:///{folder / 'runs.db'}"
    command = [str(ROOT / ".venv/bin/hf"), "run", str(ROOT / "examples" / config), "--db", db]
    for item in overrides:
        command += ["-o", item]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"{label}: hf run failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return db, re.search(r"run (run-\S+) recorded", out.stdout).group(1)


def metric_medians(db: str, run_id: str, names: list[str], first_step: int = 1) -> dict[str, float]:
    """The median over the iterations from `first_step` on of each metric of `names` the run logged."""
    from hybridflow.flows.store.run_store import RunStore

    points = RunStore(db).metrics(run_id)
    medians = {}
    for name in names:
        values = [p.value for p in points if p.name == name and p.step >= first_step and p.value is not None]
        if values:
            medians[name] = statistics.median(values)
    return medians
