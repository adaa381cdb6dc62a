"""Rollout: sample responses to a batch of prompts.

`HFRollout` uses Hugging Face ``generate`` in the calling process: the light default that needs nothing beyond
transformers. (A vLLM engine is the fast alternative, added with ``rollout.name: vllm``.)

Output layout, as in verl: ``prompts`` [B, P] left-padded, ``responses`` [B, T] right-padded to exactly
T = ``rollout.response_length`` with the pad id, ``input_ids`` = prompts ++ responses [B, P+T],
``attention_mask`` and ``position_ids`` [B, P+T], ``response_mask`` [B, T] (1 up to and including the first EOS),
``rollout_log_probs`` float32 [B, T] (each response token's log-prob under the distribution it was drawn from:
after temperature, top-k and top-p, as vLLM's ``processed_logprobs``; 0 past the response), the engine side of the
``rollout/*`` mismatch metrics.

Sampling distribution. Each token is drawn from exactly ``softmax(logits / temperature)``, restricted only by the
configured ``rollout.top_k`` / ``rollout.top_p`` (0 and 1.0 = off). transformers fills every generation setting left
as None from the model's ``generation_config.json`` and then from its own global defaults (``top_k=50``), so
`HFRollout` passes an explicit "off" value for every logits processor that has one (``repetition_penalty=1.0``,
``top_k=0``, ``min_p=0.0``, ``suppress_tokens=[]``, ...). Settings whose only "off" value is None
(``forced_bos_token_id``, ``bad_words_ids``, ``sequence_bias``, ...; see `_NO_OFF_VALUE`) are refused when the
model's generation config sets them: the PPO ratio needs the log-probs of the distribution the tokens were really
drawn from.

Randomness. Sampling never reads or advances the process-global torch RNG: `HFRollout.generate_sequences` forks
the RNG (`torch.random.fork_rng`) and seeds each micro-batch with `sampling_seed` of (``seed``,
``meta_info["global_steps"]``, ``stream``, the index of the micro-batch's first sequence in the whole batch). The
samples are therefore a pure function of those values, the prompts, the weights and ``rollout.micro_batch_size``:
a run resumed at step k samples what the uninterrupted run sampled at step k without any RNG state in the
checkpoint, validation (``stream="val"``) neither shifts nor is shifted by training, and data-parallel ranks
(each given ``meta_info["row_offset"]``, its first prompt's row in the batch) never share a seed; when every rank's
share is a whole number of micro-batches, DP=2 samples exactly what DP=1 samples.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hybridflow.engine.config import HybridFlowConfig, RolloutConfig
from hybridflow.engine.models import autocast
from hybridflow.engine.moe import RouterRecorder, generation_routes, moe_spec
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollout.tokens import TokenOutput, TokenRequest, cut_at_eos

if TYPE_CHECKING:
    from hybridflow.engine.extensions import WeightSource


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions 0, 1, ... over the real tokens of each row. int64 [B, L] -> int64 [B, L].

    Left pads get 0; right pads repeat the last position (they are masked out anyway).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_mask_from_eos(responses: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 for each response token up to and including the first EOS, 0 after it. int64 [B, T] -> int64 [B, T].

    Works when the pad id equals an EOS id (the first EOS ends the response; later ones are padding).
    """
    is_eos = torch.isin(responses, torch.tensor(eos_token_ids, device=responses.device))
    eos_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # an EOS strictly before this position
    return (~eos_before).long()


def expand_prompts(prompts: DataProto, n: int, stream: str) -> DataProto:
    """`prompts` repeated `n` times, each prompt's samples adjacent, with a ``uid`` per prompt (kept if the batch has
    one, else ``"<stream>-<global_steps>-<row in the whole batch>"``). A new DataProto: `prompts` is unchanged."""
    global_steps = int(prompts.meta_info.get("global_steps", 0))
    row_offset = int(prompts.meta_info.get("row_offset", 0))
    batch = prompts.repeat(n, interleave=True)
    if "uid" not in batch.non_tensor_batch:
        rows = np.repeat(np.arange(row_offset, row_offset + len(prompts)), n)
        batch.non_tensor_batch["uid"] = np.array([f"{stream}-{global_steps}-{i}" for i in rows], dtype=object)
    return batch


def assemble_rollout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    eos_ids: list[int],
    pad_token_id: int,
    response_length: int,
) -> dict[str, torch.Tensor]:
    """The rollout's tensors in the layout of the module docstring, whichever engine generated.

    Args:
        prompt_ids, prompt_mask: int64 [b, P], left-padded.
        responses: int64 [b, t] generated ids (t <= `response_length`; anything after the first EOS is ignored).

    Returns:
        ``prompts``, ``responses`` (right-padded to `response_length` with `pad_token_id`), ``input_ids``,
        ``attention_mask``, ``position_ids`` [b, P+T] and ``response_mask`` [b, T].
    """
    if responses.shape[1] < response_length:
        pad = responses.new_full((responses.shape[0], response_length - responses.shape[1]), pad_token_id)
        responses = torch.cat([responses, pad], dim=1)
    response_mask = response_mask_from_eos(responses, eos_ids)
    responses = torch.where(response_mask.bool(), responses, pad_token_id)
    return rollout_tensors(prompt_ids, prompt_mask, responses, response_mask, response_mask)


def rollout_tensors(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    response_real: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The rollout's tensors (module docstring) from its parts: `prompt_ids`, `prompt_mask` int64 [b, P]
    left-padded; `responses` int64 [b, T] right-padded; `response_mask` int64 [b, T] (1: trained on) and
    `response_real` int64 [b, T] (1: a real token; an agent trajectory's tool tokens are real, not trained on)."""
    attention_mask = torch.cat([prompt_mask.long(), response_real.long()], dim=1)
    return {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "response_mask": response_mask,
    }


def model_generation_config(model_path: str) -> GenerationConfig | None:
    """The model folder's ``generation_config.json`` (its eos ids), or None where it has none."""
    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return None


def eos_token_ids(tokenizer, generation_config: GenerationConfig | None = None) -> list[int]:
    """All token ids that end a response: the tokenizer's eos plus the model's generation-config eos ids."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(generation_config, "eos_token_id", None)
    if gen_eos is not None:
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


_NO_OFF_VALUE = (
    "top_h",
    "bad_words_ids",
    "sequence_bias",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "watermarking_config",
    "stop_strings",
    "max_time",
    "prompt_lookup_num_tokens",
    "token_healing",
)
"""Generation settings that change what ``generate`` samples and that None is the only way to switch off. A None
field of the config passed to ``generate`` is filled from the model's generation config, so the rollout cannot turn
these off itself: `HFRollout` refuses a model whose generation config sets one."""

_OFF_ALWAYS = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "min_new_tokens": 0,
    "guidance_scale": 1.0,
    "suppress_tokens": [],
    "begin_suppress_tokens": [],
    "remove_invalid_values": False,
    "renormalize_logits": False,
}
"""Neutral values of the logits processors that ``generate`` applies in greedy and sampling mode alike."""

_OFF_WHEN_SAMPLING = {"min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}
"""Neutral values of the sampling-only warpers that the rollout config has no key for."""


def sampling_seed(seed: int, global_steps: int, stream: str, first_sequence: int) -> int:
    """The torch seed of one generate call: a hash of its four arguments, in [0, 2**63).

    Args:
        seed: the run's seed (``trainer.seed``).
        global_steps: the iteration number (``meta_info["global_steps"]``).
        stream: what the samples are for, e.g. ``"train"`` or ``"val"``; different streams never share seeds.
        first_sequence: index of the micro-batch's first sequence in the whole (all ranks') repeated batch.

    Returns:
        A Python int, the same for the same arguments in every process and on every platform (SHA-256 based).
    """
    key = f"hybridflow-rollout/{int(seed)}/{int(global_steps)}/{stream}/{int(first_sequence)}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1)


class HFRollout:
    """Generate with ``model.generate``, `micro_batch_size` sequences per call.

    Args:
        model: a causal LM (shared with the actor: generation sees the current weights, no copy), or the
            `hybridflow.engine.extensions.WeightSource` that lends one for each call (an FSDP or megatron actor's).
        tokenizer: its tokenizer (pad id, eos id).
        config: the ``rollout`` config section.
        seed: the run's seed (``trainer.seed``); with ``meta_info["global_steps"]``, the stream tag and the
            micro-batch index it fixes every sample (see the module docstring).
        compute_dtype: run ``generate`` under ``torch.autocast`` in this dtype (bfloat16: fp32 weights, bf16
            matmuls, as the actor's forward). None or float32: no autocast.
        record_routes: an MoE model's rows also carry ``routed_experts`` int16 [B, P+T, M, k], the experts each
            token went to in each MoE layer (``actor.router_replay.mode: R3``;
            `hybridflow.engine.moe.generation_routes`).

    Raises:
        ValueError: the model's generation config sets a sampling option that cannot be switched off (one of
            `_NO_OFF_VALUE`; the message names it and how to unset it).
    """

    def __init__(
        self,
        model,
        tokenizer,
        config: RolloutConfig,
        seed: int = 0,
        compute_dtype: torch.dtype | None = None,
        record_routes: bool = False,
    ):
        from hybridflow.engine.backends.weights import ModelWeights

        self.record_routes = record_routes  # R3 router replay: each row's experts (`_generate_micro`)
        self.weights = ModelWeights(model) if isinstance(model, torch.nn.Module) else model
        self.tokenizer = tokenizer
        self.config = config
        self.seed = int(seed)
        self.compute_dtype = compute_dtype
        generation_config = self.weights.generation_config
        self.eos_token_ids = eos_token_ids(tokenizer, generation_config)
        set_fields = {name: getattr(generation_config, name, None) for name in _NO_OFF_VALUE}
        set_fields = {name: value for name, value in set_fields.items() if value is not None}
        if set_fields:
            raise ValueError(
                f"the model's generation config sets {set_fields}; generate would apply it on top of the rollout's "
                "sampling, so the sampled tokens would not follow softmax(logits / temperature) and the PPO "
                "log-probs would be wrong. Unset it (model.generation_config.<name> = None, or remove it from "
                "generation_config.json)."
            )

    def _generation_config(self, temperature: float, stream: str = "train") -> GenerationConfig:
        """The full sampling setup for ``generate``: every logits processor explicitly off except the configured ones.

        Greedy (`temperature` 0): ``do_sample=False`` and every logits processor neutral (the argmax of the logits).
        Sampling: ``temperature``, ``top_k`` (0 = off) and ``top_p`` (1.0 = off) from the config for `stream`
        (`hybridflow.engine.config.RolloutConfig.filters`: validation's own), every other warper at its neutral
        value. (transformers may still list a processor at a neutral value, e.g. suppressing
        an empty token list; it leaves the logits unchanged.)
        """
        greedy = temperature == 0.0
        options = copy.deepcopy(_OFF_ALWAYS)
        if not greedy:
            options.update(_OFF_WHEN_SAMPLING, temperature=temperature)
            top_k, top_p = self.config.filters(stream)
            options.update(top_k=top_k, top_p=top_p)
        return GenerationConfig(
            do_sample=not greedy,
            max_new_tokens=self.config.response_length,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            **options,
        )

    def _sampling(self, temperature: float, stream: str) -> tuple[GenerationConfig, list[LogitsProcessor]]:
        """`_generation_config` with its sampling warpers (temperature, top-k, top-p, in transformers' order) taken
        out into a list, for a ``logits_processor`` list that ends in a `_SampledLogProbs`: it then sees the
        distribution each token is drawn from. The draws are those of `_generation_config` alone."""
        generation_config = self._generation_config(temperature, stream)
        warpers: list[LogitsProcessor] = []
        if generation_config.do_sample:
            top_k, top_p = self.config.filters(stream)
            if temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(temperature))
            if top_k:
                warpers.append(TopKLogitsWarper(top_k))
            if top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p))
            generation_config.temperature, generation_config.top_k, generation_config.top_p = 1.0, 0, 1.0
        return generation_config, warpers

    @torch.no_grad()
    def generate_sequences(
        self,
        prompts: DataProto,
        n: int | None = None,
        temperature: float | None = None,
        stream: str = "train",
    ) -> DataProto:
        """Sample `n` responses per prompt (default ``rollout.n``), deterministically (see the module docstring).

        Each prompt is repeated n times with its samples adjacent, and keeps its ``uid`` (set by
        `hybridflow.engine.data.PromptSampler`); a batch without one gets ``"<stream>-<global_steps>-<row>"``
        so group-based estimators (GRPO, RLOO) can find the group. `prompts` itself is not modified.

        Args:
            prompts: ``input_ids``, ``attention_mask`` [B, P] left-padded; non-tensor columns are carried along;
                ``meta_info["global_steps"]`` (int, default 0) selects the random stream of this iteration.
            n: samples per prompt; temperature: overrides ``rollout.temperature`` (0 = greedy, e.g. validation).
            stream: tag of the random stream, e.g. ``"train"`` or ``"val"`` (or ``"val-<batch>"`` for several
                validation batches of one step).

        Returns:
            DataProto of B*n rows with the keys in the module docstring, plus every input non-tensor column and
            ``uid``; ``meta_info`` gains ``temperature`` (needed to recompute log-probs consistently).
        """
        n = self.config.n if n is None else n
        temperature = self.config.temperature if temperature is None else temperature
        global_steps = int(prompts.meta_info.get("global_steps", 0))
        row_offset = int(prompts.meta_info.get("row_offset", 0))
        batch = expand_prompts(prompts, n, stream)
        generation_config, warpers = self._sampling(temperature, stream)
        parts = []
        with self._lent_model() as (model, device):
            size = self.config.micro_batch_size
            for i, micro in enumerate(batch.split(size)):
                first = row_offset * n + i * size
                torch.manual_seed(sampling_seed(self.seed, global_steps, stream, first))
                parts.append(self._generate_micro(model, micro, generation_config, warpers, device))
            del model  # a generation model lent by the 3D-HybridEngine must not outlive the context
        out = DataProto.concat(parts)
        out.meta_info.update(prompts.meta_info)
        out.meta_info["temperature"] = temperature
        return out

    @contextlib.contextmanager
    def token_engine(
        self, temperature: float, stream: str = "train"
    ) -> Iterator[Callable[[list[TokenRequest]], list[TokenOutput]]]:
        """A context in which the returned function serves token requests (`hybridflow.engine.rollout.tokens`) with
        the weight source's current model, `temperature` and the top-k / top-p configured for `stream`, without
        touching the process-global RNG (forked for the context).

        The function batches its requests ``rollout.micro_batch_size`` at a time (left-padded, the micro-batch
        seeded with its first request's seed) and reports each sampled id's log-prob under the distribution it was
        drawn from (`_SampledLogProbs`).
        """
        generation_config, warpers = self._sampling(temperature, stream)
        with self._lent_model() as (model, device), torch.no_grad():

            def serve(requests: list[TokenRequest], lent: torch.nn.Module = model) -> list[TokenOutput]:
                size = self.config.micro_batch_size
                return [
                    out
                    for start in range(0, len(requests), size)
                    for out in self._generate_tokens(
                        lent, requests[start : start + size], generation_config, warpers, device
                    )
                ]

            yield serve
            del model, serve  # a generation model lent by the 3D-HybridEngine must not outlive the context

    @contextlib.contextmanager
    def _lent_model(self) -> Iterator[tuple[torch.nn.Module, torch.device]]:
        """The weight source's generation model and its device, in eval mode, under a forked RNG (the process-global
        stream is left as it was); the model's mode is restored on exit."""
        with self.weights.generation_model() as model:
            device = next(model.parameters()).device
            rng_devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
            was_training = model.training
            model.eval()
            try:
                with torch.random.fork_rng(devices=rng_devices):
                    yield model, device
            finally:
                model.train(was_training)

    def _generate_tokens(
        self, model, requests: list[TokenRequest], generation_config: GenerationConfig, warpers: list, device
    ) -> list[TokenOutput]:
        pad = self.tokenizer.pad_token_id
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((len(requests), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            input_ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            attention_mask[i, width - len(r.prompt_ids) :] = 1
        config = copy.deepcopy(generation_config)
        config.max_new_tokens = max(r.max_tokens for r in requests)
        recorder = _SampledLogProbs()
        torch.manual_seed(requests[0].seed)
        with autocast(device, self.compute_dtype):
            output = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=config,
                logits_processor=LogitsProcessorList([*warpers, recorder]),
            )
        new = output[:, width:].cpu()
        log_probs = recorder.finish(new).tolist()
        eos = set(self.eos_token_ids)
        return [cut_at_eos(new[i].tolist(), log_probs[i], eos, r.max_tokens) for i, r in enumerate(requests)]

    def update_weights(self) -> dict[str, float]:
        """Nothing to load: each call generates with the weight source's current model. Returns {}."""
        return {}

    def sleep(self) -> None:
        """Nothing to give back: the rollout holds no memory of its own between calls."""

    def wake(self) -> None:
        """Nothing to take back (see `sleep`)."""

    def _generate_micro(
        self, model: torch.nn.Module, micro: DataProto, generation_config: GenerationConfig, warpers: list, device
    ) -> DataProto:
        prompt_ids = micro.batch["input_ids"].to(device)
        prompt_mask = micro.batch["attention_mask"].to(device)
        routers = RouterRecorder(model) if self.record_routes and moe_spec(model.config) is not None else None
        recorder = _SampledLogProbs()
        try:
            with (
                routers.choosing() if routers else contextlib.nullcontext() as chosen,
                autocast(device, self.compute_dtype),
            ):
                output = model.generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    generation_config=generation_config,
                    logits_processor=LogitsProcessorList([*warpers, recorder]),
                )
        finally:
            if routers is not None:
                routers.remove()
        new = output[:, prompt_ids.shape[1] :]
        tensors = assemble_rollout(
            prompt_ids, prompt_mask, new, self.eos_token_ids, self.tokenizer.pad_token_id, self.config.response_length
        )
        log_probs = torch.zeros(tensors["responses"].shape, dtype=torch.float32)
        log_probs[:, : new.shape[1]] = recorder.finish(new.cpu())
        tensors["rollout_log_probs"] = log_probs * tensors["response_mask"].cpu()
        if routers is not None:
            layers, (rows, prompt_length) = len(routers.routers), prompt_ids.shape
            tensors["routed_experts"] = generation_routes(
                chosen, layers, rows, prompt_length, tensors["attention_mask"]
            )
        return DataProto.from_dict(tensors, dict(micro.non_tensor_batch), dict(micro.meta_info))


class _SampledLogProbs(LogitsProcessor):
    """Records the log-prob of each sampled token under the final distribution of its step.

    Placed last in ``generate``'s processor list (after the sampling warpers it is given with), it sees each step's
    final scores; the token drawn from them appears in the next step's ``input_ids`` (and the last step's in the
    output), so it keeps one step's log-softmax, float32 [b, V], at a time.
    """

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.steps.append(self.previous.gather(-1, input_ids[:, -1:].to(self.previous.device)).squeeze(-1))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """float32 [b, t]: the log-prob of each of the `new_tokens` int64 [b, t] (t = the steps generated)."""
        if self.previous is not None and new_tokens.shape[1]:
            self.steps.append(self.previous.gather(-1, new_tokens[:, -1:].to(self.previous.device)).squeeze(-1))
        if not self.steps:
            return torch.zeros(new_tokens.shape, dtype=torch.float32)
        return torch.stack(self.steps, dim=1).cpu()[:, : new_tokens.shape[1]]


def build(cfg: HybridFlowConfig, weights: WeightSource, tokenizer, model_path, compute_dtype) -> HFRollout:
    """``rollout.name: hf`` (registered in `hybridflow.engine.extensions`): `HFRollout` on `weights`."""
    record_routes = cfg.actor.router_replay.mode == "R3"
    return HFRollout(
        weights, tokenizer, cfg.rollout, seed=cfg.trainer.seed, compute_dtype=compute_dtype, record_routes=record_routes
    )
