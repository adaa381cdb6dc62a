"""verl's command lines are Hydra overrides: read them with Hydra's own parser (hydra-core's ``OverridesParser``).

Every form verl's scripts write is understood or refused in one line naming the override, never a traceback:

- ``key=value``, ``+key=value`` (add a key verl's config lacks), ``++key=value`` (add or change): a value;
- ``~key`` and ``~key=value``: a key deleted (it then takes verl's default, as Hydra leaves the dataclass's);
- ``group=option`` and ``group@package=option``: a choice in verl's defaults list (``model_engine=megatron``,
  ``actor@actor_rollout_ref.actor=megatron_actor``), kept by its group's name (with ``@package``) for the table;
- values in Hydra's grammar: quoted strings, lists ``[a,b]``, dicts ``{a:1,b:{}}``, escapes (``\\{``, ``\\,``),
  ``${a.b}`` interpolations of other keys;
- refused: sweeps (``a=1,2``, ``range(...)``, ``glob(...)``: Hydra's multirun, not one run) and what Hydra's grammar
  does not parse.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from hybridflow.engine.config.loading import ConfigError


@dataclass(frozen=True)
class HydraOverrides:
    """A verl command line's overrides, as Hydra reads them.

    Attributes:
        values: ``{dotted key: value}`` of every set key (``+``/``++`` stripped; a ``group@package`` choice keyed
            ``group@package``), in the order given; values are Python's (int, float, bool, None, str, list, dict).
        deleted: the keys given as ``~key`` (their own value and every key below them unset).
    """

    values: dict[str, Any] = field(default_factory=dict)
    deleted: tuple[str, ...] = ()


def parse_hydra_overrides(items: list[str]) -> HydraOverrides:
    """Read `items` (``["algorithm.adv_estimator=grpo", "+x.y=[1,2]", "~z", ...]``, as the shell hands them over)
    with Hydra's grammar; ``${...}`` values stay as written (`resolve_interpolations` resolves them once verl's
    defaults and config file are merged in, as OmegaConf does when verl reads its config).

    Raises:
        ConfigError: one line per override Hydra does not parse or that is a sweep (the override named, with what
            to write instead)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    values: dict[str, Any] = {}
    deleted: list[str] = []
    errors: list[str] = []
    for item in items:
        try:
            override = parser.parse_override(item)
        except HydraException as e:
            errors.append(f"override {item!r} is not Hydra's syntax: {_first_line(e)}")
            continue
        if override.is_sweep_override():
            errors.append(f"override {item!r} is a sweep (Hydra's multirun, one run per value): give one value per key")
            continue
        key = override.key_or_group + (f"@{override.package}" if override.package else "")
        if override.is_delete():
            deleted.append(key)
            values = {k: v for k, v in values.items() if k != key and not k.startswith(f"{key}.")}
            continue
        try:
            values[key] = _plain(override.value())
        except HydraException as e:  # a value Hydra parses but cannot evaluate (a function call)
            errors.append(f"override {item!r}: {_first_line(e)}")
    if errors:
        raise ConfigError("hf verl cannot read this command line:\n  " + "\n  ".join(errors))
    return HydraOverrides(values, tuple(deleted))


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _plain(value: Any) -> Any:
    """Hydra's parsed value as plain Python (its quoted strings are already ``str``)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


_INTERPOLATION = re.compile(r"\$\{([^${}]+)\}")


def resolve_interpolations(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (dotted keys) with every ``${a.b}`` resolved to key ``a.b``'s value (a whole-value reference keeps
    that value's type), ``${oc.env:NAME[,default]}`` to the environment's and ``${oc.select:key,default}`` to the
    key's value or the default.

    Raises:
        ConfigError: listing each value whose interpolation names no key and no set environment variable, or
            loops (the key named; write the value)."""
    out, errors = {}, []
    for key, value in values.items():
        try:
            out[key] = _resolved(value, values)
        except ConfigError as e:
            errors.append(f"verl key {key}={value!r}: {e}")
    if errors:
        raise ConfigError("hf verl cannot resolve this command line:\n  " + "\n  ".join(errors))
    return out


def _resolved(value: Any, values: dict[str, Any], depth: int = 0) -> Any:
    """`value` with its ``${...}`` interpolations resolved against the other overrides and the environment.

    Raises:
        ConfigError: an interpolation names neither a given key nor an environment variable, or loops."""
    if isinstance(value, list):
        return [_resolved(v, values, depth) for v in value]
    if isinstance(value, dict):
        return {k: _resolved(v, values, depth) for k, v in value.items()}
    if not isinstance(value, str) or "${" not in value:
        return value
    if depth > 8:
        raise ConfigError("interpolations refer to each other in a loop; write the value")
    whole = _INTERPOLATION.fullmatch(value.strip())
    if whole:  # the whole value is one reference: it takes the referred value's type
        return _resolved(_lookup(whole.group(1), values), values, depth + 1)
    return _INTERPOLATION.sub(lambda m: str(_resolved(_lookup(m.group(1), values), values, depth + 1)), value)


def _lookup(expression: str, values: dict[str, Any]) -> Any:
    expression = expression.strip()
    if expression.startswith("oc.env:"):
        name, _, default = expression.removeprefix("oc.env:").partition(",")
        if name.strip() in os.environ:
            return os.environ[name.strip()]
        if default:
            return default.strip().strip("'\"")
        raise ConfigError(f"${{{expression}}}: the environment variable {name.strip()} is not set")
    if expression.startswith("oc.select:"):
        key, _, default = expression.removeprefix("oc.select:").partition(",")
        return values.get(key.strip(), default.strip() or None)
    if expression in values:
        return values[expression]
    raise ConfigError(f"${{{expression}}} names no key given on the command line; write the value")
