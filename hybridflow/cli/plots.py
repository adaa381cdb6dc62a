"""``hf runs plot``: metrics of one or more runs against the iteration, one panel per metric, as a PNG (matplotlib),
shown inline in terminals that display images (kitty, iTerm2, WezTerm)."""

from __future__ import annotations

import base64
import fnmatch
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

DEFAULT_METRICS = (
    "critic/score/mean",
    "critic/rm_score/mean",
    "val/*/acc",
    "actor/kl_loss",
    "actor/reward_kl_penalty",
    "actor/entropy",
    "response_length/mean",
)
"""Plotted when no ``--name`` is given (those some run has): reward, held-out accuracy, KL to the reference
(``kl_loss`` when the KL is a loss term, ``reward_kl_penalty`` when it is in the reward), entropy, response length."""

Series = Mapping[str, Mapping[str, Sequence[tuple[int, float | None]]]]
"""run id -> metric name -> [(step, value)] in step order (None: NaN or ±inf was recorded)."""


def resolve_names(patterns: Sequence[str], available: set[str], explicit: bool) -> list[str]:
    """The metric names the `patterns` (exact names or ``fnmatch`` globs such as ``val/*/acc``) select from
    `available`, in pattern order.

    Raises:
        ValueError: `explicit` (the user named them) and a pattern matches nothing: names the pattern and the
            metrics there are.
    """
    names: list[str] = []
    for pattern in patterns:
        found = sorted(n for n in available if fnmatch.fnmatchcase(n, pattern))
        if not found and explicit:
            raise ValueError(
                f"no metric matches --name {pattern!r}; the runs have: {', '.join(sorted(available)) or 'none'}"
            )
        names += [n for n in found if n not in names]
    return names


def ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing of a scalar series: an exponential moving average ``last = weight x last + (1 -
    weight) x value`` started at 0, divided by ``1 - weight^k`` after k points (debiased, so the first points are
    not pulled toward 0). `weight` in [0, 1): 0 returns the values; TensorBoard's slider default is 0.6.

    Raises:
        ValueError: `weight` outside [0, 1)."""
    if not 0 <= weight < 1:
        raise ValueError(f"--smooth must be in [0, 1) (TensorBoard's slider), got {weight}")
    out, last = [], 0.0
    for k, value in enumerate(values, start=1):
        last = weight * last + (1 - weight) * value
        out.append(last / (1 - weight**k))
    return out


def plot_runs(series: Series, names: Sequence[str], out: Path, smooth: float = 0.0) -> Path:
    """Draw `names` (one panel each, iteration on x with integer ticks, one line per run, markers at each point)
    into the PNG `out`; with `smooth` > 0 each line is its `ema` and the raw points stay faded behind it.

    Raises:
        ValueError: `names` is empty (nothing to draw), or `smooth` outside [0, 1).
    """
    if not names:
        raise ValueError("nothing to plot: none of the metrics asked for was recorded")
    ema([], smooth)  # the weight checked before any drawing
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        for run_id, metrics in series.items():
            points = [(s, v) for s, v in metrics.get(name, ()) if v is not None]
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            if smooth:
                (raw,) = ax.plot(steps, values, marker="o", markersize=2, alpha=0.25)
                ax.plot(steps, ema(values, smooth), color=raw.get_color(), label=run_id)
            else:
                ax.plot(steps, values, marker="o", markersize=3, label=run_id)
        ax.set_title(name + (f" (smoothed {smooth:g})" if smooth else ""), fontsize=10)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole numbers
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if labels:
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 if labels else 0, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def show_in_terminal(png: Path) -> bool:
    """Display `png` inline if the terminal speaks an image protocol (kitty's graphics protocol, or iTerm2's
    inline images, which WezTerm also reads) and stdout is that terminal; returns whether it did."""
    if not sys.stdout.isatty():
        return False
    data = base64.standard_b64encode(png.read_bytes()).decode()
    if os.environ.get("TERM") == "xterm-kitty" or os.environ.get("KITTY_WINDOW_ID"):
        chunks = [data[i : i + 4096] for i in range(0, len(data), 4096)]
        for i, chunk in enumerate(chunks):
            more = int(i < len(chunks) - 1)
            head = f"a=T,f=100,m={more}" if i == 0 else f"m={more}"
            sys.stdout.write(f"\033_G{head};{chunk}\033\\")
        sys.stdout.write("\n")
        return True
    if os.environ.get("TERM_PROGRAM") in ("iTerm.app", "WezTerm"):
        sys.stdout.write(f"\033]1337;File=inline=1;size={png.stat().st_size}:{data}\a\n")
        return True
    return False
