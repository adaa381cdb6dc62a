"""Generation from the 3D-HybridEngine's resharded weights: a Hugging Face causal LM whose parameters are this rank's
generation shards (``HybridEngine.gen_weights``, used in place: no copy), made tensor-parallel over the generation
TP group the Megatron way (Shoeybi et al. 2019, section 3):

- q/k/v/gate/up are column-parallel: each rank computes its heads and its slice of the MLP (HF's attention infers
  the local head count from the weight shapes);
- o_proj and down_proj are row-parallel: their outputs are partial sums, all-reduced over the group;
- an MoE layer's router is replicated, its experts (stacked, ``gate_up_proj`` [E, 2F/t, H], ``down_proj``
  [E, H, F/t]) each a column- then row-parallel MLP: the experts' summed output is all-reduced;
- the embedding is vocabulary-parallel: each rank looks up the ids in its vocabulary range, the rest are zero,
  all-reduced; ``lm_head`` produces this rank's vocabulary slice of the logits, all-gathered.

Every rank of a generation TP group runs the same ``generate`` call on the same prompts (SPMD), so the collectives
line up and all ranks get the same tokens. Generation pipeline parallelism (p_g > 1) is not supported here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, PretrainedConfig


def _all_reduce_output(group: dist.ProcessGroup):
    def hook(module, inputs, output):
        dist.all_reduce(output, group=group)
        return output

    return hook


def _all_gather_last_dim(group: dist.ProcessGroup):
    def hook(module, inputs, output):
        parts = [torch.empty_like(output) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, output.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    return hook


class _VocabParallelEmbedding(torch.nn.Module):
    """The embedding rows ``[start, start + weight.shape[0])`` of the vocabulary; other ids give zeros, and the
    group's all-reduce fills them in. Input int64 [B, L] -> float [B, L, H]."""

    def __init__(self, weight: torch.nn.Parameter, start: int, group: dist.ProcessGroup):
        super().__init__()
        self.weight = weight
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(out, group=self.group)
        return out


def build_tp_generation_model(
    config: PretrainedConfig,
    gen_weights: Mapping[str, torch.Tensor],
    tp_group: dist.ProcessGroup | None,
    tp_rank: int = 0,
    dtype: torch.dtype = torch.float32,
    split_experts: bool = True,
) -> torch.nn.Module:
    """An eval-mode causal LM (``AutoModelForCausalLM`` of `config`) over this rank's generation shards.

    Args:
        config: the model's Hugging Face config (full sizes).
        gen_weights: parameter name -> generation shard (the full tensor for replicated ones), as
            `HybridEngine.gen_weights` gives them; the model's parameters are these tensors (shared storage).
        tp_group: the generation TP group (None or one rank: no tensor parallelism).
        tp_rank: this rank's index in `tp_group` (= ``Coords.gen_tp``): which vocabulary slice it holds.
        dtype: dtype of the model's buffers (rotary frequencies).
        split_experts: an MoE model's experts are TP-split like its MLPs (their output all-reduced); False: every
            rank holds them whole (``actor.etp: 1``) and computes their output itself.

    Returns:
        The model; drop it (and every reference to `gen_weights`) before `HybridEngine.to_training`.

    Raises:
        KeyError: a parameter of the model is missing from `gen_weights` (e.g. a generation stage without it).
    """
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    tied = getattr(config, "tie_word_embeddings", False)
    for name, _ in list(model.named_parameters()):
        if name == "lm_head.weight" and tied:
            continue
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[leaf] = torch.nn.Parameter(gen_weights[name], requires_grad=False)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    size = 1 if tp_group is None else dist.get_world_size(tp_group)
    if size > 1:
        reduce = _all_reduce_output(tp_group)
        for name, module in model.named_modules():
            # a mixture-of-experts layer: each rank's experts hold 1/t of every expert's width (a partial sum,
            # like a dense down_proj), and so does a shared expert's down_proj
            partial = ("self_attn.o_proj", "mlp.down_proj", "mlp.shared_expert.down_proj")
            if name.endswith(partial + (("mlp.experts",) if split_experts else ())):
                module.register_forward_hook(reduce)
        embed = model.model.embed_tokens
        rows = embed.weight.shape[0]
        model.model.embed_tokens = _VocabParallelEmbedding(embed.weight, tp_rank * rows, tp_group)
        model.lm_head.register_forward_hook(_all_gather_last_dim(tp_group))
    return model.eval()
