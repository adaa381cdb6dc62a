"""An iteration's timeline as a table: each stage's pool, start, end and duration (seconds from the iteration's
start) and a bar on a common time axis, so stages of different resource pools that ran at the same time show side
by side (``hf runs timeline``)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from hybridflow.flows.store.run_store import StageTime

BAR_WIDTH = 40
"""Characters of the time axis."""


def overlap(stages: Sequence[StageTime]) -> tuple[float, float]:
    """``(busy, wall)`` seconds of one iteration's `stages` (the ``step`` span excluded): the sum of the stages'
    durations and the wall time from the first start to the last end. busy / wall > 1: stages overlapped."""
    parts = [s for s in stages if s.stage != "step"]
    if not parts:
        return 0.0, 0.0
    wall = (max(s.ended_at for s in parts) - min(s.started_at for s in parts)).total_seconds()
    return sum(s.duration_s for s in parts), wall


def timeline_table(step: int, stages: Sequence[StageTime]) -> Table:
    """The table of iteration `step`'s `stages` (one `StageTime` each, as ``RunStore.stage_times`` returns them):
    stage, pool (``controller`` for stages run by the flow itself), start, end, seconds, and a bar of
    `BAR_WIDTH` characters placing the stage on the iteration's time axis."""
    origin = min(s.started_at for s in stages)
    span = max((s.ended_at - origin).total_seconds() for s in stages) or 1.0
    busy, wall = overlap(stages)
    caption = f"stages: {busy:.2f} s of work in {wall:.2f} s" + (f" ({busy / wall:.2f}x)" if wall else "")
    table = Table(
        "stage", "pool", "start s", "end s", "seconds", "timeline", title=f"iteration {step}", caption=caption
    )
    for s in sorted(stages, key=lambda s: (s.stage != "step", s.started_at)):
        start = (s.started_at - origin).total_seconds()
        end = (s.ended_at - origin).total_seconds()
        left = round(start / span * BAR_WIDTH)
        width = max(1, round(end / span * BAR_WIDTH) - left)
        bar = " " * left + "█" * width
        table.add_row(s.stage, s.pool or "controller", f"{start:.2f}", f"{end:.2f}", f"{s.duration_s:.2f}", bar)
    return table
