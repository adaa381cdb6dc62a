"""Rule-based rewards: answer extraction, GSM8K and reasoning-gym scoring, custom score functions, RewardManager.

A *score function* has the signature ``(data_source, solution_str, ground_truth, extra_info) -> float | dict``;
a dict must hold ``"score"`` (the reward) and may hold other numbers (logged as metrics, e.g. ``"acc"``).
`default_compute_score` picks one by ``data_source``; ``reward.custom_function`` (``module:function`` or
``path.py:function``, loaded by `load_reward_function`) replaces it. `RewardManager` decodes a batch of responses,
calls the score function once per sample and writes each score onto the sample's last response token.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import math
import numbers
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hybridflow.engine.guards import FIX, NonFiniteError
from hybridflow.engine.imports import load_object
from hybridflow.engine.protocol import DataProto

ScoreFunction = Callable[[str, str, Any, dict[str, Any] | None], "float | dict[str, Any]"]

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
REASONING_GYM_PREFIX = "reasoning_gym/"
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

    _check_generator(name)
    return reasoning_gym.get_score_answer_fn(name)


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


# ---------------------------------------------------------------------------------------------------- dispatch
def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """The built-in score function, chosen by `data_source`.

    ``"openai/gsm8k"`` / ``"gsm8k"`` -> `gsm8k_score` (strict); ``"reasoning_gym/<name>"`` ->
    `reasoning_gym_score`. Both return ``{"score": float, "acc": 0.0 or 1.0}``, the same keys for every source, so
    that a batch mixing data sources gives `RewardManager` one set of metrics.

    Raises:
        ValueError: for any other data_source, naming it and saying to set ``reward.custom_function``.
    """
    if data_source in GSM8K_SOURCES:
        score = gsm8k_score(solution_str, str(ground_truth))
        return {"score": score, "acc": 1.0 if score >= 1.0 else 0.0}
    if data_source.startswith(REASONING_GYM_PREFIX):
        return reasoning_gym_score(data_source, solution_str, ground_truth, extra_info)
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
    raise ValueError(
        f"no built-in reward for data_source {data_source!r} (built in: {', '.join(GSM8K_SOURCES)}, "
        "reasoning_gym/<name>); set reward.custom_function to 'module:function' or 'path.py:function' with the "
        "signature (data_source, solution_str, ground_truth, extra_info) -> float | dict with 'score'"
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
    """The score function (``reward.custom_function``, ``reward.cost_function``) raised on a sample; the message
    names the function, the sample (its data_source, ground truth and response) and the original error."""


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


class RewardManager:
    """Turns a batch of generated responses into token-level scores with a score function.

    Args:
        tokenizer: decodes response tokens (``skip_special_tokens=True``).
        compute_score: the score function; None uses `default_compute_score`.
        name: how errors name the score function (e.g. ``reward.custom_function``'s ``path.py:function``); None:
            its module and qualified name.

    Calling it with a `DataProto` returns ``(token_level_scores, extra)``:

    - ``token_level_scores``: float32 [B, T] on the device of ``responses``; each sample's score sits on its last
      response token (the last position where ``response_mask`` is 1), zeros elsewhere. A sample with an empty
      response (mask all 0) gets its score at position 0, so no score is lost.
    - ``extra``: when the score function returns dicts, every key -> numpy float64 array of length B (including
      ``"score"``; a sample whose function returned a plain number counts as ``{"score": number}``); empty when
      every sample returned a number.

    Inputs read: tensors ``responses`` int64 [B, T] and ``response_mask`` int/bool [B, T] (1 on generated tokens,
    right-padded); non-tensor columns ``data_source``, ``reward_model`` (dict with ``ground_truth``) and, if present,
    ``extra_info``.
    """

    def __init__(self, tokenizer: Any, compute_score: ScoreFunction | None = None, name: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.compute_score = compute_score if compute_score is not None else default_compute_score
        self.name = name or _function_name(self.compute_score)

    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """Score every sample of `data` (see the class docstring for inputs and outputs).

        Raises:
            KeyError: naming a missing input column, or a dict key that some samples' results lack.
            TypeError: if the score function returns neither a number nor a dict with a numeric ``"score"``
                (the function and what it returned are named).
            ValueError: if ``responses`` and ``response_mask`` differ in shape.
            NonFiniteError: a score is NaN or ±inf (after every sample is scored: the message counts them and names
                the score function and the first such sample, its data_source and the start of its response).
            ScoreFunctionError: the score function raised (on the sample named, with the original error).
        """
        return self.score(data, score_inputs(data, self.tokenizer))

    def score(
        self, data: DataProto, inputs: list[tuple[str, str, Any, Any]]
    ) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """`__call__` on `inputs` already read from `data` (`score_inputs`: a caller that decoded the responses
        itself, as the judge does, passes them on instead of decoding twice). Raises as `__call__`."""
        responses = data.batch["responses"]
        batch_size, width = responses.shape
        if width == 0:
            raise ValueError("responses has no token positions (T = 0); nothing to put a score on")
        scores = torch.zeros((batch_size, width), dtype=torch.float32)
        results: list[tuple[float, dict[str, Any] | None]] = []
        name = self.name
        non_finite: list[tuple[int, float, str]] = []
        mask_cpu = data.batch["response_mask"].bool().cpu()
        for i, (source, text, truth, extra_info) in enumerate(inputs):
            try:
                result = self.compute_score(source, text, truth, extra_info)
            except Exception as error:
                said = " ".join(str(error).split())  # one line: the CLI shows the cause's line
                raise ScoreFunctionError(
                    f"reward: the score function {name} raised {type(error).__name__}: {said} on sample {i} of "
                    f"{batch_size} (data_source {source}, ground_truth {truth!r}, response {text[:80]!r}); {FIX}"
                ) from error
            value, as_dict = self._unpack(result, name)
            if not math.isfinite(value):
                non_finite.append((i, value, text))
            results.append((value, as_dict))
            positions = torch.nonzero(mask_cpu[i]).flatten()
            last = int(positions[-1]) if positions.numel() else 0
            scores[i, last] = value
        if non_finite:
            i, value, text = non_finite[0]
            source = data.non_tensor_batch["data_source"][i]
            raise NonFiniteError(
                f"reward: token_level_scores: the score function {name} returned {value} for {len(non_finite)} of "
                f"{batch_size} samples; the first is sample {i} (data_source {source}, response {text[:80]!r}); {FIX}"
            )
        return scores.to(responses.device), self._collect(results, batch_size)

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
        if isinstance(result, torch.Tensor) and result.numel() == 1:
            return float(result.item()), None
        raise TypeError(
            f"score function {name} returned {type(result).__name__} {result!r}; "
            "it must return a float or a dict with 'score'"
        )

    @staticmethod
    def _collect(results: list[tuple[float, dict[str, Any] | None]], batch_size: int) -> dict[str, np.ndarray]:
        """Gather dict results key-wise; a plain number counts as ``{"score": number}`` next to dicts."""
        if all(as_dict is None for _, as_dict in results):
            return {}
        dicts = [as_dict if as_dict is not None else {"score": value} for value, as_dict in results]
        keys: dict[str, None] = {}
        for r in dicts:
            keys.update(dict.fromkeys(r))
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
