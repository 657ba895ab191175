"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a `WireApi`.

A request becomes the session's chat shape: the top-level `system` (a string, or text blocks
joined by newlines) is the first system message; a `user` message's `tool_result` blocks become
`tool` messages, in order, before a user message holding its text blocks; an `assistant` message's
text blocks are its content and its `tool_use` blocks its calls (arguments: the JSON of `input`);
a `system` message inside `messages` (Claude Code sends one) stays a system message there. Text
blocks of one message are joined as they are, so an earlier answer sent back as this endpoint
wrote it (one text block, then its calls) matches the answer it was, and the conversation goes on
in the same sample. `thinking` and `redacted_thinking` blocks of an earlier answer are dropped: the
session renders every answer it gave from the text the model wrote, reasoning included, and a
client's copy of that reasoning can only differ from it. A `tool_result` with `is_error: true`
reads "Error: " before its text (a chat template has no place for the flag). Consecutive messages
of one role stay separate messages, each rendered by the template.

| field | here |
|---|---|
| `model` | echoed in the answer; the endpoint serves its own agent whatever it names |
| `messages`, `system`, `tools` | read |
| `tool_choice` | auto, none; any -> required, tool -> that function (not enforced while sampling) |
| `max_tokens` | required; the turn's `max_new_tokens` (capped by the room the context leaves) |
| `stop_sequences`, `temperature`, `top_p`, `top_k` | the turn's `stop`, ..., `top_k` |
| `stream` | the answer as server-sent events |
| `metadata`, `service_tier`, `speed`, `inference_geo` | ignored: who asks, where and how fast |
| `cache_control` (anywhere) | ignored: a continued conversation reuses its ids anyway |
| a text block's `citations`, a tool's `eager_input_streaming` | ignored: they annotate, not change, text |
| `thinking`, `output_config.effort` | ignored: the agent's chat template decides whether it reasons |
| `disable_parallel_tool_use` | ignored, as chat completions' `parallel_tool_calls` |
| `context_management` | `clear_thinking_*` edits with `keep: "all"` (they clear nothing); others refused |
| `output_config.format`, `strict: true` | refused: no constrained decoding here |
| `container`, `mcp_servers` | refused unless null or empty: server-side tools are not served |

Only text and custom tools are served: image, document and search-result blocks, server tool
blocks and tools whose `type` is not `custom` are refused, named; so is any other field, and a
last message of the assistant's (a prefilled answer). A turn that stops on one of the request's
`stop_sequences` keeps it at the end of its text (the trained ids hold it, and the text must match
them when the client sends it back) and answers `stop_reason: stop_sequence`.
"""

from __future__ import annotations

import json
import math
import secrets
from typing import TYPE_CHECKING, NoReturn, cast

import orjson

from mrlx_plugin.agents.request import (
    _MESSAGE_COST,
    MAX_MESSAGES,
    MAX_REQUEST_BYTES,
    MAX_TOOLS,
    MAX_TOOLS_BYTES,
    ChatError,
    ChatRequest,
    Sampling,
    _json_size,
)
from mrlx_plugin.agents.wire import Send, TurnAnswer
from mrlx_plugin.core.values import JSON, JSONObject

if TYPE_CHECKING:
    from mrlx_plugin.agents.chat import AgentSession

_FIELDS = {
    *("model", "messages", "system", "tools", "tool_choice", "max_tokens", "stop_sequences", "stream"),
    *("temperature", "top_p", "top_k", "output_config", "context_management", "container", "mcp_servers"),
    *("metadata", "service_tier", "speed", "inference_geo", "cache_control", "thinking"),  # ignored
}
_NOT_SERVED = {"image", "document", "search_result", "container_upload"}
_BLOCK_KEYS = {  # what each block may hold; cache_control and citations are ignored
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}
_TOOL_KEYS = {
    "name",
    "description",
    "input_schema",
    "type",
    "cache_control",
    "eager_input_streaming",
    "strict",
}
_MAX_STOPS = 16
_SIGNATURE = "mrlx"  # a thinking block's signature: nothing checks it here (a client sends it back)


class MessagesRequest(ChatRequest):
    """A checked Messages request: the session's shape, and what its answer needs."""

    model: str


class AnthropicMessages:
    name = "messages"

    def check(self, body: JSON, session: AgentSession) -> MessagesRequest:
        return check_messages(body, counting=False)

    def reply(self, request: ChatRequest, send: Send, session: AgentSession) -> MessagesReply:
        return MessagesReply(send, cast(MessagesRequest, request), session.agent)

    async def count_tokens(self, body: JSON, session: AgentSession) -> JSONObject:
        """The prompt's tokens as the agent's template renders this request: the system prompt,
        the messages (an answer this session gave, as the model wrote it) and the tools."""
        return {"input_tokens": await session.prompt_tokens(check_messages(body, counting=True))}

    def error_body(self, exc: ChatError) -> JSONObject:
        return error_body(exc)

    def stream_error(self, exc: ChatError) -> bytes:
        return event("error", error_body(exc))


def error_body(exc: ChatError) -> JSONObject:
    """A refusal in Anthropic's error shape, its `type` named by the HTTP status as Anthropic does."""
    kinds = {404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}
    kinds.update({503: "overloaded_error", 529: "overloaded_error"})
    kind = kinds.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def event(name: str, data: JSONObject) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


# --- the request -------------------------------------------------------------------------------


def _refuse(message: str, param: str | None = None, status: int = 400, code: str = "") -> NoReturn:
    raise ChatError(status, message, code or "invalid_request_error", param)


def check_messages(body: JSON, counting: bool) -> MessagesRequest:
    """A Messages request (`counting`: a count_tokens one, which needs no `max_tokens`) as the
    session's request; ChatError naming what is wrong or not served."""
    if not isinstance(body, dict):
        _refuse("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        shown = ", ".join(sorted(_FIELDS))
        _refuse(f"unsupported field(s) {', '.join(unknown)}; this endpoint reads {shown}", unknown[0])
    _check_settings(body)
    raw, tools = body.get("messages"), body.get("tools")
    if not isinstance(raw, list) or not raw:
        _refuse("messages must be a non-empty list of {role, content}", "messages")
    if tools is not None and not isinstance(tools, list):
        _refuse("tools must be a list of {name, description, input_schema}", "tools")
    size = _check_limits(raw, tools or [], body.get("system"))
    specs = [_tool(t, i) for i, t in enumerate(tools or [])]
    names = [cast(str, cast(JSONObject, s["function"])["name"]) for s in specs]
    if len(set(names)) < len(names):
        _refuse("tools: two tools have the same name; each tool needs its own", "tools")
    system = body.get("system")
    messages: list[JSON] = []
    if system:  # an empty system prompt is none: the agent's configured one applies
        messages.append({"role": "system", "content": _text_blocks(system, "system", "\n")})
    messages += _messages(raw)
    if len(messages) > MAX_MESSAGES:
        _refuse(
            f"messages: {len(messages):,} messages once each tool_result is one, more than the "
            f"{MAX_MESSAGES:,} a request may hold",
            "messages",
            code="too_many_messages",
        )
    model, stream = body.get("model", ""), body.get("stream", False)
    if not isinstance(model, str) or not isinstance(stream, bool):
        _refuse("model must be a string, and stream true or false", "model")
    return {
        "messages": messages,
        "tools": specs or None,
        "tool_choice": _tool_choice(body.get("tool_choice"), set(names)),
        "stream": stream,
        "usage_chunk": False,
        "sampling": _sampling(body, counting),
        "cost": size + _MESSAGE_COST * len(messages),  # see request.OFF_LOOP_COST
        "model": model,
    }


def _check_limits(raw: list[JSON], tools: list[JSON], system: JSON) -> int:
    """The limits of chat completions (`agents.request`); the request's bytes as JSON."""
    tools_size = _json_size(tools, "tools") if tools else 0
    size = tools_size + _json_size(raw, "messages") + _json_size(system, "system")
    for over, status, code, param, what in (
        (
            len(raw) > MAX_MESSAGES,
            400,
            "too_many_messages",
            "messages",
            f"{len(raw):,} messages, more than the {MAX_MESSAGES:,} a request may hold; send fewer (drop or "
            "summarise earlier turns)",
        ),
        (
            len(tools) > MAX_TOOLS,
            400,
            "too_many_tools",
            "tools",
            f"{len(tools):,} tools, more than the {MAX_TOOLS:,} a request may hold; send those it needs",
        ),
        (
            tools_size > MAX_TOOLS_BYTES,
            413,
            "tools_too_large",
            "tools",
            f"{tools_size:,} bytes as JSON, more than the {MAX_TOOLS_BYTES:,} a request's tools may take; "
            "shorten their descriptions, or send fewer tools",
        ),
        (
            size > MAX_REQUEST_BYTES,
            413,
            "request_too_large",
            "messages",
            f"the system, messages and tools are {size:,} bytes as JSON, more than the {MAX_REQUEST_BYTES:,} "
            "a request may bring; shorten the messages (a tool's output, for one)",
        ),
    ):
        if over:
            _refuse(f"{param}: {what}", param, status, code)
    return size


def _check_settings(body: JSONObject) -> None:
    """The fields accepted only in forms that cannot change what is sampled (module docstring)."""
    for key in ("thinking", "metadata", "output_config", "context_management"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            _refuse(f"{key} must be an object", key)
    output = cast(JSONObject, body.get("output_config") or {})
    if set(output) - {"effort", "format"} or output.get("format") is not None:
        _refuse(
            "output_config: only effort is read (ignored); a format (structured output) is not served: "
            "there is no constrained decoding here, so ask for it in the prompt",
            "output_config",
        )
    context = cast(JSONObject, body.get("context_management") or {})
    edits = context.get("edits") or []
    if set(context) - {"edits"} or not isinstance(edits, list):
        _refuse("context_management: only {edits: [...]} is read", "context_management")
    for i, edit in enumerate(edits):
        e = edit if isinstance(edit, dict) else {}
        kind = e.get("type")
        if not (isinstance(kind, str) and kind.startswith("clear_thinking") and e.get("keep") == "all"):
            _refuse(
                f"context_management.edits[{i}] ({kind!r}) would clear context the turn is sampled "
                'after; only clear_thinking with keep: "all" (it clears nothing) is served',
                "context_management",
            )
    if body.get("container") is not None:
        _refuse("container is not served: server-side tools (code execution) do not run here", "container")
    if body.get("mcp_servers"):
        _refuse("mcp_servers are not served: only custom tools, run by the client, are", "mcp_servers")


def _tool(tool: JSON, i: int) -> JSONObject:
    """A custom tool as an OpenAI function tool."""
    t = tool if isinstance(tool, dict) else {}
    kind, name, schema, description = (t.get(k) for k in ("type", "name", "input_schema", "description"))
    if kind not in (None, "custom"):
        _refuse(
            f"tools[{i}]: the server tool {kind!r} ({name}) is not served; only text and custom tools "
            "(name, description, input_schema) are",
            "tools",
        )
    extra = sorted(set(t) - _TOOL_KEYS)
    if extra or t.get("strict"):
        _refuse(f"tools[{i}]: {', '.join(extra) or 'strict: true'} is not served", "tools")
    if not (isinstance(name, str) and name and isinstance(schema, dict)) or not isinstance(
        description, (str, type(None))
    ):
        _refuse(
            f"tools[{i}] must be an object {{name, description (a string), input_schema (an object)}}",
            "tools",
        )
    function: JSONObject = {"name": name, "parameters": schema}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def _tool_choice(choice: JSON, names: set[str]) -> JSON:
    if choice is None:
        return "auto" if names else "none"
    c = choice if isinstance(choice, dict) else {}
    kind, name = c.get("type"), c.get("name")
    if kind == "none":
        return "none"
    if kind not in ("auto", "any", "tool"):
        _refuse(f"tool_choice {choice!r}: expected {{type: auto | any | tool | none}}", "tool_choice")
    if not names:
        _refuse(f"tool_choice {kind!r} needs tools", "tool_choice")
    if kind == "tool" and name not in names:
        _refuse(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    if kind == "tool":
        return {"type": "function", "function": {"name": name}}
    return "auto" if kind == "auto" else "required"


def _sampling(body: JSONObject, counting: bool) -> Sampling:
    """The sampling settings, by the keys of chat completions' (`request.Sampling`)."""
    out: dict[str, object] = {}
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if value is not None:
            number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else -1.0
            if not (0 <= number <= 1) or (key == "top_p" and number == 0) or math.isnan(number):
                _refuse(f"{key} must be a number in {'[0, 1]' if key == 'temperature' else '(0, 1]'}", key)
            out[key] = number
    for key, target in (("top_k", "top_k"), ("max_tokens", "max_new_tokens")):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            _refuse(f"{key} must be an integer >= 1", key)
        if value is not None:
            out[target] = value
    if "max_tokens" not in body and not counting:
        _refuse("max_tokens is required: the most tokens the answer may take", "max_tokens")
    stops = body.get("stop_sequences") or []
    if (
        not isinstance(stops, list)
        or len(stops) > _MAX_STOPS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        _refuse(f"stop_sequences must be a list of at most {_MAX_STOPS} non-empty strings", "stop_sequences")
    if stops:
        out["stop"] = list(stops)
    return cast(Sampling, out)  # its keys are Sampling's


def _check_block(block: JSON, where: str, allowed: tuple[str, ...]) -> str:
    """The block's type, one of `allowed`, with only the keys it may hold."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in _NOT_SERVED or (isinstance(kind, str) and kind not in _BLOCK_KEYS):
        _refuse(f"{where}: {kind} blocks are not served; only text and custom tools are", "messages")
    if kind not in allowed:
        _refuse(f"{where}: expected a block of type {' or '.join(allowed)}, got {kind!r}", "messages")
    extra = sorted(set(cast(JSONObject, block)) - _BLOCK_KEYS[cast(str, kind)])
    if extra:
        _refuse(f"{where}: unsupported key(s) {', '.join(extra)} in a {kind} block", "messages")
    if kind == "text" and not isinstance(cast(JSONObject, block)["text"], str):
        _refuse(f"{where}: a text block needs its text", "messages")
    return cast(str, kind)


def _text_blocks(content: JSON, where: str, joiner: str = "") -> str:
    """The text of a string, or of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _refuse(f"{where}: content must be a string or a list of text blocks", "messages")
    parts = [
        (_check_block(b, f"{where}[{j}]", ("text",)), cast(JSONObject, b)) for j, b in enumerate(content)
    ]
    return joiner.join(cast(str, b["text"]) for _, b in parts)


def _messages(raw: list[JSON]) -> list[JSON]:
    """The messages in the session's chat shape. A tool_result must answer a tool_use of the
    assistant message before it (checked here, so that a refusal names the request's own indices)."""
    out: list[JSON] = []
    open_calls: set[str] = set()
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        m = message if isinstance(message, dict) else {}
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant", "system") or set(m) != {"role", "content"}:
            _refuse(f"{where}: expected {{role: user | assistant, content}}", "messages")
        if role == "system":
            out.append({"role": "system", "content": _text_blocks(content, f"{where}.content", "\n")})
        elif role == "assistant":
            reply = _assistant(content, f"{where}.content")
            open_calls = {cast(str, c["id"]) for c in cast("list[JSONObject]", reply.get("tool_calls", []))}
            out.append(reply)
        else:
            out += _user(content, f"{where}.content", open_calls)
            open_calls = set()
    if cast(JSONObject, out[-1])["role"] == "assistant":
        _refuse(
            "the last message is the assistant's: a prefilled answer is not served; end with a user "
            "message (or its tool results)",
            "messages",
        )
    return out


def _assistant(content: JSON, where: str) -> JSONObject:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        _refuse(f"{where}: content must be a string or a list of blocks", "messages")
    texts: list[str] = []
    calls: list[JSON] = []
    for j, block in enumerate(content):
        kind = _check_block(block, f"{where}[{j}]", ("text", "tool_use", "thinking", "redacted_thinking"))
        b = cast(JSONObject, block)
        if kind == "text":
            texts.append(cast(str, b["text"]))
        elif kind == "tool_use":  # thinking and redacted_thinking are dropped (the module's docstring)
            ident, name, args = b.get("id"), b.get("name"), b.get("input")
            if not (isinstance(ident, str) and ident and isinstance(name, str) and isinstance(args, dict)):
                _refuse(f"{where}[{j}]: a tool_use block needs an id, a name and an input object", "messages")
            arguments = json.dumps(args, ensure_ascii=False)
            calls.append(
                {"id": ident, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
    message: JSONObject = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(content: JSON, where: str, open_calls: set[str]) -> list[JSON]:
    """A user message: its tool results as tool messages, in order, then its text, if any."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        _refuse(f"{where}: content must be a string or a list of blocks", "messages")
    out: list[JSON] = []
    texts = []
    for j, block in enumerate(content):
        b = cast(JSONObject, block)
        if _check_block(block, f"{where}[{j}]", ("text", "tool_result")) == "text":
            texts.append(cast(str, b["text"]))
            continue
        ident = b.get("tool_use_id")
        if not isinstance(ident, str) or ident not in open_calls:
            _refuse(
                f"{where}[{j}]: tool_use_id {ident!r} answers no tool_use of the assistant message before it",
                "messages",
            )
        open_calls.discard(ident)
        text = _text_blocks(b.get("content", ""), f"{where}[{j}].content", "\n")
        text = ("Error: " if b.get("is_error") else "") + text
        out.append({"role": "tool", "tool_call_id": ident, "content": text})
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


# --- the answer --------------------------------------------------------------------------------


def stop_reason(answer: TurnAnswer, stops: list[str]) -> tuple[str, str | None]:
    """The turn's stop reason as Anthropic names it, and the stop sequence it ended on. The answer
    does not hold the engine's matched stop: a turn that stopped with its text ending in one of the
    request's stop sequences stopped on it (the parsers strip the text's trailing whitespace)."""
    if answer.finish_reason == "length":
        return "max_tokens", None
    if answer.parsed.tool_calls and answer.finish_reason == "stop":
        return "tool_use", None
    text = answer.parsed.content or ""
    matched = next((s for s in stops if s.strip() and text.endswith(s.strip())), None)
    return ("stop_sequence", matched) if answer.finish_reason == "stop" and matched else ("end_turn", None)


def blocks(answer: TurnAnswer) -> list[JSONObject]:
    """The answer's content blocks: its reasoning, its text, then its calls."""
    parsed = answer.parsed
    out: list[JSONObject] = []
    if parsed.reasoning is not None:
        out.append({"type": "thinking", "thinking": parsed.reasoning, "signature": _SIGNATURE})
    if parsed.content:
        out.append({"type": "text", "text": parsed.content})
    for c in parsed.tool_calls:
        out.append({"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)})
    return out


def usage(answer: TurnAnswer | None) -> JSONObject:
    n, m = (answer.prompt_tokens, answer.completion_tokens) if answer is not None else (0, 0)
    return {
        "input_tokens": n,
        "output_tokens": m,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


class MessagesReply:
    """A `message` written whole, or (`stream: true`) its events: `message_start` as the turn
    starts, the text as it is sampled in one text block, then the other blocks and the end."""

    def __init__(self, send: Send, request: MessagesRequest, agent: str):
        self.send, self.streams = send, request["stream"]
        self.model = request["model"] or agent
        self.stops = cast("list[str]", request["sampling"].get("stop", []))
        self.id = f"msg_{secrets.token_hex(12)}"
        self.index = 0  # the next content block's
        self.sent = ""  # the text streamed so far, in the text block opened first

    def message(self, answer: TurnAnswer | None) -> JSONObject:
        reason, matched = stop_reason(answer, self.stops) if answer is not None else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": cast("list[JSON]", blocks(answer) if answer is not None else []),
            "stop_reason": reason,
            "stop_sequence": matched,
            "usage": usage(answer),
        }

    async def start(self) -> None:
        if self.streams:
            await self.send.open_stream()
            await self.send.event(
                event("message_start", {"type": "message_start", "message": self.message(None)})
            )

    async def text(self, delta: str) -> None:
        if self.streams and delta:
            if not self.sent:
                await self._open({"type": "text", "text": ""})
            self.sent += delta
            await self._delta({"type": "text_delta", "text": delta})

    async def finish(self, answer: TurnAnswer) -> None:
        if not self.streams:
            await self.send.json(self.message(answer))
            return
        content = blocks(answer)
        if self.sent:
            # The text block is open: the rest of the text, if the parsers' content goes on from
            # what was streamed (else the client keeps what it was sent, and its copy of the answer
            # matches it no more: its next request opens a new conversation).
            text = answer.parsed.content or ""
            if text.startswith(self.sent) and len(text) > len(self.sent):
                await self._delta({"type": "text_delta", "text": text[len(self.sent) :]})
            await self._stop()
            content = [b for b in content if b["type"] != "text"]
        for b in content:
            if b["type"] == "text":
                await self._open({"type": "text", "text": ""})
                await self._delta({"type": "text_delta", "text": b["text"]})
            elif b["type"] == "thinking":
                await self._open({"type": "thinking", "thinking": "", "signature": ""})
                await self._delta({"type": "thinking_delta", "thinking": b["thinking"]})
                await self._delta({"type": "signature_delta", "signature": _SIGNATURE})
            else:
                await self._open({"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}})
                await self._delta(
                    {"type": "input_json_delta", "partial_json": orjson.dumps(b["input"]).decode()}
                )
            await self._stop()
        reason, matched = stop_reason(answer, self.stops)
        delta: JSONObject = {"stop_reason": reason, "stop_sequence": matched}
        await self.send.event(
            event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(answer)})
        )
        await self.send.event(event("message_stop", {"type": "message_stop"}))
        await self.send.close_stream()

    async def _open(self, block: JSONObject) -> None:
        data: JSONObject = {"type": "content_block_start", "index": self.index, "content_block": block}
        await self.send.event(event("content_block_start", data))

    async def _delta(self, delta: JSONObject) -> None:
        data: JSONObject = {"type": "content_block_delta", "index": self.index, "delta": delta}
        await self.send.event(event("content_block_delta", data))

    async def _stop(self) -> None:
        await self.send.event(
            event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        )
        self.index += 1
