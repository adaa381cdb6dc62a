"""Rule-based rewards: answer extraction, GSM8K and reasoning-gym scoring, custom score functions, RewardManager.

A *score function* has the signature ``(data_source, solution_str, ground_truth, extra_info) -> float | dict``;
a dict must hold ``"score"`` (the reward) and may hold other numbers (logged as metrics, e.g. ``"acc"``).
`default_compute_score` picks one by ``data_source``; ``reward.custom_function`` (``module:function`` or
``path.py:function``, loaded by `load_reward_function`) replaces it. `RewardManager` decodes a batch of responses,
calls the score function once per sample (several at once, each call with a time limit: `hybridflow.engine.reward.
scoring`) and writes each score onto the sample's last response token; a sample whose call raised or timed out
scores 0.0 and keeps its error, and only a batch where too many failed stops the run.

This module imports no torch at import time (torch, `hybridflow.engine.protocol` and `hybridflow.engine.guards` are
imported where used): the scoring processes import it to reach `default_compute_score` and start in ~0.1 s.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import logging
import math
import numbers
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridflow.engine.imports import load_object
from hybridflow.engine.reward.scoring import (
    Outcome,
    ProcessScorer,
    check_limits,
    score_in_process,
    timeout_text,
)

if TYPE_CHECKING:
    import torch

    from hybridflow.engine.protocol import DataProto

logger = logging.getLogger(__name__)

ScoreFunction = Callable[[str, str, Any, dict[str, Any] | None], "float | dict[str, Any]"]

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
REASONING_GYM_PREFIX = "reasoning_gym/"
VERIFIERS_PREFIX = "verifiers/"
# Generators whose score_answer compares the parsed answer grid with metadata["output"] as a tuple of tuples;
# a JSON round trip turns those into lists, so they are turned back before scoring.
_TUPLE_GRID_GENERATORS = frozenset({"arc_agi", "rearc"})

# A number: optional minus, digits with optional thousands commas (1,234,567), optional decimals.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GSM8K_STRICT_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")


# ---------------------------------------------------------------------------------------------------- extraction
def _last_number(text: str) -> str | None:
    """The last number in `text` with thousands commas removed, or None."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_answer(solution_str: str) -> str:
    """The answer a response gives, by the first rule that applies:

    1. the text inside the last complete ``<answer>...</answer>`` pair, stripped;
    2. otherwise the last number in the text: an integer or decimal, possibly negative, with thousands commas
       removed (``"so 1,234.5 apples"`` -> ``"1234.5"``; ``"7."`` -> ``"7"``; a fraction ``3/4`` gives ``"4"``);
    3. otherwise the whole text, stripped.
    """
    tags = _ANSWER_TAG_RE.findall(solution_str)
    if tags:
        return tags[-1].strip()
    number = _last_number(solution_str)
    if number is not None:
        return number
    return solution_str.strip()


def _normalise_number_text(text: str) -> str:
    return text.strip().replace(",", "").replace("$", "").strip()


def _answers_equal(answer: str, truth: str) -> bool:
    """Equal as numbers if both parse as floats (``"72.0" == "72"``), else as normalised strings."""
    a, t = _normalise_number_text(answer), _normalise_number_text(truth)
    try:
        return float(a) == float(t)
    except ValueError:
        return a == t


# ---------------------------------------------------------------------------------------------------- GSM8K
def gsm8k_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """Score a GSM8K response against the reference number.

    Extraction: ``method="strict"`` takes the number after the last ``####`` (the GSM8K answer format; a ``$``
    and thousands commas are allowed and removed); ``method="flexible"`` takes the last number anywhere in the text.
    The answer and `ground_truth` are compared as numbers when both parse as floats (``"72.0"`` equals ``"72"``),
    else as strings with commas and ``$`` removed. A `ground_truth` holding a full GSM8K solution
    (``"... #### 72"``) is reduced to the number after ``####``.

    Returns:
        `score` if the extracted answer is correct, `format_score` if an answer was extracted but is wrong,
        ``0.0`` if no answer could be extracted.

    Raises:
        ValueError: if `method` is not ``"strict"`` or ``"flexible"``.
    """
    if method == "strict":
        matches = _GSM8K_STRICT_RE.findall(solution_str)
        answer = matches[-1].replace(",", "") if matches else None
    elif method == "flexible":
        answer = _last_number(solution_str)
    else:
        raise ValueError(f"gsm8k_score method must be 'strict' or 'flexible', got {method!r}")
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    if "####" in truth:
        truth = truth.rsplit("####", 1)[1]
    return float(score) if _answers_equal(answer, truth) else float(format_score)


# ---------------------------------------------------------------------------------------------------- reasoning-gym
@functools.cache
def _reasoning_gym_scorer(name: str) -> Callable[[Any, dict[str, Any]], float]:
    import reasoning_gym

    try:
        return reasoning_gym.get_score_answer_fn(name)
    except Exception:  # an unknown name: said with the close ones (the list's module imports torch: only then)
        _check_generator(name)
        raise


def _check_generator(name: str) -> None:
    """Raise ValueError (close names listed) if `name` is not a reasoning-gym generator."""
    from hybridflow.engine.data import reasoning_gym_names  # the cached list: reasoning-gym itself is not imported

    names = reasoning_gym_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
        hint = f"did you mean {', '.join('reasoning_gym/' + c for c in close)}?" if close else "no close match"
        raise ValueError(
            f"data_source 'reasoning_gym/{name}' names no reasoning-gym generator; {hint} "
            "(fix the data_source column of the prompt file or data.reasoning_gym.name)"
        )


def reasoning_gym_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None
) -> dict[str, float]:
    """Score a response with the reasoning-gym generator's own ``score_answer``.

    The generator is ``data_source`` after ``"reasoning_gym/"``; the answer is `extract_answer` of the response;
    the entry is ``extra_info["entry"]`` (as written by `hybridflow.engine.data.reasoning_gym_rows`; a JSON string
    is parsed), or ``{"answer": ground_truth, "metadata": {}}`` when absent. For the ARC generators (``arc_agi``,
    ``rearc``), whose scorers compare against tuple grids, the grids that JSON turned into lists become tuples again.
    Grid- or text-valued tasks need the response to wrap its answer in ``<answer>...</answer>``, since without tags
    `extract_answer` falls back to the last number.

    Decision on partial credit: ``"score"`` keeps reasoning-gym's partial credit (e.g. 0.5 for an answer that
    contains the right one inside a wrong one), a denser training reward; ``"acc"`` is 1.0 only for a full score
    (``score >= 1.0``), so validation accuracy counts exact answers only.

    Returns:
        ``{"score": float in [0, 1], "acc": 0.0 or 1.0}``.

    Raises:
        ValueError: if `data_source` does not start with ``"reasoning_gym/"`` or names no generator (close names
            listed).
    """
    if not data_source.startswith(REASONING_GYM_PREFIX):
        raise ValueError(f"reasoning_gym_score needs a data_source 'reasoning_gym/<name>', got {data_source!r}")
    name = data_source[len(REASONING_GYM_PREFIX) :]
    scorer = _reasoning_gym_scorer(name)
    entry = (extra_info or {}).get("entry")
    if isinstance(entry, str):
        entry = json.loads(entry)
    if not entry:
        entry = {"answer": ground_truth, "metadata": {}}
    entry = _restore_tuples(name, entry)
    score = float(scorer(extract_answer(solution_str), entry))
    return {"score": score, "acc": 1.0 if score >= 1.0 else 0.0}


def _restore_tuples(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Undo the JSON round trip (tuples -> lists) where a generator's scorer needs tuples (ARC grids)."""
    if name not in _TUPLE_GRID_GENERATORS or not isinstance(entry.get("metadata"), dict):
        return entry
    metadata = dict(entry["metadata"])
    for key in ("input", "output"):
        grid = metadata.get(key)
        if isinstance(grid, list):
            metadata[key] = tuple(tuple(row) if isinstance(row, list) else row for row in grid)
    return {**entry, "metadata": metadata}


def verifiers_score(extra_info: dict[str, Any] | None) -> dict[str, float]:
    """A verifiers environment's own score of the trajectory (its rubric's weighted reward, computed in the rollout:
    `hybridflow.engine.agent.verifiers_env`): ``score`` its ``extra_info["agent"]["env_reward"]``, ``acc`` 1.0 where
    that reaches the environment's ``pass_threshold``.

    Raises:
        ValueError: the trajectory carries no environment reward (it was not run by its ``verifiers/<env_id>``
            loop: names the key to set)."""
    agent = (extra_info or {}).get("agent") or {}
    if "env_reward" not in agent:
        raise ValueError(
            "a verifiers/<env_id> prompt without its environment's reward: run it in its loop "
            "(rollout.multi_turn.enable=true, rollout.multi_turn.default_agent_loop=verifiers/<env_id>)"
        )
    return {"score": float(agent["env_reward"]), "acc": float(agent.get("env_passed", 0.0))}


# ---------------------------------------------------------------------------------------------------- dispatch
def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """The built-in score function, chosen by `data_source`.

    ``"openai/gsm8k"`` / ``"gsm8k"`` -> `gsm8k_score` (strict); ``"reasoning_gym/<name>"`` ->
    `reasoning_gym_score`; ``"verifiers/<env_id>"`` -> `verifiers_score`. All return ``{"score": float, "acc": 0.0
    or 1.0}``, the same keys for every source, so that a batch mixing data sources gives `RewardManager` one set of
    metrics.

    Raises:
        ValueError: for any other data_source, naming it and saying to set ``reward.custom_function``.
    """
    if data_source in GSM8K_SOURCES:
        score = gsm8k_score(solution_str, str(ground_truth))
        return {"score": score, "acc": 1.0 if score >= 1.0 else 0.0}
    if data_source.startswith(REASONING_GYM_PREFIX):
        return reasoning_gym_score(data_source, solution_str, ground_truth, extra_info)
    if data_source.startswith(VERIFIERS_PREFIX):
        return verifiers_score(extra_info)
    check_builtin_source(data_source)  # raises, naming the fix
    raise AssertionError("unreachable")


def check_builtin_source(data_source: str) -> None:
    """Whether `default_compute_score` can score prompts of `data_source` (checked before a run starts).

    Raises:
        ValueError: for a data_source with no built-in reward (saying to set ``reward.custom_function``), or a
            ``reasoning_gym/<name>`` that names no generator (close names listed)."""
    if data_source in GSM8K_SOURCES:
        return
    if data_source.startswith(REASONING_GYM_PREFIX):
        _check_generator(data_source[len(REASONING_GYM_PREFIX) :])
        return
    if data_source.startswith(VERIFIERS_PREFIX):
        return
    raise ValueError(
        f"no built-in reward for data_source {data_source!r} (built in: {', '.join(GSM8K_SOURCES)}, "
        "reasoning_gym/<name>, verifiers/<env_id>); set reward.custom_function to 'module:function' or "
        "'path.py:function' with the signature (data_source, solution_str, ground_truth, extra_info) -> float | "
        "dict with 'score'"
    )


SCORE_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
"""What a score function is called with (verl's ``compute_score``)."""


def load_reward_function(
    spec: str, key: str = "reward.custom_function", arguments: tuple[str, ...] = SCORE_ARGUMENTS
) -> ScoreFunction:
    """Load a score function from ``reward.custom_function`` (or, as `key` names, ``reward.cost_function``, or a
    judge's prompt and verdict functions, which take the `arguments` named).

    Forms: ``"package.module:function"`` (imported with importlib from ``sys.path``) or ``"path/to/file.py:function"``
    (absolute, or relative to the current directory; the file is loaded as a module of its own).
    The function is called as ``fn(data_source, solution_str, ground_truth, extra_info)`` (`arguments`) and returns
    a float or a dict with ``"score"``.

    Raises:
        ValueError: if `spec` is not of either form.
        FileNotFoundError: if the ``.py`` file does not exist (its resolved path is named).
        ImportError: if the module cannot be found or fails to import (the module and the cause are named).
        AttributeError: if the module has no such function (its public callables are listed).
        TypeError: if the attribute is not callable or cannot take the four arguments.
    """
    fn = load_object(spec, key)
    func_name = spec.rsplit(":", 1)[1]
    if not callable(fn):
        raise TypeError(f"{key} {spec!r}: {func_name!r} is a {type(fn).__name__}, not a callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature; calling will tell
        signature = None
    if signature is not None:
        try:
            signature.bind(*arguments)
        except TypeError as e:
            genrm = (
                "; verl's generative-reward-model functions ask a served judge over HTTP (reward_router_address): "
                "here the judge runs in the reward model's pool, given its prompt and the parsing of its verdict as "
                "reward_model.judge.prompt_function and reward_model.judge.verdict_function"
                if "reward_router_address" in signature.parameters
                else ""
            )
            raise TypeError(
                f"{key} {spec!r}: {func_name}{signature} cannot be called as ({', '.join(arguments)}): {e}{genrm}"
            ) from e
    return fn


def _function_name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name


class ScoreFunctionError(RuntimeError):
    """More of a batch's samples failed in the score function (``reward.custom_function``, ``reward.cost_function``,
    the built-in rewards) than ``reward.max_failed_fraction`` allows: each raised or ran past ``reward.timeout_s``.
    The message names the function, how many samples failed of how many (and how many timed out), the first failed
    sample (its data_source, ground truth and the start of its response) with its error, and the keys that fix it."""


def score_inputs(data: DataProto, tokenizer: Any) -> list[tuple[str, str, Any, Any]]:
    """A score function's arguments for each row: ``(data_source, solution_str, ground_truth, extra_info)``, the
    response decoded with `tokenizer` (``skip_special_tokens=True``; only the tokens ``response_mask`` covers).

    Args:
        data: tensors ``responses`` int64 [B, T], ``response_mask`` [B, T]; non-tensor ``data_source``,
            ``reward_model`` (dicts with ``ground_truth``), ``extra_info`` (optional: None each).

    Raises:
        KeyError: naming a missing column, or the first row whose ``reward_model`` has no ``ground_truth``.
        ValueError: ``responses`` and ``response_mask`` differ in shape or are not [B, T].
    """
    have = set(data.batch.keys()) if data.batch is not None else set()
    for key in ("responses", "response_mask"):
        if key not in have:
            raise KeyError(f"RewardManager needs tensor {key!r} in the batch; it has {data.keys}")
    for key in ("data_source", "reward_model"):
        if key not in data.non_tensor_batch:
            raise KeyError(f"RewardManager needs non-tensor column {key!r} in the batch; it has {data.keys}")
    responses, mask = data.batch["responses"].cpu(), data.batch["response_mask"].bool().cpu()
    if responses.shape != mask.shape or responses.dim() != 2:
        raise ValueError(
            f"responses {tuple(responses.shape)} and response_mask {tuple(mask.shape)} must be the same [B, T]"
        )
    extra_infos = data.non_tensor_batch.get("extra_info")
    inputs = []
    for i in range(len(responses)):
        text = tokenizer.decode(responses[i][mask[i]].tolist(), skip_special_tokens=True)
        reward_model = data.non_tensor_batch["reward_model"][i]
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise KeyError(f"reward_model of sample {i} has no 'ground_truth': {reward_model!r}")
        extra_info = extra_infos[i] if extra_infos is not None else None
        inputs.append((str(data.non_tensor_batch["data_source"][i]), text, reward_model["ground_truth"], extra_info))
    return inputs


@dataclass
class ScoredBatch:
    """What `RewardManager.scored` returns for a batch of B samples, T response positions.

    Attributes:
        scores: float32 [B, T] on the device of ``responses``: each sample's score on its last response token.
        extra: the score function's dict keys -> float64 [B] (see `RewardManager`); empty for plain numbers.
        errors: B strings: ``""`` for a sample scored, else why it has no score (``"timeout after 30 s"``,
            ``"ValueError: ..."``); such a sample scores 0.0, as do its extra keys.
        timed_out: bool [B] (numpy): the sample's call ran past the time limit (and was stopped).
    """

    scores: torch.Tensor
    extra: dict[str, np.ndarray]
    errors: list[str]
    timed_out: np.ndarray

    @property
    def failed(self) -> np.ndarray:
        """bool [B]: the sample has no score of its own (its call raised or timed out)."""
        return np.asarray([bool(e) for e in self.errors], dtype=bool)


class RewardManager:
    """Turns a batch of generated responses into token-level scores with a score function.

    Args:
        tokenizer: decodes response tokens (``skip_special_tokens=True``).
        compute_score: the score function, called in this process; None (and no `spec`) uses
            `default_compute_score`.
        name: how errors name the score function (e.g. ``reward.custom_function``'s ``path.py:function``); None:
            `spec`, else the function's module and qualified name.
        spec: a score function by name, ``"module:function"`` or ``"path.py:function"`` (``reward.custom_function``;
            `hybridflow.engine.reward.scoring.BUILTIN_SPEC` for the built-in rewards): it is then called in
            `num_workers` worker processes started at construction (`hybridflow.engine.reward.scoring.
            ProcessScorer`), and a call past `timeout_s` is stopped by killing its process. The caller has checked
            that it loads (`load_reward_function`). Given `spec`, `compute_score` is not called.
        key: the config key `spec` came from, named in load errors (``reward.custom_function``,
            ``reward.cost_function``).
        timeout_s: seconds one sample's call may take (> 0); None: no limit. Without `spec` the calls run on
            threads of this process, which cannot be stopped: a call past the limit is recorded as timed out and
            abandoned (it runs on in the background, its result dropped).
        num_workers: samples scored at once (>= 1). Without `spec`, more than 1 calls `compute_score` from several
            threads at once (it must be thread-safe); with 1 and no `timeout_s` the calls run in the caller's
            thread, in the samples' order (the judge's verdict wrapper relies on it).
        max_failed_fraction: the share of a batch (0 to 1) that may fail (raise or time out) before the batch stops
            the run with `ScoreFunctionError` (``reward.max_failed_fraction``); 0: any failure stops it.

    Calling it with a `DataProto` returns ``(token_level_scores, extra)`` (`scored` returns both with each sample's
    error, as a `ScoredBatch`):

    - ``token_level_scores``: float32 [B, T] on the device of ``responses``; each sample's score sits on its last
      response token (the last position where ``response_mask`` is 1), zeros elsewhere. A sample with an empty
      response (mask all 0) gets its score at position 0, so no score is lost. A sample whose call raised or timed
      out scores 0.0 (a failure is then neither rewarded nor punished beyond the batch's zero; its error is logged
      as a warning, kept in `ScoredBatch.errors`, and counted against `max_failed_fraction`).
    - ``extra``: when the score function returns dicts, every key -> numpy float64 array of length B (including
      ``"score"``; a sample whose function returned a plain number counts as ``{"score": number}``, a failed sample
      as 0.0 for every key); empty when every sample returned a number.

    Inputs read: tensors ``responses`` int64 [B, T] and ``response_mask`` int/bool [B, T] (1 on generated tokens,
    right-padded); non-tensor columns ``data_source``, ``reward_model`` (dict with ``ground_truth``) and, if present,
    ``extra_info``.

    Raises:
        ValueError: `timeout_s` <= 0, `num_workers` < 1 or `max_failed_fraction` outside [0, 1].
    """

    def __init__(
        self,
        tokenizer: Any,
        compute_score: ScoreFunction | None = None,
        name: str | None = None,
        *,
        spec: str | None = None,
        key: str = "reward.custom_function",
        timeout_s: float | None = None,
        num_workers: int = 1,
        max_failed_fraction: float = 0.5,
    ) -> None:
        check_limits(timeout_s, num_workers)
        if not 0.0 <= max_failed_fraction <= 1.0:
            raise ValueError(f"reward.max_failed_fraction must be in [0, 1], got {max_failed_fraction}")
        self.tokenizer = tokenizer
        self.compute_score = compute_score if compute_score is not None else default_compute_score
        self.name = name or spec or _function_name(self.compute_score)
        self.timeout_s, self.num_workers, self.max_failed_fraction = timeout_s, num_workers, max_failed_fraction
        self.spec = spec
        self._processes = ProcessScorer(spec, key, timeout_s, num_workers) if spec is not None else None

    def close(self) -> None:
        """End the scoring processes (with `spec`); a later batch starts new ones."""
        if self._processes is not None:
            self._processes.close()

    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """Score every sample of `data` (see the class docstring for inputs and outputs).

        Raises:
            KeyError: naming a missing input column, or a dict key that some samples' results lack.
            TypeError: if the score function returns neither a number nor a dict with a numeric ``"score"``
                (the function and what it returned are named).
            ValueError: if ``responses`` and ``response_mask`` differ in shape.
            ScoreFunctionError: more than ``max_failed_fraction`` of the samples failed (raised or timed out): the
                message names the function, the count, the first failed sample and its error, and the fix.
            NonFiniteError: a score is NaN or ±inf (after every sample is scored: the message counts them and names
                the score function and the first such sample, its data_source and the start of its response).
        """
        out = self.scored(data)
        return out.scores, out.extra

    def score(
        self, data: DataProto, inputs: list[tuple[str, str, Any, Any]]
    ) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """`__call__` on `inputs` already read from `data` (`score_inputs`: a caller that decoded the responses
        itself, as the judge does, passes them on instead of decoding twice). Raises as `__call__`."""
        out = self.scored(data, inputs)
        return out.scores, out.extra

    def scored(self, data: DataProto, inputs: list[tuple[str, str, Any, Any]] | None = None) -> ScoredBatch:
        """`__call__` with each sample's error kept: a `ScoredBatch`. `inputs`: as `score`'s (None: read from
        `data` with `score_inputs`). Raises as `__call__`."""
        import torch

        from hybridflow.engine.guards import FIX, NonFiniteError

        if inputs is None:
            inputs = score_inputs(data, self.tokenizer)
        responses = data.batch["responses"]
        batch_size, width = responses.shape
        if width == 0:
            raise ValueError("responses has no token positions (T = 0); nothing to put a score on")
        allowed = math.floor(self.max_failed_fraction * batch_size + 1e-9)  # failures that do not stop the run
        if self._processes is not None:
            outcomes = self._processes(inputs, max_failures=allowed)
        else:
            outcomes = score_in_process(self.compute_score, inputs, self.timeout_s, self.num_workers, allowed)
        failed = [i for i, o in enumerate(outcomes) if o is not None and o.failed]
        if len(failed) > allowed:  # (samples not scored, None, come only after that)
            raise ScoreFunctionError(self._too_many(outcomes, inputs, FIX))
        if failed:
            first = failed[0]
            logger.warning(
                "reward: the score function %s failed on %d of %d samples (scored 0.0; at most "
                "reward.max_failed_fraction=%g may); the first is sample %d: %s",
                self.name, len(failed), batch_size, self.max_failed_fraction, first, outcomes[first].error,
            )  # fmt: skip
        scores = torch.zeros((batch_size, width), dtype=torch.float32)
        results: list[tuple[float, dict[str, Any] | None]] = []
        non_finite: list[tuple[int, float, str]] = []
        mask_cpu = data.batch["response_mask"].bool().cpu()
        for i, outcome in enumerate(outcomes):
            value, as_dict = (0.0, None) if outcome.failed else self._unpack(outcome.value, self.name)
            if not math.isfinite(value):
                non_finite.append((i, value, inputs[i][1]))
            results.append((value, as_dict))
            positions = torch.nonzero(mask_cpu[i]).flatten()
            last = int(positions[-1]) if positions.numel() else 0
            scores[i, last] = value
        if non_finite:
            i, value, text = non_finite[0]
            source = data.non_tensor_batch["data_source"][i]
            raise NonFiniteError(
                f"reward: token_level_scores: the score function {self.name} returned {value} for {len(non_finite)} "
                f"of {batch_size} samples; the first is sample {i} (data_source {source}, response {text[:80]!r}); "
                f"{FIX}"
            )
        errors = [o.error for o in outcomes]
        timed_out = np.asarray([o.timed_out for o in outcomes], dtype=bool)
        failed_mask = [bool(e) for e in errors]
        return ScoredBatch(
            scores.to(responses.device), self._collect(results, batch_size, failed_mask), errors, timed_out
        )

    def _too_many(self, outcomes: list[Outcome | None], inputs: list[tuple[str, str, Any, Any]], fix: str) -> str:
        """The `ScoreFunctionError` message of a batch with more failures than allowed (None: not scored, the
        batch having been given up)."""
        failed = [i for i, o in enumerate(outcomes) if o is not None and o.failed]
        first = failed[0]
        source, text, truth, _ = inputs[first]
        timeouts = sum(1 for o in outcomes if o is not None and o.timed_out)
        unscored = sum(1 for o in outcomes if o is None)
        timed = f", {timeouts} of them by a {timeout_text(self.timeout_s)}" if timeouts else ""
        rest = f" ({unscored} left unscored once that was clear)" if unscored else ""
        slow = f"raise reward.timeout_s={self.timeout_s:g} if it is only slow, " if self.timeout_s is not None else ""
        return (
            f"reward: the score function {self.name} failed on {len(failed)} of {len(outcomes)} samples{timed}, "
            f"more than reward.max_failed_fraction={self.max_failed_fraction:g} of the batch{rest}; the first is "
            f"sample {first} (data_source {source}, ground_truth {truth!r}, response {text[:80]!r}): "
            f"{outcomes[first].error}; fix the function ({slow}or raise reward.max_failed_fraction to go on past "
            f"failures); {fix}"
        )

    @staticmethod
    def _unpack(result: Any, name: str) -> tuple[float, dict[str, Any] | None]:
        if isinstance(result, dict):
            if "score" not in result:
                raise TypeError(f"score function {name} returned a dict without 'score': {result!r}")
            value = result["score"]
            if not isinstance(value, numbers.Real):
                raise TypeError(f"score function {name} returned a non-numeric 'score': {value!r}")
            return float(value), result
        if isinstance(result, numbers.Real):
            return float(result), None
        torch = sys.modules.get("torch")  # a tensor can only come from a process that has torch
        if torch is not None and isinstance(result, torch.Tensor) and result.numel() == 1:
            return float(result.item()), None
        raise TypeError(
            f"score function {name} returned {type(result).__name__} {result!r}; "
            "it must return a float or a dict with 'score'"
        )

    @staticmethod
    def _collect(
        results: list[tuple[float, dict[str, Any] | None]], batch_size: int, failed: list[bool]
    ) -> dict[str, np.ndarray]:
        """Gather dict results key-wise; a plain number counts as ``{"score": number}`` next to dicts, a `failed`
        sample as 0.0 for every key."""
        if all(as_dict is None for _, as_dict in results):
            return {}
        dicts = [as_dict if as_dict is not None else {"score": value} for value, as_dict in results]
        keys: dict[str, None] = {}
        for r in dicts:
            keys.update(dict.fromkeys(r))
        dicts = [{k: 0.0 for k in keys} if gone else r for r, gone in zip(dicts, failed, strict=True)]
        extra = {}
        for key in keys:
            missing = [i for i, r in enumerate(dicts) if key not in r]
            if missing:
                raise KeyError(
                    f"score key {key!r} is missing in {len(missing)} of {batch_size} samples (first: sample "
                    f"{missing[0]}, data_source-specific keys need a value for every sample, e.g. 0.0)"
                )
            try:
                extra[key] = np.asarray([float(r[key]) for r in dicts], dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise TypeError(f"score key {key!r} holds a non-numeric value; extra keys must be numbers") from e
        return extra
