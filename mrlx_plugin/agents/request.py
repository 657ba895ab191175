"""A chat-completions request before it reaches an agent's session: its body parsed (large ones
scanned for their item count first), its fields checked against the endpoint's limits, its
messages as the session matches them (`Seen`), and the answer's shape; with the work kept off the
event loop (`off_loop`). Every refusal is a `ChatError`, answered in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import json
import math
import weakref
from collections.abc import Callable, Hashable
from typing import TypedDict, TypeVar, cast

import orjson

from mrlx_plugin.agents.parsers import ParsedTurn
from mrlx_plugin.core.values import JSON, JSONObject

# Chat-completions fields, each honoured, accepted and ignored (it cannot change what is sampled
# here), or refused with the reason (`_REFUSED`); any other field is refused as unknown.
_FIELDS = {
    # honoured
    "messages",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "top_k",  # SGLang's extension
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "stream",
    "stream_options",  # include_usage: a last chunk with the usage
    # accepted only as their neutral values (checked below)
    "n",
    "logprobs",
    "top_logprobs",
    "response_format",
    # accepted and ignored: names, bookkeeping and hints for OpenAI's own service
    "model",  # every key reaches one agent, whatever model a client names
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "parallel_tool_calls",  # every call the model writes is returned
    "reasoning_effort",  # the agent's chat template decides whether and how it reasons
}
_REFUSED = {
    "logit_bias": "its keys are token ids of the client's tokenizer, not of this agent's model",
    "functions": "the legacy functions API is not served; send tools",
    "function_call": "the legacy functions API is not served; send tool_choice",
    "audio": "only text is served",
    "modalities": "only text is served",
    "prediction": "predicted outputs are not served",
    "web_search_options": "no server-side tools are served; give the agent a function tool",
}
_ROLES = ("system", "developer", "user", "assistant", "tool")

# What one request may bring, checked before anything is rendered (docs/agents-as-code.md). A long
# coding-agent session (a few hundred tools' specs, a 200k-token conversation) is well within them.
MAX_MESSAGES = 10_000
MAX_TOOLS = 1_024
MAX_TOOLS_BYTES = 2 * 1024 * 1024  # the tools list as JSON
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # the messages and the tools as JSON: every text the request brings
# The JSON items (objects, arrays, keys, values) a body may hold: parsing costs 10-40 ns an item on
# the event loop (orjson holds the interpreter while it runs; freeing them, half that again), so a
# body of millions of tiny values is refused before it is parsed. A request at the limits above
# holds 100,000 to 500,000 (10,000 messages that each carry a tool call are 220,000).
MAX_JSON_ITEMS = 1_000_000
# A request whose work is estimated past this (bytes of its JSON, and `_MESSAGE_COST` a message,
# which the template renders one by one) is checked, rendered and encoded off the event loop, in at
# most `_OFF_LOOP_THREADS` threads at once per loop (more requests wait their turn, unrendered).
OFF_LOOP_COST = 32 * 1024
_MESSAGE_COST = 64
_OFF_LOOP_THREADS = 2
_PARSE_INLINE_BYTES = 256 * 1024  # bodies past this are scanned for their item count first
_SCAN_CHUNK = 256 * 1024
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


class ChatError(Exception):
    """A request the endpoint answers with an HTTP error, in OpenAI's error shape."""

    def __init__(
        self, status: int, message: str, code: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> JSONObject:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# A message as matched against a thread: (role, text, ((call id, name, arguments as a JSON value),
# ...), tool_call_id). The client's copy of an answer is matched on what it shows, not its extra
# fields; arguments as the value their JSON holds (`1.0` and `1`, key order and spacing agree:
# `_canonical`).
SeenCall = tuple[str, str, Hashable]
Seen = tuple[str, str, tuple[SeenCall, ...], str | None]


class Sampling(TypedDict, total=False):
    """A request's sampling settings as SGLang's sampling parameters (`_sampling`)."""

    temperature: float
    top_p: float
    top_k: int
    presence_penalty: float
    frequency_penalty: float
    max_new_tokens: int
    stop: list[str]
    sampling_seed: int


class ChatRequest(TypedDict):
    """A request's body once checked (`check_request`)."""

    messages: list[JSON]  # each checked as it is read (`seen_of`)
    tools: list[JSONObject] | None  # OpenAI function tools, checked
    tool_choice: JSON  # "auto", "none", "required" or {"type": "function", "function": {"name": ...}}
    stream: bool  # the answer is streamed (server-sent events)
    usage_chunk: bool  # a stream ends with a chunk holding the usage (chat completions' stream_options)
    sampling: Sampling
    cost: int  # see OFF_LOOP_COST


# --- the body, and work kept off the event loop ------------------------------------------------

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a worker thread, at most `_OFF_LOOP_THREADS` at once per event loop. A caller
    cancelled meanwhile returns at once, and its thread keeps its slot until it ends: a flood of
    requests, cancelled or not, cannot pile up threads (or the memory they render into)."""
    loop = asyncio.get_running_loop()
    slots = _slots.get(loop)
    if slots is None:
        slots = _slots[loop] = asyncio.Semaphore(_OFF_LOOP_THREADS)
    await slots.acquire()
    try:
        future = loop.run_in_executor(None, functools.partial(contextvars.copy_context().run, fn, *args))
    except BaseException:
        slots.release()
        raise

    def done(f: asyncio.Future) -> None:
        slots.release()
        if not f.cancelled():
            f.exception()  # retrieved: a cancelled caller's thread may fail unseen

    future.add_done_callback(done)
    return await asyncio.shield(future)


async def parse_body(raw: bytes) -> JSON:
    """A request body's JSON (orjson.JSONDecodeError when it is not JSON).

    A body past `_PARSE_INLINE_BYTES` is first scanned off the event loop for the JSON items it
    holds, and refused (413) past `MAX_JSON_ITEMS`. orjson holds the interpreter while it parses,
    in a thread as well, so the parse itself runs here, with the garbage collector paused (it
    would otherwise walk every object of the process again and again while the body's are made)."""
    if len(raw) > _PARSE_INLINE_BYTES:
        items = await off_loop(_json_items, raw, MAX_JSON_ITEMS)
        if items > MAX_JSON_ITEMS:
            raise ChatError(
                413,
                f"the body holds more than {MAX_JSON_ITEMS:,} JSON items (objects, arrays, keys and values); "
                f"a request holds at most {MAX_MESSAGES:,} messages and {MAX_TOOLS:,} tools: send fewer, "
                "larger values",
                "request_too_large",
            )
    collecting = gc.isenabled()
    if collecting:
        gc.disable()
    try:
        return orjson.loads(raw)
    finally:
        if collecting:
            gc.enable()


def _json_items(raw: bytes, cap: int) -> int:
    """How many JSON items (objects, arrays, keys, values) the JSON text `raw` holds at most,
    counted outside its strings: every item but the first follows a `[`, `{`, `,` or `:`, and a
    container is an item too. A chunk at a time, so that the thread running it lets the event
    loop run between chunks; stops once past `cap`. Not a validation: orjson parses it next."""
    items, inside, start, n = 1, False, 0, len(raw)
    while start < n and items <= cap:
        end = min(n, start + _SCAN_CHUNK)
        while end < n and raw[end - 1] == 0x5C:  # a chunk never ends inside an escape
            end += 1
        chunk = raw[start:end].replace(b"\\\\", b"").replace(b'\\"', b"")  # escaped quotes are text
        parts = chunk.split(b'"')
        outside = b"".join(parts[1 if inside else 0 :: 2])
        items += outside.count(b",") + outside.count(b":") + 2 * (outside.count(b"[") + outside.count(b"{"))
        inside ^= len(parts) % 2 == 0  # an odd number of quotes: the chunk ends in the other state
        start = end
    return items


def _json_size(value: JSON, where: str) -> int:
    """The bytes of `value` as compact JSON (orjson: a few ms for megabytes)."""
    try:
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError as exc:
        raise ChatError(400, f"{where} cannot be read as JSON: {exc}", param=where) from None


def render_cost(seen: list[Seen], tools_key: str) -> int:
    """The estimated work of rendering a conversation (see `OFF_LOOP_COST`)."""
    return len(tools_key) + sum(len(s[1]) for s in seen) + _MESSAGE_COST * len(seen)


# --- the request ---------------------------------------------------------------------------


def check_request(body: JSON) -> ChatRequest:
    """The request's messages, tools and sampling overrides; ChatError(400) naming what is wrong."""
    if not isinstance(body, dict):
        raise ChatError(400, "the request body must be a JSON object")
    refused = next((f for f in body if f in _REFUSED), None)
    if refused is not None:
        raise ChatError(400, f"{refused}: {_REFUSED[refused]}", param=refused)
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise ChatError(
            400,
            f"unsupported field(s) {', '.join(unknown)}; this endpoint reads {', '.join(sorted(_FIELDS))}",
            param=unknown[0],
        )
    if body.get("n", 1) != 1:
        raise ChatError(400, "n must be 1 (each call is one turn of the agent)", param="n")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise ChatError(
            400,
            "logprobs are not returned to the client (the trainer keeps the exact ones); send logprobs=false",
            param="logprobs",
        )
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise ChatError(
            400,
            f"response_format {response_format!r} is not served: this endpoint does not constrain decoding "
            '(the embedded engine has no grammar); ask for JSON in the prompt, or send {"type": "text"}',
            param="response_format",
        )
    options = body.get("stream_options")
    if options is not None and (
        not isinstance(options, dict) or not set(options) <= {"include_usage", "include_obfuscation"}
    ):
        raise ChatError(
            400, "stream_options may hold include_usage (and include_obfuscation)", param="stream_options"
        )
    if body.get("stream") not in (None, True, False):
        raise ChatError(400, "stream must be true or false", param="stream")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatError(400, "messages must be a non-empty list", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise ChatError(
            400,
            f"messages: {len(messages):,} messages, more than the {MAX_MESSAGES:,} a request may hold; "
            "send fewer (drop or summarise earlier turns)",
            "too_many_messages",
            "messages",
        )
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise ChatError(
            400,
            f"tools: {len(tools):,} tools, more than the {MAX_TOOLS:,} a request may hold; send the tools "
            "this conversation needs",
            "too_many_tools",
            "tools",
        )
    if tools is not None and (not isinstance(tools, list) or not all(_is_tool(t) for t in tools)):
        raise ChatError(
            400,
            'tools must be a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}',
            param="tools",
        )
    size = _json_size(tools, "tools") if tools else 0
    if size > MAX_TOOLS_BYTES:
        raise ChatError(
            413,
            f"tools: {size:,} bytes as JSON, more than the {MAX_TOOLS_BYTES:,} "
            f"({MAX_TOOLS_BYTES // 2**20} MiB) a request's tools may take; shorten their descriptions, "
            "or send fewer tools",
            "tools_too_large",
            "tools",
        )
    size += _json_size(messages, "messages")
    if size > MAX_REQUEST_BYTES:
        raise ChatError(
            413,
            f"the messages and tools are {size:,} bytes as JSON, more than the {MAX_REQUEST_BYTES:,} "
            f"({MAX_REQUEST_BYTES // 2**20} MiB) a request may bring; shorten the messages (a tool's "
            "output, for one)",
            "request_too_large",
            "messages",
        )
    specs = cast("list[JSONObject]", tools or [])  # each one checked above (`_is_tool`)
    names = {cast(JSONObject, t["function"])["name"] for t in specs}
    choice = body.get("tool_choice", "auto" if tools else "none")
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise ChatError(
                400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
    elif choice not in ("auto", "none", "required"):
        raise ChatError(
            400, f"tool_choice {choice!r}: expected auto, none, required or a function", param="tool_choice"
        )
    return {
        "messages": messages,
        "tools": specs or None,
        "tool_choice": choice,
        "stream": body.get("stream") is True,
        "usage_chunk": isinstance(options, dict) and options.get("include_usage") is True,
        "sampling": _sampling(body),
        "cost": size + _MESSAGE_COST * len(messages),  # see OFF_LOOP_COST
    }


def _is_tool(t: JSON) -> bool:
    if not isinstance(t, dict):
        return False
    f = t.get("function")
    return (
        isinstance(f, dict)
        and t.get("type") == "function"
        and isinstance(f.get("name"), str)
        and bool(f["name"])
        and isinstance(f.get("parameters", {}), dict)
    )


def _sampling(body: JSONObject) -> Sampling:
    """The request's sampling settings as SGLang's sampling parameters."""
    out: dict[str, float | int | list[str]] = {}
    for key, low, high, shown in (("temperature", 0.0, math.inf, ">= 0"), ("top_p", 0.0, 1.0, "in (0, 1]")):
        value = body.get(key)
        if value is not None:
            number = (
                float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
            )
            if not (low <= number <= high) or not math.isfinite(number) or (key == "top_p" and number == 0):
                raise ChatError(400, f"{key} must be a finite number {shown}", param=key)
            out[key] = number
    for key in ("presence_penalty", "frequency_penalty"):
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ChatError(400, f"{key} must be a number in [-2, 2]", param=key)
            if value:
                out[key] = float(value)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
            raise ChatError(400, "top_k must be an integer >= 1 (or -1: off)", param="top_k")
        out["top_k"] = top_k
    cap = body.get("max_completion_tokens", body.get("max_tokens"))
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ChatError(400, "max_tokens must be an integer >= 1", param="max_tokens")
        out["max_new_tokens"] = cap
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
            raise ChatError(400, "stop must be a string or a list of at most 16 strings", param="stop")
        out["stop"] = cast("list[str]", stops)  # checked just above
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ChatError(400, "seed must be an integer", param="seed")
        out["sampling_seed"] = seed & 0x7FFFFFFF
    return cast(Sampling, out)  # its keys are Sampling's


def _text(content: JSON, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise ChatError(400, f"{where}: only text content parts are supported", param="messages")
            parts.append(text)
        return "".join(parts)
    raise ChatError(400, f"{where}: content must be a string or a list of text parts", param="messages")


def _canonical(arguments: JSON, where: str) -> Hashable:
    """Tool-call arguments as the value their JSON holds, in a form that compares as JSON does
    (an object's key order and a number's spelling, `1.0` or `1`, do not matter)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            raise ChatError(
                400, f"{where}: arguments are not JSON (or nest too deep)", param="messages"
            ) from None
    if not isinstance(arguments, dict):
        raise ChatError(400, f"{where}: arguments must be a JSON object", param="messages")
    try:
        return _frozen(arguments)
    except RecursionError:
        raise ChatError(400, f"{where}: arguments nest too deep", param="messages") from None


def _frozen(value: JSON) -> Hashable:
    if isinstance(value, dict):
        return ("{}", tuple(sorted((str(k), _frozen(v)) for k, v in value.items())))
    if isinstance(value, list):
        return ("[]", tuple(_frozen(v) for v in value))
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def seen_of(message: JSON, i: int) -> Seen:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise ChatError(
            400, f"{where}: expected a message with a role among {', '.join(_ROLES)}", param="messages"
        )
    role = cast(str, message["role"])  # one of _ROLES
    text = _text(message.get("content"), where)
    calls: tuple[SeenCall, ...] = ()
    if role == "assistant" and message.get("tool_calls"):
        if not isinstance(message["tool_calls"], list):
            raise ChatError(400, f"{where}: tool_calls must be a list", param="messages")
        found: list[SeenCall] = []
        for j, call in enumerate(message["tool_calls"]):
            f, ident = (call.get("function"), call.get("id")) if isinstance(call, dict) else (None, None)
            if not (
                isinstance(f, dict) and isinstance(name := f.get("name"), str) and isinstance(ident, str)
            ):
                raise ChatError(
                    400, f"{where}.tool_calls[{j}]: expected an id and a function name", param="messages"
                )
            found.append((ident, name, _canonical(f.get("arguments", "{}"), f"{where}.tool_calls[{j}]")))
        calls = tuple(found)
    call_id = message.get("tool_call_id") if role == "tool" else None
    if role == "tool" and not isinstance(call_id, str):
        raise ChatError(
            400, f"{where}: a tool message needs the tool_call_id of the call it answers", param="messages"
        )
    return (role, text, calls, cast("str | None", call_id))  # a string for a tool message


def check_tool_results(seen: list[Seen]) -> None:
    """Each tool message answers a call of the assistant message before it (no forged call ids)."""
    open_calls: set[str] = set()
    for i, (role, _, calls, call_id) in enumerate(seen):
        if role == "assistant":
            open_calls = {c[0] for c in calls}
        elif role == "tool":
            if call_id not in open_calls:
                raise ChatError(
                    400,
                    f"messages[{i}]: tool_call_id {call_id!r} answers no call of the assistant message "
                    "before it",
                    param="messages",
                )
            open_calls.discard(call_id)
        elif role != "system":
            open_calls = set()


def calls_seen(parsed: ParsedTurn) -> tuple[SeenCall, ...]:
    return tuple((c.id, c.name, _canonical(c.arguments, "answer")) for c in parsed.tool_calls)
