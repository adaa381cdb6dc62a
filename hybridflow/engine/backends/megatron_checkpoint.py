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

from hybridflow.engine.backends.megatron_bridge import mcore_to_hf, unshard
from hybridflow.engine.checkpoint import CheckpointError, read_weights
from hybridflow.engine.parallel_layout import HybridLayout

OPTIM_DIR = "megatron_optim"


def global_names(model, hf_config, pp_rank: int, p: int) -> dict[str, str]:
    """This stage's local parameter names -> full-model megatron names (layers renumbered from the stage's first).
    A tied output layer's last-stage copy is left out (the Hugging Face model ties it to the embedding)."""
    per_stage = hf_config.num_hidden_layers // p
    tied = getattr(hf_config, "tie_word_embeddings", False)
    out = {}
    for local, _ in model.named_parameters():
        if local == "output_layer.weight" and tied:
            continue
        name = local
        if local.startswith("decoder.layers."):
            index, rest = local.removeprefix("decoder.layers.").split(".", 1)
            name = f"decoder.layers.{int(index) + pp_rank * per_stage}.{rest}"
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
    rank = dist.get_rank()
    c = layout.coords(rank)
    names = global_names(model, hf_config, c.pp, layout.p)
    local = {}
    if c.dp == 0:
        local = {names[n]: (c.tp, p.detach().cpu()) for n, p in model.named_parameters() if n in names}
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
    if c.dp == 0:
        optim_dir = folder / OPTIM_DIR
        optim_dir.mkdir(parents=True, exist_ok=True)
        state = {"optimizer": optimizer.state_dict(), "lr_scheduler": scheduler.state_dict()}
        torch.save(state, optim_dir / f"pp{c.pp}_tp{c.tp}.pt")
        if rank == 0:
            (optim_dir / "layout.json").write_text(json.dumps({"tp": layout.t, "pp": layout.p}))


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
    saved = json.loads(layout_file.read_text())
    if (saved["tp"], saved["pp"]) != (layout.t, layout.p):
        raise CheckpointError(
            f"{folder} was saved with actor.tp={saved['tp']}, actor.pp={saved['pp']}; its optimizer states fit only "
            f"that layout: set actor.tp={saved['tp']} actor.pp={saved['pp']} to resume"
        )
    load_hf_weights(model, read_weights(folder), hf_config)
    c = layout.coords(dist.get_rank())
    state = torch.load(folder / OPTIM_DIR / f"pp{c.pp}_tp{c.tp}.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["lr_scheduler"])
