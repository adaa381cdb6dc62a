"""Checkpoints of a training run: save atomically, find the latest complete one, verify it, load it for exact resume.

Layout of one checkpoint, ``<checkpoint_dir>/global_step_<N>/`` (N = completed iterations)::

    actor/                  the policy in Hugging Face layout (``save_pretrained``: config.json, *.safetensors)
                            plus its tokenizer, so ``AutoModelForCausalLM.from_pretrained(actor/)`` loads it
    actor/optim.pt          {"optimizer": state_dict, "lr_scheduler": state_dict} (no weights: those are in actor/)
                            (a LoRA actor, ``model.lora_rank`` > 0: its adapter only, as PEFT writes it,
                            adapter_config.json + adapter_model.safetensors, for ``PeftModel.from_pretrained``; its
                            optimizer state covers the adapter alone)
    critic/                 the same for the value model when there is one (AutoModelForTokenClassification layout)
    cost_critic/            the same for Safe-RLHF's cost critic
    trainer_state.json      {"global_steps", "sampler", "kl_ctrl_value", "lagrange_multiplier", "format_version"}
                            and whatever else the trainer passes (JSON)
    rng.pt                  torch CPU (and CUDA) RNG states, numpy's global state, python ``random``'s state
    manifest.json           written last: relative path -> {"bytes", "sha256"} for every other file, plus totals

Atomicity: everything is written into a hidden sibling folder ``.tmp-global_step_<N>-<random>``, every file is
fsync'd, ``manifest.json`` is written and fsync'd last, and only then is the folder renamed (``os.replace``) to
``global_step_<N>``. A crash therefore leaves either a hidden temporary folder (ignored, and removed by the next
save of the same step) or a complete checkpoint; a ``global_step_<N>`` folder without ``manifest.json`` (e.g. one
whose manifest was deleted by hand) is never treated as a checkpoint.

Every ``.pt`` file is read with ``torch.load(..., weights_only=True)``: loading a checkpoint never unpickles
arbitrary objects.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from hybridflow.engine.disk_space import (
    block_size,
    disk_bytes,
    format_bytes,
    on_disk,
    out_of_space,
    safetensors_bytes,
    small_file_bytes,
    torch_save_bytes,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng.pt"
OPTIM_STATE = "optim.pt"
AHEAD_DIR = "rollout_ahead"  # trainer.mode one_step_off | async: <iteration>.safetensors, each batch generated ahead
STREAM_FILE = "stream-{rank}.json"  # in AHEAD_DIR, rollout.streaming: each rollout rank's stream and its admission
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_STEP_DIR = re.compile(r"global_step_(\d+)")
_TMP_PREFIX = ".tmp-"
_CHUNK = 8 * 1024 * 1024


class CheckpointError(RuntimeError):
    """A checkpoint folder is incomplete, corrupt, or does not fit the models it is loaded into.

    The message names the folder and the missing or mismatching part.
    """


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk.

    Attributes:
        path: the ``global_step_<N>`` folder.
        step: N, the number of completed iterations it holds.
        bytes: total size of its files in bytes, ``manifest.json`` included.
        sha256: hex SHA-256 of ``manifest.json``; the manifest lists every other file's hash, so this one value
            identifies the whole checkpoint.
    """

    path: Path
    step: int
    bytes: int
    sha256: str


# ---------------------------------------------------------------------------------------------------- files
def _sha256_and_sync(path: Path) -> tuple[int, str]:
    """(size in bytes, hex sha256) of a file, read in chunks; the file is fsync'd on the way."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return size, digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable. A no-op where folders cannot be opened (Windows)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _payload_files(folder: Path) -> list[Path]:
    """Every regular file under `folder` except the manifest, sorted by relative path."""
    files = [p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


# ---------------------------------------------------------------------------------------------------- RNG
def _rng_state() -> dict[str, Any]:
    """Every global RNG state, as tensors and plain Python values (loadable with ``weights_only=True``)."""
    bit_generator, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "bit_generator": str(bit_generator),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {
            "version": int(version),
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    cuda_states = list(state.get("cuda") or [])
    if cuda_states:
        if not torch.cuda.is_available():
            logger.warning("checkpoint holds CUDA RNG states but torch sees no CUDA device; they are not restored")
        else:
            count = torch.cuda.device_count()
            if count != len(cuda_states):
                logger.warning(
                    "checkpoint holds RNG states of %d CUDA devices, this process sees %d; restoring the first %d",
                    len(cuda_states),
                    count,
                    min(count, len(cuda_states)),
                )
            for device, rng in enumerate(cuda_states[:count]):
                torch.cuda.set_rng_state(rng, device)
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["bit_generator"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    py_state = state["python"]
    random.setstate((py_state["version"], tuple(int(x) for x in py_state["state"].tolist()), py_state["gauss_next"]))


# ---------------------------------------------------------------------------------------------------- listing
def list_checkpoints(checkpoint_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in `checkpoint_dir`: ``(N, folder)`` for each ``global_step_<N>`` folder that has a
    ``manifest.json``, ascending by N. Temporary folders and folders without a manifest are skipped; a missing
    `checkpoint_dir` gives an empty list."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and (entry / MANIFEST).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in `checkpoint_dir`, or None if there is none.

    Only ``global_step_<N>`` folders with a ``manifest.json`` count (see `list_checkpoints`); this does not re-hash
    the files (use `verify_checkpoint` for that).
    """
    found = list_checkpoints(checkpoint_dir)
    return found[-1][1] if found else None


# ---------------------------------------------------------------------------------------------------- save
def _tensor_bytes(tree: Any) -> int:
    """Bytes of every tensor in a nested dict / list / tuple (a state dict, an optimizer state)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _no_space(staging: Path, part: str, contents: str, need: int, free: int) -> CheckpointError:
    """The error of a checkpoint that does not fit its disk: which part of which checkpoint, how much it needs and
    how much is free (in the unit that fits, `format_bytes`), and the fix.

    Args:
        staging: the checkpoint's staging folder (``<checkpoint_dir>/.tmp-global_step_<N>-<random>``).
        part: what did not fit, e.g. ``"actor/ of checkpoint"``; the checkpoint's final folder follows it.
        contents: what the part holds, in words.
        need, free: bytes the part takes on disk; bytes free on the file system before it was written."""
    root = staging.parent
    checkpoint = root / staging.name.removeprefix(_TMP_PREFIX).rsplit("-", 1)[0]
    return CheckpointError(
        f"the disk is full: {part} {checkpoint} needs about {format_bytes(need)} ({contents}) and "
        f"{format_bytes(free)} is free on {root}; free space there or set trainer.checkpoint_dir to a larger file "
        "system, then hf resume (the earlier checkpoints are intact)"
    )


def _save_model_dir(folder: Path, model, optimizer, scheduler, tokenizer=None, full_state=None) -> None:
    """Write one role's folder: its tokenizer (if given) first, then, once what is left is known to fit the free
    space, the weights and ``optim.pt`` (each writer checks its own part).

    What the role takes on disk, in bytes (each file rounded up to the file system's blocks): the tokenizer's files
    as written (measured: they are small, and their size depends on the tokenizer's kind); the weights file as
    ``save_pretrained`` writes it (`safetensors_bytes`: header and tensors, tied weights once); ``optim.pt``
    (`torch_save_bytes`: the optimizer and scheduler states' pickle and storages, no tensor serialized twice);
    ``config.json`` and ``generation_config.json``. Not counted: the index of a weights file split into shards
    (``save_pretrained`` splits past 50 GB; the index is about 100 B per tensor).

    Raises:
        CheckpointError: the disk cannot hold it, before the weights are written, or when a write fails on a full
            disk (ENOSPC; torch's own message is "unexpected pos ..."). The caller removes the staging folder."""
    weights, optimizer_state = full_state if full_state is not None else (None, optimizer.state_dict())
    if weights is None and not isinstance(model, torch.nn.Module) and callable(getattr(model, "state", None)):
        weights = model.state()  # a LoRA adapter (`hybridflow.engine.backends.lora.LoraAdapter`): its tensors
    scheduler_state = scheduler.state_dict()
    optim_file = {"optimizer": optimizer_state, "lr_scheduler": scheduler_state}
    block = block_size(folder.parent)
    estimate = weights if weights is not None else (model.state_dict() if isinstance(model, torch.nn.Module) else {})
    rest = block + sum(  # the folder itself, then its files
        on_disk(size, block)
        for size in (
            safetensors_bytes(estimate),
            torch_save_bytes(optim_file),
            *small_file_bytes(model),
        )
    )
    free = shutil.disk_usage(folder.parent).free
    contents = "weights, optimizer state" + (" and tokenizer" if tokenizer is not None else "")
    folder.mkdir()
    need = rest
    try:
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
            need = rest + disk_bytes(folder)
        if rest > shutil.disk_usage(folder.parent).free:  # what is left to write does not fit
            raise _no_space(folder.parent, f"{folder.name}/ of checkpoint", contents, need, free)
        model.save_pretrained(folder, state_dict=weights)
        torch.save(optim_file, folder / OPTIM_STATE)
    except CheckpointError:
        raise
    except Exception as error:
        if out_of_space(error, folder.parent):
            raise _no_space(folder.parent, f"{folder.name}/ of checkpoint", contents, need, free) from error
        raise


def save_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    *,
    actor_model,
    actor_optimizer: torch.optim.Optimizer,
    actor_scheduler: torch.optim.lr_scheduler.LRScheduler,
    tokenizer,
    trainer_state: dict[str, Any],
    critic_model=None,
    critic_optimizer: torch.optim.Optimizer | None = None,
    critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    cost_critic=None,
    keep_last: int | None = None,
) -> CheckpointInfo:
    """Write ``<checkpoint_dir>/global_step_<step>/`` atomically (layout and protocol in the module docstring).

    Args:
        checkpoint_dir: parent folder (created if missing).
        step: completed iterations, >= 0; names the folder.
        actor_model, actor_optimizer, actor_scheduler: the policy (a Hugging Face ``PreTrainedModel``) and its
            optimizer and LR scheduler.
        tokenizer: saved next to the policy weights.
        trainer_state: JSON-serialisable dict (``global_steps``, ``sampler``, ``kl_ctrl_value``, ...);
            ``format_version`` is set here.
        critic_model, critic_optimizer, critic_scheduler: the value model and its optimizer and scheduler, all or
            none.
        cost_critic: Safe-RLHF's cost critic (with ``model``, ``optimizer``, ``lr_scheduler``), saved as
            ``cost_critic/``; None: none.
        keep_last: after a successful save, delete all but the `keep_last` highest-step complete checkpoints in
            `checkpoint_dir` (the one just written is always kept); None keeps everything.

    Returns:
        The `CheckpointInfo` of the new checkpoint (its size in bytes and the manifest's sha256).

    Raises:
        ValueError: `step` < 0, `keep_last` < 1, or a critic given without its optimizer and scheduler.
        FileExistsError: ``global_step_<step>`` already exists (checkpoints are never overwritten).
        TypeError: `trainer_state` is not JSON-serialisable. On this and any other error the temporary folder is
            removed and nothing named ``global_step_<step>`` appears.
    """
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be None or >= 1, got {keep_last}")
    if critic_model is not None and (critic_optimizer is None or critic_scheduler is None):
        raise ValueError("save_checkpoint: critic_model needs critic_optimizer and critic_scheduler too")
    staging = begin_checkpoint(checkpoint_dir, step)
    try:
        save_role(staging, "actor", actor_model, actor_optimizer, actor_scheduler, tokenizer)
        if critic_model is not None:
            save_role(staging, "critic", critic_model, critic_optimizer, critic_scheduler)
        if cost_critic is not None:
            save_role(staging, "cost_critic", cost_critic.model, cost_critic.optimizer, cost_critic.lr_scheduler)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return finish_checkpoint(staging, trainer_state, keep_last=keep_last)


def begin_checkpoint(checkpoint_dir: str | Path, step: int) -> Path:
    """Create the hidden staging folder of checkpoint `step`; roles are written into it with `save_role`
    (by any process that sees the folder), then `finish_checkpoint` makes it a checkpoint.

    Raises:
        FileExistsError: ``global_step_<step>`` already exists (checkpoints are never overwritten).
    """
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"global_step_{step}"
    if final.exists():
        raise FileExistsError(f"checkpoint folder {final} already exists; checkpoints are not overwritten")
    for stale in root.glob(f"{_TMP_PREFIX}global_step_{step}-*"):  # left by a save of this step that crashed
        logger.warning("removing %s, left by an interrupted save", stale)
        shutil.rmtree(stale, ignore_errors=True)
    staging = root / f"{_TMP_PREFIX}global_step_{step}-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    return staging


TRAINED_ROLES = ("actor", "critic", "cost_critic", "reward_model")
"""The roles a checkpoint holds: an RL run's actor (and critic, and Safe-RLHF's cost critic), or a reward-model
training run's reward model."""


def save_role(staging: str | Path, role: str, model, optimizer, scheduler, tokenizer=None, full_state=None) -> None:
    """Write one trained role (`TRAINED_ROLES`: weights in HF layout, optimizer and scheduler states) into a staging
    folder made by `begin_checkpoint`.

    `full_state`: ``(weights, optimizer state)`` gathered from an FSDP-sharded model
    (`hybridflow.engine.backends.fsdp.full_model_state`, `full_optimizer_state`), written instead of the model's own."""
    if role not in TRAINED_ROLES:
        raise ValueError(f"checkpointed roles are {', '.join(TRAINED_ROLES)}, not {role!r}")
    _save_model_dir(Path(staging) / role, model, optimizer, scheduler, tokenizer, full_state)


def _manifest_bytes(step: int, files: dict[str, dict[str, Any]]) -> bytes:
    """``manifest.json``'s bytes for the files of checkpoint `step` (relative path -> {"bytes", "sha256"})."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "total_files": len(files),
        "total_bytes": sum(f["bytes"] for f in files.values()),
        "files": files,
    }
    return (json.dumps(manifest, indent=2) + "\n").encode()


def finish_checkpoint(
    staging: str | Path, trainer_state: dict[str, Any], keep_last: int | None = None
) -> CheckpointInfo:
    """Add ``trainer_state.json`` and this process's RNG states, hash and fsync every file, write the manifest
    last, and rename the staging folder to ``global_step_<N>``. On failure the staging folder is removed.

    These last writes are a few KB (no check of the free space first, which could not be exact at that scale): one
    that fails on a full disk (ENOSPC or EDQUOT, also at an fsync) gives the same `CheckpointError` as a role that
    does not fit, with what they take on disk in bytes (the three files, each rounded up to the file system's
    blocks; the manifest's size is exact before the files are hashed) and what was free before them.

    Raises:
        TypeError: `trainer_state` is not JSON-serialisable.
        ValueError: the staging folder holds no actor and no reward model (nothing to resume from).
        CheckpointError: the disk is full (names the checkpoint, the sizes, the free space and the fix).
    """
    tmp = Path(staging)
    root = tmp.parent
    step = int(tmp.name.removeprefix(_TMP_PREFIX).split("-")[0].removeprefix("global_step_"))
    final = root / f"global_step_{step}"
    need = free = 0
    try:
        if not ((tmp / "actor").is_dir() or (tmp / "reward_model").is_dir()):
            raise ValueError(
                f"checkpoint staging folder {tmp} has no actor/ or reward_model/; save_role('actor', ...) first"
            )
        state_bytes = json.dumps({**trainer_state, "format_version": FORMAT_VERSION}, indent=2).encode()
        rng = io.BytesIO()
        torch.save(_rng_state(), rng)
        rng_bytes = rng.getvalue()

        sizes = {path.relative_to(tmp).as_posix(): path.stat().st_size for path in _payload_files(tmp)}
        sizes.update({TRAINER_STATE: len(state_bytes), RNG_STATE: len(rng_bytes)})
        manifest_size = len(_manifest_bytes(step, {k: {"bytes": v, "sha256": "0" * 64} for k, v in sizes.items()}))
        block = block_size(root)
        need = sum(on_disk(size, block) for size in (len(state_bytes), len(rng_bytes), manifest_size))
        free = shutil.disk_usage(root).free

        (tmp / TRAINER_STATE).write_bytes(state_bytes)  # fsync'd while hashed
        (tmp / RNG_STATE).write_bytes(rng_bytes)
        files = {}
        for path in _payload_files(tmp):
            size, digest = _sha256_and_sync(path)
            files[path.relative_to(tmp).as_posix()] = {"bytes": size, "sha256": digest}
        manifest_bytes = _manifest_bytes(step, files)
        _write_synced(tmp / MANIFEST, manifest_bytes)
        for sub in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            _fsync_dir(sub)
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException as error:
        full = need > 0 and out_of_space(error, root)  # need > 0: the writes began; asked before the files go
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            contents = f"{TRAINER_STATE}, {RNG_STATE} and {MANIFEST}"
            raise _no_space(tmp, "finishing checkpoint", contents, need, free) from error
        raise

    info = CheckpointInfo(
        path=final,
        step=step,
        bytes=sum(f["bytes"] for f in files.values()) + len(manifest_bytes),
        sha256=hashlib.sha256(manifest_bytes).hexdigest(),
    )
    if keep_last is not None:
        _prune(root, keep=keep_last, protect=final)
    return info


def _prune(root: Path, keep: int, protect: Path) -> None:
    """Delete all but the `keep` highest-step complete checkpoints (never `protect`). The manifest goes first, so
    a deletion cut short leaves a folder that no longer looks complete."""
    older = [path for _, path in list_checkpoints(root) if path != protect]
    for path in older[: max(0, len(older) - (keep - 1))]:
        logger.info("keep_last=%d: deleting checkpoint %s", keep, path)
        (path / MANIFEST).unlink()
        _fsync_dir(path)
        shutil.rmtree(path)


# ---------------------------------------------------------------------------------------------------- verify
def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint folder `path`, after checking that every listed file exists with its size."""
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        hint = ""
        if list_checkpoints(path):
            hint = f"; {path} looks like a checkpoint_dir: pass one of its global_step_<N> folders"
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {MANIFEST} is missing (the save did not finish, or this is not a "
            f"checkpoint folder){hint}"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({e})") from None
    for rel, entry in files.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} lists {rel!r}, which is outside the folder")
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {rel} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {rel} has {size} bytes, the manifest says {entry['bytes']}"
            )
    return manifest


def verify_checkpoint(path: str | Path) -> CheckpointInfo:
    """Re-hash every file of checkpoint folder `path` against its manifest (reads the whole checkpoint).

    Returns:
        Its `CheckpointInfo`.

    Raises:
        FileNotFoundError: `path` does not exist.
        CheckpointError: the manifest is missing or unreadable, or a listed file is missing or differs in size or
            sha256 from the manifest; the message names the folder and the first such file.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    for rel, entry in sorted(manifest["files"].items()):
        if _sha256(path / rel) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: the sha256 of {rel} does not match the manifest")
    manifest_path = path / MANIFEST
    return CheckpointInfo(
        path=path,
        step=int(manifest.get("step", -1)),
        bytes=sum(e["bytes"] for e in manifest["files"].values()) + manifest_path.stat().st_size,
        sha256=_sha256(manifest_path),
    )


# ---------------------------------------------------------------------------------------------------- load
def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``save_pretrained`` folder's safetensors file(s), by name (on CPU).

    Raises:
        CheckpointError: a weight file the folder's index names (or ``model.safetensors``) is missing."""
    folder = Path(folder)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = [SAFETENSORS_FILE]
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise CheckpointError(f"checkpoint folder {folder} is incomplete: {shard} is missing")
        state.update(load_file(folder / shard, device="cpu"))
    return state


def model_layout(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` as ``save_pretrained`` wrote it (the checkpoint's names) in `model`'s own names and shapes: transformers
    keeps some weights fused in memory that its files hold apart (an MoE layer's experts: one
    ``mlp.experts.gate_up_proj`` [E, 2I, H] for the files' ``mlp.experts.<e>.gate_proj.weight`` and
    ``up_proj.weight``), and ``save_pretrained`` reverts that fusion. This applies the model's own conversions
    forward, as ``from_pretrained`` does; `state` unchanged when its names are the model's already (a dense model)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    if not set(state) - set(model.state_dict()):
        return state
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # a model built from a config: transformers' mapping for its class, as it saves with
        conversions = [
            c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)
        ]
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    targets: dict[str, Any] = {}
    for key, tensor in sorted(state.items(), key=lambda item: dot_natural_key(item[0])):
        renamed, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            entry, pattern = targets.setdefault(renamed, WeightRenaming(key, renamed)), key
        else:
            entry = targets.setdefault(renamed, copy.deepcopy(by_pattern[pattern]))
        entry.add_tensor(renamed, key, pattern, tensor)
    out = {}
    for name, entry in targets.items():
        for target, value in entry.convert(name, model=model, config=model.config).items():
            out[target] = value[0] if isinstance(value, list) else value
    return out


def _load_sharded(folder: Path, model, optimizer, scheduler) -> None:
    """`_load_weights` + `_load_optim` for an FSDP-sharded model: the full tensors are scattered to the shards."""
    from hybridflow.engine.sharded_state import load_full_state

    state = model_layout(model, read_weights(folder))
    first_name: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():  # save_pretrained writes a tied weight once
        alias = first_name.setdefault(id(tensor), name)
        if name not in state and alias in state:
            state[name] = state[alias]
    optim = torch.load(folder / OPTIM_STATE, map_location="cpu", weights_only=True)
    try:
        load_full_state(model, optimizer, state, optim["optimizer"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"weights or optimizer state in {folder} do not fit the model: {e}") from None
    scheduler.load_state_dict(optim["lr_scheduler"])


def _load_weights(folder: Path, model) -> None:
    """Copy the safetensors weights in `folder` into `model` in place (parameters keep their identity, so
    optimizers and a rollout sharing the model see the loaded values)."""
    state = model_layout(model, read_weights(folder))
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    # save_pretrained writes tied weights (e.g. lm_head.weight = embed_tokens.weight) once; a key missing from the
    # file is fine when it shares storage with one that is there.
    saved_ptrs = {own[k].data_ptr() for k in state if k in own}
    missing = sorted(k for k in set(own) - set(state) if own[k].data_ptr() not in saved_ptrs)
    if unexpected or missing:
        raise CheckpointError(
            f"weights in {folder} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]} "
            f"({len(missing)} missing, {len(unexpected)} unexpected in all); was it saved from another model?"
        )
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"weights in {folder} do not fit the model: {e}") from None


def _load_optim(folder: Path, optimizer, scheduler) -> None:
    state = torch.load(folder / OPTIM_STATE, map_location="cpu", weights_only=True)
    missing = [k for k in ("optimizer", "lr_scheduler") if k not in state]
    if missing:
        raise CheckpointError(f"{folder / OPTIM_STATE} has no {missing}")
    try:
        optimizer.load_state_dict(state["optimizer"])
    except ValueError as e:
        raise CheckpointError(f"optimizer state in {folder / OPTIM_STATE} does not fit the optimizer: {e}") from None
    scheduler.load_state_dict(state["lr_scheduler"])


def role_states(actor=None, critic=None, cost_critic=None) -> dict[str, Any]:
    """`load_checkpoint`'s keyword arguments for a trained actor, critic and cost critic (objects with ``model``,
    ``optimizer`` and ``lr_scheduler``, as `hybridflow.engine.backends.actor.Actor` and
    `hybridflow.engine.backends.critic.Critic`;
    None for a role that is not loaded)."""
    out: dict[str, Any] = {}
    for role, trained in (("actor", actor), ("critic", critic), ("cost_critic", cost_critic)):
        if trained is not None:
            out.update(
                {
                    f"{role}_model": getattr(trained, "lora", None) or trained.model,
                    f"{role}_optimizer": trained.optimizer,
                    f"{role}_scheduler": trained.lr_scheduler,
                }
            )
    return out


def load_checkpoint(
    path: str | Path,
    *,
    actor_model=None,
    actor_optimizer: torch.optim.Optimizer | None = None,
    actor_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    critic_model=None,
    critic_optimizer: torch.optim.Optimizer | None = None,
    critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    cost_critic_model=None,
    cost_critic_optimizer: torch.optim.Optimizer | None = None,
    cost_critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    verify: bool = True,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore a checkpoint written by `save_checkpoint` in place: weights, optimizer and scheduler states, RNGs.

    Args:
        path: the ``global_step_<N>`` folder.
        actor_model, actor_optimizer, actor_scheduler: loaded into in place (same architecture as when saved);
            None for a process that hosts no actor (e.g. a separate critic group).
        critic_model, critic_optimizer, critic_scheduler: likewise, when the run has a critic; a checkpoint's
            ``critic/`` is ignored when no critic is given.
        cost_critic_model, cost_critic_optimizer, cost_critic_scheduler: likewise for Safe-RLHF's cost critic
            (``cost_critic/``).
        verify: re-hash every file against the manifest first (`verify_checkpoint`; reads the checkpoint twice).
            False only checks that every listed file exists with its size in bytes.
        restore_rng: restore the RNG states saved with it (those of the process that finished the checkpoint).
            Worker processes of the flow pass False: their sampling and shuffling are seeded per step, and the
            saved states are the controller's.

    Returns:
        The trainer state saved with it (``global_steps``, ``sampler``, ``kl_ctrl_value``, ``format_version``);
        restoring those is the caller's part.

    Raises:
        FileNotFoundError: `path` does not exist.
        CheckpointError: the checkpoint is incomplete or corrupt (message names the folder and the file), has an
            unknown ``format_version``, has no ``critic/`` while a critic was given, or its weights or optimizer
            state do not fit the given models.
    """
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    else:
        _read_manifest(path)
    trainer_state = read_trainer_state(path)
    version = trainer_state.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format_version {version!r}; this code reads {FORMAT_VERSION}")
    critics = {
        "critic": (critic_model, critic_optimizer, critic_scheduler),
        "cost_critic": (cost_critic_model, cost_critic_optimizer, cost_critic_scheduler),
    }
    for role, (model, optimizer, scheduler) in critics.items():
        if model is None:
            continue
        if optimizer is None or scheduler is None:
            raise ValueError(f"load_checkpoint: {role}_model needs {role}_optimizer and {role}_scheduler too")
        if not (path / role).is_dir():
            raise CheckpointError(
                f"checkpoint {path} has no {role}/ folder, but a {role.replace('_', ' ')} was given to load into "
                f"(was it saved by a run without a {role.replace('_', ' ')}?)"
            )

    if actor_model is not None:
        if actor_optimizer is None or actor_scheduler is None:
            raise ValueError("load_checkpoint: actor_model needs actor_optimizer and actor_scheduler too")
        _load_role(path / "actor", actor_model, actor_optimizer, actor_scheduler)
    for role, (model, optimizer, scheduler) in critics.items():
        if model is not None:
            _load_role(path / role, model, optimizer, scheduler)
    if restore_rng:
        _set_rng_state(torch.load(path / RNG_STATE, map_location="cpu", weights_only=True))
    return trainer_state


def load_role(path: str | Path, role: str, model, optimizer, scheduler) -> None:
    """Restore one role's weights, optimizer and scheduler states in place from checkpoint `path` (its ``<role>/``
    folder; the caller has verified the checkpoint).

    Raises:
        CheckpointError: the checkpoint has no ``<role>/`` folder."""
    folder = Path(path) / role
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {path} has no {role}/ folder (was it written by another kind of run?)")
    _load_role(folder, model, optimizer, scheduler)


def _load_role(folder: Path, model, optimizer, scheduler) -> None:
    from hybridflow.engine.sharded_state import is_sharded

    if hasattr(model, "load_role"):  # a LoRA adapter (`hybridflow.engine.backends.lora.LoraAdapter`) restores itself
        try:
            model.load_role(folder, optimizer, scheduler)
        except (FileNotFoundError, ValueError) as e:
            raise CheckpointError(str(e)) from None
    elif is_sharded(model):
        _load_sharded(folder, model, optimizer, scheduler)
    else:
        _load_weights(folder, model)
        _load_optim(folder, optimizer, scheduler)


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint (the controller's part of a resume: step, data cursor, KL)."""
    return json.loads((Path(path) / TRAINER_STATE).read_text())
