"""Token-in-token-out engine calls: what an agent loop asks a rollout engine for, and what it gets back.

Every engine (`hybridflow.engine.rollout.hf`, `hybridflow.engine.rollout.vllm`) serves a list of `TokenRequest` in
one batched call inside its ``token_engine(temperature, stream)`` context; the ids are fed as they are, never decoded
and re-encoded, and the answer's ids are the sampled ids verbatim.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenRequest:
    """Continue `prompt_ids` by at most `max_tokens` (>= 1) sampled ids, stopping after the first EOS id; `seed`
    fixes the sampling (`hybridflow.engine.rollout.hf.sampling_seed` of the row and turn)."""

    prompt_ids: list[int]
    max_tokens: int
    seed: int


@dataclass
class TokenOutput:
    """One request's answer: the sampled ids (ending with an EOS id when `stopped`), and the engine's log-prob of each
    under the distribution it sampled from (after temperature, top-k and top-p), one float per id."""

    ids: list[int]
    log_probs: list[float]
    stopped: bool


def cut_at_eos(ids: list[int], log_probs: list[float], eos_ids: set[int], max_tokens: int) -> TokenOutput:
    """The first `max_tokens` of `ids`, up to and including the first EOS id (`stopped` when one is kept)."""
    ids, log_probs = ids[:max_tokens], log_probs[:max_tokens]
    for i, token in enumerate(ids):
        if token in eos_ids:
            return TokenOutput(ids[: i + 1], log_probs[: i + 1], True)
    return TokenOutput(ids, log_probs, False)
