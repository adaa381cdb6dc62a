"""megatron-core ``GPTModel`` for a Hugging Face Llama-family config, sharded by megatron's parallel state
(tensor, pipeline and data parallel), with its weights loaded from the Hugging Face model through
`hybridflow.engine.backends.megatron_bridge`.

The model uses megatron-core's local layer spec (no Transformer Engine): RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, no linear biases (q/k/v biases for Qwen2 through ``add_qkv_bias``; Qwen3's per-head query
and key RMSNorm through ``qk_layernorm``). On CPU call
`hybridflow.engine.backends.megatron_cpu.install` before importing megatron.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from hybridflow.engine.backends.megatron_bridge import hf_to_mcore, shard, stage_names

QK_NORM_MODELS = ("qwen3",)
"""Hugging Face model types whose attention RMS-normalises each query and key head before RoPE (megatron-core's
``qk_layernorm``)."""


def transformer_config(hf_config, tp: int, pp: int, dtype: torch.dtype = torch.float32, recompute: bool = False):
    """megatron-core ``TransformerConfig`` equivalent to `hf_config` (no dropout, no fused CUDA kernels). With
    `recompute`, full activation recompute of every layer (``recompute_granularity="full"``, ``uniform``, one layer
    per unit: Korthikanti et al. 2022, §3, megatron's full checkpointing): each layer keeps only its input in training.

    Raises:
        ValueError: a model type outside the Llama family (no SwiGLU / RMSNorm).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"megatron backend: only SwiGLU (hidden_act=silu) models, got {hf_config.hidden_act}")
    heads = hf_config.num_attention_heads
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=hf_config.num_key_value_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(hf_config, "attention_bias", False)) or hf_config.model_type == "qwen2",
        qk_layernorm=hf_config.model_type in QK_NORM_MODELS,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        **(
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
            if recompute
            else {}
        ),
    )


class ValueHead(torch.nn.Module):
    """A critic's output layer, in place of ``GPTModel``'s vocabulary projection (called as megatron calls it):
    hidden states [s, b, H] -> values [s, b, 1]. Every TP rank holds it whole (their hidden states are equal)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.head = torch.nn.Linear(hidden_size, 1, dtype=dtype)

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        return self.head(hidden_states), None


def build_gpt_model(hf_config, dtype: torch.dtype = torch.float32, value_head: bool = False, recompute: bool = False):
    """This rank's ``GPTModel`` (its pipeline stage, its tensor-parallel shard) under the initialised megatron
    parallel state (``parallel_state.initialize_model_parallel``). With `value_head` it is a critic: the last
    stage ends in a `ValueHead` (the model returns values [b, s, 1] instead of logits) and no weights are tied. With
    `recompute`, activation recompute (`transformer_config`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(
        hf_config,
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        dtype,
        recompute,
    )
    rope = getattr(hf_config, "rope_parameters", None) or {}
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head,
        position_embedding_type="rope",
        rotary_base=int(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
    )
    if value_head and parallel_state.is_pipeline_last_stage():
        model.output_layer = ValueHead(hf_config.hidden_size, dtype)
    return model


@torch.no_grad()
def load_hf_weights(model, hf_state: Mapping[str, torch.Tensor], hf_config) -> None:
    """Copy this rank's shard of the Hugging Face weights into `model` (from `build_gpt_model`).

    Raises:
        KeyError: the model has a parameter the converted state lacks (or the reverse): the configs differ.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    full = hf_to_mcore(hf_state, hf_config)
    critic = "output_layer.head.weight" in full
    if getattr(hf_config, "tie_word_embeddings", False) and pp_size > 1 and not critic:
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]  # the last stage's copy
    local = {}
    for name, tensor in full.items():
        owner, local_name = stage_names(name, hf_config.num_hidden_layers, pp_size)
        if owner == stage:
            local[local_name] = shard(name, tensor, tp_rank, tp_size)
    params = dict(model.named_parameters())
    missing, extra = sorted(set(params) - set(local)), sorted(set(local) - set(params))
    if missing or extra:
        raise KeyError(f"megatron model and converted weights differ: missing {missing[:4]}, unexpected {extra[:4]}")
    for name, param in params.items():
        param.copy_(local[name])
