"""The values a setting holds: strings with `${NAME}` from the environment, numbers as YAML writes
them, numbers within bounds that say what they protect, and how a value shows in a message (a
value from the environment as its `${NAME}`, never what the environment held)."""

from __future__ import annotations

import os
import re
import reprlib
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_core import PydanticCustomError


class EnvValue(str):
    """A setting's string with `${NAME}` filled in from the environment. It is that string in
    every use; its repr, and so every message about it, shows what the YAML says (`${NAME}`),
    never the value, which may be a secret."""

    env_template: str

    def __new__(cls, value: str, template: str) -> EnvValue:
        obj = super().__new__(cls, value)
        obj.env_template = template
        return obj

    def __repr__(self) -> str:
        return repr(self.env_template)

    def __reduce__(self) -> tuple:
        return (EnvValue, (str(self), self.env_template))


def public_text(value: object) -> str:
    """`value` as a message may show it: a value from the environment as its `${NAME}` text."""
    return value.env_template if isinstance(value, EnvValue) else str(value)


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 200
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 3, 8, 8


def show_value(value: object) -> str:
    """A value in an error message: its repr, cut short (a value can be a whole YAML subtree),
    and for a value from the environment the variable, not the value."""
    if isinstance(value, EnvValue):
        return f"{value!r} (from the environment)"
    return _SHORT.repr(value)


def problem(message: str) -> PydanticCustomError:
    """A validator's error with this message as it stands (`messages` puts the key before it)."""
    # The text goes in through the context: a template would read the braces of a message
    # (`{url: self}`, `{problem}`) as its own placeholders.
    return PydanticCustomError("mrlx", "{message}", {"message": message})


# ---------------------------------------------------------------------------------------------
# Strings from the environment, numbers as YAML writes them
# ---------------------------------------------------------------------------------------------

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand_env(value: str) -> str:
    """`${NAME}` and `${NAME:-default}` in a string setting, from the environment, so that the
    addresses of a multi-job run live in one env file (launch/mrlx.env) and nowhere else. The
    result is an `EnvValue`: messages show the YAML's text, never what the environment held."""
    if "${" not in value:
        return value
    missing: list[str] = []

    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        found = os.environ.get(name)
        if found is None or (found == "" and default is not None):
            if default is None:
                missing.append(name)
                return ""
            return default
        return found

    expanded = _ENV_REF.sub(sub, value)
    if missing:
        names = f"variable {missing[0]} is" if len(missing) == 1 else f"variables {', '.join(missing)} are"
        raise problem(
            f"environment {names} not set (the YAML says {value!r}); set it (launch/mrlx.env "
            "holds a run's addresses) or write the value itself"
        )
    return EnvValue(expanded, value) if _ENV_REF.search(value) else expanded


def _yaml_number(value: object) -> object:
    # YAML 1.1 reads 3e-4 (no dot) as a string: take it as the number meant.
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    # Not finite (NaN, infinity): refused by `allow_inf_nan=False` beside this validator, which
    # pydantic checks before any bound (NaN would pass every comparison).
    return value


Text = Annotated[str, AfterValidator(_expand_env)]  # every string setting may name ${VARIABLES}
# Every number a setting holds is finite: YAML's .inf and .nan are no timeout, weight or temperature.
Number = Annotated[float, Field(allow_inf_nan=False), BeforeValidator(_yaml_number)]


# ---------------------------------------------------------------------------------------------
# Bounds: each number has the range a user would expect, checked when the file is read (by `mrlx
# check` and at start-up alike), so that a value past one is refused naming its key instead of
# failing, or quietly costing the run its time, when it is used
# ---------------------------------------------------------------------------------------------

DAY_S = 86_400
INT32_MAX = 2**31 - 1  # what SGLang and torch read token counts and ids as
# The coordinator's own bounds on a lease (mrlx_plugin.coordinator.bodies refuses any other).
MIN_LEASE_S, MAX_LEASE_S = 0.05, 7 * DAY_S


class Why(str):
    """Why a setting has its upper bound; a message about a value past it says so."""


def bounded(
    kind: type,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    why: str | None = None,
) -> Any:
    """`kind` (int, or float: finite, and read as YAML writes numbers) within the bounds given, as
    an annotated type: the bounds are pydantic's own (they show in the JSON Schema and the
    reference), `why` says what an upper bound protects. (A type made at run time, used in
    annotations: `Any` to a type checker.)"""
    # The bounds before the validator: pydantic then puts them in the JSON Schema as minimum/maximum.
    meta: list[object] = [Field(ge=ge, gt=gt, le=le, lt=lt)]
    if kind is float:
        meta = [Field(ge=ge, gt=gt, le=le, lt=lt, allow_inf_nan=False), BeforeValidator(_yaml_number)]
    return Annotated[(kind, *meta, *([Why(why)] if why else []))]


_SECONDS_WHY = "a day; these are seconds, and a longer wait only hides a run that has stopped"
Seconds = bounded(float, gt=0, le=DAY_S, why=_SECONDS_WHY)  # a timeout or deadline
Pause = bounded(float, ge=0, le=DAY_S, why=_SECONDS_WHY)  # a wait between tries (0: none)
Tokens = bounded(int, ge=1, le=INT32_MAX, why="the engine reads token counts as 32-bit integers")
TURNS_WHY = "each turn is one more model call, and the transcript grows with each"
