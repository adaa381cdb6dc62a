"""A generative reward model (an LLM as a judge; verl's GenRM): a causal LM reads a prompt built from each sample and
writes a verdict, and the verdict becomes the sample's reward-model score (``rm_scores``).

Two user functions say what is task-specific (``reward_model.judge``):

- ``prompt_function(data_source, solution_str, ground_truth, extra_info)`` -> the judge's prompt: chat messages
  (``[{"role": "user", "content": ...}]``, rendered with the judge's chat template and its generation prompt) or a
  plain string (tokenized as it is). ``solution_str`` is the response, decoded with the actor's tokenizer.
- ``verdict_function(judge_text, data_source, solution_str, ground_truth, extra_info)`` -> the score: a float, or a
  dict with ``"score"`` whose other keys become ``reward_extra/judge_<key>`` columns (averaged into metrics).

The judge generates (``judge.engine: vllm``) on a vLLM engine in each rank of the reward model's pool, or over
each block of ``judge.tensor_parallel_size`` consecutive ranks (vLLM tensor parallel: the block's ranks get the
same rows and its first returns them); its own pool with ``placement.pools``, or beside other roles. Or it
generates with transformers' ``generate`` (``hf``). A prompt longer than
``reward_model.max_length`` tokens loses tokens from its start. Each row's sampling is seeded by the run's seed, the
iteration and the row's index, so a resumed run judges alike. verl's reward loop lets the user's score function call
a served judge over HTTP; here the engine lives in the worker and the two functions hold the task's parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridflow.engine.models import dtype_name
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.reward.reward_model import RewardModelError
from hybridflow.engine.reward.rewards import (
    SCORE_ARGUMENTS,
    RewardManager,
    ScoreFunctionError,
    load_reward_function,
    score_inputs,
)

if TYPE_CHECKING:
    from hybridflow.engine.config import RewardModelConfig

VERDICT_ARGUMENTS = ("judge_text", *SCORE_ARGUMENTS)


def _eos_ids(tokenizer: Any, path: str | Path) -> list[int]:
    """The judge's stop tokens: its tokenizer's EOS and its generation config's (`hybridflow.engine.rollout.hf.
    eos_token_ids`)."""
    from hybridflow.engine.rollout.hf import eos_token_ids, model_generation_config

    return eos_token_ids(tokenizer, model_generation_config(str(path)))


def load_judge_functions(config: RewardModelConfig) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(prompt_function, verdict_function)`` of ``reward_model.judge``, each checked callable with its arguments.

    Raises:
        ValueError, FileNotFoundError, ImportError, AttributeError, TypeError: as
            `hybridflow.engine.reward.rewards.load_reward_function`, naming ``reward_model.judge.*_function``.
    """
    judge = config.judge
    prompt = load_reward_function(judge.prompt_function, "reward_model.judge.prompt_function")
    verdict = load_reward_function(judge.verdict_function, "reward_model.judge.verdict_function", VERDICT_ARGUMENTS)
    return prompt, verdict


def check_judge(path: str | Path) -> Any:
    """The judge's tokenizer, after checking that ``reward_model.path`` holds a causal LM (without loading weights).

    Raises:
        RewardModelError: the folder's config names no ``*ForCausalLM`` architecture (names what it holds)."""
    from transformers import AutoConfig, AutoTokenizer

    architectures = getattr(AutoConfig.from_pretrained(path), "architectures", None) or []
    if not any(a.endswith("ForCausalLM") for a in architectures):
        raise RewardModelError(
            f"reward_model.path={path}: its config.json names {architectures or 'no architecture'}, not a "
            "*ForCausalLM model; a judge (reward_model.judge.enable) generates its verdict: give a causal LM, or "
            "set judge.enable=false for a sequence classifier"
        )
    return AutoTokenizer.from_pretrained(path)


class JudgeRewardModel:
    """The ``reward_model`` role of a worker rank when ``reward_model.judge.enable``: a frozen causal LM judging rollout
    batches (see the module docstring).

    Args:
        config: the ``reward_model`` section (``path``, ``max_length``, ``judge.*``).
        path: the judge's folder, resolved.
        actor_tokenizer: decodes the rollout's responses.
        device: where it runs; dtype: the ``hf`` engine's weights' dtype.
        seed: the run's seed (``trainer.seed``).
        max_failed_fraction: ``reward.max_failed_fraction``: the share of a batch whose prompt or verdict function
            may fail (scored 0.0) before the batch stops the run.

    Raises:
        RewardModelError: not a causal LM (`check_judge`).
        ImportError: ``judge.engine: vllm`` without vLLM installed (the message says how to install it).
    """

    column = "rm_scores"

    def __init__(
        self,
        config: RewardModelConfig,
        path: Path,
        actor_tokenizer: Any,
        device,
        dtype: torch.dtype,
        seed: int = 0,
        max_failed_fraction: float = 0.5,
    ):
        self.config, self.judge, self.seed = config, config.judge, int(seed)
        self.max_failed_fraction = max_failed_fraction
        self.actor_tokenizer = actor_tokenizer
        self.tokenizer = check_judge(path)
        self.prompt_fn, self.verdict_fn = load_judge_functions(config)
        self.on_gpu = torch.device(device).type == "cuda"
        self.eos_token_ids = _eos_ids(self.tokenizer, path)
        self.block_leader = True  # the rank that returns its engine block's scores (every rank without a block)
        if self.judge.engine == "vllm":
            from hybridflow.engine.rollout.vllm import import_vllm, memory_options, spmd_options, unlink_segments

            self._vllm = import_vllm()
            options = memory_options(self.on_gpu, self.judge.gpu_memory_utilization, self.judge.vllm_kv_cache_gb)
            segments = None
            if self.judge.tensor_parallel_size > 1:  # one engine over a block of the pool's ranks
                import torch.distributed as dist

                spmd, segments = spmd_options(self.judge.tensor_parallel_size, self.on_gpu)
                options.update(spmd)
                self.block_leader = dist.get_rank() % self.judge.tensor_parallel_size == 0
            self.llm = self._vllm.LLM(
                model=str(path),
                dtype=dtype_name(self.judge.vllm_dtype, torch.device(device)),
                enforce_eager=not self.on_gpu,
                seed=self.seed,
                max_model_len=config.max_length + self.judge.max_tokens,
                **options,
            )
            if segments is not None:
                unlink_segments(segments)
            self.model = None
        else:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()

    # ------------------------------------------------------------------ prompts
    def prompt_ids(self, prompt: Any) -> list[int]:
        """The judge's input tokens for one `prompt_function` result: chat messages in its chat template with the
        generation prompt (a plain string: tokenized as it is), keeping the last ``reward_model.max_length`` tokens.

        Raises:
            TypeError: the result is neither a string nor a list of ``{"role", "content"}`` dicts."""
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
            text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            raise TypeError(
                f"reward_model.judge.prompt_function {self.judge.prompt_function!r} returned "
                f"{type(prompt).__name__} {str(prompt)[:80]!r}: return a string or chat messages "
                "([{'role': 'user', 'content': ...}])"
            )
        return list(ids)[-self.config.max_length :]

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[list[int]], step: int, rows: Sequence[int] | None = None) -> list[str]:
        """The judge's verdict text for each prompt (token ids), at most ``judge.max_tokens`` tokens, stopping at
        its EOS; the prompt of batch row i (`rows`: each prompt's row, default 0, 1, ...) sampled with seed
        `hybridflow.engine.rollout.hf.sampling_seed` (seed, `step`, ``judge``, i)."""
        from hybridflow.engine.rollout.hf import sampling_seed

        rows = range(len(prompts)) if rows is None else rows
        seeds = [sampling_seed(self.seed, step, "judge", i) for i in rows]
        if self.model is None:
            return self._generate_vllm(prompts, seeds)
        return [self._generate_hf(ids, seed) for ids, seed in zip(prompts, seeds, strict=True)]

    def _generate_vllm(self, prompts: Sequence[list[int]], seeds: list[int]) -> list[str]:
        from vllm.inputs import TokensPrompt

        from hybridflow.engine.rollout.vllm import eager_on_cpu

        judge = self.judge
        params = [
            self._vllm.SamplingParams(
                temperature=judge.temperature,
                top_p=judge.top_p if judge.temperature > 0 else 1.0,
                max_tokens=judge.max_tokens,
                stop_token_ids=list(self.eos_token_ids),
                seed=seed,
            )
            for seed in seeds
        ]
        with eager_on_cpu(self.on_gpu):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [self.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True) for out in outputs]

    @torch.no_grad()
    def _generate_hf(self, ids: list[int], seed: int) -> str:
        judge = self.judge
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([ids], device=device)
        sampled = judge.temperature > 0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=sampled,
                temperature=judge.temperature if sampled else None,
                top_p=judge.top_p if sampled else None,
                top_k=None,
                max_new_tokens=judge.max_tokens,
                eos_token_id=list(self.eos_token_ids),
                pad_token_id=self.tokenizer.pad_token_id or self.eos_token_ids[0],
            )
        return self.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    # ------------------------------------------------------------------ scoring
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` float32 [B, T] (each row's verdict score on its last response token), non-tensor
        ``judge_text`` (the verdicts, kept with the samples: ``hf runs samples``; a failed sample's starts with
        ``[failed: <error>]``), ``reward_extra/judge_failed`` float64 [B] (1.0 where the prompt or verdict function
        failed) and, when the verdict function returns dicts, ``reward_extra/judge_<key>`` float64 [B].

        Args:
            data: ``responses`` int64 [B, T], ``response_mask`` [B, T], non-tensor ``data_source``,
                ``reward_model`` (with ``ground_truth``), ``extra_info``; ``meta_info["global_steps"]`` seeds the
                sampling.

        A sample whose prompt function or verdict function raises scores 0.0, its error kept and logged, as a score
        function's (`hybridflow.engine.reward.rewards.RewardManager`; the judge does not run on it); more than
        ``reward.max_failed_fraction`` of the batch failing stops the run.

        Raises:
            ScoreFunctionError: more than ``reward.max_failed_fraction`` of the samples failed (names the function,
                the first failed sample and its error).
            TypeError: a prompt that is neither a string nor chat messages, or a verdict that is no number.
            NonFiniteError: a verdict scored NaN or ±inf.
        """
        inputs = score_inputs(data, self.actor_tokenizer)
        built = [self._call_prompt_fn(i, args) for i, args in enumerate(inputs)]
        rows = [i for i, prompt in enumerate(built) if not isinstance(prompt, ScoreFunctionError)]
        texts = [""] * len(inputs)
        verdict_texts = self.generate(
            [self.prompt_ids(built[i]) for i in rows], data.meta_info.get("global_steps", 0), rows
        )
        if not self.block_leader:  # the block's first rank scores its rows; this one only generated with it
            return DataProto.from_dict({self.column: torch.zeros(data.batch["responses"].shape)})
        for i, text in zip(rows, verdict_texts, strict=True):
            texts[i] = text
        answers = iter(zip(built, texts, strict=True))

        def verdict(*args: Any) -> Any:
            prompt, text = next(answers)  # called in the samples' order, in this thread (RewardManager)
            if isinstance(prompt, ScoreFunctionError):
                raise prompt
            return self.verdict_fn(text, *args)

        manager = RewardManager(
            self.actor_tokenizer,
            verdict,
            name=f"reward_model.judge.verdict_function {self.judge.verdict_function}",
            max_failed_fraction=self.max_failed_fraction,
        )
        scored = manager.scored(data, inputs)  # each verdict's score on its row's last response token
        tensors = {self.column: scored.scores.cpu()}
        for key, values in scored.extra.items():
            if key != "score":
                tensors[f"reward_extra/judge_{key}"] = torch.from_numpy(values)
        tensors["reward_extra/judge_failed"] = torch.from_numpy(scored.failed.astype(np.float64))
        failures = zip(texts, scored.errors, strict=True)
        texts = [f"[failed: {error}] {text}".strip() if error else text for text, error in failures]
        return DataProto.from_dict(tensors, {"judge_text": np.array(texts, dtype=object)})

    def _call_prompt_fn(self, i: int, args: tuple[Any, ...]) -> Any:
        """The prompt function's result for sample `i`, or the `ScoreFunctionError` saying how it raised."""
        from hybridflow.engine.guards import FIX

        try:
            return self.prompt_fn(*args)
        except Exception as error:
            said = " ".join(str(error).split())
            failure = ScoreFunctionError(
                f"reward_model.judge.prompt_function {self.judge.prompt_function} raised {type(error).__name__}: "
                f"{said} on sample {i} (data_source {args[0]}, response {args[1][:80]!r}); {FIX}"
            )
            failure.__cause__ = error
            return failure
