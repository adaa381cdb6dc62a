"""Loading Hugging Face models, and the forward passes RLHF needs: response log-probs, entropy, values.

Sequences are laid out as in verl: ``input_ids`` [B, P+T] = left-padded prompt (P tokens) followed by the
right-padded response (T tokens); ``attention_mask`` and ``position_ids`` [B, P+T] cover both. The logit that
predicts response token t sits at position P-1+t, so a forward over the sequence needs only the last T+1 positions
of the output (``logits_to_keep``): the lm-head never runs on prompt tokens.

Memory: log-probs and entropy are computed one micro-batch at a time, so at most
``micro_batch_size * (T+1) * vocab`` logits exist at once (fp32, or bf16 under autocast, upcast per micro-batch).

Precision: a model that is trained (actor, critic) keeps fp32 master weights (``load_model(..., trainable=True)``,
`load_critic`), so small Adam updates are not rounded away. With a bf16 compute dtype (``model.dtype: bfloat16``, or
``auto`` on CUDA) its forwards run under ``torch.autocast(dtype=torch.bfloat16)``: bf16 matmuls, fp32 weights and
gradients. Frozen models (the reference policy) may be stored in bf16 (``trainable=False``). With fp32 compute
(the CPU default) nothing is cast.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

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
    """The compute dtype for ``model.dtype``: 'auto' -> bfloat16 on CUDA, float32 on CPU (bf16 on CPU is slow).

    Trained models keep fp32 weights whatever this returns (see the module docstring); it selects the autocast
    dtype of their forwards and the storage dtype of frozen models.

    Raises:
        AttributeError: `dtype` is not a torch dtype name.
    """
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


def autocast(device: torch.device | str, compute_dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """The context a forward runs in: ``torch.autocast`` for a 16-bit `compute_dtype`, else no cast at all.

    Args:
        device: the model's device (its type picks CUDA or CPU autocast; both support bfloat16).
        compute_dtype: ``torch.bfloat16`` / ``torch.float16`` -> autocast in it; None or ``torch.float32`` -> none.
    """
    if compute_dtype is None or compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=compute_dtype)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _config_without_dropout(path: str | Path, **overrides) -> PretrainedConfig:
    """The model's config with every float attribute whose name contains "dropout" set to 0.0 (sub-configs too).

    Dropout written into the config (``attention_dropout``, ``hidden_dropout``, ...) is often applied functionally
    (``F.dropout(p=config.attention_dropout, training=self.training)``), so zeroing ``nn.Dropout`` modules after
    loading misses it. Keyword `overrides` are set on the config as well (e.g. ``num_labels=1``).
    """
    config = AutoConfig.from_pretrained(path)
    _zero_dropout(config)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _zero_dropout(config: PretrainedConfig) -> None:
    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            _zero_dropout(value)
        elif isinstance(value, float) and "dropout" in name.lower():
            setattr(config, name, 0.0)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trainable: bool = True,
):
    """Any Hugging Face causal LM from a local folder (no hub access), with all dropout off.

    The model comes back in eval mode (``from_pretrained``'s default); the actor and critic switch to train mode
    for their updates, which changes nothing else since every dropout probability is 0.

    Args:
        path: the folder (config.json and weights).
        dtype: the compute dtype. A frozen model (``trainable=False``: reference policy, rollout-only copy) is
            stored in it; a trained one always keeps fp32 weights and gets bf16 compute from `autocast` instead.
        device: where to put it.
        trainable: whether an optimizer will update the weights (then they stay fp32).

    Returns:
        The model; every config dropout probability is 0 and every ``nn.Dropout`` has p = 0.
    """
    weights_dtype = torch.float32 if trainable else dtype
    config = _config_without_dropout(path)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=weights_dtype).to(device)
    _disable_dropout(model)
    return model


def load_critic(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trainable: bool = True,
):
    """Critic: the LM backbone with a one-label token-classification head (value per token), dropout off.

    The head (``score``) is new and zero-initialised, so the first value estimates are 0 everywhere;
    the backbone comes from the causal-LM checkpoint at `path`. Saved with ``save_pretrained``, it reloads with
    ``AutoModelForTokenClassification``. `dtype` and `trainable` mean what they mean for `load_model` (the critic
    is trained, so its weights are fp32 unless ``trainable=False``).
    """
    weights_dtype = torch.float32 if trainable else dtype
    config = _config_without_dropout(path, num_labels=1)
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=weights_dtype).to(device)
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
    """T, the padded response length: ``responses.shape[1]`` of a batch with ``responses`` int64 [B, T].

    Raises:
        KeyError: the batch has no ``responses``.
    """
    return int(data.batch["responses"].shape[1])


def forward_response_logits(
    model: PreTrainedModel,
    micro: DataProto,
    temperature: float = 1.0,
    compute_dtype: torch.dtype | None = None,
    share_prompts: bool = True,
) -> torch.Tensor:
    """Logits that predict each response token.

    Rows that follow each other with the same prompt (the rollout's n samples of one prompt) share its pass: the
    prompt runs once per group and its keys and values are repeated for the group's responses, which run as a second
    pass over that cache (`prompt_groups`; gradients reach the prompt from every sample through the repeat). The
    logits equal one pass over every full row up to float32 rounding (other matmul shapes): the prompt's positions
    never see the response (causal attention), and each response sees the same keys and values. Without a repeated
    prompt (or `share_prompts` false) it is one pass over the full rows.

    Args:
        micro: DataProto with ``input_ids``, ``attention_mask``, ``position_ids`` [b, P+T] (prompts left-padded,
            responses right-padded), ``responses`` [b, T].
        temperature: logits are divided by it (the rollout's sampling temperature), as the PPO ratio requires.
        compute_dtype: run the forward under `autocast` in this dtype (None / float32: as stored).
        share_prompts: compute a repeated prompt once (False: every row in full).

    Returns:
        float tensor [b, T, V]: in the model's dtype, or `compute_dtype` under autocast.
    """
    t = response_length(micro)
    counts = prompt_groups(micro) if share_prompts else None
    with autocast(_model_device(model), compute_dtype):
        if counts is not None and len(counts) < len(micro):
            logits = _shared_prompt_logits(model, micro, counts, t)
        else:
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


def prompt_groups(micro: DataProto) -> torch.Tensor:
    """Sizes of the runs of consecutive rows with the same prompt (ids and mask of the first P = L - T columns).

    Returns:
        int64 [groups], summing to the rows (all ones when no two neighbours share a prompt)."""
    t = response_length(micro)
    ids = micro.batch["input_ids"][:, :-t]
    mask = micro.batch["attention_mask"][:, :-t]
    same = (ids[1:] == ids[:-1]).all(-1) & (mask[1:] == mask[:-1]).all(-1)
    starts = torch.cat([torch.tensor([0], device=ids.device), torch.nonzero(~same).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([len(ids)], device=ids.device)])
    return (ends - starts).cpu()


def _shared_prompt_logits(model: PreTrainedModel, micro: DataProto, counts: torch.Tensor, t: int) -> torch.Tensor:
    from transformers.cache_utils import DynamicCache

    batch = micro.batch
    firsts = torch.cumsum(counts, 0) - counts  # each group's first row
    ids, mask, positions = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    prompt = model(
        input_ids=ids[firsts, :-t],
        attention_mask=mask[firsts, :-t],
        position_ids=positions[firsts, :-t],
        logits_to_keep=1,
        use_cache=True,
    )
    repeat = counts.to(ids.device)
    layers = [(layer.keys, layer.values) for layer in prompt.past_key_values.layers]
    cache = DynamicCache(
        ddp_cache_data=[(k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)) for k, v in layers]
    )
    responses = model(
        input_ids=ids[:, -t:],
        attention_mask=mask,
        position_ids=positions[:, -t:],
        past_key_values=cache,
        use_cache=True,
    )
    first = prompt.logits[:, -1:, :].repeat_interleave(repeat, 0)  # the last prompt position predicts token 0
    return torch.cat([first, responses.logits[:, :-1, :]], dim=1)


def response_log_probs(
    model: PreTrainedModel,
    micro: DataProto,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    compute_dtype: torch.dtype | None = None,
    entropy_grad: bool = True,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each response token under `model` (differentiable), and optionally the entropy
    (differentiable unless `entropy_grad` is false: a metric, which then keeps no [b, T, V] softmax for backward);
    `share_prompts`: see `forward_response_logits`.

    The forward runs in `compute_dtype` (see `forward_response_logits`); the softmax math runs in fp32.

    Returns:
        (log_probs float32 [b, T], entropy float32 [b, T] or None). Positions past the response end are
        computed but meaningless; mask them with ``response_mask``.
    """
    logits = forward_response_logits(model, micro, temperature, compute_dtype, share_prompts).float()
    log_probs = logprobs_from_logits(logits, micro.batch["responses"])
    entropy = None
    if calculate_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    return log_probs, entropy


@torch.no_grad()
def compute_log_probs(
    model: PreTrainedModel,
    data: DataProto,
    micro_batch_size: int,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    compute_dtype: torch.dtype | None = None,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` over a whole batch, one micro-batch of `micro_batch_size` sequences at a time.

    Returns:
        (log_probs float32 [B, T], entropy float32 [B, T] or None) on the model's device.
    """
    log_probs, entropies = [], []
    for micro in data.split(micro_batch_size):
        lp, ent = response_log_probs(
            model, micro, temperature, calculate_entropy, compute_dtype, share_prompts=share_prompts
        )
        log_probs.append(lp)
        if ent is not None:
            entropies.append(ent)
    return torch.cat(log_probs), (torch.cat(entropies) if calculate_entropy else None)


def response_values(
    critic: PreTrainedModel, micro: DataProto, compute_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Critic values V(s_t) for each response position (differentiable).

    The value for response token t is read at the position that predicts it (P-1+t), i.e. the state before
    the token is chosen, as in GAE (Schulman et al. 2016, eq. 16). The forward runs under `autocast` in
    `compute_dtype` (None / float32: as stored).

    Returns:
        float32 [b, T].
    """
    t = response_length(micro)
    with autocast(_model_device(critic), compute_dtype):
        out = critic(
            input_ids=micro.batch["input_ids"],
            attention_mask=micro.batch["attention_mask"],
            position_ids=micro.batch["position_ids"],
            use_cache=False,
        )
    return out.logits[:, -t - 1 : -1, 0].float()


@torch.no_grad()
def compute_values(
    critic: PreTrainedModel, data: DataProto, micro_batch_size: int, compute_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`response_values` over a whole batch in micro-batches (forwards in `compute_dtype`). Returns float32 [B, T]."""
    return torch.cat([response_values(critic, micro, compute_dtype) for micro in data.split(micro_batch_size)])
