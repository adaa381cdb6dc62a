"""What a write needs on disk, and whether a failed write ran out of it: the sizes of the files a checkpoint writes,
computed without writing them (a safetensors file from its tensors' names, dtypes and shapes; a ``torch.save``
archive from a hollow copy of its structure), rounded up to the file system's blocks, and sizes as people read them.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch


def format_bytes(size: float) -> str:
    """A size in bytes as people read it: decimal units (1 KB = 1000 B, as disks are sold and ``df -H`` prints),
    the unit that keeps 3 significant digits below 1000: ``"812 B"``, ``"1.18 MB"``, ``"3.40 GB"``, ``"12.0 TB"``."""
    if abs(size) < 1000:
        return f"{size:.0f} B"
    for power, unit in enumerate(("KB", "MB", "GB", "TB", "PB"), start=1):
        value = float(f"{size / 1000**power:.3g}")  # rounded first: 999,999 B is 1.00 MB, not 1000 KB
        if abs(value) < 1000 or unit == "PB":
            return f"{value:.{2 if abs(value) < 10 else 1 if abs(value) < 100 else 0}f} {unit}"
    raise AssertionError("unreachable")


def block_size(folder: Path) -> int:
    """The allocation unit of `folder`'s file system in bytes (4096 on ext4, xfs, tmpfs): a file takes whole ones."""
    return os.statvfs(folder).f_frsize if hasattr(os, "statvfs") else 4096


def on_disk(size: int, block: int) -> int:
    """Bytes a file of `size` bytes takes on a file system of `block`-byte allocation units."""
    return -(-size // block) * block


def disk_bytes(folder: Path) -> int:
    """Bytes the files under `folder` take on disk (their allocated blocks; their sizes where blocks are unknown)."""
    files = [p.stat() for p in folder.rglob("*") if p.is_file()]
    return sum(st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size for st in files)


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def safetensors_bytes(weights: dict[str, torch.Tensor]) -> int:
    """Size in bytes of the safetensors file of `weights`: its 8-byte length, its JSON header (name, dtype, shape
    and offsets of each tensor, padded to 8 bytes) and the tensors, each once (a weight tied to another, sharing its
    memory, is written once, as ``save_pretrained`` writes it). Cheap: no tensor is read."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    seen: set[tuple] = set()
    offset = 0
    for name, tensor in weights.items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.data_ptr() and key in seen:
            continue
        seen.add(key)
        end = offset + tensor.numel() * tensor.element_size()
        dtype = _SAFETENSORS_DTYPES.get(tensor.dtype, "F8_E4M3")
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":"))
    return 8 + on_disk(len(text), 8) + offset


def torch_save_bytes(obj: Any) -> int:
    """Size in bytes of ``torch.save(obj)`` (a zip archive: a pickle of the structure, one 64-byte-aligned record
    per tensor storage, a directory), without serializing a tensor: the structure is saved with every tensor
    replaced by an empty one of its dtype, and the storages' bytes are added, each shared storage once (torch.save
    writes whole storages). Off by at most the 64-byte alignment per storage."""
    storages: dict[tuple, int] = {}

    def hollow(tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            storage = tree.untyped_storage()
            storages[(storage.data_ptr(), str(tree.device))] = storage.nbytes()
            return torch.empty(0, dtype=tree.dtype)
        if isinstance(tree, dict):
            return {k: hollow(v) for k, v in tree.items()}
        if isinstance(tree, tuple):
            return tuple(hollow(v) for v in tree)
        if isinstance(tree, list):
            return [hollow(v) for v in tree]
        return tree

    buffer = io.BytesIO()
    torch.save(hollow(obj), buffer)
    return buffer.getbuffer().nbytes + sum(storages.values())


def small_file_bytes(model) -> list[int]:
    """Sizes in bytes of the JSON files ``save_pretrained`` writes beside the weights: a Hugging Face model's
    ``config.json`` (and ``generation_config.json`` for a generating model); one small file for anything else (a
    LoRA adapter's ``adapter_config.json``)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        return [1]
    sizes = [len(config.to_json_string(use_diff=True).encode())]
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        sizes.append(len(generation.to_json_string(use_diff=True).encode()))
    return sizes


def out_of_space(error: BaseException, where: Path) -> bool:
    """Whether a failed write ran out of space on `where`'s file system: ENOSPC or EDQUOT, the wording of torch
    ("unexpected pos ...": its zip writer hides the errno) or safetensors ("No space left on device"), or under
    1 MiB left after it (called before the partial files are removed)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit
        return False
    if "unexpected pos" in str(error) or "No space left on device" in str(error):
        return True
    try:
        return isinstance(error, OSError | RuntimeError) and shutil.disk_usage(where).free < 2**20
    except OSError:
        return False
