"""``actor.strategy: megatron``: the actor trained on megatron-core (tensor, pipeline and data parallel) and the
rollout generating from the same weights through the 3D-HybridEngine, in one worker group's processes.

`HybridActorRollout` owns, on one rank: megatron's parallel state, this rank's ``GPTModel`` shard and its
`MegatronActor`, and a `HybridEngine` over the shard. Each ``generate_sequences`` moves the weights to the
generation layout (``rollout.gen_tp``, ``rollout.reshard``), builds a tensor-parallel Hugging Face model over the
generation shards (`hybridflow.engine.tp_generation`, no copy), samples with the ``hf`` rollout, and moves the
weights back; between calls the rank holds only its training shard.

Transfer protocol (`dispatch_coords`): the actor's stages split a batch over megatron's data-parallel replicas (the
ranks of one model-parallel group get the same rows) and collect from the last pipeline stage's first TP rank;
generation splits over the generation replicas (the generation TP groups) and collects from each one's first rank.

Checkpoints (`save` / `load`): ``actor/`` holds the weights in Hugging Face layout (gathered through
`hybridflow.engine.megatron_bridge`, so any layout can resume from them, and ``from_pretrained`` loads them) and
``actor/megatron_optim/pp<P>_tp<T>.pt`` the optimizer and LR-scheduler states of each model-parallel shard (written
by data-parallel replica 0: the replicas are identical); resuming needs the same ``actor.tp`` and ``actor.pp``.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.engine.checkpoint import CheckpointError, read_weights
from hybridflow.engine.config import HybridFlowConfig
from hybridflow.engine.hybrid_engine import HybridEngine, megatron_shard_specs
from hybridflow.engine.megatron_bridge import generation_hf_weights, generation_order, mcore_to_hf, unshard
from hybridflow.engine.models import load_model
from hybridflow.engine.protocol import DataProto
from hybridflow.engine.rollout import HFRollout

OPTIM_DIR = "megatron_optim"


class HybridActorRollout:
    """The megatron actor and its 3D-HybridEngine rollout on this rank (see the module docstring).

    Must be built on every rank of the group at once (it creates process groups). On CPU it installs
    `hybridflow.engine.megatron_cpu` first.

    Args:
        cfg: the run config (``actor.strategy: megatron``).
        model_path: the resolved Hugging Face model folder (weights are loaded from it and converted).
        tokenizer: its tokenizer.
        device: where the model lives.

    Raises:
        ValueError: the model does not split as configured (heads, query groups or vocabulary not divisible by
            ``actor.tp``, layers by ``actor.pp``); the message names the key.
        RuntimeError: megatron's rank order differs from `HybridLayout`'s (the engine would gather wrong shards).
    """

    def __init__(self, cfg: HybridFlowConfig, model_path: str | Path, tokenizer, device: torch.device):
        if device.type == "cpu":
            from hybridflow.engine.megatron_cpu import install

            install()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from hybridflow.engine.megatron_actor import MegatronActor
        from hybridflow.engine.megatron_model import build_gpt_model, load_hf_weights

        self.cfg = cfg
        self.layout = layout = cfg.actor_layout()
        self.rank = dist.get_rank()
        self.coords = layout.coords(self.rank)
        parallel_state.initialize_model_parallel(layout.t, layout.p)
        model_parallel_cuda_manual_seed(cfg.trainer.seed)
        mine = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
        if mine != (self.coords.pp, self.coords.tp):
            raise RuntimeError(
                f"rank {self.rank}: megatron placed it at (pp, tp) = {mine}, the hybrid layout at "
                f"{(self.coords.pp, self.coords.tp)}; the 3D-HybridEngine needs megatron's default rank order"
            )
        hf_model = load_model(model_path, torch.float32, device, trainable=False)
        self.hf_config = hf_model.config
        self.generation_config = hf_model.generation_config
        specs = megatron_shard_specs(self.hf_config, layout.p)
        for key, value in (
            ("query groups (num_key_value_heads)", self.hf_config.num_key_value_heads),
            ("attention heads", self.hf_config.num_attention_heads),
            ("vocabulary", self.hf_config.vocab_size),
        ):
            if value % layout.t:
                raise ValueError(f"the model's {key} ({value}) do not split into actor.tp={layout.t} parts")
        self.model = build_gpt_model(self.hf_config).to(device)
        load_hf_weights(self.model, {n: p.detach() for n, p in hf_model.named_parameters()}, self.hf_config)
        del hf_model
        self.actor = MegatronActor(self.model, cfg.actor, cfg.rollout.n, cfg.trainer.seed)
        self._names = self._global_names(specs)
        params = {self._names[local]: p for local, p in self.model.named_parameters() if local in self._names}
        regroup = functools.partial(generation_order, config=self.hf_config)
        self.engine = HybridEngine(params, specs, layout, cfg.rollout.reshard, regroup=regroup)
        self.tokenizer = tokenizer
        self.last_transition: dict[str, float] = {}

    def _global_names(self, specs) -> dict[str, str]:
        """This stage's local parameter names -> full-model megatron names (those with a spec)."""
        per_stage = self.hf_config.num_hidden_layers // self.layout.p
        out = {}
        for local, _ in self.model.named_parameters():
            name = local
            if local.startswith("decoder.layers."):
                index, rest = local.removeprefix("decoder.layers.").split(".", 1)
                name = f"decoder.layers.{int(index) + self.coords.pp * per_stage}.{rest}"
            if name in specs:
                out[local] = name
        return out

    # ------------------------------------------------------------------ transfer protocol
    def dispatch_coords(self, method: str) -> tuple[int, int, bool] | None:
        """``(data-parallel index, data-parallel size, collect)`` of this rank for `method`, or None when the
        method is not the actor's or the rollout's (it then runs plain data-parallel over every rank)."""
        c, layout = self.coords, self.layout
        if method == "generate_sequences":
            groups = layout.gen_tp_groups()
            replica = next(i for i, g in enumerate(groups) if self.rank in g)
            return replica, len(groups), c.gen_tp == 0
        if method in ("compute_log_prob", "update_actor"):
            return c.dp, layout.d, c.pp == layout.p - 1 and c.tp == 0
        return None

    # ------------------------------------------------------------------ stages
    def generate_sequences(self, prompts: DataProto, **kwargs: Any) -> DataProto:
        """Reshard to the generation layout, sample (`HFRollout.generate_sequences` and its arguments), reshard
        back. ``last_transition`` gets ``hybrid_engine/to_generation_s``, ``/to_training_s``, ``/received_mib``
        and ``/gen_param_mib`` (this rank's)."""
        from hybridflow.engine.tp_generation import build_tp_generation_model

        stats = self.engine.to_generation()
        try:
            weights = generation_hf_weights(self.engine.gen_weights, self.hf_config)
            model = build_tp_generation_model(self.hf_config, weights, self.engine.gen_tp_group, self.coords.gen_tp)
            model.generation_config = self.generation_config
            del weights
            out = HFRollout(model, self.tokenizer, self.cfg.rollout, seed=self.cfg.trainer.seed).generate_sequences(
                prompts, **kwargs
            )
            del model
        finally:
            back = self.engine.to_training()
        mib = 2.0**20
        self.last_transition = {
            "hybrid_engine/to_generation_s": stats.seconds,
            "hybrid_engine/to_training_s": back,
            "hybrid_engine/received_mib": stats.received_bytes / mib,
            "hybrid_engine/gen_param_mib": stats.gen_param_bytes / mib,
        }
        return out

    def compute_log_prob(self, data: DataProto, calculate_entropy: bool = False) -> DataProto | None:
        """``old_log_probs`` [B, T] float32 on the last pipeline stage (None elsewhere: not collected). No
        ``entropys``: the vocabulary-parallel entropy is not computed (`calculate_entropy` is ignored), so runs on
        this strategy record no ``actor/entropy``."""
        return self.actor.compute_log_prob(data)

    @property
    def optimizer(self):
        return self.actor.optimizer

    @property
    def lr_scheduler(self):
        return self.actor.lr_scheduler

    def update_policy(self, data: DataProto) -> dict[str, float]:
        """The PPO update (`MegatronActor.update_policy`) plus the last transition's figures."""
        start = time.perf_counter()
        metrics = self.actor.update_policy(data)
        metrics["perf/update_actor_s"] = time.perf_counter() - start
        return {**metrics, **self.last_transition}

    def parameter_count(self) -> int:
        """Parameters of the whole model (every stage and TP shard counted once), from the HF config's shapes."""
        specs = megatron_shard_specs(self.hf_config, 1)
        return sum(torch.Size(s.shape).numel() for s in specs.values())

    # ------------------------------------------------------------------ checkpoints
    def save(self, staging: str | Path) -> None:
        """Write ``actor/`` into a checkpoint's staging folder (see the module docstring). Every rank must call it
        (the weights are gathered to rank 0)."""
        folder = Path(staging) / "actor"
        c = self.coords
        local = {}
        if c.dp == 0:
            named = self.model.named_parameters()
            local = {self._names[n]: (c.tp, p.detach().cpu()) for n, p in named if n in self._names}
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(local, gathered, dst=0)
        if self.rank == 0:
            self._save_hf(folder, gathered)
        dist.barrier()  # actor/ exists before the shards' optimizer files go in
        if c.dp == 0:
            optim_dir = folder / OPTIM_DIR
            optim_dir.mkdir(parents=True, exist_ok=True)
            actor = self.actor
            state = {"optimizer": actor.optimizer.state_dict(), "lr_scheduler": actor.lr_scheduler.state_dict()}
            torch.save(state, optim_dir / f"pp{c.pp}_tp{c.tp}.pt")
            if self.rank == 0:
                (optim_dir / "layout.json").write_text(json.dumps({"tp": self.layout.t, "pp": self.layout.p}))

    def _save_hf(self, folder: Path, gathered: list[dict[str, tuple[int, torch.Tensor]]]) -> None:
        from transformers import AutoModelForCausalLM

        shards: dict[str, dict[int, torch.Tensor]] = {}
        for part in gathered:
            for name, (tp, tensor) in part.items():
                shards.setdefault(name, {})[tp] = tensor
        full = {name: unshard(name, [by_tp[i] for i in sorted(by_tp)]) for name, by_tp in shards.items()}
        hf_state = mcore_to_hf(full, self.hf_config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.hf_config)
        model.load_state_dict(hf_state, strict=False, assign=True)
        if getattr(self.hf_config, "tie_word_embeddings", False):
            model.tie_weights()
        model.generation_config = self.generation_config
        model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)

    def load(self, path: str | Path) -> None:
        """Restore weights (any layout's checkpoint) and this shard's optimizer and scheduler states.

        Raises:
            CheckpointError: no optimizer state for this shard: the checkpoint was saved with another
                ``actor.tp`` / ``actor.pp`` or another ``actor.strategy`` (the message says which)."""
        from hybridflow.engine.megatron_model import load_hf_weights

        folder = Path(path) / "actor"
        layout_file = folder / OPTIM_DIR / "layout.json"
        if not layout_file.is_file():
            raise CheckpointError(
                f"{folder} holds no megatron optimizer states ({OPTIM_DIR}/): it was saved with another "
                "actor.strategy; resume with that strategy"
            )
        saved = json.loads(layout_file.read_text())
        if (saved["tp"], saved["pp"]) != (self.layout.t, self.layout.p):
            raise CheckpointError(
                f"{path} was saved with actor.tp={saved['tp']}, actor.pp={saved['pp']}; its optimizer states fit "
                f"only that layout: set actor.tp={saved['tp']} actor.pp={saved['pp']} to resume"
            )
        load_hf_weights(self.model, read_weights(folder), self.hf_config)
        state = torch.load(folder / OPTIM_DIR / f"pp{self.coords.pp}_tp{self.coords.tp}.pt", weights_only=True)
        self.actor.optimizer.load_state_dict(state["optimizer"])
        self.actor.lr_scheduler.load_state_dict(state["lr_scheduler"])
