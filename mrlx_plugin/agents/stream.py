"""A turn's visible text, passed to its `Reply` as the engine samples it (a streamed answer).

The engine streams ids; they are decoded a few at a time (a window of the last ids, so a
character split across tokens is sent whole once its last byte arrives), and only the text that
is surely the turn's visible content is passed on: with the `think` reasoning parser, text after
`</think>`; with the `hermes` tool parser, text before the first `<tool_call>`; never a tail that
may still become one of those markers, nor the whitespace at either end (the parsed content is
stripped). What was held back is sent by the reply's `finish`, from the parsed turn. With other
parsers (an SGLang parser, one a system registered) nothing is streamed before the turn ends:
which text they keep as content is known only once they have read the whole turn.

Text is passed on at most every `MIN_INTERVAL_S` (what arrives between is sent with the next piece,
or by `finish`): an engine streams a token or a few at a time, and an event per chunk would cost
the endpoint and the client far more than a reader gains from it.
"""

from __future__ import annotations

import asyncio
import time

from mrlx_plugin.agents.parsers import ReasoningParser, ToolParser, hermes, no_reasoning, no_tools, think
from mrlx_plugin.agents.wire import Reply
from mrlx_plugin.core.tokenizer import AgentTokenizer

MIN_INTERVAL_S = 0.02
_END_THINK = "</think>"
_TOOL_CALL = "<tool_call>"


class TurnStream:
    """Feeds one turn's ids (`push`, the engine client's `on_tokens`) to `reply.text`.

    `push` never waits for the client: the text goes out through one writer task, which sends
    what has piled up each time the previous write is done. A client that stops reading holds
    back only its own answer, never the engine's stream (whose reading would otherwise stall
    until the engine call's timeout, and end the episode). `drain()` waits for the writer before
    the reply's `finish`; `cancel()` stops it when the turn fails."""

    def __init__(self, tok: AgentTokenizer, reply: Reply, reasoning: bool, tools: bool):
        self.tok, self.reply = tok, reply
        self.reasoning, self.tools = reasoning, tools
        self.ids: list[int] = []
        self.pieces: list[str] = []  # what the ids so far spell, up to the last whole character
        self.text = ""  # the pieces joined, as of the last look at what is visible
        self.sent = ""  # handed to the writer for reply.text
        self.written = ""  # passed to reply.text
        self.broken = False  # ids that do not decode: nothing more is streamed (the turn fails later)
        self._prefix = self._read = 0  # the decoding window: ids[_prefix:_read] spell text already read
        self._last = 0.0  # when text was last handed on (time.monotonic())
        self._writer: asyncio.Task[None] | None = None

    @staticmethod
    def possible(tool_parser: ToolParser | None, reasoning_parser: ReasoningParser | None) -> bool:
        """Whether the visible text of a turn can be known before the turn ends (see the module)."""
        return tool_parser in (None, hermes, no_tools) and reasoning_parser in (None, think, no_reasoning)

    async def push(self, ids: list[int]) -> None:
        """Take a chunk's new ids (never waits for the client)."""
        if self.broken:
            return
        self.ids.extend(ids)
        try:
            before = self.tok.answer_text(self.ids[self._prefix : self._read])
            now = self.tok.answer_text(self.ids[self._prefix :])
        except (IndexError, ValueError, TypeError):  # an id past the vocabulary: the turn fails as malformed
            self.broken = True
            return
        if len(now) > len(before) and not now.endswith("\ufffd"):  # else a character not yet whole
            self.pieces.append(now[len(before) :])
            self._prefix, self._read = self._read, len(self.ids)
            if time.monotonic() - self._last >= MIN_INTERVAL_S:
                self._hand_on()

    def _hand_on(self) -> None:
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        self.text = self.pieces[0] if self.pieces else ""
        shown = self.visible()
        if len(shown) > len(self.sent) and shown.startswith(self.sent):
            self.sent = shown
            self._last = time.monotonic()
            if self._writer is None or self._writer.done():
                self._writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        """Send what was handed on and not yet written, until nothing is left."""
        while len(self.written) < len(self.sent):
            target = self.sent
            await self.reply.text(target[len(self.written) :])
            self.written = target

    async def drain(self) -> str:
        """Wait for the writer; the text written (raises what writing raised: the client left)."""
        if self._writer is not None:
            await self._writer
        return self.written

    def cancel(self) -> None:
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()

    def visible(self) -> str:
        """The part of the text so far that is surely visible content."""
        region = self.text
        if self.reasoning:
            close = region.find(_END_THINK)
            if close < 0:
                return ""
            start = region.find("<think>")
            if 0 <= start < close and region[:start].strip():
                return ""  # text before the reasoning joins the content after it: not a prefix
            region = region[close + len(_END_THINK) :]
        markers = [_TOOL_CALL] if self.tools else []
        if self.reasoning:
            markers.append("<think>")  # text before a `<think>` joins the content, after it does not
        for marker in markers:
            at = region.find(marker)
            if at >= 0:
                region = region[:at]
            else:  # hold back a tail that may yet become the marker
                for k in range(len(marker) - 1, 0, -1):
                    if region.endswith(marker[:k]):
                        region = region[:-k]
                        break
        return region.strip()
