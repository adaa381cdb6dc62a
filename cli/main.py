"""The ``hf`` command (also installed as ``hybridflow``).

- ``hf run CONFIG [-o key=value ...]``: run training. Until the orchestration layer lands, this runs the
  single-process trainer (all roles in this process; no Prefect, no worker groups, no run store).
- ``hf models prepare NAME``: make an embedded model (``smollm2``, ``tiny``) available as a local HF folder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(help="HybridFlow: RLHF (PPO, GRPO, RLOO) with a single controller.", no_args_is_help=True)
models_app = typer.Typer(help="Embedded models (no model hub needed).", no_args_is_help=True)
app.add_typer(models_app, name="models")
console = Console(soft_wrap=True)  # one line per iteration, also when piped to a file

# Metrics shown in the one-line-per-iteration log; everything goes to metrics.jsonl.
_SHOWN = [
    "critic/score/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/entropy",
    "critic/vf_loss",
    "response_length/mean",
    "timing_s/step",
    "perf/throughput",
]


def _format_record(record: dict) -> str:
    parts = [f"[bold]step {record['step']}[/bold]"]
    parts += [f"{k}={record[k]:.4g}" for k in _SHOWN if k in record]
    parts += [f"[green]{k}={v:.3f}[/green]" for k, v in record.items() if k.startswith("val/")]
    return "  ".join(parts)


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="YAML run configuration", exists=True, dir_okay=False)],
    override: Annotated[list[str] | None, typer.Option("-o", "--override", help="key.sub=value (repeatable)")] = None,
) -> None:
    """Train with CONFIG (single process for now; see README)."""
    from hybridflow.engine.config import ConfigError, load_config

    try:
        cfg = load_config(config, override or [])
    except ConfigError as e:
        console.print(f"[red]{config}: {e}[/red]")
        raise typer.Exit(2) from None
    from hybridflow.engine.trainer import SingleProcessTrainer

    with console.status("loading model and data..."):
        trainer = SingleProcessTrainer(cfg)
    console.print(
        f"model {cfg.model.path}: {len(trainer.train_dataset)} train prompts "
        f"({trainer.train_dataset.num_filtered} over data.max_prompt_length dropped), "
        f"{len(trainer.val_dataset) if trainer.val_dataset else 0} validation prompts, "
        f"algorithm {cfg.algorithm.adv_estimator}, {cfg.trainer.total_iterations} iterations"
    )
    trainer.fit(log=lambda record: console.print(_format_record(record)))
    out = Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name / "metrics.jsonl"
    console.print(f"metrics written to {out}")


@models_app.command("prepare")
def models_prepare(
    name: Annotated[str, typer.Argument(help="embedded model: smollm2 or tiny")],
    force: Annotated[bool, typer.Option(help="rebuild even if already prepared")] = False,
) -> None:
    """Convert an embedded model into a cached Hugging Face folder (idempotent) and print its path."""
    from hybridflow.engine.embedded_models import prepare_model

    try:
        with console.status(f"preparing {name} (once; ~30 s for smollm2)..."):
            path = prepare_model(name, force=force)
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    print(path)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()
