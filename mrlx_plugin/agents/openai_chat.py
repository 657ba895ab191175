"""OpenAI's chat completions (`POST /v1/chat/completions`) as a `WireApi`: the request is the
session's own shape already (`check_request`), the answer a `chat.completion`."""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

from mrlx_plugin.agents.request import ChatError, ChatRequest, check_request
from mrlx_plugin.agents.wire import Send, TurnAnswer
from mrlx_plugin.core.values import JSON, JSONObject

if TYPE_CHECKING:
    from mrlx_plugin.agents.chat import AgentSession


class ChatCompletions:
    name = "chat.completions"

    def check(self, body: JSON, session: AgentSession) -> ChatRequest:
        return check_request(body)

    def reply(self, request: ChatRequest, send: Send, session: AgentSession) -> ChatReply:
        return ChatReply(send)

    def error_body(self, exc: ChatError) -> JSONObject:
        return exc.body()


class ChatReply:
    """A `chat.completion` answer, written whole once the turn is sampled."""

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
