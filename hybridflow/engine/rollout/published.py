"""Weights published by the training pool for a rollout pool of its own (``placement.pools`` with the rollout apart
from the actor).

The actor's rank 0 writes the actor's full weights, cast to the engine's dtype, as one safetensors file (`publish`),
with the actor's log-probabilities on a fixed probe prompt beside them; every rank of the rollout pool memory-maps
that file and streams it into its engine (`published_tensors`), then checks the engine's greedy probe token against
the published log-probabilities (`hybridflow.engine.rollout.vllm.VLLMRollout.load_weights`). On one node the file
lives in shared memory (``/dev/shm``: no disk), across nodes in the run's shared data folder. A file is written under
a temporary name and renamed, so a reader never sees half of one. This is ``rollout.checkpoint_engine.backend:
file``; ``gloo`` sends the same weights and probe by a broadcast instead (`hybridflow.engine.rollout.broadcast`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PROBE_KEY = "hybridflow.probe_log_probs"
"""The tensor of a published file that is not a weight: the actor's log-probabilities float32 [V] of the token after
`probe_prompt`, for the engine's check."""

PROBE_TEXT = "The answer is"


def probe_prompt(tokenizer: Any, eos_token_ids: list[int]) -> list[int]:
    """The token ids of the weight-sync probe's prompt (`PROBE_TEXT`; the first eos id if it tokenizes to nothing)."""
    return tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"] or [eos_token_ids[0]]


@torch.no_grad()
def actor_probe_log_probs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """The actor's log-probabilities float32 [V] of the token after `prompt` (eval mode for the forward, then the
    model's mode as it was)."""
    was_training = model.training
    model.eval()
    try:
        logits = model(torch.tensor([prompt], device=next(model.parameters()).device)).logits[0, -1]
    finally:
        model.train(was_training)
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def weights_folder(run_data_dir: str | Path, local: bool) -> Path:
    """Where a run's published weights go: shared memory when every pool runs on this node (`local`: the local
    executor) and ``/dev/shm`` exists, else the run's data folder (shared by the nodes of a Slurm run). Named after
    the run's data folder, so two runs never share one; `publish` creates it private (0700), and the rollout's
    rank 0 removes it with the file it loaded."""
    if local and Path("/dev/shm").is_dir():
        digest = hashlib.sha256(str(Path(run_data_dir).resolve()).encode()).hexdigest()[:16]
        return Path("/dev/shm") / f"hybridflow-weights-{digest}"
    return Path(run_data_dir) / "weights"


def remove_published(path: str | Path) -> None:
    """Remove a published file once every rollout rank has loaded it, with every earlier version in its folder
    (loads run in version order: none of them is loaded again), and the folder once empty."""
    path = Path(path)
    loaded = _version(path)
    for file in path.parent.glob("actor-v*.safetensors"):
        if _version(file) <= loaded:
            file.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: a newer version waits for its load
        path.parent.rmdir()


def _version(path: Path) -> int:
    """The version in a published file's name, ``actor-v<version>.safetensors``."""
    return int(path.name.removeprefix("actor-v").removesuffix(".safetensors"))


def full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every entry of `model`'s state dict, whole (a DTensor's full tensor); a tied tensor under
    each of its names (an engine's reload restores a tied tensor it is not sent)."""
    from torch.distributed.tensor import DTensor

    for name, tensor in model.state_dict().items():
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def publish(model: torch.nn.Module, prompt: list[int], folder: Path, version: int, dtype: torch.dtype) -> dict:
    """Write `model`'s full state dict in `dtype` (every name, a tied tensor under each of its names: an engine's
    reload restores a tied tensor it is not sent) and its probe log-probs as ``<folder>/actor-v<version>.safetensors``,
    atomically. Earlier versions stay until the rollout loads this one or a later one (`remove_published`): in the
    overlapped modes a load queued behind generations may still be waiting for its file.

    Args:
        model: the actor's Hugging Face model holding full weights (an FSDP actor's gathered for the call).
        prompt: `probe_prompt`'s ids.
        version: the weights' version (the actor updates they contain).
        dtype: the engine's (``rollout.vllm_dtype``).

    Returns:
        ``{"path", "version", "bytes"}``: the file and the bytes of the weights in it.
    """
    tensors = {
        name: full.detach().to(device="cpu", dtype=dtype, copy=True).contiguous() for name, full in full_weights(model)
    }
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    tensors[PROBE_KEY] = actor_probe_log_probs(model, prompt)
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"actor-v{version}.safetensors"
    partial = folder / f".actor-v{version}.safetensors.partial"
    save_file(tensors, str(partial), metadata={"version": str(version)})
    os.replace(partial, path)
    return {"path": str(path), "version": version, "bytes": weight_bytes}


def published_tensors(path: str | Path) -> tuple[Iterator[tuple[str, torch.Tensor]], torch.Tensor]:
    """The weights of a published file, as (name, tensor) pairs read one at a time (memory-mapped), and its probe
    log-probs float32 [V].

    Raises:
        FileNotFoundError: no such file (the message names it and the stage that writes it).
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"published weights {path} not found: the actor pool writes them (publish_weights)")
    handle = safe_open(str(path), framework="pt")
    probe = handle.get_tensor(PROBE_KEY)
    names = [name for name in handle.keys() if name != PROBE_KEY]  # noqa: SIM118 (safe_open is not iterable)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, handle.get_tensor(name)

    return weights(), probe
