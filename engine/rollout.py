"""Rollout: sample responses to a batch of prompts.

`HFRollout` uses Hugging Face ``generate`` in the calling process: the light default that needs nothing beyond
transformers. (A vLLM engine is the fast alternative, added with ``rollout.name: vllm``.)

Output layout, as in verl: ``prompts`` [B, P] left-padded, ``responses`` [B, T] right-padded to exactly
T = ``rollout.response_length`` with the pad id, ``input_ids`` = prompts ++ responses [B, P+T],
``attention_mask`` and ``position_ids`` [B, P+T], ``response_mask`` [B, T] (1 up to and including the first EOS).
"""

from __future__ import annotations

import uuid

import numpy as np
import torch
from transformers import GenerationConfig

from hybridflow.engine.config import RolloutConfig
from hybridflow.engine.protocol import DataProto


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


def eos_token_ids(tokenizer, generation_config: GenerationConfig | None = None) -> list[int]:
    """All token ids that end a response: the tokenizer's eos plus the model's generation-config eos ids."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(generation_config, "eos_token_id", None)
    if gen_eos is not None:
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


class HFRollout:
    """Generate with ``model.generate``, `micro_batch_size` sequences per call.

    Args:
        model: a causal LM (shared with the actor: generation sees the current weights, no copy).
        tokenizer: its tokenizer (pad id, eos id).
        config: the ``rollout`` config section.
    """

    def __init__(self, model, tokenizer, config: RolloutConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = eos_token_ids(tokenizer, model.generation_config)

    def _generation_config(self, temperature: float) -> GenerationConfig:
        greedy = temperature == 0.0
        return GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else temperature,
            top_p=None if greedy or self.config.top_p >= 1.0 else self.config.top_p,
            top_k=None if greedy or self.config.top_k <= 0 else self.config.top_k,
            max_new_tokens=self.config.response_length,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto, n: int | None = None, temperature: float | None = None):
        """Sample `n` responses per prompt (default ``rollout.n``).

        Each prompt gets a ``uid`` (kept if the batch already has one) before it is repeated n times with its
        samples adjacent, so group-based estimators (GRPO, RLOO) can find the group.

        Args:
            prompts: ``input_ids``, ``attention_mask`` [B, P] left-padded; non-tensor columns are carried along.
            n: samples per prompt; temperature: overrides ``rollout.temperature`` (0 = greedy, e.g. validation).

        Returns:
            DataProto of B*n rows with the keys in the module docstring, plus every input non-tensor column and
            ``uid``; ``meta_info`` gains ``temperature`` (needed to recompute log-probs consistently).
        """
        n = self.config.n if n is None else n
        temperature = self.config.temperature if temperature is None else temperature
        if "uid" not in prompts.non_tensor_batch:
            prompts.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(prompts))], dtype=object)
        batch = prompts.repeat(n, interleave=True)
        generation_config = self._generation_config(temperature)
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        parts = []
        try:
            for micro in batch.split(self.config.micro_batch_size):
                parts.append(self._generate_micro(micro, generation_config, device))
        finally:
            self.model.train(was_training)
        out = DataProto.concat(parts)
        out.meta_info.update(prompts.meta_info)
        out.meta_info["temperature"] = temperature
        return out

    def _generate_micro(self, micro: DataProto, generation_config: GenerationConfig, device) -> DataProto:
        prompt_ids = micro.batch["input_ids"].to(device)
        prompt_mask = micro.batch["attention_mask"].to(device)
        output = self.model.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config
        )
        responses = output[:, prompt_ids.shape[1] :]
        t = self.config.response_length
        if responses.shape[1] < t:
            pad = responses.new_full((responses.shape[0], t - responses.shape[1]), self.tokenizer.pad_token_id)
            responses = torch.cat([responses, pad], dim=1)
        response_mask = response_mask_from_eos(responses, self.eos_token_ids)
        responses = torch.where(response_mask.bool(), responses, self.tokenizer.pad_token_id)
        attention_mask = torch.cat([prompt_mask.long(), response_mask], dim=1)
        tensors = {
            "prompts": prompt_ids,
            "responses": responses,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask),
            "response_mask": response_mask,
        }
        return DataProto.from_dict(tensors, dict(micro.non_tensor_batch), dict(micro.meta_info))
