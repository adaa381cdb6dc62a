"""Checkpoints of a megatron-core role (actor or critic) in the run's checkpoint layout
(`hybridflow.engine.checkpoint`): ``<role>/`` holds the weights in Hugging Face layout, gathered from every shard
through `hybridflow.engine.backends.megatron_bridge` (``from_pretrained`` loads them, and any layout can start from
them),
and ``<role>/megatron_optim/pp<P>_tp<T>.pt`` the optimizer and LR-scheduler states of each model-parallel shard
(written by data-parallel replica 0: the replicas are identical); resuming needs the same ``actor.tp`` / ``actor.pp``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.engine.backends.megatron_bridge import expert_global_name, is_expert, mcore_to_hf, unshard
from hybridflow.engine.checkpoint import CheckpointError, model_layout, read_weights
from hybridflow.engine.moe import moe_spec
from hybridflow.engine.parallel_layout import HybridLayout

OPTIM_DIR = "megatron_optim"


def global_names(model, hf_config, pp_rank: int, p: int) -> dict[str, str]:
    """This stage's local parameter names -> full-model megatron names (layers renumbered from the stage's first,
    this EP rank's experts renumbered globally, `expert_global_name`). A tied output layer's last-stage copy is
    left out (the Hugging Face model ties it to the embedding)."""
    from megatron.core import parallel_state

    per_stage = hf_config.num_hidden_layers // p
    tied = getattr(hf_config, "tie_word_embeddings", False)
    spec = moe_spec(hf_config)
    ep_rank, ep = parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()
    out = {}
    for local, _ in model.named_parameters():
        if local == "output_layer.weight" and tied:
            continue
        name = local
        if local.startswith("decoder.layers."):
            index, rest = local.removeprefix("decoder.layers.").split(".", 1)
            name = f"decoder.layers.{int(index) + pp_rank * per_stage}.{rest}"
        if spec is not None:
            name = expert_global_name(name, ep_rank, ep, spec.num_experts)
        out[local] = name
    return out


def save_sharded_role(
    folder: Path,
    model,
    optimizer,
    scheduler,
    hf_config,
    layout: HybridLayout,
    auto_class,
    tokenizer=None,
    generation_config=None,
) -> None:
    """Write one megatron role into `folder` (``<staging>/actor`` or ``/critic``). Every rank of the group calls
    it: the shards are gathered to rank 0 (``torch.distributed.gather_object``), which writes the Hugging Face
    folder with `auto_class` (``AutoModelForCausalLM`` / ``AutoModelForTokenClassification``)."""
    from megatron.core import parallel_state

    rank = dist.get_rank()
    c = layout.coords(rank)
    names = global_names(model, hf_config, c.pp, layout.p)
    local = {}
    # dense weights from data-parallel replica 0, each EP rank's experts from its first replica (expert DP rank 0)
    first_experts = parallel_state.get_expert_data_parallel_rank() == 0
    expert_tp = parallel_state.get_expert_tensor_parallel_rank()
    for n, p in model.named_parameters():
        if n in names and (first_experts if is_expert(names[n]) else c.dp == 0):
            local[names[n]] = (expert_tp if is_expert(names[n]) else c.tp, p.detach().cpu())
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if rank == 0:
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for part in gathered:
            for name, (tp, tensor) in part.items():
                shards.setdefault(name, {})[tp] = tensor
        full = {name: unshard(name, [by_tp[i] for i in sorted(by_tp)]) for name, by_tp in shards.items()}
        with torch.device("meta"):
            hf_model = auto_class.from_config(hf_config)
        hf_model.load_state_dict(mcore_to_hf(full, hf_config), strict=False, assign=True)
        if getattr(hf_config, "tie_word_embeddings", False):
            hf_model.tie_weights()
        if generation_config is not None:
            hf_model.generation_config = generation_config
        hf_model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
    dist.barrier()  # the folder exists before the shards' optimizer files go in
    # one writer per optimizer-state file: the first rank holding each (stage, TP shard, EP rank)
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, _optim_file(c))
    if keys.index(_optim_file(c)) == rank:
        optim_dir = folder / OPTIM_DIR
        optim_dir.mkdir(parents=True, exist_ok=True)
        state = {"optimizer": optimizer.state_dict(), "lr_scheduler": scheduler.state_dict()}
        torch.save(state, optim_dir / _optim_file(c))
        if rank == 0:
            ep = parallel_state.get_expert_model_parallel_world_size()
            (optim_dir / "layout.json").write_text(json.dumps({"tp": layout.t, "pp": layout.p, "ep": ep}))


def _optim_file(c) -> str:
    """This shard's optimizer-state file: ``pp<P>_tp<T>.pt``, ``pp<P>_tp<T>_ep<E>.pt`` with expert parallelism."""
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    suffix = f"_ep{parallel_state.get_expert_model_parallel_rank()}" if ep > 1 else ""
    return f"pp{c.pp}_tp{c.tp}{suffix}.pt"


def load_sharded_role(folder: Path, model, optimizer, scheduler, hf_config, layout: HybridLayout) -> None:
    """Restore weights (from any layout's checkpoint) and this shard's optimizer and scheduler states.

    Raises:
        CheckpointError: no optimizer state for this shard: the checkpoint was saved with another ``actor.tp`` /
            ``actor.pp`` or another strategy (the message says which)."""
    from hybridflow.engine.backends.megatron_model import load_hf_weights

    layout_file = folder / OPTIM_DIR / "layout.json"
    if not layout_file.is_file():
        raise CheckpointError(
            f"{folder} holds no megatron optimizer states ({OPTIM_DIR}/): it was saved with another strategy; "
            "resume with that strategy"
        )
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    saved = json.loads(layout_file.read_text())
    ep = parallel_state.get_expert_model_parallel_world_size()
    if (saved["tp"], saved["pp"], saved.get("ep", 1)) != (layout.t, layout.p, ep):
        keys = f"actor.tp={saved['tp']} actor.pp={saved['pp']} actor.ep={saved.get('ep', 1)}"
        raise CheckpointError(
            f"{folder} was saved with {keys}; its optimizer states fit only that layout: set {keys} to resume"
        )
    weights = read_weights(folder)
    if moe_spec(hf_config) is not None:  # the files hold experts apart; the bridge reads them stacked
        with torch.device("meta"):
            weights = model_layout(AutoModelForCausalLM.from_config(hf_config), weights)
    load_hf_weights(model, weights, hf_config)
    c = layout.coords(dist.get_rank())
    state = torch.load(folder / OPTIM_DIR / _optim_file(c), weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["lr_scheduler"])
