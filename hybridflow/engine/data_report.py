"""What a run's prompts hold, before it trains on them: the report behind ``hf data check CONFIG``.

Rows are built exactly as a run builds them (`hybridflow.engine.data.build_prompt_rows`), tokenized with the run's
tokenizer and chat template, and checked for what silently spoils a run: held-out prompts that are also trained on,
prompts over ``data.max_prompt_length`` (a run drops them), and labels that are not the answer to their question
(`hybridflow.engine.audit`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridflow.engine.audit import AuditResult, audit_rows
from hybridflow.engine.config import DataConfig
from hybridflow.engine.data import build_prompt_rows, encode_prompt


@dataclass
class SplitReport:
    """One split (``train`` or ``val``) of a config's prompts.

    Attributes:
        rows: rows built (before the length filter).
        distinct: distinct prompts among them (the prompt's messages as text).
        over_length: rows whose prompt is over ``data.max_prompt_length`` tokens (a run drops them).
        prompt_tokens: tokens per prompt, int64 [rows] (chat template applied, as the rollout sees it).
        label_chars: characters per label (``reward_model.ground_truth`` as text), int64 [rows].
        sources: rows per ``data_source``.
        audit: the label audit of these rows.
    """

    rows: int
    distinct: int
    over_length: int
    prompt_tokens: np.ndarray
    label_chars: np.ndarray
    sources: dict[str, int]
    audit: AuditResult


@dataclass
class DataReport:
    """`data_report`'s result: one `SplitReport` per non-empty split, and the prompts in both.

    Attributes:
        splits: ``{"train": SplitReport, "val": SplitReport}`` (``val`` absent without held-out prompts).
        shared: validation prompts that are also training prompts (distinct prompts counted once).
        max_prompt_length: ``data.max_prompt_length`` (tokens).
    """

    splits: dict[str, SplitReport]
    shared: int
    max_prompt_length: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No label fails its audit and no held-out prompt is trained on."""
        return not self.problems


def _prompt_key(row: dict[str, Any]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in row["prompt"])


def _split_report(
    rows: list[dict[str, Any]], tokenizer: Any, max_prompt_length: int, tools: list[dict[str, Any]] | None
) -> SplitReport:
    tokens = np.array([len(encode_prompt(row["prompt"], tokenizer, tools=tools)) for row in rows], dtype=np.int64)
    labels = np.array([len(str(row["reward_model"].get("ground_truth"))) for row in rows], dtype=np.int64)
    return SplitReport(
        rows=len(rows),
        distinct=len({_prompt_key(row) for row in rows}),
        over_length=int((tokens > max_prompt_length).sum()),
        prompt_tokens=tokens,
        label_chars=labels,
        sources=dict(Counter(row["data_source"] for row in rows)),
        audit=audit_rows(rows),
    )


def data_report(data: DataConfig, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> DataReport:
    """Build a config's train and validation rows as a run does and report on them.

    Args:
        data: the config's ``data`` section.
        tokenizer: the run's tokenizer (``model.path``'s), for prompt lengths in tokens.
        tools: the OpenAI function schemas the run's prompts offer
            (`hybridflow.engine.agent.rollout.prompt_tools`): their lengths count in the prompts'.

    Returns:
        The report; its ``problems`` name each failed check in words: labels failing their audit (per split, with
        the count) and validation prompts also in the training set.

    Raises:
        ValueError, FileNotFoundError: as `build_prompt_rows` (a missing or malformed file, a bad generator setting).
    """
    train, val = build_prompt_rows(data)
    splits = {"train": _split_report(train, tokenizer, data.max_prompt_length, tools)}
    if val:
        splits["val"] = _split_report(val, tokenizer, data.max_prompt_length, tools)
    shared = len({_prompt_key(r) for r in train} & {_prompt_key(r) for r in val})
    report = DataReport(splits, shared, data.max_prompt_length)
    for name, split in splits.items():
        failed = len(split.audit.failures)
        if failed:
            report.problems.append(
                f"{failed} of {split.audit.audited} audited {name} labels are not the value of their question"
            )
    if shared:
        report.problems.append(f"{shared} validation prompts are also training prompts")
    return report


def histogram(values: np.ndarray, bins: int = 8) -> list[tuple[int, int, int]]:
    """Integer-edged histogram of `values`: ``(low, high, count)`` per bin, ``low <= v <= high``, lows ascending."""
    if values.size == 0:
        return []
    lo, hi = int(values.min()), int(values.max())
    width = max(1, -(-(hi - lo + 1) // bins))
    out = []
    for low in range(lo, hi + 1, width):
        high = min(hi, low + width - 1)
        out.append((low, high, int(((values >= low) & (values <= high)).sum())))
    return out
