"""``hf data check CONFIG``: what a run's prompts hold before it trains on them.

Prints, per split: rows, distinct prompts, rows per data_source, prompts over ``data.max_prompt_length``, labels that
fail their audit (the first few, with the exact value), and histograms of prompt lengths (tokens) and label lengths
(characters); then the validation prompts that are also training prompts. Exits 1 when a label fails its audit or a
held-out prompt is trained on, 2 when the config or its data cannot be read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from hybridflow.cli.common import console, styled

data_app = typer.Typer(help="Prompt data: check a config's rows, labels and lengths.", no_args_is_help=True)
SHOWN_FAILURES = 5
BAR = 40


@data_app.command("check")
def data_check(
    config: Path,
    override: Annotated[list[str] | None, typer.Option("-o", "--override", help="key=value (repeatable)")] = None,
) -> None:
    """Check a run config's prompts: rows, duplicates between train and validation, prompts over
    data.max_prompt_length, labels that fail their audit (exact arithmetic for reasoning_gym/basic_arithmetic,
    reasoning_gym/chain_sum and arithmetic rows), and prompt and label lengths."""
    from hybridflow.engine.agent.rollout import prompt_tools
    from hybridflow.engine.config import ConfigError, load_config
    from hybridflow.engine.data_report import data_report
    from hybridflow.engine.embedded_models import resolve_model_path
    from hybridflow.engine.models import load_tokenizer

    try:
        cfg = load_config(config, list(override or []))
    except ConfigError as e:
        console.print(str(e) if str(e).startswith(str(config)) else f"{config}: {e}", style="red")
        raise typer.Exit(2) from None
    try:
        with console.status("building and tokenizing the prompts..."):
            tokenizer = load_tokenizer(str(resolve_model_path(cfg.model.path)))
            report = data_report(cfg.data, tokenizer, prompt_tools(cfg))
    except (ValueError, FileNotFoundError, ImportError) as e:
        console.print(f"{config}: {e}", style="red")
        raise typer.Exit(2) from None
    _render(report)
    if not report.ok:
        raise typer.Exit(1)


def _render(report) -> None:
    from hybridflow.engine.data_report import histogram

    summary = Table("split", "rows", "distinct", "data_source", f"> {report.max_prompt_length} tokens", "audited",
                    "label fails")  # fmt: skip
    for name, split in report.splits.items():
        sources = ", ".join(f"{s} ({n})" for s, n in split.sources.items())
        fails = len(split.audit.failures)
        summary.add_row(name, str(split.rows), str(split.distinct), sources, str(split.over_length),
                        str(split.audit.audited), Text(str(fails), style="red") if fails else "0")  # fmt: skip
    console.print(summary)
    console.print(f"validation prompts also in the training set: {report.shared}")
    for name, split in report.splits.items():
        for i, source, question, problem in split.audit.failures[:SHOWN_FAILURES]:
            console.print(styled((f"{name} row {i}", "red"), f" ({source}) {question}: {problem}"), highlight=False)
        more = len(split.audit.failures) - SHOWN_FAILURES
        if more > 0:
            console.print(f"... and {more} more {name} labels fail their audit")
        if split.audit.unaudited:
            sources = ", ".join(f"{s} ({n} rows)" for s, n in split.audit.unaudited.items())
            console.print(f"{name}: no audit for {sources}")
    for name, split in report.splits.items():
        for title, values in (("prompt tokens", split.prompt_tokens), ("label characters", split.label_chars)):
            median = int(sorted(values)[len(values) // 2])
            console.print(
                styled((f"{name}: {title}", "bold"), f" (min {values.min()}, median {median}, max {values.max()})")
            )
            bins = histogram(values)
            peak = max(count for _, _, count in bins)
            for low, high, count in bins:
                label = f"{low}" if low == high else f"{low}-{high}"
                bar = "#" * max(1 if count else 0, round(BAR * count / peak))
                console.print(f"  {label:>9} {bar:<{BAR}} {count}", highlight=False)
    for problem in report.problems:
        console.print(styled(("problem:", "red"), f" {problem}"))
    if report.ok:
        console.print("data check passed", style="green")
