"""The coordinator's OpenAPI 3.0 document (/openapi.json): every route of `ROUTES`, its request
body from its model, its answers, and the signed-request scheme in words."""

from __future__ import annotations

import re
from typing import cast

from mrlx_plugin.coordinator.bodies import Body
from mrlx_plugin.coordinator.routes import ROUTES
from mrlx_plugin.link.auth import MAX_SKEW_S, SCHEME
from mrlx_plugin.link.wire import CONTENT_TYPE


def _openapi30(schema: object) -> object:
    """A pydantic (JSON Schema 2020-12) schema in OpenAPI 3.0's dialect: `X | None` as `nullable`,
    no titles, no null defaults."""
    if isinstance(schema, list):
        return [_openapi30(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _openapi30(value) for key, value in schema.items() if key != "title"}
    options = cast("list[dict[str, object]] | None", out.get("anyOf"))
    if options is not None and {"type": "null"} in options:
        rest = [option for option in options if option != {"type": "null"}]
        del out["anyOf"]
        out.update(rest[0] if len(rest) == 1 else {"anyOf": rest})
        out["nullable"] = True
    if "default" in out and out["default"] is None:
        del out["default"]
    return out


def body_schema(model: type[Body]) -> dict[str, object]:
    """The published JSON schema of a request body model."""
    return cast("dict[str, object]", _openapi30(model.model_json_schema()))


SIGNATURE_SCHEME_TEXT = (
    f"{SCHEME}: the token never travels. Keys: client_key = HMAC-SHA256(token, 'mrlx client'), "
    "server_key = HMAC-SHA256(token, 'mrlx server'). A request carries X-Mrlx-Time (Unix seconds, within "
    f"{MAX_SKEW_S:.0f} s of the coordinator's clock), X-Mrlx-Nonce (16 to 64 hex digits, never reused), "
    "X-Mrlx-Content-Sha256 (hex SHA-256 of the body, of nothing when there is none), optionally X-Mrlx-Boot "
    "(the coordinator start's id, from an earlier answer, or '-') and X-Mrlx-Signature = hex HMAC-SHA256("
    "client_key, 'mrlx-v1' LF METHOD LF PATH LF NONCE LF TIME LF CONTENT_SHA256 [LF BOOT]), PATH as on "
    "the request line. Every answer to a request signed so carries X-Mrlx-Proof = hex HMAC-SHA256("
    "server_key, 'mrlx-v1' LF NONCE LF STATUS LF hex SHA-256 of the answer body) and X-Mrlx-Boot; use no "
    "answer without the proof. A request that names another start, or none and a time before the start, "
    "is refused (503): sign it again naming the start. `mrlx coordinator call METHOD PATH` makes one signed "
    "call from a shell; mrlx_plugin.link.auth has the code."
)


def openapi_document(run_id: str | None = None, agents: list[str] | None = None) -> dict[str, object]:
    """The OpenAPI 3.0 description of every route in `ROUTES` (served auth-free at /openapi.json),
    request bodies from their models.

    Given the run id and agents, path parameters list them as their only valid values, so that a
    schema-driven fuzzer reaches the handlers instead of the 404 for an unknown run or agent."""
    error = {
        "description": "error",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    json_ok = {
        "description": "ok",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
    binary = {"schema": {"type": "string", "format": "binary"}}
    frame_ok = {
        "description": "a wire frame: an Arrow IPC stream (see mrlx_plugin.link.wire); the JSON header in "
        "its schema metadata holds lease_id, end, groups, message, dead (groups set aside)",
        "content": {CONTENT_TYPE: binary},
    }
    metrics_ok = {
        "description": "metrics",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
    names = {"run": [run_id] if run_id else None, "consumer": agents, "agent": agents}
    paths: dict[str, dict[str, object]] = {}
    for route in ROUTES:
        op: dict[str, object] = {"summary": route.summary}
        if route.open:
            op["security"] = []
        params = re.findall(r"{(\w+)}", route.path)
        if params:
            op["parameters"] = [
                {
                    "name": p,
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", **({"enum": list(names[p])} if names[p] else {})},
                }
                for p in params
            ]
        if route.frame_in:
            # the server reads the body as a frame whatever its declared type
            op["requestBody"] = {
                "required": True,
                "content": {CONTENT_TYPE: binary, "application/octet-stream": binary},
            }
        elif route.body is not None:
            schema = body_schema(route.body)
            op["requestBody"] = {
                "required": bool(schema.get("required")),
                "content": {"application/json": {"schema": schema}},
            }
        ok = frame_ok if route.frame_out else metrics_ok if route.handler == "metrics_text" else json_ok
        op["responses"] = {"200": ok, **{str(code): error for code in route.errors}}
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.0.3",
        "info": {"title": "mrlx coordinator", "version": "1"},
        "components": {
            "securitySchemes": {
                "mrlxSignature": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "X-Mrlx-Signature",
                    "description": SIGNATURE_SCHEME_TEXT,
                }
            },
            "schemas": {
                "Error": {
                    "type": "object",
                    "properties": {"error": {"type": "string"}},
                    "required": ["error"],
                }
            },
        },
        "security": [{"mrlxSignature": []}],
        "paths": paths,
    }
