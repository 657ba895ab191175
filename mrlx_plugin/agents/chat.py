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
The request's body and fields are checked before it reaches a session (`agents.request`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import cast

from mrlx_plugin.agents.parsers import (
    ParsedTurn,
    ReasoningParser,
    ToolParser,
    hermes,
    parse_turn,
    render_calls_hermes,
    think,
)
from mrlx_plugin.agents.request import (
    OFF_LOOP_COST,
    ChatError,
    ChatRequest,
    Seen,
    calls_seen,
    check_tool_results,
    off_loop,
    render_cost,
    seen_of,
)
from mrlx_plugin.agents.stream import TurnStream
from mrlx_plugin.agents.wire import Send, TurnAnswer, WireApi
from mrlx_plugin.core.tokenizer import TemplateError
from mrlx_plugin.core.transcript import Mark, Transcript
from mrlx_plugin.core.values import JSON, JSONObject
from mrlx_plugin.episodes.episode import Episode
from mrlx_plugin.episodes.errors import EpisodeAborted

logger = logging.getLogger(__name__)


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

    async def complete(self, body: JSON, api: WireApi, send: Send) -> None:
        """Answer one request body (parsed JSON) of `api` through `send`; ChatError for what is
        refused. The turn is kept only once its reply has finished: a turn whose answer did not
        reach its client (it left, or the episode ended first) is undone as if it never ran, and
        counted (`undelivered`)."""
        self.stats.requests += 1
        try:
            await self._complete(body, api, send)
        except ChatError as exc:
            if exc.status < 500:
                self.stats.refused += 1
            raise

    async def _complete(self, body: JSON, api: WireApi, send: Send) -> None:
        if self.closed is not None:
            raise ChatError(404, self.closed, "session_not_found")
        if self.episode.aborted:
            raise ChatError(
                404, f"episode {self.episode.id} has ended: {self.episode.abort_reason}", "session_not_found"
            )
        request = api.check(body, self)
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
        stream = None
        try:
            reply = api.reply(request, send, self)
            await reply.start()
            before_turn = len(thread.transcript.tokens)
            parse_tools = tools if request["tool_choice"] != "none" else None
            if reply.streams and TurnStream.possible(self.tool_parser, self.reasoning_parser):
                tok = self.episode.context.tokenizers[self.agent]
                hermes_calls = bool(parse_tools) and self.tool_parser is hermes
                stream = TurnStream(tok, reply, self.reasoning_parser is think, hermes_calls)
            try:
                if stream is None:
                    turn = await self.episode.generate(thread.transcript, **request["sampling"])
                else:
                    turn = await self.episode.generate(
                        thread.transcript, on_tokens=stream.push, **request["sampling"]
                    )
            except EpisodeAborted:
                raise ChatError(
                    502, f"episode {self.episode.id} has ended: {self.episode.abort_reason}", "episode_ended"
                ) from None
            parsed = self._parse(turn.text, parse_tools)
            answer: Seen = ("assistant", parsed.content or "", calls_seen(parsed), None)
            streamed = "" if stream is None else await stream.drain()
            await reply.finish(
                TurnAnswer(self.agent, parsed, turn.finish_reason, before_turn, len(turn.token_ids), streamed)
            )
        except BaseException as exc:  # the turn never ran, or its answer never reached the client
            if stream is not None:
                stream.cancel()
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

    async def prompt_tokens(self, request: ChatRequest) -> int:
        """How many tokens the agent's template makes of `request` as a new conversation (its
        system prompt, messages and tools; an answer this session gave, as the model wrote it),
        without opening one (Anthropic's `count_tokens`)."""
        tok = self.episode.context.tokenizers[self.agent]

        def count() -> int:
            tools, tools_key, seen = self._read_now(request)
            template = [self._template_message(s, m) for s, m in zip(seen, request["messages"])]
            full = self.episode.with_system_prompt(self.agent, template)
            return len(tok.prompt_ids(full, tools, tools_key, cache=False)[1])

        try:
            return await off_loop(count) if request["cost"] > OFF_LOOP_COST else count()
        except TemplateError as exc:
            raise ChatError(400, str(exc), "template_error", "messages") from None

    def _undo(self, thread: Thread, before: tuple[Mark, list[Seen]] | None) -> None:
        """Leave no trace of a request: its appends undone, its turn too if it ran; a conversation
        it opened is gone, so its place is free for the client's retry."""
        self.episode.counts.turns -= len(thread.transcript.turns) - (
            before[0].turns if before is not None else 0
        )
        if before is None:
            self.threads.remove(thread)
            self.episode.transcripts.remove(thread.transcript)
        else:
            thread.transcript.rollback(before[0])
            thread.seen = before[1]

    def _parse(self, text: str, tools: list[JSONObject] | None) -> ParsedTurn:
        """The turn's content, reasoning and calls. A parser that fails leaves the text as content
        (counted as one malformed call): the turn is recorded, so its answer must reach the client."""
        try:
            return parse_turn(text, tools, self.tool_parser, self.reasoning_parser)
        except Exception as exc:  # noqa: BLE001 - a parser's bug must not drop a recorded turn
            logger.warning("agent %r: a parser failed on a turn: %s: %s", self.agent, type(exc).__name__, exc)
            return ParsedTurn(text.strip() or None, None, (), 1)

    async def _read(self, request: ChatRequest) -> tuple[list[JSONObject] | None, str, list[Seen]]:
        """The request's tools, their canonical JSON (`tools_key`) and its messages as matched
        (`Seen`), checked; off the event loop when the request is large (`OFF_LOOP_COST`)."""
        if request["cost"] > OFF_LOOP_COST:
            return await off_loop(self._read_now, request)
        return self._read_now(request)

    def _read_now(self, request: ChatRequest) -> tuple[list[JSONObject] | None, str, list[Seen]]:
        tools = request["tools"]
        tools_key = json.dumps(tools, sort_keys=True, ensure_ascii=False) if tools else ""
        self._check_tools(tools_key)
        seen = [seen_of(m, i) for i, m in enumerate(request["messages"])]
        check_tool_results(seen)
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
        self, seen: list[Seen], messages: list[JSON], tools: list[JSONObject] | None, tools_key: str
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

        if render_cost(seen, tools_key) > OFF_LOOP_COST:
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

    async def _extend(self, thread: Thread, seen: list[Seen], messages: list[JSON]) -> None:
        n = len(thread.seen)
        room = thread.transcript.room()

        def render() -> tuple[list[dict[str, str]], tuple[str, list[int]]]:
            new = [self._template_message(s, m) for s, m in zip(seen[n:], messages[n:])]
            self._check_size([m["content"] for m in new], room)
            return new, thread.transcript.continuation(new)

        # The template renders the whole conversation (twice): its cost is the whole's.
        if render_cost(seen, thread.tools_key) > OFF_LOOP_COST:
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

    def _template_message(self, s: Seen, message: JSON) -> dict[str, str]:
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
                # `seen_of` checked them: a list of calls, each an object
                shown = cast("list[JSONObject]", cast(JSONObject, message)["tool_calls"])
                text = (text + "\n" if text else "") + render_calls_hermes(shown)
        return {"role": role, "content": text}

    def close(self, reason: str) -> None:
        self.closed = reason
