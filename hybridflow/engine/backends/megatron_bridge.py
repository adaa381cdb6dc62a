"""Weights between Hugging Face Llama / Qwen2 / Qwen3 / Mistral and megatron-core's ``GPTModel`` (local layer spec),
exactly (every conversion is a permutation of rows: HF -> megatron -> HF is bit-identical).

Names (HF -> megatron-core), per decoder layer i:

====================================================  =====================================================
``model.embed_tokens.weight``                          ``embedding.word_embeddings.weight``   (vocab-parallel)
``model.layers.i.input_layernorm.weight``              ``decoder.layers.i.input_layernorm.weight``
``q_proj``, ``k_proj``, ``v_proj`` (weights, biases)   ``decoder.layers.i.self_attention.linear_qkv``
``model.layers.i.self_attn.o_proj.weight``             ``decoder.layers.i.self_attention.linear_proj.weight``
``self_attn.q_norm``, ``k_norm`` (Qwen3)               ``self_attention.q_layernorm``, ``k_layernorm``  (replicated)
``model.layers.i.post_attention_layernorm.weight``     ``decoder.layers.i.pre_mlp_layernorm.weight``
``gate_proj``, ``up_proj``                             ``decoder.layers.i.mlp.linear_fc1.weight``
``model.layers.i.mlp.down_proj.weight``                ``decoder.layers.i.mlp.linear_fc2.weight``
``model.norm.weight``                                  ``decoder.final_layernorm.weight``
``lm_head.weight`` (absent when tied)                  ``output_layer.weight``
``model.layers.i.mlp.gate.weight`` (MoE router)        ``decoder.layers.i.mlp.router.weight``  (replicated)
``mlp.experts.gate_up_proj`` [E, 2F, H] (expert e)     ``mlp.experts.local_experts.e.linear_fc1.weight``
``mlp.experts.down_proj`` [E, H, F] (expert e)         ``mlp.experts.local_experts.e.linear_fc2.weight``
``mlp.shared_expert.*`` (Qwen2-MoE)                    ``mlp.shared_experts.linear_fc1`` / ``linear_fc2``
``mlp.shared_expert_gate.weight`` (Qwen2-MoE)          ``mlp.shared_experts.gate_weight``  (replicated)
``score.weight``, ``score.bias`` (a critic)            ``output_layer.head.weight``, ``.bias``  (replicated)
====================================================  =====================================================

Mixture-of-experts layers (megatron-core's ``MoELayer`` with ``SequentialMLP`` experts, no grouped GEMM): the
full-model names number experts globally; expert parallelism gives EP rank r the experts
``[r E / ep, (r + 1) E / ep)`` as its ``local_experts.0 ...`` (`expert_local_name`), and expert tensor parallelism
splits each expert's ``linear_fc1`` / ``linear_fc2`` as a dense MLP's over the expert-TP group. transformers 5 keeps
an MoE layer's experts stacked (``gate_up_proj`` [E, 2F, H], gate rows first, as megatron's ``linear_fc1``).

Layouts. ``linear_qkv`` is ``[ng * (h / ng + 2) * d, H]`` (ng query groups, h heads of width d): per query group,
its ``h / ng`` query heads, then its key head, then its value head; tensor parallelism gives each rank whole groups
(a contiguous block of rows). ``linear_fc1`` is ``[gate; up]`` in one piece, but each TP shard is
``[gate_r; up_r]`` (its slice of each), so TP sharding regroups rather than cutting the full tensor. Pipeline
stages number their layers from 0: global layer ``s * L / p + j`` is ``decoder.layers.j`` on stage ``s``.

The 3D-HybridEngine's generation shards (consecutive TP shards stacked) go to Hugging Face names through
`generation_order` (an in-place row permutation) and `generation_hf_weights` (views).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

_LAYER_MAP = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}
_DENSE_DOWN = {"mlp.down_proj.weight": "mlp.linear_fc2.weight"}
# Qwen3's per-head RMSNorm of queries and keys (before RoPE), megatron-core's ``qk_layernorm`` (replicated over TP)
_QK_NORM_MAP = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
_TOP_MAP = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
# a critic (``AutoModelForTokenClassification``, one label): its ``score`` head replaces the output layer,
# replicated over TP ranks (`hybridflow.engine.backends.megatron_model.ValueHead`)
_CRITIC_MAP = {"score.weight": "output_layer.head.weight", "score.bias": "output_layer.head.bias"}
# megatron name suffix -> TP split dimension (None: replicated)
TP_DIM = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "linear_qkv.weight": 0,
    "linear_qkv.bias": 0,
    "linear_fc1.weight": 0,
    "linear_proj.weight": 1,
    "linear_fc2.weight": 1,
}


# Qwen2-MoE's shared expert (every token passes it, scaled by a sigmoid gate), megatron-core's ``shared_experts``
_SHARED_MAP = {
    "mlp.shared_expert.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_expert_gate.weight": "mlp.shared_experts.gate_weight",
}
_EXPERTS = ".mlp.experts.local_experts."


def is_expert(mcore_name: str) -> bool:
    """Whether a megatron-core parameter belongs to a routed expert (split over expert parallelism)."""
    return _EXPERTS in mcore_name


def expert_local_name(mcore_name: str, ep_rank: int, ep_size: int, num_experts: int) -> str | None:
    """The name EP rank `ep_rank` gives a full-model routed-expert parameter (its experts renumbered from 0), or
    None when another EP rank holds that expert; other parameters keep their names."""
    if not is_expert(mcore_name):
        return mcore_name
    head, rest = mcore_name.split(_EXPERTS)
    index, tail = rest.split(".", 1)
    per_rank = num_experts // ep_size
    local = int(index) - ep_rank * per_rank
    return f"{head}{_EXPERTS}{local}.{tail}" if 0 <= local < per_rank else None


def expert_global_name(local_name: str, ep_rank: int, ep_size: int, num_experts: int) -> str:
    """Inverse of `expert_local_name`: the full-model name of EP rank `ep_rank`'s parameter `local_name`."""
    if not is_expert(local_name):
        return local_name
    head, rest = local_name.split(_EXPERTS)
    index, tail = rest.split(".", 1)
    return f"{head}{_EXPERTS}{int(index) + ep_rank * (num_experts // ep_size)}.{tail}"


def expert_stack(mcore_name: str) -> tuple[str | None, int]:
    """``(stack, e)`` of a full-model routed-expert parameter: the name of its layer's stacked tensor over the
    experts (``decoder.layers.i.mlp.experts.linear_fc1.weight``, Hugging Face's ``gate_up_proj`` layout) and its
    index e in it; ``(None, 0)`` for other parameters."""
    if not is_expert(mcore_name):
        return None, 0
    head, rest = mcore_name.split(_EXPERTS)
    index, tail = rest.split(".", 1)
    return f"{head}.mlp.experts.{tail}", int(index)


def tp_dim(mcore_name: str) -> int | None:
    """The tensor-parallel split dimension of a megatron-core parameter (None: every TP rank holds it whole)."""
    return next((d for suffix, d in TP_DIM.items() if mcore_name.endswith(suffix)), None)


def _qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """HF q [h*d, ...], k/v [ng*d, ...] -> megatron's group-interleaved [ng*(h/ng+2)*d, ...]."""
    q = q.reshape(groups, -1, *q.shape[1:])
    k = k.reshape(groups, -1, *k.shape[1:])
    v = v.reshape(groups, -1, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _qkv_split(qkv: torch.Tensor, groups: int, heads: int, head_dim: int):
    per_group = heads // groups * head_dim
    grouped = qkv.reshape(groups, per_group + 2 * head_dim, *qkv.shape[1:])
    q, k, v = grouped.split([per_group, head_dim, head_dim], dim=1)
    return (t.reshape(-1, *qkv.shape[1:]).contiguous() for t in (q, k, v))


def hf_to_mcore(hf: Mapping[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict -> the full (TP=1, PP=1) megatron-core state dict.

    Args:
        hf: ``model.state_dict()`` or ``named_parameters()`` of a Llama-family model (``lm_head.weight`` is
            ignored when ``config.tie_word_embeddings``).
        config: its ``PretrainedConfig`` (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``).

    Raises:
        KeyError: a parameter the mapping needs is missing. ValueError: a parameter it does not know.
    """
    groups = config.num_key_value_heads
    out: dict[str, torch.Tensor] = {}
    known: set[str] = set()
    for i in range(config.num_hidden_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mc_name in _LAYER_MAP.items():
            out[mp + mc_name] = hf[hp + hf_name]
            known.add(hp + hf_name)
        for hf_name, mc_name in _QK_NORM_MAP.items():
            if hp + hf_name in hf:
                out[mp + mc_name] = hf[hp + hf_name]
                known.add(hp + hf_name)
        attn = hp + "self_attn."
        for kind in ("weight", "bias"):
            names = [f"{attn}{p}_proj.{kind}" for p in "qkv"]
            if names[0] in hf:
                out[f"{mp}self_attention.linear_qkv.{kind}"] = _qkv_merge(*(hf[n] for n in names), groups)
                known.update(names)
        if hp + "mlp.gate.weight" in hf:  # a mixture-of-experts layer
            known.update(_moe_to_mcore(hf, hp, mp, out))
        else:
            gate, up = hp + "mlp.gate_proj.weight", hp + "mlp.up_proj.weight"
            out[mp + "mlp.linear_fc1.weight"] = torch.cat([hf[gate], hf[up]], dim=0)
            out[mp + "mlp.linear_fc2.weight"] = hf[hp + "mlp.down_proj.weight"]
            known.update((gate, up, hp + "mlp.down_proj.weight"))
    for hf_name, mc_name in _TOP_MAP.items():
        if hf_name == "lm_head.weight" and (getattr(config, "tie_word_embeddings", False) or "score.weight" in hf):
            known.add(hf_name)
            continue
        out[mc_name] = hf[hf_name]
        known.add(hf_name)
    for hf_name, mc_name in _CRITIC_MAP.items():  # a critic's value head (token classification, one label)
        if hf_name in hf:
            out[mc_name] = hf[hf_name]
            known.add(hf_name)
    unknown = sorted(set(hf) - known - {n for n in hf if n.endswith("rotary_emb.inv_freq")})
    if unknown:
        raise ValueError(f"parameters with no megatron-core mapping: {unknown[:5]}")
    return out


def mcore_to_hf(mcore: Mapping[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_mcore` (full TP=1, PP=1 megatron-core state dict -> Hugging Face names)."""
    groups, heads = config.num_key_value_heads, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    out: dict[str, torch.Tensor] = {}
    for i in range(config.num_hidden_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mc_name in _LAYER_MAP.items():
            out[hp + hf_name] = mcore[mp + mc_name]
        for hf_name, mc_name in _QK_NORM_MAP.items():
            if mp + mc_name in mcore:
                out[hp + hf_name] = mcore[mp + mc_name]
        for kind in ("weight", "bias"):
            name = f"{mp}self_attention.linear_qkv.{kind}"
            if name in mcore:
                q, k, v = _qkv_split(mcore[name], groups, heads, head_dim)
                for proj, t in zip("qkv", (q, k, v), strict=True):
                    out[f"{hp}self_attn.{proj}_proj.{kind}"] = t
        if mp + "mlp.router.weight" in mcore:
            _moe_to_hf(mcore, hp, mp, out)
        else:
            gate, up = mcore[mp + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
            out[hp + "mlp.down_proj.weight"] = mcore[mp + "mlp.linear_fc2.weight"]
    for hf_name, mc_name in {**_TOP_MAP, **_CRITIC_MAP}.items():
        if mc_name in mcore:
            out[hf_name] = mcore[mc_name]
    return out


def _moe_to_mcore(hf: Mapping[str, torch.Tensor], hp: str, mp: str, out: dict[str, torch.Tensor]) -> list[str]:
    """One MoE layer's router, routed experts (unstacked, expert e -> ``local_experts.e``) and shared expert from
    Hugging Face names (prefix `hp`) into `out` (prefix `mp`); returns the Hugging Face names read."""
    out[mp + "mlp.router.weight"] = hf[hp + "mlp.gate.weight"]
    gate_up, down = hf[hp + "mlp.experts.gate_up_proj"], hf[hp + "mlp.experts.down_proj"]
    for e in range(gate_up.shape[0]):
        out[f"{mp}mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
        out[f"{mp}mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    read = [hp + "mlp.gate.weight", hp + "mlp.experts.gate_up_proj", hp + "mlp.experts.down_proj"]
    shared_gate, shared_up = hp + "mlp.shared_expert.gate_proj.weight", hp + "mlp.shared_expert.up_proj.weight"
    if shared_gate in hf:
        out[mp + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([hf[shared_gate], hf[shared_up]], dim=0)
        read += [shared_gate, shared_up]
        for hf_name, mc_name in _SHARED_MAP.items():
            out[mp + mc_name] = hf[hp + hf_name]
            read.append(hp + hf_name)
    return read


def _moe_to_hf(mcore: Mapping[str, torch.Tensor], hp: str, mp: str, out: dict[str, torch.Tensor]) -> None:
    """Inverse of `_moe_to_mcore` for one layer (the experts stacked again)."""
    out[hp + "mlp.gate.weight"] = mcore[mp + "mlp.router.weight"]
    prefix = mp + "mlp.experts.local_experts."
    experts = sorted({int(n.removeprefix(prefix).split(".")[0]) for n in mcore if n.startswith(prefix)})
    out[hp + "mlp.experts.gate_up_proj"] = torch.stack(
        [mcore[f"{mp}mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in experts]
    )
    out[hp + "mlp.experts.down_proj"] = torch.stack(
        [mcore[f"{mp}mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in experts]
    )
    if mp + "mlp.shared_experts.linear_fc1.weight" in mcore:
        gate, up = mcore[mp + "mlp.shared_experts.linear_fc1.weight"].chunk(2, dim=0)
        out[hp + "mlp.shared_expert.gate_proj.weight"] = gate.contiguous()
        out[hp + "mlp.shared_expert.up_proj.weight"] = up.contiguous()
        for hf_name, mc_name in _SHARED_MAP.items():
            out[hp + hf_name] = mcore[mp + mc_name]


def shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of a full megatron-core parameter (a new tensor).

    Raises:
        ValueError: the split dimension does not divide by `tp_size` (e.g. query groups or vocabulary).
    """
    dim = tp_dim(name)
    if dim is None:
        return full.clone()
    if full.shape[dim] % tp_size:
        raise ValueError(f"{name} {list(full.shape)}: dim {dim} does not split into actor.tp={tp_size}")
    if name.endswith("linear_fc1.weight"):  # [gate; up] -> [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=dim)[tp_rank].clone()


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full megatron-core parameter from its TP shards in rank order (inverse of `shard`)."""
    dim = tp_dim(name)
    if dim is None:
        return shards[0].clone()
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(shards, dim=dim)


def stage_names(mcore_name: str, num_layers: int, pp_size: int) -> tuple[int, str]:
    """``(stage, local name)`` of a full-model megatron-core parameter under `pp_size` pipeline stages."""
    per_stage = num_layers // pp_size
    if mcore_name.startswith("decoder.layers."):
        index, rest = mcore_name.removeprefix("decoder.layers.").split(".", 1)
        stage = int(index) // per_stage
        return stage, f"decoder.layers.{int(index) - stage * per_stage}.{rest}"
    if mcore_name.startswith("embedding."):
        return 0, mcore_name
    return pp_size - 1, mcore_name


def _qkv_sizes(rows: int, config) -> tuple[int, int, int]:
    """(query-group count, query rows per group, head width) of a ``linear_qkv`` block of `rows` rows."""
    groups, heads = config.num_key_value_heads, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_group = heads // groups
    return rows // ((per_group + 2) * head_dim), per_group, head_dim


@torch.no_grad()
def generation_order(name: str, stored: torch.Tensor, blocks: int, config, inverse: bool = False) -> None:
    """Reorder, in place, a generation shard made of `blocks` consecutive TP shards of megatron parameter `name`
    (split dimension first) into the Hugging Face layout `generation_hf_weights` reads, or back with `inverse`.

    - ``linear_qkv`` (weight ``[g*(h/g+2)*d, H]`` or bias): per query group [q heads; k; v] -> [all q; all k; all v]
      (the shard's q/k/v projections, each contiguous).
    - ``linear_fc1`` ``[gate_1; up_1; ...; gate_s; up_s]`` (each TP shard's slice of both) -> ``[gate; up]``.
    - Other parameters are already in order.

    Uses one temporary of the shard's size. The reordering is a permutation of rows: exact, and `inverse` undoes it.
    """
    if ".linear_qkv." in name:
        groups, per_group, head_dim = _qkv_sizes(stored.shape[0], config)
        if inverse:
            q, k, v = stored.split([groups * per_group * head_dim, groups * head_dim, groups * head_dim])
            stored.copy_(_qkv_merge(q, k, v, groups))
        else:
            stored.copy_(torch.cat(list(_qkv_split(stored, groups, groups * per_group, head_dim))))
    elif name.endswith("linear_fc1.weight") and blocks > 1:
        rows, rest = stored.shape[0] // (2 * blocks), stored.shape[1:]
        order = (2, blocks) if inverse else (blocks, 2)
        stored.copy_(stored.reshape(*order, rows, *rest).transpose(0, 1).reshape(stored.shape))


def generation_hf_weights(gen: Mapping[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Hugging Face names for generation shards in `generation_order` (full-model megatron names -> views of the same
    storage: nothing is copied). q/k/v and gate/up are row ranges of the fused tensors; a tied output layer is left
    to the model (it ties ``lm_head`` to the embedding)."""
    layer_names = {mc: hf for hf, mc in {**_LAYER_MAP, **_QK_NORM_MAP, **_DENSE_DOWN}.items()}
    top_names = {mc: hf for hf, mc in _TOP_MAP.items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in gen.items():
        if name in top_names:
            out[top_names[name]] = tensor
            continue
        index, rest = name.removeprefix("decoder.layers.").split(".", 1)
        prefix = f"model.layers.{index}."
        if rest.startswith("self_attention.linear_qkv."):
            groups, per_group, head_dim = _qkv_sizes(tensor.shape[0], config)
            sizes = [groups * per_group * head_dim, groups * head_dim, groups * head_dim]
            kind = rest.rsplit(".", 1)[1]
            for proj, part in zip("qkv", tensor.split(sizes), strict=True):
                out[f"{prefix}self_attn.{proj}_proj.{kind}"] = part
        elif rest == "mlp.linear_fc1.weight":
            out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = tensor.chunk(2, dim=0)
        elif rest in _MOE_GENERATION:  # a stack of every expert, or the router
            out[prefix + _MOE_GENERATION[rest]] = tensor
        elif rest == "mlp.shared_experts.linear_fc1.weight":
            gate, up = tensor.chunk(2, dim=0)
            out[prefix + "mlp.shared_expert.gate_proj.weight"], out[prefix + "mlp.shared_expert.up_proj.weight"] = (
                gate,
                up,
            )
        elif rest.startswith("mlp.shared_experts."):
            out[prefix + {mc: hf for hf, mc in _SHARED_MAP.items()}[rest]] = tensor
        else:
            out[prefix + layer_names[rest]] = tensor
    return out


# generation names of an MoE layer (the experts stacked by the 3D-HybridEngine, `expert_stack`) -> Hugging Face's
_MOE_GENERATION = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.experts.linear_fc1.weight": "mlp.experts.gate_up_proj",
    "mlp.experts.linear_fc2.weight": "mlp.experts.down_proj",
}
