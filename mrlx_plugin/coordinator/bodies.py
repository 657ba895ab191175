"""The coordinator's JSON request bodies: strict models (no "1" for 1, no unknown keys, finite
numbers, 64-bit integers), and their errors as one 422 message naming the field (`parse_body`)."""

from __future__ import annotations

from typing import Annotated, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from mrlx_plugin.link.wire import MAX_GROUP_SIZE, MAX_KEY_CHARS

INT64_MAX = (1 << 63) - 1
MAX_WAIT_S = 300.0  # longest single long poll; clients loop for longer waits
MAX_LEASE_GROUPS = 4096


class Body(BaseModel):
    """A JSON request body: strict types (no "1" for 1, no true for 1), no unknown keys, finite
    numbers. Every integer is bounded by SQLite's 64-bit range, so a value that validates is one
    the database can store; the bounds are published in /openapi.json like any other."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


Int64 = Annotated[int, Field(le=INT64_MAX)]


class LeaseBody(Body):
    max_groups: int = Field(1, ge=1, le=MAX_LEASE_GROUPS, description="most complete groups to lease")
    lease_s: float = Field(600.0, ge=0.05, le=7 * 86400.0, description="seconds until the lease expires")
    wait_s: float = Field(0.0, ge=0.0, le=MAX_WAIT_S, description="long-poll for up to this many seconds")
    step: Int64 | None = Field(None, ge=0, description="only groups of this producer step")


class AckBody(Body):
    lease_id: str = Field(min_length=1, max_length=64, description="the lease to ack")


class AckThroughBody(Body):
    step: Int64 = Field(ge=0, description="every group of this producer step or an earlier one is done")


class ReleaseBody(Body):
    pass


class RejectBody(Body):
    group: str = Field(min_length=1, max_length=MAX_KEY_CHARS, description="the group to set aside")
    reason: str = Field(min_length=1, max_length=1000, description="why its consumer cannot train it")


class ExtendBody(Body):
    lease_id: str = Field(min_length=1, max_length=64, description="the lease to keep")
    lease_s: float = Field(ge=0.05, le=7 * 86400.0, description="seconds from now until it expires")


class SealBody(Body):
    group: str = Field(min_length=1, max_length=MAX_KEY_CHARS, description="the group id")
    size: int = Field(ge=1, le=MAX_GROUP_SIZE, description="the group's final size")


class EndBody(Body):
    pass


class HeartbeatBody(Body):
    pid: Int64 | None = Field(None, ge=0, description="process id of the agent")
    host: str | None = Field(None, min_length=1, max_length=256, description="host name of the agent")


class VersionBody(Body):
    version: Int64 = Field(ge=0, description="the agent's weight version (monotonic)")


class WaitBody(Body):
    min_version: Int64 = Field(ge=0, description="wait until the agent has at least this version")
    timeout_s: float = Field(30.0, ge=0.0, le=MAX_WAIT_S, description="long-poll for up to this many seconds")


B = TypeVar("B", bound=Body)


class HttpProblem(Exception):
    """An error answer: status, one clear message, optional headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


_KINDS = {int: "an integer", float: "a number", str: "a string"}


def _problem_text(model: type[Body], error: ErrorDetails) -> str:
    """One validation error of `model` as a sentence naming the field."""
    name = str(error["loc"][0]) if error["loc"] else ""
    value, kind, ctx = error.get("input"), error["type"], error.get("ctx") or {}
    if kind == "missing":
        return f"field {name!r} is required"
    if value is None:
        return f"field {name!r} must not be null"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        annotation = model.model_fields[name].annotation
        base = next((t for t in get_args(annotation) if t is not type(None)), annotation)
        base = get_args(base)[0] if get_args(base) else base  # Annotated[int, ...] -> int
        return f"field {name!r} must be {_KINDS.get(base, 'of another type')}, got {value!r}"
    if kind == "greater_than_equal":
        return f"field {name!r} must be >= {ctx['ge']}, got {value}"
    if kind == "less_than_equal":
        return f"field {name!r} must be <= {ctx['le']}, got {value}"
    if kind in ("string_too_short", "string_too_long"):
        longest = model.model_fields[name].metadata
        limit = next((m.max_length for m in longest if getattr(m, "max_length", None) is not None), None)
        return f"field {name!r} must be a non-empty string of at most {limit} characters"
    return f"field {name!r}: {error['msg'].lower()}, got {value!r}"


def parse_body(raw: bytes, model: type[B], where: str) -> B:
    """Strictly parse a JSON object body into `model`: unknown fields, missing fields and wrong
    types are 422, with a message naming `where` and the field."""
    try:
        return model.model_validate_json(raw if raw.strip() else b"{}")
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        raise HttpProblem(422, f"{where}: the body is not valid JSON ({first['msg']})") from None
    if not first["loc"]:
        raise HttpProblem(422, f"{where}: the body must be a JSON object") from None
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        raise HttpProblem(
            422, f"{where}: unknown fields {unknown}; allowed are {sorted(model.model_fields)}"
        ) from None
    raise HttpProblem(422, f"{where}: {_problem_text(model, first)}") from None
