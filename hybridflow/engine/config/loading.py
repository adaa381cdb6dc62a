"""Reading a config: YAML files (``defaults:`` chains), ``-o key=value`` overrides, validation with errors that
name each key, and what a resume may change (`resume_config`)."""

from __future__ import annotations

import copy
import fnmatch
import logging
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hybridflow.engine.config.run import HybridFlowConfig
from hybridflow.engine.config.sections import _format_errors, _Section

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names each offending key."""


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[leaf] = value


def _yaml_problem(error: yaml.YAMLError) -> str:
    """``line L, column C: <problem>`` from a YAML parse error (1-based, as editors count)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, schema: type[_Section] | None = None
) -> HybridFlowConfig:
    """Read a YAML config, apply ``key.sub=value`` overrides (values parsed as YAML), and validate against
    `schema` (default `HybridFlowConfig`; `RMTrainingConfig` for ``hf rm train``).

    A config may extend others, as Hydra's defaults list does: ``defaults: [grpo_smollm2.yaml]`` (paths relative to
    the file) reads those first, in order, and merges this file's keys over them, section by section; a
    ``data.reasoning_gym`` naming another generator replaces its base's whole.

    Raises:
        ConfigError: naming every unknown, missing or ill-typed key and, for choices, the allowed values; a
            ``defaults`` entry that is missing or loops back.
        FileNotFoundError: if `path` does not exist.
    """
    tree = {} if path is None else _read_tree(Path(path))
    return validate_config(apply_overrides(tree, overrides or [], source=str(path or "the config")), schema)


def _read_tree(path: Path, extending: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The YAML tree of `path` merged over its ``defaults`` (read recursively; `extending`: the files on the way)."""
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, ...)")
    bases = tree.pop("defaults", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: defaults must be a list of YAML files to extend, e.g. [grpo_smollm2.yaml]")
    merged: dict[str, Any] = {}
    for base in bases:
        base_path = (path.parent / base).resolve()
        if base_path in extending or base_path == path.resolve():
            raise ConfigError(f"{path}: defaults entry {base} extends itself (through {[str(p) for p in extending]})")
        if not base_path.is_file():
            raise ConfigError(f"{path}: defaults entry {base} is not a file ({base_path})")
        merged = _merged(merged, _read_tree(base_path, (*extending, path.resolve())))
    return _merged(merged, tree)


_RENAMED_REPLACES = {("data", "reasoning_gym")}
"""Sections whose options belong to the thing they name: one that names another ``name`` than its base's replaces
the base's whole (a ``products`` generator does not inherit ``basic_arithmetic``'s ``operators``)."""


def _merged(base: dict[str, Any], top: dict[str, Any], at: tuple[str, ...] = ()) -> dict[str, Any]:
    """`top` over `base`: mappings merge key by key (but see `_RENAMED_REPLACES`), anything else in `top` replaces
    `base`'s; `at`: the keys leading to these mappings."""
    out = dict(base)
    for key, value in top.items():
        below = out.get(key)
        renamed = (*at, key) in _RENAMED_REPLACES and isinstance(value, dict) and isinstance(below, dict)
        if renamed and value.get("name", below.get("name")) != below.get("name"):
            out[key] = value
        elif isinstance(value, dict) and isinstance(below, dict):
            out[key] = _merged(below, value, (*at, key))
        else:
            out[key] = value
    return out


def validate_config(tree: dict[str, Any], schema: type[_Section] | None = None) -> HybridFlowConfig:
    """Validate a config tree (plain data, e.g. a stored run's config) against `schema` (default
    `HybridFlowConfig`).

    Raises:
        ConfigError: naming every unknown, missing or ill-typed key and, for choices, the allowed values."""
    try:
        return (schema or HybridFlowConfig).model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=[x, y]"]`` -> ``{"a.b": 1, "c": ["x", "y"]}`` (values parsed as YAML).

    Raises:
        ConfigError: for an item that is not ``key=value``."""
    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        parsed[key.strip()] = yaml.safe_load(raw)
    return parsed


RESUMABLE_KEYS = (
    "trainer.total_iterations",
    "trainer.total_epochs",
    "trainer.test_freq",
    "trainer.save_freq",
    "trainer.logger",
    "trainer.project_name",
    "trainer.mlflow_tracking_uri",
    "trainer.log_val_generations",
    "trainer.log_train_generations",
    "trainer.log_routed_experts",
    "trainer.max_recoveries",
    "trainer.recovery_backoff_s",
    "trainer.resubmit_on_preemption",
    "placement.executor",
    "placement.slurm.",
    "placement.pools.*.slurm.",
    "placement.concurrent",
    "placement.heartbeat_timeout_s",
    "placement.call_timeout_s",
)
"""Keys (or prefixes, ending in '.'; ``*`` stands for a pool's name) that ``hf resume RUN_ID -o ...`` may change: how
long the run goes, how often it validates and saves, where its metrics and samples are logged, how it recovers from
lost workers and Slurm's warnings, and where, under which limits and whether at the same time its workers run. None
of them changes what an iteration computes, so the resumed run's iterations equal those of a run started with the
new values."""


def dotted_leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": {}}`` -> ``{"a.b": 1, "c": {}}``: each value that is not a non-empty mapping, by its
    dotted key (as overrides name it); ``{}`` -> ``{}``."""
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in dotted_leaves(sub, f"{prefix}{key}.").items()}
    return {prefix.removesuffix("."): tree} if prefix else {}  # an empty tree has no leaves


def resume_config(
    stored: dict[str, Any], overrides: list[str], schema: type[_Section] | None = None
) -> HybridFlowConfig:
    """A recorded run's config with ``hf resume`` overrides applied, refused where they would change the
    computation (anything outside `RESUMABLE_KEYS`: the model, data, batch sizes, algorithm, ...).

    Raises:
        ConfigError: for an invalid override or value, or one that changes a key outside `RESUMABLE_KEYS` (the
            keys are named, with the way out: a new run with ``hf run``)."""
    old = validate_config(stored, schema).model_dump(mode="json")
    new = validate_config(apply_overrides(stored, overrides, source="the run's recorded config"), schema)
    before, after = dotted_leaves(old), dotted_leaves(new.model_dump(mode="json"))
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    refused = [
        k for k in changed if not any(fnmatch.fnmatchcase(k, f"{r}*" if r.endswith(".") else r) for r in RESUMABLE_KEYS)
    ]
    if refused:
        raise ConfigError(
            f"hf resume cannot change {', '.join(refused)}: that would change what the run's iterations compute, "
            "so the resumed run would no longer be one run. Start a new run with hf run instead. Resume may change: "
            + ", ".join(k + ("*" if k.endswith(".") else "") for k in RESUMABLE_KEYS)
        )
    return new


_PROMPT_SOURCES = {
    "files": ("data.train_files", "data.val_files"),
    "reasoning_gym": ("data.reasoning_gym",),
    "verifiers": ("data.verifiers",),
}


def apply_overrides(tree: dict[str, Any], overrides: list[str], source: str = "the config") -> dict[str, Any]:
    """A copy of `tree` with ``key.sub=value`` overrides applied.

    Prompt sources: an override that names one kind of source (``data.train_files`` / ``data.val_files``,
    ``data.reasoning_gym.*`` or ``data.verifiers.*``) replaces the other kinds given by `tree` rather than mixing
    them into one training set (a warning says so); to mix them, name them all in the overrides or write them all in
    the file.

    ``placement: auto`` becomes ``{auto: true}`` first, so ``-o placement.hardware=...`` can complete it.

    Raises:
        ConfigError: for a malformed override or one that descends into a value."""
    tree = copy.deepcopy(tree)
    if tree.get("placement") == "auto":
        tree["placement"] = {"auto": True}
    parsed = parse_overrides(overrides)
    named = {kind for kind, keys in _PROMPT_SOURCES.items() for key in parsed if key.startswith(keys)}
    data = tree.get("data")
    if len(named) == 1 and isinstance(data, dict):
        (kind,) = named
        others = [key for other, keys in _PROMPT_SOURCES.items() if other != kind for key in keys]
        dropped = [k for k in others if data.get(k.removeprefix("data."))]
        for key in dropped:
            del data[key.removeprefix("data.")]
        if dropped:
            logger.warning(
                "%s given with -o replaces %s of %s (name both with -o to train on a mix)",
                " / ".join(_PROMPT_SOURCES[kind]),
                " / ".join(dropped),
                source,
            )
    for key, value in parsed.items():
        _set_dotted(tree, key, value)
    return tree
