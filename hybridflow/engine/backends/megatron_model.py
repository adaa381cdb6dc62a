"""megatron-core ``GPTModel`` for a Hugging Face Llama-family config, sharded by megatron's parallel state
(tensor, pipeline and data parallel), with its weights loaded from the Hugging Face model through
`hybridflow.engine.backends.megatron_bridge`.

The model uses megatron-core's local layer spec (no Transformer Engine): RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, no linear biases (q/k/v biases for Qwen2 through ``add_qkv_bias``; Qwen3's per-head query
and key RMSNorm through ``qk_layernorm``). Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its gated shared
expert, Mixtral) get megatron-core's ``MoELayer`` in every layer, with expert parallelism (`moe_settings`). On CPU call
`hybridflow.engine.backends.megatron_cpu.install` before importing megatron.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from hybridflow.engine.backends.megatron_bridge import expert_local_name, hf_to_mcore, is_expert, shard, stage_names
from hybridflow.engine.moe import moe_spec

QK_NORM_MODELS = ("qwen3", "qwen3_moe")
"""Hugging Face model types whose attention RMS-normalises each query and key head before RoPE (megatron-core's
``qk_layernorm``)."""


def moe_settings(hf_config, moe=None, ep: int = 1, etp: int | None = None) -> dict:
    """The megatron-core ``TransformerConfig`` fields of a mixture-of-experts `hf_config` (empty for a dense one):
    its routed experts (``SequentialMLP``, no grouped GEMM), top-k router and shared expert, the auxiliary losses and
    token dispatcher of `moe` (``actor.moe``; None: no losses, the allgather dispatcher) and expert parallelism
    (`ep` ranks share the experts, each expert split over `etp` ranks; None: ``actor.tp``).

    Routing as transformers': softmax over all experts then the top k, renormalised over them when the model does
    (Mixtral always, Qwen3-MoE / Qwen2-MoE with ``norm_topk_prob``); megatron-core's default (top-k of the logits,
    softmax over those) is that renormalised form, ``moe_router_pre_softmax`` the other.

    Raises:
        ValueError: an MoE layout megatron-core's layer spec cannot express here (dense layers between MoE layers).
    """
    from hybridflow.engine.moe import moe_spec

    spec = moe_spec(hf_config)
    if spec is None:
        return {}
    if getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) != 1:
        raise ValueError(
            "actor.strategy=megatron builds every layer as an MoE layer, but this model has dense layers between "
            "them (mlp_only_layers / decoder_sparse_step in config.json); train it with actor.strategy=fsdp"
        )
    aux = float(moe.aux_loss_coeff) if moe is not None else 0.0
    z = float(moe.z_loss_coeff) if moe is not None else 0.0
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    return {
        "num_moe_experts": spec.num_experts,
        "moe_router_topk": spec.top_k,
        "moe_ffn_hidden_size": getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size,
        "moe_router_pre_softmax": spec.architecture != "MixtralForCausalLM"
        and not getattr(hf_config, "norm_topk_prob", False),
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if aux > 0 else "none",
        "moe_aux_loss_coeff": aux,
        "moe_z_loss_coeff": z or None,
        "moe_token_dispatcher_type": moe.token_dispatcher_type if moe is not None else "allgather",
        "moe_grouped_gemm": False,
        "moe_shared_expert_intermediate_size": shared or None,
        "moe_shared_expert_gate": bool(shared),
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
    }


def transformer_config(
    hf_config,
    tp: int,
    pp: int,
    dtype: torch.dtype = torch.float32,
    recompute: bool = False,
    moe=None,
    ep: int = 1,
    etp: int | None = None,
):
    """megatron-core ``TransformerConfig`` equivalent to `hf_config` (no dropout, no fused CUDA kernels). With
    `recompute`, full activation recompute of every layer (``recompute_granularity="full"``, ``uniform``, one layer
    per unit: Korthikanti et al. 2022, §3, megatron's full checkpointing): each layer keeps only its input in training.
    A mixture-of-experts model gets `moe_settings` (`moe`, `ep`, `etp`).

    Raises:
        ValueError: a model type outside the Llama family (no SwiGLU / RMSNorm), or an MoE layout `moe_settings`
            refuses.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"megatron backend: only SwiGLU (hidden_act=silu) models, got {hf_config.hidden_act}")
    heads = hf_config.num_attention_heads
    qkv_bias = bool(getattr(hf_config, "attention_bias", False) or getattr(hf_config, "qkv_bias", False))
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
        add_qkv_bias=qkv_bias or hf_config.model_type in ("qwen2", "qwen2_moe"),
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
        # megatron-core trains MoE layers under tensor parallelism only with the sequence split over the TP ranks
        sequence_parallel=tp > 1 and moe_spec(hf_config) is not None,
        **moe_settings(hf_config, moe, ep, etp),
    )


class ValueHead(torch.nn.Module):
    """A critic's output layer, in place of ``GPTModel``'s vocabulary projection (called as megatron calls it):
    hidden states [s, b, H] -> values [s, b, 1]. Every TP rank holds it whole (their hidden states are equal)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False):
        super().__init__()
        self.head = torch.nn.Linear(hidden_size, 1, dtype=dtype)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:  # [s/t, b, H] -> [s, b, H], as megatron's output layer gathers
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states)
        return self.head(hidden_states), None


def build_gpt_model(
    hf_config, dtype: torch.dtype = torch.float32, value_head: bool = False, recompute: bool = False, moe=None
):
    """This rank's ``GPTModel`` (its pipeline stage, its tensor-parallel shard, its experts) under the initialised
    megatron parallel state (``parallel_state.initialize_model_parallel``, whose expert-parallel sizes a
    mixture-of-experts model uses; `moe`: the ``actor.moe`` section, `moe_settings`). With `value_head` it is a
    critic: the last stage ends in a `ValueHead` (the model returns values [b, s, 1] instead of logits) and no
    weights are tied. With `recompute`, activation recompute (`transformer_config`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(
        hf_config,
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        dtype,
        recompute,
        moe,
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )
    rope = getattr(hf_config, "rope_parameters", None) or {}
    layer_spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        qk_layernorm=config.qk_layernorm,
    )
    if config.sequence_parallel:
        layer_spec = _sequence_parallel_block(layer_spec, config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head,
        position_embedding_type="rope",
        rotary_base=int(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
    )
    if value_head and parallel_state.is_pipeline_last_stage():
        model.output_layer = ValueHead(hf_config.hidden_size, dtype, config.sequence_parallel)
    return model


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm in megatron-core's local layer spec under sequence parallelism, where megatron's own wrapper
    (``WrappedTorchNorm``) refuses to run: the same normalisation of [s/t, b, H] activations, its weight marked
    ``sequence_parallel`` so that its gradient, computed from 1/t of the tokens (or, as a q/k norm, of the heads),
    is summed over the TP group (`hybridflow.engine.backends.megatron_actor`). Arguments as megatron passes them."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = True


def _sequence_parallel_block(layer_spec, config):
    """The decoder block's spec for `layer_spec` with every torch norm (layers, q/k norms, the final norm) a
    `SequenceParallelRMSNorm`."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    def swapped(node):
        if node is WrappedTorchNorm:
            return SequenceParallelRMSNorm
        if isinstance(node, ModuleSpec) or (dataclasses.is_dataclass(node) and not isinstance(node, type)):
            return dataclasses.replace(
                node, **{f.name: swapped(getattr(node, f.name)) for f in dataclasses.fields(node)}
            )
        return node

    layer = swapped(layer_spec)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=SequenceParallelRMSNorm
    )


@torch.no_grad()
def load_hf_weights(model, hf_state: Mapping[str, torch.Tensor], hf_config) -> None:
    """Copy this rank's shard of the Hugging Face weights into `model` (from `build_gpt_model`).

    Raises:
        KeyError: the model has a parameter the converted state lacks (or the reverse): the configs differ.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    etp_size = parallel_state.get_expert_tensor_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    spec = moe_spec(hf_config)
    full = hf_to_mcore(hf_state, hf_config)
    critic = "output_layer.head.weight" in full
    if getattr(hf_config, "tie_word_embeddings", False) and pp_size > 1 and not critic:
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]  # the last stage's copy
    local = {}
    for name, tensor in full.items():
        owner, local_name = stage_names(name, hf_config.num_hidden_layers, pp_size)
        if owner != stage:
            continue
        if is_expert(name):  # this EP rank's experts, each split over the expert-TP group
            local_name = expert_local_name(local_name, ep_rank, ep_size, spec.num_experts)
            if local_name is not None:
                local[local_name] = shard(name, tensor, etp_rank, etp_size)
        else:
            local[local_name] = shard(name, tensor, tp_rank, tp_size)
    params = dict(model.named_parameters())
    missing, extra = sorted(set(params) - set(local)), sorted(set(local) - set(params))
    if missing or extra:
        raise KeyError(f"megatron model and converted weights differ: missing {missing[:4]}, unexpected {extra[:4]}")
    for name, param in params.items():
        param.copy_(local[name])
