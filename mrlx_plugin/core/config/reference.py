"""The reference of every setting, from the models: the Markdown table of docs/reference.md (dotted
key, type with its bounds, default, meaning and what an upper bound protects)."""

from __future__ import annotations

import json
import types
import typing
from typing import Annotated, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from mrlx_plugin.core.config.messages import TOP_KEY, shown_bound, type_name, unwrap
from mrlx_plugin.core.config.schema import Settings
from mrlx_plugin.core.config.values import Why


def _reference_rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    top = issubclass(model, Settings)
    # The plugin systems' sections (`extra`) last, after the sections of the registered systems.
    fields = sorted(model.model_fields.items(), key=lambda item: top and item[0] == "extra")
    for name, f in fields:
        key = "<system name>" if (top and name == "extra") else (f.alias or name)
        path, tp = f"{prefix}.{key}", unwrap(f.annotation)
        optional = type(None) in typing.get_args(f.annotation)
        inner = typing.get_args(tp)[-1] if typing.get_origin(tp) is dict else None
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            rows.append((path, type_name(tp), "", f.description or ""))
            rows += _reference_rows(tp, path)
        elif isinstance(inner, type) and issubclass(inner, BaseModel):
            rows.append((path, type_name(tp), "{}", f.description or ""))
            rows += _reference_rows(inner, f"{path}.NAME")
        else:
            default = f.get_default(call_default_factory=True)
            bounds, why = _bounds_text(f)
            kind = type_name(tp) + bounds + (" or null" if optional else "")
            kind = "any mapping" if name == "extra" else kind
            meaning = (f.description or "") + (f" (the limit: {why})" if why else "")
            rows.append((path, kind, json.dumps(default), meaning))
    return rows


def _bounds_text(f: FieldInfo) -> tuple[str, str | None]:
    """A field's bounds as the reference writes them after its type (` from 1 to 64`), and what
    its upper bound protects."""
    found: dict[str, object] = {}
    why = None
    todo: list[object] = [*f.metadata, f.annotation]
    while todo:
        item = todo.pop()
        origin = typing.get_origin(item)
        if origin is Annotated or origin in (Union, types.UnionType, list):
            todo += typing.get_args(item)
        elif isinstance(item, Why):
            why = str(item)
        elif hasattr(item, "metadata") and not isinstance(item, type):  # a FieldInfo inside Annotated
            todo += item.metadata
        else:
            found.update(
                {k: shown_bound(getattr(item, k)) for k in ("ge", "gt", "le", "lt") if hasattr(item, k)}
            )
    low = f"from {found['ge']}" if "ge" in found else f"more than {found['gt']}" if "gt" in found else ""
    high = f"at most {found['le']}" if "le" in found else f"less than {found['lt']}" if "lt" in found else ""
    if "ge" in found and "le" in found:
        return f" ({found['ge']} to {found['le']})", why
    if low and high:
        return f" ({low}, {high})", why
    if "ge" in found:
        return f" ({found['ge']} or more)", why
    return (f" ({low or high})" if low or high else ""), why


def settings_reference_markdown(model: type[Settings] = Settings) -> str:
    """The reference of every setting of `model` (see `settings_model`) as a Markdown table:
    dotted key, type, default, meaning."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for path, kind, default, description in _reference_rows(model, TOP_KEY):
        shown = f"`{cell(default)}`" if default else ""
        lines.append(f"| `{cell(path)}` | {cell(kind)} | {shown} | {cell(description)} |")
    return "\n".join(lines) + "\n"
