"""The live terminal display of a run: iteration bar, current stage, reward, KL, tokens/s (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

LIVE_METRICS = (
    "critic/score/mean",
    "critic/rm_score/mean",
    "actor/ppo_kl",
    "actor/pg_loss",
    "perf/throughput",
    "rm/loss",
    "rm/acc",
    "train/loss",
    "val/loss",
    "num_turns/mean",
)
"""Printed per iteration (those present), then every ``val/*/acc``."""


class LiveProgress:
    """Listens to the flow's events (``hybridflow.flows.lifecycle.listeners``) and draws a progress bar, printing one
    line per iteration with its key metrics, so the scrollback keeps the history."""

    def __init__(self, console: Console):
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]iterations"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[stage]}"),
            TextColumn("{task.fields[summary]}"),
            console=console,
        )
        self.task = None

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        if event == "flow":
            self.console.print(f"Prefect flow run: {data['ui_url'] or '(no UI: no Prefect server)'}")
            self.progress.console.print("starting worker groups and loading models...")
        elif event == "fallback":  # a checkpoint failed verification: say which and what the run resumes from
            self.console.print(f"{data['message']}", style="yellow")
        elif event == "recovery":  # the flow's warning says it; the next session starts its own progress
            if self.task is not None:
                self.progress.remove_task(self.task)
                self.task = None
        elif event == "start":
            self.task = self.progress.add_task(
                "run", total=data["total"], completed=data["start_step"], stage="", summary=""
            )
        elif self.task is None:
            return
        elif event == "stage":
            self.progress.update(self.task, stage=f"[cyan]{data['name']}[/cyan]")
        elif event in ("iteration", "validation"):
            m = data["metrics"]
            parts = [f"{k}={m[k]:.4g}" for k in LIVE_METRICS if m.get(k) is not None]
            parts += [f"{k}={v:.3f}" for k, v in m.items() if k.startswith("val/") and k.endswith("/acc")]
            step = data.get("step", 0)
            self.console.print(f"step {step}  " + "  ".join(parts))
            if event == "iteration":
                self.progress.update(self.task, completed=step, summary="  ".join(parts[:2]))
