"""The APIs an agent's endpoint speaks, in one shape. Each API (`WireApi`) turns its request body
into a `ChatRequest` (OpenAI chat messages, function tools, SGLang sampling settings) and answers a
turn through a `Reply` it makes; the session in between (`mrlx_plugin.agents.chat`) knows no API.
The HTTP side is a `Send`, given by the server: a JSON answer, or a stream of server-sent events.

A turn is kept only once its reply has finished, that is, once the whole answer (or a stream's
last event) is written to the client's connection: a client that leaves first gets no turn
trained (docs/agents-as-code.md, "Only delivered turns train").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mrlx_plugin.agents.parsers import ParsedTurn
from mrlx_plugin.agents.request import ChatError, ChatRequest
from mrlx_plugin.core.values import JSON, JSONObject

if TYPE_CHECKING:
    from mrlx_plugin.agents.chat import AgentSession


class Send(Protocol):
    """How a reply reaches the client: one JSON answer, or a stream of events."""

    started: bool  # an answer has begun (its status and headers are on their way)
    streaming: bool  # a stream is open: begun, not yet ended

    async def json(self, data: JSON, status: int = 200) -> None:
        """Write a whole JSON answer; returns once it is written."""

    async def open_stream(self) -> None:
        """Send the headers of a `text/event-stream` answer."""

    async def event(self, payload: bytes) -> None:
        """Write one server-sent event as given (its `event:`/`data:` lines and blank line)."""

    async def close_stream(self) -> None:
        """End the stream; returns once everything is written."""


@dataclass(frozen=True)
class TurnAnswer:
    """One sampled turn as every API answers it."""

    agent: str
    parsed: ParsedTurn  # content, reasoning and tool calls, as the agent's parsers read the turn
    finish_reason: str  # the engine's: stop | length | abort
    prompt_tokens: int  # the conversation's tokens before the turn
    completion_tokens: int  # the turn's own
    # The visible text already sent through `Reply.text` (a stream), a prefix of `parsed.content`
    # when the parsers agree with what was streamed; "" for a reply that does not stream.
    streamed: str = ""


class Reply(Protocol):
    """One request's answer, in its API's shape."""

    # True: the session passes the turn's visible text to `text` as the engine samples it.
    streams: bool

    async def start(self) -> None:
        """The turn is about to be sampled (a stream sends its opening events)."""

    async def text(self, delta: str) -> None:
        """Visible content, as the engine produces it (a stream sends it; a JSON answer waits)."""

    async def finish(self, answer: TurnAnswer) -> None:
        """The whole answer, or a stream's closing events; returns once written."""


class WireApi(Protocol):
    """One API of the endpoint (chat completions, Anthropic Messages, Responses)."""

    name: str

    def check(self, body: JSON, session: AgentSession) -> ChatRequest:
        """The request as the session takes it; ChatError naming what is wrong or not served."""

    def reply(self, request: ChatRequest, send: Send, session: AgentSession) -> Reply:
        """The reply of one checked request."""

    def error_body(self, exc: ChatError) -> JSONObject:
        """A refusal in this API's error shape."""

    def stream_error(self, exc: ChatError) -> bytes:
        """A refusal after a stream had begun (its headers sent), as this API's error event."""
