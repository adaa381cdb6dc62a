"""A tiny random Llama model and a small byte-level BPE tokenizer, built from config with no model hub.

Tests and smoke runs use it: it loads through the same `load_model` path as a real Hugging Face folder, so
nothing is special-cased. Building it takes well under a second on CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# ChatML, the template SmolLM2-Instruct uses, so prompts look the same on the tiny and the real model.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]

_CORPUS = [
    "What is 3 + 4? The answer is 7.",
    "Compute 12 - 5 and give the result: 7",
    "The quick brown fox jumps over the lazy dog.",
    "Solve the problem step by step, then write the final answer. #### 42",
    "user assistant system: you are a helpful assistant",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) . , ? !",
    "Calculate 1 + 2 + 3. Answer with a number only.",
]


def build_tiny_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on a built-in corpus (any text encodes; bytes are the fallback).

    Returns:
        A `PreTrainedTokenizerFast` with eos ``<|im_end|>``, pad ``<pad>``, bos ``<|endoftext|>`` and a ChatML
        chat template, padding on the left (the side generation needs).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        padding_side="left",
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny_model(
    path: str | Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    head_dim: int = 16,
    max_positions: int = 512,
) -> Path:
    """Write a random tiny `LlamaForCausalLM` (GQA, SwiGLU, tied embeddings) and its tokenizer to `path`.

    Args:
        path: folder to create (overwritten files if it exists).
        seed: torch seed for the random weights (same seed -> identical weights). The caller's global torch RNG
            state is left as it was (the weights are drawn under `torch.random.fork_rng`).
        hidden_size: model width.
        head_dim: width of each attention head (vLLM's CPU attention needs 32, 64, 80, ...); query heads =
            hidden_size / head_dim, key/value heads = half as many (GQA; at least 1).
        num_layers: number of decoder layers.
        max_positions: the longest sequence (prompt + response, tokens) the model takes (``max_position_embeddings``;
            vLLM refuses a longer ``max_model_len``).

    Returns:
        The folder, loadable with `hybridflow.engine.models.load_model` or `from_pretrained`.
    """
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=max(1, hidden_size // head_dim // 2),
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG stream
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_moe_model(
    path: str | Path,
    architecture: str = "qwen3_moe",
    seed: int = 0,
    num_experts: int = 8,
    top_k: int = 2,
    hidden_size: int = 64,
    num_layers: int = 2,
    head_dim: int = 16,
) -> Path:
    """Write a random tiny mixture-of-experts model of transformers' own classes, with the tiny tokenizer, to `path`.

    Args:
        architecture: ``qwen3_moe`` (`Qwen3MoeForCausalLM`: routed experts only, per-head q/k RMSNorm),
            ``qwen2_moe`` (`Qwen2MoeForCausalLM`: routed experts plus a gated shared expert) or ``mixtral``
            (`MixtralForCausalLM`).
        num_experts: routed experts per layer; each token goes to `top_k` of them.
        seed, hidden_size, num_layers, head_dim: as for `build_tiny_model`; each expert's width is hidden_size / 2.

    Returns:
        The folder, loadable with `hybridflow.engine.models.load_model`.

    Raises:
        ValueError: an `architecture` not listed above.
    """
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    width = hidden_size // 2
    kinds = {
        "qwen3_moe": (
            Qwen3MoeConfig,
            Qwen3MoeForCausalLM,
            {"num_experts": num_experts, "moe_intermediate_size": width},
        ),
        "qwen2_moe": (
            Qwen2MoeConfig,
            Qwen2MoeForCausalLM,
            {"num_experts": num_experts, "moe_intermediate_size": width, "shared_expert_intermediate_size": 2 * width},
        ),
        "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": num_experts, "intermediate_size": width}),
    }
    if architecture not in kinds:
        raise ValueError(f"unknown tiny MoE architecture {architecture!r}; choose one of {sorted(kinds)}")
    config_class, model_class, experts = kinds[architecture]
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=max(1, hidden_size // head_dim // 2),
        head_dim=head_dim,
        num_experts_per_tok=top_k,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **experts,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
