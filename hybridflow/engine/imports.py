"""Load a Python object named in configuration: ``"package.module:name"`` or ``"path/to/file.py:name"``.

Used for ``reward.custom_function`` and for the worker classes of worker groups; errors name the config key.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def load_object(spec: str, config_key: str) -> Any:
    """The object `spec` names.

    Forms: ``"package.module:name"`` (imported with importlib from ``sys.path``) or ``"path/to/file.py:name"``
    (absolute, or relative to the current directory; the file is loaded as a module of its own, once per path).

    Args:
        spec: the string from the configuration.
        config_key: the key it came from, named in every error (e.g. ``reward.custom_function``).

    Raises:
        ValueError: if `spec` is not of either form.
        FileNotFoundError: if the ``.py`` file does not exist (its resolved path is named).
        ImportError: if the module cannot be found or fails to import (the module and the cause are named).
        AttributeError: if the module has no such name (close matches and its public names are listed).
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{config_key} must be 'module:name' or 'path.py:name', got {spec!r}")
    target, name = spec.rsplit(":", 1)
    if not target or not name:
        raise ValueError(f"{config_key} {spec!r} needs both parts: 'module:name' or 'path.py:name'")
    module = load_module(target, config_key, spec)
    if not hasattr(module, name):
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        close = difflib.get_close_matches(name, available, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise AttributeError(
            f"{config_key} {spec!r}: module {target!r} has no attribute {name!r}; {hint}"
            f"its public callables: {available}"
        )
    return getattr(module, name)


def load_module(target: str, config_key: str, spec: str | None = None) -> Any:
    """The module `target` names: ``"package.module"`` (imported from ``sys.path``) or ``"path/to/file.py"`` (loaded
    as a module of its own, once per path). `spec`: how errors quote the setting (default `target`).

    Raises:
        FileNotFoundError, ImportError: as `load_object`.
    """
    spec = target if spec is None else spec
    if target.endswith(".py") or "/" in target or "\\" in target:
        return _load_module_from_file(target, spec, config_key)
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise ImportError(
                f"{config_key} {spec!r}: module {target!r} is not importable (not found on sys.path); "
                "install it, add its folder to PYTHONPATH, or give a file path 'path/to/file.py:name'"
            ) from e
        raise ImportError(
            f"{config_key} {spec!r}: module {target!r} failed to import because {e.name!r} is missing"
        ) from e
    except Exception as e:
        raise ImportError(f"{config_key} {spec!r}: importing module {target!r} raised {type(e).__name__}: {e}") from e


def _load_module_from_file(target: str, spec: str, config_key: str) -> Any:
    path = Path(target).expanduser()
    resolved = path.resolve()
    if not resolved.is_file():
        raise FileNotFoundError(
            f"{config_key} {spec!r}: file {resolved} not found (relative paths are taken from the "
            f"current directory {Path.cwd()})"
        )
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    module_name = f"hybridflow_user_{resolved.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"{config_key} {spec!r}: cannot load {resolved} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # so that dataclasses and pickling inside the file work
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise ImportError(f"{config_key} {spec!r}: running {resolved} raised {type(e).__name__}: {e}") from e
    return module
