"""LoRA on the actor (``model.lora_rank`` > 0), through PEFT: the adapter, what it saves and syncs, and the reference
policy as the same model with the adapter switched off.

PEFT injects its LoRA layers into the Hugging Face model in place (``get_peft_model``), so the actor, the FSDP
wrapping, the packed forwards and the ``hf`` rollout keep working on the same ``model`` object: only the adapter's
parameters (``lora_A``/``lora_B``) require gradients, so the optimizer, gradient all-reduce and Adam states cover them
alone. `LoraAdapter` keeps the ``PeftModel`` around the model for what only PEFT knows: switching the adapter off
(`LoraAdapter.disabled`), the adapter's file layout (``adapter_config.json`` + ``adapter_model.safetensors``, loadable
with ``PeftModel.from_pretrained``) and the merged weights ``W + (alpha / r) B A`` (Hu et al. 2021, eq. 3).

`LoraReference` is the reference policy of a LoRA run: the actor's own model with the adapter disabled, which is the
base model exactly, so no second copy of the weights is loaded (verl does the same: ``ref_in_actor``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridflow.engine.models import compute_log_probs
from hybridflow.engine.protocol import DataProto

if TYPE_CHECKING:
    from hybridflow.engine.config import ModelConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value on this rank (an FSDP2 / tensor-parallel DTensor is all-gathered: a collective)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class LoraAdapter:
    """The actor's LoRA adapter (PEFT's ``default``), injected into `model` in place.

    Args:
        model: the Hugging Face causal LM, before any DDP/FSDP wrapping; its base weights are frozen here.
        config: the ``model`` section: ``lora_rank`` (r), ``lora_alpha``, ``target_modules`` (``all-linear``: every
            linear layer but the output head; or a list of module names), ``lora_dropout``, ``lora_adapter_path`` (a
            saved adapter folder to start from, trained further).
        seed: seeds ``lora_A``'s random initialisation (``lora_B`` starts at 0, so the adapter starts as the identity),
            so every rank of a group starts from the same adapter.

    Raises:
        FileNotFoundError: ``model.lora_adapter_path`` is not an adapter folder (names the missing file).
        ValueError: ``model.target_modules`` names no module of the model (PEFT's message, with the key).
    """

    def __init__(self, model: torch.nn.Module, config: ModelConfig, seed: int = 0):
        from peft import LoraConfig, PeftModel, get_peft_model

        self.model = model
        if config.lora_adapter_path:
            folder = Path(config.lora_adapter_path)
            missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (folder / f).is_file()]
            if missing:
                raise FileNotFoundError(
                    f"model.lora_adapter_path={folder} is not a LoRA adapter folder: {', '.join(missing)} missing "
                    "(a folder written by PeftModel.save_pretrained, or a LoRA run's checkpoint actor/)"
                )
            self.peft = PeftModel.from_pretrained(model, str(folder), is_trainable=True)
        else:
            lora = LoraConfig(
                r=config.lora_rank,
                lora_alpha=config.lora_alpha,
                lora_dropout=config.lora_dropout,
                target_modules=config.target_modules,
                bias="none",
                task_type="CAUSAL_LM",
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                try:
                    self.peft = get_peft_model(model, lora)
                except ValueError as e:
                    raise ValueError(f"model.target_modules={config.target_modules!r}: {e}") from None
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]

    # ------------------------------------------------------------------ sizes
    @property
    def rank(self) -> int:
        """The adapter's rank r (that of ``model.lora_adapter_path``'s config when it starts from one)."""
        return int(self.peft.peft_config["default"].r)

    def trainable_parameters(self) -> int:
        """Elements in the adapter (what the optimizer updates), whole-model count even when sharded."""
        params = dict(self.model.named_parameters())
        return sum(params[n].numel() for n in self.names)

    def state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors in the file's names (PEFT's: ``base_model.model.<module>.lora_A.weight``), whole,
        detached, on this rank's device. A collective under FSDP (every rank calls it)."""
        from peft import get_peft_model_state_dict

        params = dict(self.model.named_parameters())
        full = {_PEFT_PREFIX + n: _full(params[n].detach()) for n in self.names}
        return get_peft_model_state_dict(self.peft, state_dict=full)

    # ------------------------------------------------------------------ files
    def save(self, folder: str | Path, state: dict[str, torch.Tensor] | None = None) -> int:
        """Write the adapter as PEFT does (``adapter_config.json``, ``adapter_model.safetensors``) into `folder`.

        Args:
            state: `state` computed already (e.g. on every rank of an FSDP group); None computes it.

        Returns:
            bytes of the tensors written."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = self.state() if state is None else state
        config = self.peft.peft_config["default"].to_dict()
        config["target_modules"] = sorted(config["target_modules"]) if config.get("target_modules") else None
        (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        save_file({k: v.contiguous().cpu() for k, v in state.items()}, folder / ADAPTER_WEIGHTS)
        return sum(t.numel() * t.element_size() for t in state.values())

    def save_pretrained(self, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """`save` under the name a checkpoint calls on a role's model (`hybridflow.engine.checkpoint.save_role`):
        a LoRA actor's checkpoint holds its adapter, not the base weights. `state_dict`: `state`, gathered."""
        self.save(folder, state_dict)

    def load_role(self, folder: str | Path, optimizer, scheduler) -> None:
        """Restore a checkpoint's ``actor/`` in place: the adapter, then the optimizer (its states, the adapter's
        only) and the LR scheduler (`hybridflow.engine.checkpoint` calls it for a role whose model is an adapter).

        Raises:
            FileNotFoundError, ValueError: from `load`; the optimizer state does not fit (names the file)."""
        from hybridflow.engine.checkpoint import OPTIM_STATE
        from hybridflow.engine.sharded_state import is_sharded, load_full_state

        self.load(folder)
        optim = torch.load(Path(folder) / OPTIM_STATE, map_location="cpu", weights_only=True)
        try:
            if is_sharded(self.model):
                load_full_state(self.model, optimizer, {}, optim["optimizer"], strict=False)
            else:
                optimizer.load_state_dict(optim["optimizer"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise ValueError(f"optimizer state in {folder} does not fit the adapter's optimizer: {e}") from None
        scheduler.load_state_dict(optim["lr_scheduler"])

    def load(self, folder: str | Path) -> None:
        """Copy the adapter saved in `folder` into the model in place (the optimizer keeps its parameters).

        Raises:
            FileNotFoundError: no ``adapter_model.safetensors`` in `folder`.
            ValueError: the file's tensors are not this adapter's (missing or unexpected names)."""
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = Path(folder) / ADAPTER_WEIGHTS
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint's actor/ holds no LoRA adapter")
        saved = load_file(path, device="cpu")
        own = set(self._file_names())  # the names alone: no tensor gathered
        if set(saved) != own:
            raise ValueError(
                f"the adapter in {folder} does not fit model.lora_rank / model.target_modules: "
                f"{len(own - set(saved))} tensors missing, {len(set(saved) - own)} unexpected"
            )
        from hybridflow.engine.sharded_state import is_sharded, load_full_state

        if is_sharded(self.model):
            by_name = {n: saved[k] for n, k in zip(self.names, self._file_names(), strict=True)}
            load_full_state(self.model, None, by_name, None, strict=False)
        else:
            result = set_peft_model_state_dict(self.peft, saved)
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"unexpected adapter tensors in {folder}: {result.unexpected_keys[:5]}")

    def _file_names(self) -> list[str]:
        """The file names of `names`, in the same order (PEFT drops the adapter name ``.default``)."""
        return [(_PEFT_PREFIX + n).replace(".default.", ".") for n in self.names]

    # ------------------------------------------------------------------ the base model, merged weights
    @contextlib.contextmanager
    def disabled(self) -> Iterator[torch.nn.Module]:
        """A context in which the model computes without the adapter: the base model, exactly."""
        with self.peft.disable_adapter():
            yield self.model

    @torch.no_grad()
    def merged_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The base model's weights with the adapter merged in (``W + scaling * B @ A`` per adapted layer), in the
        base model's Hugging Face names, one tensor at a time, out of place (the trained weights are not touched).
        A collective under FSDP (every rank iterates it whole, in the same order)."""
        from peft.tuners.lora import LoraLayer

        layers = {name: m for name, m in self.model.named_modules() if isinstance(m, LoraLayer)}
        for name, tensor in self.model.state_dict().items():
            if ".lora_" in name:
                continue
            clean = name.replace(".base_layer.", ".")
            owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
            value = _full(tensor)
            if owner in layers and name.endswith("base_layer.weight"):
                layer = layers[owner]
                a = _full(layer.lora_A["default"].weight)
                b = _full(layer.lora_B["default"].weight)
                delta = (b.float() @ a.float()) * layer.scaling["default"]
                value = (value.float() + (delta.T if layer.fan_in_fan_out else delta)).to(value.dtype)
            yield clean, value


class LoraReference:
    """The reference policy of a LoRA run: the actor's model with its adapter disabled (= the base model), so no
    reference model is loaded.

    Args:
        actor: the LoRA actor (`hybridflow.engine.backends.actor.Actor` with ``lora``), in this process.
        micro_batch_size: sequences per forward (``ref.log_prob_micro_batch_size``).
    """

    def __init__(self, actor, micro_batch_size: int):
        self.actor = actor
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` float32 [B, T] of the base model (logits divided by the rollout temperature), as
        `hybridflow.engine.backends.actor.RefPolicy` computes it. A collective under FSDP."""
        temperature = data.meta_info.get("temperature", 1.0) or 1.0
        actor = self.actor
        actor.model.eval()
        with actor.lora.disabled() as model:
            log_probs, _ = compute_log_probs(
                model,
                data,
                self.micro_batch_size,
                temperature,
                compute_dtype=actor.compute_dtype,
                share_prompts=actor.config.shares_prompts,
            )
        return DataProto.from_dict({"ref_log_prob": log_probs})
