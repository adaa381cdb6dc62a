"""Sparse upcycling: a mixture-of-experts model made from a dense one (Komatsuzaki et al. 2022, "Sparse Upcycling:
Training Mixture-of-Experts from Dense Checkpoints", section 3), and the dense model of the same active size.

`upcycle` turns a Llama-architecture model (SmolLM2) into a `MixtralForCausalLM`: attention, norms and embeddings
carried over, each layer's MLP copied into every expert, and a router of small random weights. A token's output is
the gate-weighted sum of its top-k experts with gates summing to 1 (Mixtral renormalises them), and the experts are
equal, so the upcycled model computes the dense one's function whatever the router chooses; training then lets the
experts part ways on the tokens each is sent.

`widen` makes the dense model with the upcycled one's active parameter count: each MLP k times as wide, its gate
and up rows repeated and its down columns repeated divided by k, which again computes the same function. The two
compare iteration time at equal active compute (HybridFlow issue 86).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

_CARRIED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
)


def _dense(path: str | Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = model.config
    if config.model_type != "llama" or config.attention_bias or getattr(config, "mlp_bias", False):
        raise ValueError(
            f"{path}: upcycling takes a Llama-architecture model without biases (SmolLM2); this one is "
            f"{config.model_type} (attention_bias={config.attention_bias})"
        )
    return model


def _save(model, tokenizer_dir: str | Path, target: str | Path) -> Path:
    from transformers import AutoTokenizer, GenerationConfig

    target = Path(target)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(target)
    with contextlib.suppress(OSError):  # a dense folder without generation_config.json
        GenerationConfig.from_pretrained(tokenizer_dir).save_pretrained(target)
    return target


def upcycle(dense_path: str | Path, target: str | Path, num_experts: int = 8, top_k: int = 2, seed: int = 0) -> Path:
    """Write the sparse upcycling of the Llama model at `dense_path` to `target`: a `MixtralForCausalLM` of
    `num_experts` copies of each MLP, `top_k` per token, float32, with the dense folder's tokenizer.

    The router weights [E, H] are drawn from N(0, initializer_range^2) with `seed`; they change which experts a token
    meets, not the output, while the experts are equal.

    Raises:
        ValueError: the model is not a bias-free Llama, or `top_k` is not in [1, `num_experts`].
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    dense = _dense(dense_path)
    source = dense.config
    config = MixtralConfig(
        **{key: getattr(source, key) for key in _CARRIED},
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
        router_aux_loss_coef=0.0,
        architectures=["MixtralForCausalLM"],
    )
    moe = MixtralForCausalLM(config).to(torch.float32)
    weights = dense.state_dict()
    generator = torch.Generator().manual_seed(seed)
    own = moe.state_dict()
    with torch.no_grad():
        for name, tensor in own.items():
            if name in weights:  # embeddings, attention, norms, the LM head
                tensor.copy_(weights[name])
        for i, layer in enumerate(moe.model.layers):
            mlp = f"model.layers.{i}.mlp"
            gate_up = torch.cat([weights[f"{mlp}.gate_proj.weight"], weights[f"{mlp}.up_proj.weight"]], dim=0)
            layer.mlp.experts.gate_up_proj.copy_(gate_up.expand(num_experts, *gate_up.shape))
            down = weights[f"{mlp}.down_proj.weight"]
            layer.mlp.experts.down_proj.copy_(down.expand(num_experts, *down.shape))
            router = layer.mlp.gate.weight
            router.copy_(torch.randn(router.shape, generator=generator) * source.initializer_range)
    return _save(moe, dense_path, target)


def widen(dense_path: str | Path, target: str | Path, factor: int = 2) -> Path:
    """Write the Llama model at `dense_path` with every MLP `factor` times as wide to `target`, computing the same
    function (module docstring): the dense model with a top-`factor` upcycling's active parameters.

    Raises:
        ValueError: the model is not a bias-free Llama, or `factor` < 1.
    """
    from transformers import LlamaForCausalLM

    if factor < 1:
        raise ValueError(f"factor={factor} must be at least 1")
    dense = _dense(dense_path)
    config = dense.config
    config.intermediate_size *= factor
    wide = LlamaForCausalLM(config).to(torch.float32)
    weights = dense.state_dict()
    with torch.no_grad():
        for name, tensor in wide.state_dict().items():
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                tensor.copy_(weights[name].repeat(factor, 1))
            elif name.endswith("down_proj.weight"):
                tensor.copy_(weights[name].repeat(1, factor) / factor)
            elif name in weights:
                tensor.copy_(weights[name])
    return _save(wide, dense_path, target)
