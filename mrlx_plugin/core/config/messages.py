"""pydantic's errors as this project's messages: one line per problem, `mrlx.dotted.key: what was
wrong; what to do`, the closest known key for an unknown one, the expected type in words, and for a
value past its upper bound what the bound protects."""

from __future__ import annotations

import difflib
import types
import typing
from typing import TYPE_CHECKING, Annotated, Literal, Union

from pydantic import BaseModel

from mrlx_plugin.core.config.values import Why, show_value

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

TOP_KEY = "mrlx"
CROSS = "mrlx_cross"  # the error that carries every problem found between sections


class ConfigError(ValueError):
    """A bad setting. The message names each offending key and what to do about it."""

    # Its public home, where users catch it and host logs name it (`mrlx_plugin.core.config.ConfigError`).
    __module__ = "mrlx_plugin.core.config"


def keys_of(model: object) -> list[str]:
    """The YAML keys of a settings model (none for anything else)."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []
    return sorted(f.alias or name for name, f in model.model_fields.items() if name != "extra")


def unknown_key(path: str, key: object, model: object) -> str:
    """The message of a key `model` does not have, with the closest one it has."""
    known = keys_of(model)
    hint = difflib.get_close_matches(str(key), known, n=1)
    did_you_mean = f"; did you mean '{hint[0]}'?" if hint else ""
    return f"{path}: unknown key{did_you_mean}" + (f" (known keys: {', '.join(known)})" if known else "")


def unwrap(tp: object) -> object:
    """The type a value at a place must have: `X | None` and `Annotated[X, ...]` as X."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            inner = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(inner) != 1:
                return tp
            tp = inner[0]
        else:
            return tp


def _declared_at(loc: tuple, root: type[BaseModel]) -> tuple[object, list[object]] | None:
    """(declared type, the field's own metadata) of the value at a pydantic error's location,
    walking from the model validated (`root`); None when the location names no declared value."""
    tp: object = root
    found: list[object] = []
    for part in loc:
        tp = unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            fields = {f.alias or name: f for name, f in tp.model_fields.items()}
            if part not in fields:
                return None
            tp, found = fields[part].annotation, list(fields[part].metadata)
        elif typing.get_origin(tp) in (dict, list):
            tp, found = typing.get_args(tp)[-1], []
        else:
            return None
    return tp, found


def _type_at(loc: tuple, root: type[BaseModel]) -> object:
    """The declared type of the value at a pydantic error's location, walking from `root`."""
    declared = _declared_at(loc, root)
    return None if declared is None else unwrap(declared[0])


_NAMES: dict[object, tuple[str, str]] = {
    str: ("a string", "strings"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    bool: ("true or false", "true or false"),
}


def type_name(tp: object, plural: bool = False) -> str:
    """How messages and the reference name a type: `a list of strings`, `'math' | 'host'`."""
    tp = unwrap(tp)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return ("lists" if plural else "a list") + f" of {type_name(typing.get_args(tp)[0], plural=True)}"
    if origin is dict:
        values = type_name(typing.get_args(tp)[1], plural=True)
        return ("mappings" if plural else "a mapping") + f" of names to {values}"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "sections" if plural else "a section"
    return _NAMES[tp][plural] if tp in _NAMES else str(tp)


def _why_at(loc: tuple, root: type[BaseModel]) -> str | None:
    """What the upper bound of the setting at a pydantic error's location protects: the `Why` in
    its type (in the field's own metadata, or inside `X | None` and list items)."""
    declared = _declared_at(loc, root)
    if declared is None:
        return None
    tp, found = declared
    todo = [tp]
    while todo:
        tp = todo.pop()
        if typing.get_origin(tp) is Annotated:
            found += typing.get_args(tp)[1:]
            todo.append(typing.get_args(tp)[0])
        elif typing.get_origin(tp) in (Union, types.UnionType):
            todo += typing.get_args(tp)
    return next((str(m) for m in found if isinstance(m, Why)), None)


def shown_bound(value: object) -> object:
    """A bound as a message shows it: 86400, not 86400.0."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _dotted(loc: tuple) -> str:
    out = TOP_KEY
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def message_lines(error: ErrorDetails, root: type[BaseModel]) -> list[str]:
    """One pydantic error as this package's messages: `mrlx.dotted.key: what was wrong; what to do`."""
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind == CROSS:
        return list(ctx["problems"])
    loc = error["loc"][1:] if error["loc"][:1] == ("extra",) else error["loc"]  # `extra` is no YAML key
    if loc[-1:] == ("[key]",):
        return [f"{_dotted(loc[:-2])}: key {show_value(loc[-2])} must be a string"]
    path = _dotted(loc)
    if kind == "mrlx":
        return [f"{path}: {ctx['message']}"]
    if kind == "value_error":  # a ValueError of a section's own validator (a plugin's too): its text
        return [f"{path}: {ctx.get('error', error['msg'])}"]
    if kind == "extra_forbidden":
        model = _type_at(loc[:-1], root)
        return [unknown_key(path, loc[-1], model)]
    unit = " of seconds" if str(loc[-1]).endswith("_s") else ""
    if kind == "greater_than_equal":
        bound = "0 or more" if ctx["ge"] == 0 else f"at least {shown_bound(ctx['ge'])}"
        return [f"{path}: got {show_value(value)}; expected {bound}"]
    if kind == "greater_than":
        return [
            f"{path}: got {show_value(value)}; expected "
            + (f"a positive number{unit}" if ctx["gt"] == 0 else f"more than {shown_bound(ctx['gt'])}")
        ]
    if kind in ("less_than_equal", "less_than"):
        bound = f"at most {shown_bound(ctx['le'])}" if "le" in ctx else f"less than {shown_bound(ctx['lt'])}"
        why = _why_at(loc, root)
        return [f"{path}: got {show_value(value)}; expected {bound}" + (f" ({why})" if why else "")]
    if kind == "finite_number":
        return [f"{path}: got {show_value(value)}; expected a finite number{unit}"]
    if kind in ("literal_error", "bool_type"):
        return [f"{path}: got {show_value(value)}; expected {type_name(_type_at(loc, root))}"]
    if kind in ("model_type", "model_attributes_type"):
        return [f"{path}: got {type(value).__name__} {show_value(value)}; expected a mapping of settings"]
    if kind.endswith(("_type", "_parsing")) and _type_at(loc, root) is not None:
        expected = type_name(_type_at(loc, root))
        return [f"{path}: got {type(value).__name__} {show_value(value)}; expected {expected}"]
    return [f"{path}: {error['msg']}"]
