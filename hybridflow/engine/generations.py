"""Sample generations as text: what the model wrote, for the run store, the trackers and the Prefect UI."""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.engine.protocol import DataProto

GENERATION_KEYS = ["prompts", "responses", "response_mask", "attention_mask", "token_level_scores"]
"""The tensor columns `decode_generations` reads (plus ``data_source`` and ``reward_model`` when present)."""


TOOL_OPEN, TOOL_CLOSE = "\n[tool turn]", "[/tool turn]\n"
"""What `decode_generations` writes around the tool and template tokens of an agent trajectory."""


def _conversation(tokenizer: Any, ids: Any, trained: Any, real: Any) -> str:
    """A response as text: the model's runs of tokens decoded without special tokens, each run of tool and template
    tokens (real but not trained on) decoded with them and marked."""
    pieces, start = [], 0
    kinds = [(bool(t), bool(r)) for t, r in zip(trained.tolist(), real.tolist(), strict=True)]
    while start < len(kinds):
        end = start
        while end < len(kinds) and kinds[end] == kinds[start]:
            end += 1
        model_tokens, in_trajectory = kinds[start]
        run = ids[start:end].tolist()
        if model_tokens:
            pieces.append(tokenizer.decode(run, skip_special_tokens=True))
        elif in_trajectory:
            pieces.append(TOOL_OPEN + tokenizer.decode(run, skip_special_tokens=False) + TOOL_CLOSE)
        start = end
    return "".join(pieces)


def decode_generations(data: DataProto, tokenizer: Any, step: int) -> list[dict[str, Any]]:
    """Decode each row of a scored rollout into one sample.

    Args:
        data: rows with ``prompts`` int64 [B, P] (left-padded), ``responses`` int64 [B, T], ``response_mask``
            [B, T], ``attention_mask`` [B, P + T], ``token_level_scores`` float [B, T]; optional
            ``rollout_version`` int64 [B], ``rollout_token_versions`` int64 [B, T] (a streaming rollout's; -1
            past a response's end), ``routed_experts`` int16 [B, P+T, M, k] (router replay's routes,
            `hybridflow.engine.moe`), ``rm_scores`` float [B, T] and non-tensor ``uid``, ``data_source``,
            ``reward_model`` (``{"ground_truth": ...}``) and ``judge_text``.
        tokenizer: the actor's tokenizer (special tokens are skipped).
        step: the iteration the samples belong to (0: the validation before training).

    Returns:
        one dict per row: ``step``, ``data_source``, ``prompt``, ``response`` (text; an agent trajectory's tool
        turns, the tokens ``response_mask`` leaves out, are shown with their template markers between
        `TOOL_OPEN` and `TOOL_CLOSE`), ``score`` (the row's summed
        ``token_level_scores``, float), ``ground_truth`` (str, "" when absent), ``uid`` (the prompt's id, str) and
        ``rollout_version`` (int: the actor updates in the weights that generated it), ``rm_score`` (the reward
        model's score: ``rm_scores`` summed), ``judge_text`` (a generative reward model's verdict) and
        ``token_versions`` (the response's tokens by the version that sampled them, ``[(version, tokens), ...]``
        in order, `version_runs`) and ``routed_experts`` (the experts each response token went to,
        ``[token][MoE layer][k]`` over the response's tokens, -1 where nothing was recorded); None without the
        column.
    """
    batch, extra = data.batch, data.non_tensor_batch
    prompt_len = batch["prompts"].shape[1]
    prompt_mask = batch["attention_mask"][:, :prompt_len].bool()
    response_mask = batch["response_mask"].bool()
    real = batch["attention_mask"][:, prompt_len:].bool()
    scores = batch["token_level_scores"].sum(-1).tolist()
    versions = batch["rollout_version"].tolist() if "rollout_version" in batch else [None] * len(data)
    rm_scores = batch["rm_scores"].sum(-1).tolist() if "rm_scores" in batch else [None] * len(data)
    token_versions = batch.get("rollout_token_versions", None)
    routes = batch.get("routed_experts", None)
    verdicts = extra.get("judge_text")
    samples = []
    for i in range(len(data)):
        truth = extra["reward_model"][i].get("ground_truth", "") if "reward_model" in extra else ""
        samples.append(
            {
                "step": step,
                "data_source": str(extra["data_source"][i]) if "data_source" in extra else "",
                "prompt": tokenizer.decode(batch["prompts"][i][prompt_mask[i]].tolist(), skip_special_tokens=True),
                "response": _conversation(tokenizer, batch["responses"][i], response_mask[i], real[i]),
                "score": float(scores[i]),
                "ground_truth": "" if truth is None else str(truth),
                "uid": str(extra["uid"][i]) if "uid" in extra else None,
                "rollout_version": versions[i],
                "rm_score": rm_scores[i],
                "judge_text": None if verdicts is None else str(verdicts[i]),
                "token_versions": None if token_versions is None else version_runs(token_versions[i]),
                "routed_experts": None if routes is None else routes[i, prompt_len:][real[i]].tolist(),
            }
        )
    return samples


def version_runs(versions: torch.Tensor) -> list[tuple[int, int]]:
    """A response's per-token weight versions (int64 [T], -1 past its end) as runs ``[(version, tokens), ...]`` in
    order: ``[(3, 40)]`` for 40 tokens of version 3, ``[(3, 12), (4, 28)]`` for a partial rollout continued under
    version 4 after 12 tokens."""
    runs: list[tuple[int, int]] = []
    for version in versions[versions >= 0].tolist():
        if runs and runs[-1][0] == version:
            runs[-1] = (version, runs[-1][1] + 1)
        else:
            runs.append((version, 1))
    return runs
