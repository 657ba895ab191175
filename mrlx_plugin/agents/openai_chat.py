"""OpenAI's chat completions (`POST /v1/chat/completions`) as a `WireApi`: the request is the
session's own shape already (`check_request`), the answer a `chat.completion`, or with
`stream: true` its `chat.completion.chunk`s: the content as the engine samples it, then the rest
(reasoning, tool calls: each call one chunk, whole), the finish reason, the usage when
`stream_options.include_usage` asks for it, and `data: [DONE]`."""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

import orjson

from mrlx_plugin.agents.request import ChatError, ChatRequest, check_request
from mrlx_plugin.agents.wire import Send, TurnAnswer
from mrlx_plugin.core.values import JSON, JSONObject

if TYPE_CHECKING:
    from mrlx_plugin.agents.chat import AgentSession


class ChatCompletions:
    name = "chat.completions"

    def check(self, body: JSON, session: AgentSession) -> ChatRequest:
        return check_request(body)

    def reply(self, request: ChatRequest, send: Send, session: AgentSession) -> ChatReply | ChunkReply:
        if request["stream"]:
            return ChunkReply(send, session.agent, request["usage_chunk"])
        return ChatReply(send)

    def error_body(self, exc: ChatError) -> JSONObject:
        return exc.body()

    def stream_error(self, exc: ChatError) -> bytes:
        return _event(exc.body())  # the SDK raises an APIError on a chunk that holds `error`


class ChatReply:
    """A `chat.completion` answer, written whole once the turn is sampled."""

    streams = False

    def __init__(self, send: Send):
        self.send = send

    async def start(self) -> None:
        pass

    async def text(self, delta: str) -> None:
        pass

    async def finish(self, answer: TurnAnswer) -> None:
        await self.send.json(completion(answer))


def completion(answer: TurnAnswer) -> JSONObject:
    """The `chat.completion` of one turn."""
    parsed = answer.parsed
    message: JSONObject = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": answer.agent,
        "choices": [
            {"index": 0, "message": message, "finish_reason": finish_reason(answer), "logprobs": None}
        ],
        "usage": {
            "prompt_tokens": answer.prompt_tokens,
            "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        },
    }


def finish_reason(answer: TurnAnswer) -> str:
    """The turn's finish reason as OpenAI names it: `tool_calls` for a stop with calls; an
    engine's `abort` (the host ended the rollout as the turn finished) reads as `stop`."""
    finish = answer.finish_reason
    if answer.parsed.tool_calls and finish == "stop":
        return "tool_calls"
    return "stop" if finish == "abort" else finish


class ChunkReply:
    """A streamed answer: `chat.completion.chunk` events."""

    streams = True

    def __init__(self, send: Send, agent: str, usage: bool):
        self.send, self.usage = send, usage
        self.head: JSONObject = {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": agent,
        }

    def _chunk(self, delta: JSONObject, finish: str | None = None) -> bytes:
        chunk: JSONObject = {
            **self.head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.usage:
            chunk["usage"] = None
        return _event(chunk)

    async def start(self) -> None:
        await self.send.open_stream()
        await self.send.event(self._chunk({"role": "assistant", "content": ""}))

    async def text(self, delta: str) -> None:
        await self.send.event(self._chunk({"content": delta}))

    async def finish(self, answer: TurnAnswer) -> None:
        parsed, streamed = answer.parsed, answer.streamed
        content = parsed.content or ""
        rest = content[len(streamed) :] if content.startswith(streamed) else content
        if parsed.reasoning is not None:
            await self.send.event(self._chunk({"reasoning_content": parsed.reasoning}))
        if rest:
            await self.send.event(self._chunk({"content": rest}))
        for i, c in enumerate(parsed.tool_calls):
            call = {
                "index": i,
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            await self.send.event(self._chunk({"tool_calls": [call]}))
        await self.send.event(self._chunk({}, finish_reason(answer)))
        if self.usage:
            usage = completion(answer)["usage"]
            await self.send.event(_event({**self.head, "choices": [], "usage": usage}))
        await self.send.event(b"data: [DONE]\n\n")
        await self.send.close_stream()


def _event(data: JSON) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"
