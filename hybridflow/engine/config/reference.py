"""The configuration reference, generated from the config models: one Markdown table per section, every key with
its type, default and description (the documentation site's Configuration reference page is this output)."""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from hybridflow.engine.config.run import HybridFlowConfig


def config_reference(model: type[BaseModel] = HybridFlowConfig) -> str:
    """Markdown: for each section of `model` (``model``, ``data``, ...), a table ``key | type | default |
    description`` of its keys, nested sections flattened to dotted keys (``actor.optim.lr``)."""
    out = []
    for name, field in model.model_fields.items():
        section = _model_of(field.annotation)
        if section is None:
            continue
        out.append(f"## `{name}`\n\n{_first_line(section.__doc__)}\n")
        out.append("| key | type | default | description |\n| --- | --- | --- | --- |")
        out += [_row(key, info) for key, info in _fields(section, f"{name}.")]
        out.append("")
    return "\n".join(out)


def _fields(model: type[BaseModel], prefix: str) -> list[tuple[str, Any]]:
    rows = []
    for name, field in model.model_fields.items():
        nested = _model_of(field.annotation)
        if nested is not None and typing.get_origin(field.annotation) is not dict:
            rows += _fields(nested, f"{prefix}{name}.")
        else:
            rows.append((f"{prefix}{name}", field))
    return rows


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``X``, ``X | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 and typing.get_origin(annotation) is not dict else None


def _row(key: str, field: Any) -> str:
    kind = _type_name(field.annotation)
    if field.default is not PydanticUndefined:
        default = json.dumps(field.default) if not isinstance(field.default, str) else field.default or '""'
    elif field.default_factory is not None:
        made = field.default_factory()
        default = json.dumps(made.model_dump(mode="json") if isinstance(made, BaseModel) else made)
    else:
        default = "(required)"
    text = (field.description or "").replace("|", "/").replace("\n", " ")
    return f"| `{key}` | {kind} | `{default}` | {text} |"


def _type_name(annotation: Any) -> str:
    name = str(annotation).replace("typing.", "").replace("NoneType", "None").replace("|", "/")
    return name.removeprefix("<class '").removesuffix("'>")


def _first_line(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())
