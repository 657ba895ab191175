"""One agent in one episode, seen through OpenAI's chat-completions format (`AgentSession`).

A request's messages are the conversation as the user's code holds it. The session keeps, per
*thread*, the conversation as that code saw it (its messages and the answers this session gave)
beside the agent's `Transcript`, which holds the exact ids the engine sampled:

- a request whose messages extend an idle thread's conversation (the same messages, then only
  `user` or `tool` messages) continues that thread: only the new messages are rendered and
  appended (loss mask 0), and the turn is taken after the exact ids already held. Earlier turns
  are never re-tokenised, whatever the client sent back of them (reasoning it dropped, arguments
  it re-serialised);
- any other request opens a new thread, a new sample: the first of a conversation, a parallel
  call (a thread answering another request is not idle), or a history the client rewrote. In a
  rewritten history every message, the agent's earlier answers included, is context (loss mask
  0): nothing is trained on ids the model did not produce here. Those are counted as `forks`.

Every text a request brings (a system, user, tool or earlier assistant message) is content: it is
rendered as plain text, so no special token and no markup of the template can be forged by it.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import json
import logging
import math
import secrets
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from mrlx_plugin.agents.parsers import (
    ParsedTurn,
    ReasoningParser,
    ToolParser,
    parse_turn,
    render_calls_hermes,
)
from mrlx_plugin.core.tokenizer import TemplateError
from mrlx_plugin.core.transcript import Mark, Transcript
from mrlx_plugin.episodes.episode import Episode
from mrlx_plugin.episodes.errors import EpisodeAborted

# Request fields read here; any other is refused (a setting the endpoint would not honour).
_FIELDS = {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "n",
    "stream",
    "parallel_tool_calls",
    "user",
    "metadata",
    "logprobs",
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
_OFF_LOOP_COST = 32 * 1024
_MESSAGE_COST = 64
_OFF_LOOP_THREADS = 2
_PARSE_INLINE_BYTES = 256 * 1024  # bodies past this are scanned for their item count first
_SCAN_CHUNK = 256 * 1024
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()

logger = logging.getLogger(__name__)


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

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# Sends a turn's answer to the client; returns once it is written (raises if the client is gone).
Deliver = Callable[[dict[str, Any]], Awaitable[None]]

# A message as matched against a thread: (role, text, ((call id, name, arguments as a JSON value),
# ...), tool_call_id). The client's copy of an answer is matched on what it shows, not its extra
# fields; arguments as the value their JSON holds (`1.0` and `1`, key order and spacing agree).
Seen = tuple[str, str, tuple[tuple[str, str, Any], ...], str | None]


@dataclass
class Thread:
    transcript: Transcript
    seen: list[Seen]
    tools_key: str
    busy: bool = False


@dataclass
class SessionStats:
    requests: int = 0
    threads: int = 0
    forks: int = 0  # threads opened from a history that holds earlier answers (rewritten or unknown)
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    refused: int = 0  # requests answered with a 4xx
    undelivered: int = 0  # requests undone unanswered: the client left, or the episode ended first

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class AgentSession:
    """What one agent's endpoint serves in one episode (see the module's docstring)."""

    episode: Episode
    agent: str
    max_threads: int
    max_turns: int
    tool_parser: ToolParser | None
    reasoning_parser: ReasoningParser | None
    threads: list[Thread] = field(default_factory=list)
    stats: SessionStats = field(default_factory=SessionStats)
    closed: str | None = None  # why the session takes no more requests
    # The raw text of each answer given, by what the client sees of it: a rewritten history that
    # quotes one shows the model what it wrote, not a re-rendering of it.
    _written: dict[Seen, str] = field(default_factory=dict)

    async def complete(self, body: Any, deliver: Deliver) -> None:
        """Answer one chat-completions request body (parsed JSON) by awaiting `deliver(answer)`;
        ChatError for what is refused. The turn is kept only once `deliver` has returned: a turn
        whose answer did not reach its client (it left, or the episode ended first) is undone as if
        it never ran, and counted (`undelivered`)."""
        self.stats.requests += 1
        try:
            await self._complete(body, deliver)
        except ChatError as exc:
            if exc.status < 500:
                self.stats.refused += 1
            raise

    async def _complete(self, body: Any, deliver: Deliver) -> None:
        if self.closed is not None:
            raise ChatError(404, self.closed, "session_not_found")
        if self.episode.aborted:
            raise ChatError(
                404, f"episode {self.episode.id} has ended: {self.episode.abort_reason}", "session_not_found"
            )
        request = _check_request(body)
        tools, tools_key, seen = await self._read(request)
        thread = self._thread_for(seen, tools_key)
        if thread is not None and len(thread.transcript.turns) >= self.max_turns:
            raise ChatError(  # refused before anything is appended
                429,
                f"agent {self.agent!r} has taken the {self.max_turns} turn(s) one conversation may take in "
                "this system (its `turns`); start a new conversation or declare more turns",
                "turn_limit",
            )
        before = None if thread is None else (thread.transcript.mark(), list(thread.seen))
        try:
            if thread is None:
                thread = await self._open(seen, request["messages"], tools, tools_key)
            else:
                thread.busy = True
                await self._extend(thread, seen, request["messages"])
        except BaseException as exc:
            if thread is not None:
                thread.busy = False
            if isinstance(exc, TemplateError):
                raise ChatError(400, str(exc), "template_error", "messages") from None
            raise
        try:
            try:
                turn = await self.episode.generate(thread.transcript, **request["sampling"])
            except EpisodeAborted:
                raise ChatError(
                    502, f"episode {self.episode.id} has ended: {self.episode.abort_reason}", "episode_ended"
                ) from None
            parse_tools = tools if request["tool_choice"] != "none" else None
            parsed = self._parse(turn.text, parse_tools)
            answer: Seen = ("assistant", parsed.content or "", _calls_seen(parsed), None)
            await deliver(
                _response(self.agent, parsed, turn.finish_reason, thread.transcript, len(turn.token_ids))
            )
        except BaseException as exc:  # the turn never ran, or its answer never reached the client
            self._undo(thread, before)
            if isinstance(
                exc, (asyncio.CancelledError, ConnectionError)
            ):  # the client left, or the episode ended
                self.stats.undelivered += 1
            raise
        finally:
            thread.busy = False
        if before is None:  # counted once its first turn is delivered
            self.stats.threads += 1
            if any(m[0] == "assistant" for m in seen):
                self.stats.forks += 1
                self.episode.metadata["agent_forks"] = self.episode.metadata.get("agent_forks", 0) + 1
        self.stats.tool_calls += len(parsed.tool_calls)
        self.stats.malformed_tool_calls += parsed.malformed
        thread.seen = seen + [answer]
        self._written[answer] = turn.text

    def _undo(self, thread: Thread, before: tuple[Mark, list[Seen]] | None) -> None:
        """Leave no trace of a request: its appends undone, its turn too if it ran; a conversation
        it opened is gone, so its place is free for the client's retry."""
        self.episode.turns -= len(thread.transcript.turns) - (before[0].turns if before is not None else 0)
        if before is None:
            self.threads.remove(thread)
            self.episode.transcripts.remove(thread.transcript)
        else:
            thread.transcript.rollback(before[0])
            thread.seen = before[1]

    def _parse(self, text: str, tools: list[dict] | None) -> ParsedTurn:
        """The turn's content, reasoning and calls. A parser that fails leaves the text as content
        (counted as one malformed call): the turn is recorded, so its answer must reach the client."""
        try:
            return parse_turn(text, tools, self.tool_parser, self.reasoning_parser)
        except Exception as exc:  # noqa: BLE001 - a parser's bug must not drop a recorded turn
            logger.warning("agent %r: a parser failed on a turn: %s: %s", self.agent, type(exc).__name__, exc)
            return ParsedTurn(text.strip() or None, None, (), 1)

    async def _read(self, request: dict[str, Any]) -> tuple[list[dict] | None, str, list[Seen]]:
        """The request's tools, their canonical JSON (`tools_key`) and its messages as matched
        (`Seen`), checked; off the event loop when the request is large (`_OFF_LOOP_COST`)."""
        if request["cost"] > _OFF_LOOP_COST:
            return await off_loop(self._read_now, request)
        return self._read_now(request)

    def _read_now(self, request: dict[str, Any]) -> tuple[list[dict] | None, str, list[Seen]]:
        tools = request["tools"]
        tools_key = json.dumps(tools, sort_keys=True, ensure_ascii=False) if tools else ""
        self._check_tools(tools_key)
        seen = [_seen(m, i) for i, m in enumerate(request["messages"])]
        _check_tool_results(seen)
        return tools, tools_key, seen

    def _check_tools(self, tools_key: str) -> None:
        """Tool specs are rendered as the template's markup: none may spell an added token."""
        if not tools_key:
            return
        if "\ue000" in tools_key:
            raise ChatError(400, "tools hold the private-use character U+E000; remove it", param="tools")
        tok = self.episode.context.tokenizers[self.agent]
        found = next((t for t in tok.added_token_texts if t in tools_key), None)
        if found is not None:
            raise ChatError(
                400,
                f"tools hold {found!r}, which the chat template would render as that token of agent "
                f"{self.agent!r}; tool specs may not hold a token's string",
                param="tools",
            )

    def _check_size(self, texts: list[str], room: int | None) -> int:
        """The bytes of `texts`; ChatError when they are surely more tokens than `room` (known
        without encoding them: no token spells more than the tokenizer's `max_token_bytes`)."""
        size = sum(len(t.encode()) for t in texts)
        tok = self.episode.context.tokenizers[self.agent]
        if room is not None and size > room * tok.max_token_bytes:
            raise ChatError(
                400,
                f"the messages are {size} bytes, more than the {room} tokens agent {self.agent!r} has room "
                "for can hold (its context limit); shorten them (a tool's output, for one)",
                "context_length_exceeded",
                "messages",
            )
        return size

    # --- threads ---------------------------------------------------------------------------

    def _thread_for(self, seen: list[Seen], tools_key: str) -> Thread | None:
        """The idle thread this conversation continues, if any (the longest such)."""
        best = None
        for thread in self.threads:
            n = len(thread.seen)
            if (
                not thread.busy
                and thread.tools_key == tools_key
                and n < len(seen)
                and seen[:n] == thread.seen
                and all(m[0] in ("user", "tool") for m in seen[n:])
                and (best is None or n > len(best.seen))
            ):
                best = thread
        return best

    async def _open(
        self, seen: list[Seen], messages: list[dict], tools: list[dict] | None, tools_key: str
    ) -> Thread:
        if len(self.threads) >= self.max_threads:
            raise ChatError(
                429,
                f"agent {self.agent!r} has opened the {self.max_threads} conversation(s) one episode may "
                "hold in this system (its `samples`); continue one of them (send its messages and the "
                "answers back unchanged) or declare more samples",
                "thread_limit",
            )
        tok = self.episode.context.tokenizers[self.agent]
        limit = self.episode.context_limit(self.agent)

        def render() -> tuple[list[dict[str, str]], list[dict[str, str]], tuple[str, tuple[int, ...]]]:
            template = [self._template_message(s, m) for s, m in zip(seen, messages)]
            self._check_size([m["content"] for m in template], limit)
            full = self.episode.with_system_prompt(self.agent, template)
            # not cached yet: a rendering over the context is refused, and must leave nothing behind
            return template, full, tok.prompt_ids(full, tools, tools_key, cache=False)

        if _cost(seen, tools_key) > _OFF_LOOP_COST:
            template, full, rendered = await off_loop(render)
            if len(self.threads) >= self.max_threads:  # other requests opened theirs meanwhile
                raise ChatError(
                    429, f"agent {self.agent!r} has opened its {self.max_threads} conversation(s)"
                )
        else:
            template, full, rendered = render()
        if limit is not None and len(rendered[1]) >= limit:
            raise ChatError(
                400,
                f"the prompt is {len(rendered[1])} tokens, and agent {self.agent!r} has a context limit of "
                f"{limit} (a turn needs at least one more); shorten the messages (a tool's output, for one)",
                "context_length_exceeded",
                "messages",
            )
        label = f"{self.agent}-{len(self.threads)}"
        with tok.lend(full, tools_key, rendered):  # opened from the rendering made above
            t = self.episode.open_transcript(self.agent, template, label, tools=tools, tools_key=tools_key)
        if isinstance(t, str):
            raise ChatError(400, t, "context_length_exceeded", "messages")
        tok.keep(full, tools_key, rendered)  # accepted: cached for the next conversation from it
        thread = Thread(t, seen, tools_key, busy=True)
        self.threads.append(thread)
        return thread

    async def _extend(self, thread: Thread, seen: list[Seen], messages: list[dict]) -> None:
        n = len(thread.seen)
        room = thread.transcript.room()

        def render() -> tuple[list[dict[str, str]], tuple[str, list[int]]]:
            new = [self._template_message(s, m) for s, m in zip(seen[n:], messages[n:])]
            self._check_size([m["content"] for m in new], room)
            return new, thread.transcript.continuation(new)

        # The template renders the whole conversation (twice): its cost is the whole's.
        if _cost(seen, thread.tools_key) > _OFF_LOOP_COST:
            new, (text, ids) = await off_loop(render)
        else:
            new, (text, ids) = render()
        if room is not None and len(ids) >= room:
            raise ChatError(
                400,
                f"the new messages are {len(ids)} tokens, and the conversation of agent {self.agent!r} has "
                f"room for {room} more within its context limit (a turn needs at least one); shorten "
                "them (a tool's output, for one)",
                "context_length_exceeded",
                "messages",
            )
        thread.transcript.append_continuation(new, text, ids)
        thread.seen = list(seen)

    def _template_message(self, s: Seen, message: dict) -> dict[str, str]:
        """What the chat template renders for a request's message: its text as content (an earlier
        answer as the model wrote it, when this session gave it, else its text and calls)."""
        role, text, calls, _ = s
        if role == "developer":
            role = "system"
        if role == "assistant":
            written = self._written.get(s)
            if written is not None:
                return {"role": "assistant", "content": written}
            if calls:  # shown in the Hermes form, whatever the agent's parser: it is context only
                text = (text + "\n" if text else "") + render_calls_hermes(message["tool_calls"])
        return {"role": role, "content": text}

    def close(self, reason: str) -> None:
        self.closed = reason


# --- the body, and work kept off the event loop ------------------------------------------------

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
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


async def parse_body(raw: bytes) -> Any:
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


def _json_size(value: Any, where: str) -> int:
    """The bytes of `value` as compact JSON (orjson: a few ms for megabytes)."""
    try:
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError as exc:
        raise ChatError(400, f"{where} cannot be read as JSON: {exc}", param=where) from None


def _cost(seen: list[Seen], tools_key: str) -> int:
    """The estimated work of rendering a conversation (see `_OFF_LOOP_COST`)."""
    return len(tools_key) + sum(len(s[1]) for s in seen) + _MESSAGE_COST * len(seen)


# --- the request ---------------------------------------------------------------------------


def _check_request(body: Any) -> dict[str, Any]:
    """The request's messages, tools and sampling overrides; ChatError(400) naming what is wrong."""
    if not isinstance(body, dict):
        raise ChatError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise ChatError(
            400,
            f"unsupported field(s) {', '.join(unknown)}; this endpoint reads {', '.join(sorted(_FIELDS))}",
            param=unknown[0],
        )
    if body.get("stream"):
        raise ChatError(400, "streaming is not supported; send stream=false", param="stream")
    if body.get("n", 1) != 1:
        raise ChatError(400, "n must be 1 (each call is one turn of the agent)", param="n")
    if body.get("logprobs"):
        raise ChatError(400, "logprobs are not returned here; the trainer keeps them", param="logprobs")
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
    names = {t["function"]["name"] for t in tools or []}
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
        "tools": tools or None,
        "tool_choice": choice,
        "sampling": _sampling(body),
        "cost": size + _MESSAGE_COST * len(messages),  # see _OFF_LOOP_COST
    }


def _is_tool(t: Any) -> bool:
    f = t.get("function") if isinstance(t, dict) else None
    return (
        isinstance(f, dict)
        and t.get("type") == "function"
        and isinstance(f.get("name"), str)
        and bool(f["name"])
        and isinstance(f.get("parameters", {}), dict)
    )


def _sampling(body: dict) -> dict[str, Any]:
    """The request's sampling settings as SGLang's sampling parameters."""
    out: dict[str, Any] = {}
    for key, low, high, shown in (("temperature", 0.0, math.inf, ">= 0"), ("top_p", 0.0, 1.0, "in (0, 1]")):
        value = body.get(key)
        if value is not None:
            number = (
                float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
            )
            if not (low <= number <= high) or not math.isfinite(number) or (key == "top_p" and number == 0):
                raise ChatError(400, f"{key} must be a finite number {shown}", param=key)
            out[key] = number
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
        out["stop"] = stops
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ChatError(400, "seed must be an integer", param="seed")
        out["sampling_seed"] = seed & 0x7FFFFFFF
    return out


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise ChatError(400, f"{where}: only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatError(400, f"{where}: content must be a string or a list of text parts", param="messages")


def _canonical(arguments: Any, where: str) -> Any:
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


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return ("{}", tuple(sorted((str(k), _frozen(v)) for k, v in value.items())))
    if isinstance(value, list):
        return ("[]", tuple(_frozen(v) for v in value))
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _seen(message: Any, i: int) -> Seen:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise ChatError(
            400, f"{where}: expected a message with a role among {', '.join(_ROLES)}", param="messages"
        )
    role = message["role"]
    text = _text(message.get("content"), where)
    calls: tuple[tuple[str, str, Any], ...] = ()
    if role == "assistant" and message.get("tool_calls"):
        if not isinstance(message["tool_calls"], list):
            raise ChatError(400, f"{where}: tool_calls must be a list", param="messages")
        found = []
        for j, call in enumerate(message["tool_calls"]):
            f = call.get("function") if isinstance(call, dict) else None
            if not (
                isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(call.get("id"), str)
            ):
                raise ChatError(
                    400, f"{where}.tool_calls[{j}]: expected an id and a function name", param="messages"
                )
            found.append(
                (call["id"], f["name"], _canonical(f.get("arguments", "{}"), f"{where}.tool_calls[{j}]"))
            )
        calls = tuple(found)
    call_id = message.get("tool_call_id") if role == "tool" else None
    if role == "tool" and not isinstance(call_id, str):
        raise ChatError(
            400, f"{where}: a tool message needs the tool_call_id of the call it answers", param="messages"
        )
    return (role, text, calls, call_id)


def _check_tool_results(seen: list[Seen]) -> None:
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


def _calls_seen(parsed: ParsedTurn) -> tuple[tuple[str, str, Any], ...]:
    return tuple((c.id, c.name, _canonical(c.arguments, "answer")) for c in parsed.tool_calls)


def _response(agent: str, parsed: ParsedTurn, finish: str, t: Transcript, completion: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
    reason = "tool_calls" if parsed.tool_calls and finish == "stop" else finish
    if reason == "abort":
        reason = "stop"
    total = len(t.prompt_ids) + len(t.response_ids)
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": agent,
        "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": total - completion,
            "completion_tokens": completion,
            "total_tokens": total,
        },
    }
