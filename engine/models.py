"""Loading Hugging Face models, and the forward passes RLHF needs: response log-probs, entropy, values.

Sequences are laid out as in verl: ``input_ids`` [B, P+T] = left-padded prompt (P tokens) followed by the
right-padded response (T tokens); ``attention_mask`` and ``position_ids`` [B, P+T] cover both. The logit that
predicts response token t sits at position P-1+t, so a forward over the sequence needs only the last T+1 positions
of the output (``logits_to_keep``): the lm-head never runs on prompt tokens.

Memory: log-probs and entropy are computed one micro-batch at a time, so at most
``micro_batch_size * (T+1) * vocab`` logits exist at once (fp32 on CPU; bf16 upcast per micro-batch on CUDA).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer, PreTrainedModel

from hybridflow.engine.core_algos import entropy_from_logits, logprobs_from_logits
from hybridflow.engine.protocol import DataProto


def pick_device(device: str = "auto") -> torch.device:
    """'auto' -> cuda if available else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but torch sees no CUDA device; use trainer.device=cpu or auto")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, float32 on CPU (bf16 matmuls on CPU are slow and lossy for training)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_tokenizer(path: str | Path):
    """Tokenizer from a local folder, padding on the left (generation needs it); pad falls back to eos."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Any Hugging Face causal LM from a local folder (no hub access), in train mode with dropout off."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    _disable_dropout(model)
    return model


def load_critic(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Critic: the LM backbone with a one-label token-classification head (value per token).

    The head (``score``) is new and zero-initialised, so the first value estimates are 0 everywhere;
    the backbone comes from the causal-LM checkpoint at `path`. Saved with ``save_pretrained``, it reloads with
    ``AutoModelForTokenClassification``.
    """
    model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=dtype).to(device)
    head = model.score if hasattr(model, "score") else model.classifier
    torch.nn.init.zeros_(head.weight)
    if getattr(head, "bias", None) is not None:
        torch.nn.init.zeros_(head.bias)
    _disable_dropout(model)
    return model


def _disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def response_length(data: DataProto) -> int:
    return int(data.batch["responses"].shape[1])


def forward_response_logits(model: PreTrainedModel, micro: DataProto, temperature: float = 1.0) -> torch.Tensor:
    """Logits that predict each response token.

    Args:
        micro: DataProto with ``input_ids``, ``attention_mask``, ``position_ids`` [b, P+T], ``responses`` [b, T].
        temperature: logits are divided by it (the rollout's sampling temperature), as the PPO ratio requires.

    Returns:
        float tensor [b, T, V] in the model's dtype.
    """
    t = response_length(micro)
    out = model(
        input_ids=micro.batch["input_ids"],
        attention_mask=micro.batch["attention_mask"],
        position_ids=micro.batch["position_ids"],
        logits_to_keep=t + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1, :]
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return logits


def response_log_probs(
    model: PreTrainedModel, micro: DataProto, temperature: float = 1.0, calculate_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each response token under `model` (differentiable), and optionally the entropy.

    Returns:
        (log_probs float32 [b, T], entropy float32 [b, T] or None). Positions past the response end are
        computed but meaningless; mask them with ``response_mask``.
    """
    logits = forward_response_logits(model, micro, temperature).float()
    log_probs = logprobs_from_logits(logits, micro.batch["responses"])
    entropy = entropy_from_logits(logits) if calculate_entropy else None
    return log_probs, entropy


@torch.no_grad()
def compute_log_probs(
    model: PreTrainedModel,
    data: DataProto,
    micro_batch_size: int,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` over a whole batch, one micro-batch of `micro_batch_size` sequences at a time.

    Returns:
        (log_probs float32 [B, T], entropy float32 [B, T] or None) on the model's device.
    """
    log_probs, entropies = [], []
    for micro in data.split(micro_batch_size):
        lp, ent = response_log_probs(model, micro, temperature, calculate_entropy)
        log_probs.append(lp)
        if ent is not None:
            entropies.append(ent)
    return torch.cat(log_probs), (torch.cat(entropies) if calculate_entropy else None)


def response_values(critic: PreTrainedModel, micro: DataProto) -> torch.Tensor:
    """Critic values V(s_t) for each response position (differentiable).

    The value for response token t is read at the position that predicts it (P-1+t), i.e. the state before
    the token is chosen, as in GAE (Schulman et al. 2016, eq. 16).

    Returns:
        float32 [b, T].
    """
    t = response_length(micro)
    out = critic(
        input_ids=micro.batch["input_ids"],
        attention_mask=micro.batch["attention_mask"],
        position_ids=micro.batch["position_ids"],
        use_cache=False,
    )
    return out.logits[:, -t - 1 : -1, 0].float()


@torch.no_grad()
def compute_values(critic: PreTrainedModel, data: DataProto, micro_batch_size: int) -> torch.Tensor:
    """`response_values` over a whole batch in micro-batches. Returns float32 [B, T]."""
    return torch.cat([response_values(critic, micro) for micro in data.split(micro_batch_size)])
