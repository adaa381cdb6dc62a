"""Loading Hugging Face models, and the forward passes RLHF needs: response log-probs, entropy, values.

Sequences are laid out as in verl: ``input_ids`` [B, P+T] = left-padded prompt (P tokens) followed by the
right-padded response (T tokens); ``attention_mask`` and ``position_ids`` [B, P+T] cover both. The logit that
predicts response token t sits at position P-1+t of a row. The passes here do not run that layout as it is: each
micro-batch is packed (`hybridflow.engine.packing.pack_rows`: real tokens only, a prompt once for its samples) and
the LM head runs only at the positions that predict a response token (``logits_to_keep`` as indices).

Memory: log-probs and entropy are computed one micro-batch at a time, so at most (the micro-batch's response
tokens) x vocab logits exist at once (fp32, or bf16 under autocast, upcast 1,024 rows at a time).

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

from hybridflow.engine.moe import RouterRecorder, stack_routes
from hybridflow.engine.packing import PACKED_ATTENTION, PackedRows, pack_rows
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.torch_ops import log_probs_at, logprobs_and_entropy, sum_pi_squared, top_k_log_probs


def pick_device(device: str = "auto") -> torch.device:
    """'auto' -> cuda if available else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but torch sees no CUDA device; use trainer.device=cpu or auto")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The compute dtype of a ``*.dtype`` key: 'auto' -> bfloat16 on CUDA, float32 on CPU; 'native' -> bfloat16
    where the device computes it in hardware (CUDA, or a CPU with AVX512-BF16 or AMX: `cpu_has_native_bf16`),
    float32 where it would be emulated (23 times slower for a SmolLM2 update on a 2-core AMD EPYC); a dtype name as
    it is.

    Trained models keep fp32 weights whatever this returns (see the module docstring); it selects the autocast
    dtype of their forwards and the storage dtype of frozen models.

    Raises:
        AttributeError: `dtype` is not a torch dtype name.
    """
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "native":
        native = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
        return torch.bfloat16 if native else torch.float32
    return getattr(torch, dtype)


def dtype_name(dtype: str, device: torch.device | None) -> str:
    """`pick_dtype`'s choice as vLLM names it (``"bfloat16"``, ``"float32"``), for an engine on `device` (None:
    the CPU)."""
    return str(pick_dtype(dtype, device or torch.device("cpu"))).removeprefix("torch.")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls in hardware (AVX512-BF16 or AMX tiles, as torch's CPU kernels detect
    them). Without them torch emulates bf16 under autocast: a SmolLM2 forward and backward of 4 x 152 tokens took
    151.8 s against 6.5 s in float32 on a 2-core AMD EPYC (AVX2 only; 2026-11-27); with AMX-BF16 bf16 is the faster.
    (``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported``: torch's own CPUID checks, no public
    equivalent in torch 2.13.)"""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


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
    return _attend_per_group(model)


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
    return _attend_per_group(model)


def checkpoint_layers(model: PreTrainedModel) -> None:
    """Activation checkpointing on a Hugging Face model (``model.gradient_checkpointing``,
    ``critic.gradient_checkpointing``; Chen et al. 2016): in training mode each decoder layer keeps only its input
    and recomputes its activations in the backward pass (PyTorch's non-reentrant ``torch.utils.checkpoint``, which
    replays the RNG state: the same values and gradients for about one more forward of compute). Call it before
    LoRA, DDP or FSDP wrap the model; eval-mode forwards (log-probs, generation) are unchanged."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _attend_per_group(model: PreTrainedModel) -> PreTrainedModel:
    """Switch a model on sdpa attention to `hybridflow.engine.packing.packed_sdpa` (sdpa per prompt group of a
    packed sequence, plain sdpa otherwise); models on another implementation keep it."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(PACKED_ATTENTION)
    return model


def _disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def response_logits(
    model: PreTrainedModel,
    packed: PackedRows,
    temperature: float = 1.0,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The logits that predict each real response token of `packed` (`pack_rows`), divided by `temperature`.

    One forward over the packed sequence; the LM head runs only at the K predicting positions (``logits_to_keep``
    as indices), so no [b, L, V] tensor and no padding or prompt position reaches it.

    Args:
        temperature: the rollout's sampling temperature, as the PPO ratio requires.
        compute_dtype: run the forward under `autocast` in this dtype (None / float32: as stored).

    Returns:
        float [K, V]: in the model's dtype, or `compute_dtype` under autocast.
    """
    with autocast(_model_device(model), compute_dtype):
        out = model(**_packed_inputs(model, packed), logits_to_keep=packed.predict, use_cache=False)
    logits = out.logits[0]
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return logits


def _packed_inputs(model: torch.nn.Module, packed: PackedRows) -> dict:
    """The forward's keyword arguments for `packed`: its ids, positions and mask (additive float for eager
    attention, which adds the mask to the scores; boolean for sdpa), and its group spans (`packed_sdpa`)."""
    mask = packed.attention_mask
    config = getattr(model, "module", model).config  # DDP wraps the model
    if config._attn_implementation == "eager":
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
    return {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "attention_mask": mask,
        "packed_spans": packed.spans,
    }


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
    (differentiable unless `entropy_grad` is false: a metric, which then keeps no [K, V] softmax for backward).

    The rows are packed (`pack_rows`: no padding, a repeated prompt once unless `share_prompts` is false) and the
    LM head runs at response positions only (`response_logits`); the forward runs in `compute_dtype`, the softmax
    math in fp32, one log-softmax per chunk of rows for both (`torch_ops.logprobs_and_entropy`).

    Returns:
        (log_probs float32 [b, T], entropy float32 [b, T] or None), 0 where ``response_mask`` is 0 (padding, and
        the tool tokens of agent trajectories: never computed).
    """
    stats = response_token_stats(
        model, micro, temperature, calculate_entropy, compute_dtype, entropy_grad, share_prompts
    )
    return stats["log_probs"], stats.get("entropy")


def response_token_stats(
    model: PreTrainedModel,
    micro: DataProto,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    compute_dtype: torch.dtype | None = None,
    entropy_grad: bool = True,
    share_prompts: bool = True,
    calculate_sum_pi_squared: bool = False,
    top_k: int = 0,
    support: torch.Tensor | None = None,
    packed: PackedRows | None = None,
) -> dict[str, torch.Tensor]:
    """`response_log_probs`' one forward (over `packed`, `micro` packed by `pack_rows` when None), and from the same
    logits what else is asked, each 0 off the response:

    - ``log_probs`` float32 [b, T] (differentiable), ``entropy`` float32 [b, T] with `calculate_entropy`;
    - ``sum_pi_squared`` float32 [b, T]: sum_v pi(v)^2 (`torch_ops.sum_pi_squared`, no gradient);
    - ``top_k_ids`` int64 [b, T, k] and ``top_k_log_probs`` float32 [b, T, k] with `top_k` = k > 0: each
      position's k likeliest tokens and their log-probs (`torch_ops.top_k_log_probs`, no gradient);
    - ``support_log_probs`` float32 [b, T, k] with `support` (int [b, T, k] token ids, e.g. the teacher's
      ``teacher_top_k_ids``): the log-probs at those ids (`torch_ops.log_probs_at`, differentiable).
    """
    packed = pack_rows(micro, share_prompts) if packed is None else packed
    logits = response_logits(model, packed, temperature, compute_dtype)
    targets = micro.batch["responses"][packed.rows, packed.cols]
    log_probs, entropy = logprobs_and_entropy(logits, targets, calculate_entropy, entropy_grad)
    stats = {"log_probs": packed.scatter(log_probs)}
    if entropy is not None:
        stats["entropy"] = packed.scatter(entropy)
    with torch.no_grad():
        if calculate_sum_pi_squared:
            stats["sum_pi_squared"] = packed.scatter(sum_pi_squared(logits))
        if top_k:
            ids, values = top_k_log_probs(logits, top_k)
            stats.update(top_k_ids=packed.scatter(ids), top_k_log_probs=packed.scatter(values))
    if support is not None:
        stats["support_log_probs"] = packed.scatter(log_probs_at(logits, support[packed.rows, packed.cols]))
    return stats


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
    stats = compute_token_stats(
        model, data, micro_batch_size, temperature, calculate_entropy, compute_dtype, share_prompts
    )
    return stats["log_probs"], stats.get("entropy")


@torch.no_grad()
def compute_token_stats(
    model: PreTrainedModel,
    data: DataProto,
    micro_batch_size: int,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    compute_dtype: torch.dtype | None = None,
    share_prompts: bool = True,
    calculate_sum_pi_squared: bool = False,
    top_k: int = 0,
    routers: RouterRecorder | None = None,
    routing: str | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token statistics of the responses over a whole batch, one forward per micro-batch of
    `micro_batch_size` sequences: ``log_probs``, with `calculate_entropy` ``entropy``, with
    `calculate_sum_pi_squared` ``sum_pi_squared`` (sum over the vocabulary of pi^2 at each response token, the
    optimal token baseline's input), with `top_k` = k > 0 ``top_k_ids`` int64 [B, T, k] and ``top_k_log_probs``
    float32 [B, T, k] (`response_token_stats`); each on the model's device, 0 off the response.

    An MoE model's `routers` (`hybridflow.engine.moe.RouterRecorder`) with `routing` ``"record"``: also
    ``routed_experts`` int16 [B, P+T, M, k], the experts each real token went to in each MoE layer (-1 at padding);
    ``"replay"``: the forwards route every token to `data`'s ``routed_experts`` (`RouterRecorder.replaying`)."""
    stats: dict[str, list[torch.Tensor]] = {}
    for micro in data.split(micro_batch_size):
        packed = pack_rows(micro, share_prompts)
        replay = packed.gather(micro.batch["routed_experts"]) if routing == "replay" else None
        with (
            routers.replaying(replay) if routers is not None else contextlib.nullcontext(),
            routers.choosing() if routing == "record" else contextlib.nullcontext() as chosen,
        ):
            values = response_token_stats(
                model,
                micro,
                temperature,
                calculate_entropy,
                compute_dtype,
                False,
                share_prompts,
                calculate_sum_pi_squared,
                top_k,
                packed=packed,
            )
        if routing == "record":
            values["routed_experts"] = packed.spread(stack_routes(chosen), fill=-1)
        for name, value in values.items():
            stats.setdefault(name, []).append(value)
    return {name: torch.cat(parts) for name, parts in stats.items()}


def response_values(
    critic: PreTrainedModel,
    micro: DataProto,
    compute_dtype: torch.dtype | None = None,
    share_prompts: bool = True,
) -> torch.Tensor:
    """Critic values V(s_t) for each response position (differentiable).

    The value for response token t is read at the position that predicts it (P-1+t in the padded row), i.e. the
    state before the token is chosen, as in GAE (Schulman et al. 2016, eq. 16). The rows are packed as for
    `response_log_probs` (`pack_rows`: no padding, a repeated prompt once unless `share_prompts` is false); the
    forward runs under `autocast` in `compute_dtype` (None / float32: as stored).

    Returns:
        float32 [b, T], 0 where ``response_mask`` is 0.
    """
    packed = pack_rows(micro, share_prompts)
    with autocast(_model_device(critic), compute_dtype):
        out = critic(**_packed_inputs(critic, packed), use_cache=False)
    return packed.scatter(out.logits[0, packed.predict, 0].float())


@torch.no_grad()
def compute_values(
    critic: PreTrainedModel,
    data: DataProto,
    micro_batch_size: int,
    compute_dtype: torch.dtype | None = None,
    share_prompts: bool = True,
) -> torch.Tensor:
    """`response_values` over a whole batch in micro-batches (forwards in `compute_dtype`). Returns float32 [B, T]."""
    return torch.cat(
        [response_values(critic, micro, compute_dtype, share_prompts) for micro in data.split(micro_batch_size)]
    )
