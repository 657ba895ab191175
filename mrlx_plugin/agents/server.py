"""The endpoints of a rollout process's agents, one aiohttp server per event loop, started with the
first episode of agent code: each API (`mrlx_plugin.agents.wire.WireApi`) on its route (OpenAI's
chat completions, `POST /v1/chat/completions`; Anthropic's Messages, `POST /v1/messages` and
`/v1/messages/count_tokens`; OpenAI's Responses, `POST /v1/responses`), and `GET /v1/models`. Any
other path is answered 404 in the error shape of the API it looks like, naming what is served.

Every refusal carries `x-should-retry: false`: the official SDKs (openai, anthropic) would otherwise
retry a 429 or a 5xx, and no refusal here passes by itself (a limit stays reached until the client
continues a conversation or the episode ends).

The key is the session: each episode gives each agent a fresh random key (slime's agent adapters
use the same convention), sent as a bearer token or as `x-api-key`; it selects the
`AgentSession`, and an unknown or finished key is a 404 with a message. The server listens on
loopback unless the system's settings say otherwise; a key is 192 random bits, so knowing one is
the only way into an episode.

Every request is answered by `AgentServer.answer(method, path, headers, read, send)`, whatever
carries it: the aiohttp handler here (`HttpSend`), or, for Python agent code in the rollout
process, the in-process transport of `mrlx_plugin.agents.local_client` (no socket crossed).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import weakref
from collections.abc import Awaitable, Callable, Mapping

import orjson
from aiohttp import web

from mrlx_plugin.agents.anthropic_messages import AnthropicMessages
from mrlx_plugin.agents.chat import AgentSession
from mrlx_plugin.agents.openai_chat import ChatCompletions
from mrlx_plugin.agents.openai_responses import Responses
from mrlx_plugin.agents.request import ChatError, parse_body
from mrlx_plugin.agents.wire import Send, WireApi
from mrlx_plugin.core.values import JSON, JSONObject

logger = logging.getLogger(__name__)

# A request past this is answered 413 before it is read whole. Its messages and tools may bring
# 4 MiB of text (request.MAX_REQUEST_BYTES): this leaves room for JSON's escapes (non-ASCII text
# written as \uXXXX, as Python's json writes it by default, takes twice its UTF-8 bytes).
MAX_BODY_BYTES = 16 * 1024 * 1024


# The paths served, and their methods; any other is answered by `_unknown`.
SERVED = {
    "/v1/chat/completions": "POST",
    "/v1/messages": "POST",
    "/v1/messages/count_tokens": "POST",
    "/v1/responses": "POST",
    "/v1/models": "GET",
}
_CHAT, _MESSAGES, _RESPONSES = ChatCompletions(), AnthropicMessages(), Responses()
_APIS: dict[str, WireApi] = {
    "/v1/chat/completions": _CHAT,
    "/v1/messages": _MESSAGES,
    "/v1/responses": _RESPONSES,
}

Read = Callable[[], Awaitable[bytes]]
_ERROR_EVENT_S = 5.0  # how long a stream's closing error event may take to be written


class AgentServer:
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.sessions: dict[str, AgentSession] = {}
        self._inflight: dict[str, set[asyncio.Task]] = {}
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._http)
        # A client that closes its connection cancels its request's handler: the turn it waited
        # for is undone (cancelled on the engine, or rolled back), never trained unseen.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = self._runner.addresses[0][1]
        host = self.host if ":" not in self.host else f"[{self.host}]"
        self.base_url = f"http://{host}:{port}/v1"
        logger.info("agent endpoints at %s", self.base_url)

    async def aclose(self) -> None:
        for key in list(self.sessions):
            await self.close(key, "the rollout process stopped")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- sessions --------------------------------------------------------------------------

    def open(self, session: AgentSession) -> str:
        key = "mrlx-" + secrets.token_urlsafe(24)
        self.sessions[key] = session
        self._inflight[key] = set()
        return key

    async def close(self, key: str, reason: str) -> None:
        """End a session: later requests get a 404; requests still waiting on a turn are cancelled,
        and waited for, so that what they appended is undone before the episode's samples are made."""
        session = self.sessions.pop(key, None)
        if session is not None:
            session.close(reason)
        pending = self._inflight.pop(key, set())
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10.0)

    def _session(self, headers: Mapping[str, str]) -> tuple[str, AgentSession]:
        auth = headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        key = key or headers.get("x-api-key", "").strip()  # Anthropic's clients send this one
        session = self.sessions.get(key) if key else None
        if session is None:
            raise ChatError(
                404,
                "no open session has this key (the episode it belonged to has ended, or the key is wrong); "
                "use the api_key the episode gave this agent",
                "session_not_found",
            )
        return key, session

    # --- requests --------------------------------------------------------------------------

    async def _http(self, request: web.Request) -> web.StreamResponse:
        send = HttpSend(request)
        await self.answer(request.method, request.path, request.headers, request.read, send)
        assert send.response is not None  # answer() always answers (or raises: the client left)
        return send.response

    async def answer(
        self, method: str, path: str, headers: Mapping[str, str], read: Read, send: Send
    ) -> None:
        """Answer one request through `send`: the session's answer, or a refusal in the shape of the
        API the path belongs to. Raises only when the client left (ConnectionError, or this task
        cancelled), which undoes the turn."""
        api = _APIS.get(path) if method == "POST" else None
        if api is None:
            await self._other(method, path, headers, read, send)
            return
        try:
            key, session = self._session(headers)
            body = await _body(read)
            task = asyncio.current_task()
            inflight = self._inflight.get(key)
            if inflight is not None and task is not None:
                inflight.add(task)
            try:
                await session.complete(body, api, send)
            except asyncio.CancelledError:
                if session.closed is None:
                    raise
                raise ChatError(404, session.closed, "session_not_found") from None
            finally:
                if inflight is not None and task is not None:
                    inflight.discard(task)
        except ChatError as exc:
            await _refuse(api, exc, send)
        except ConnectionError:  # the client left while its answer was written: nothing to answer
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here answers with its message, in the API's shape
            logger.exception("agent endpoint: a request failed")
            error = ChatError(500, f"the endpoint failed: {type(exc).__name__}: {exc}", "internal_error")
            await _refuse(api, error, send)

    async def _other(
        self, method: str, path: str, headers: Mapping[str, str], read: Read, send: Send
    ) -> None:
        """`GET /v1/models`, `POST /v1/messages/count_tokens`, and what is not served: 404 (405 for a
        served path's other methods) in the shape of the API the path looks like, saying what is."""
        api: WireApi = _MESSAGES if "/messages" in path else _CHAT
        try:
            if SERVED.get(path) == method == "GET":  # /v1/models
                _, session = self._session(headers)
                model: JSONObject = {"id": session.agent, "object": "model", "created": 0, "owned_by": "mrlx"}
                await send.json({"object": "list", "data": [model]})
            elif SERVED.get(path) == method:  # /v1/messages/count_tokens
                _, session = self._session(headers)
                await send.json(await _MESSAGES.count_tokens(await _body(read), session))
            else:
                raise self._not_served(method, path)
        except ChatError as exc:
            await _refuse(api, exc, send)
        except Exception as exc:  # noqa: BLE001 - a bug here answers with its message, in the API's shape
            logger.exception("agent endpoint: a request failed")
            await _refuse(api, ChatError(500, f"the endpoint failed: {type(exc).__name__}: {exc}"), send)

    def _not_served(self, method: str, path: str) -> ChatError:
        listed = ", ".join(f"{m} {p}" for p, m in SERVED.items())
        if path in SERVED:
            return ChatError(405, f"{method} {path} is not served; this endpoint serves {listed}")
        hint = ""
        for suffix in ("/chat/completions", "/messages", "/responses", "/models"):
            if path.endswith(suffix) and path != "/v1" + suffix:
                hint = f" (the client's base URL is likely missing or doubling /v1: use {self.base_url})"
        return ChatError(404, f"no API at {method} {path}{hint}; this endpoint serves {listed}", "not_found")


async def _body(read: Read) -> JSON:
    """The request's body as JSON (large bodies: their items counted first); ChatError if not."""
    try:
        return await parse_body(await read())
    except orjson.JSONDecodeError as exc:
        raise ChatError(400, f"the body is not JSON: {exc}") from None
    except web.HTTPRequestEntityTooLarge:
        raise ChatError(
            413, f"the request is over {MAX_BODY_BYTES // 2**20} MiB; shorten its messages"
        ) from None


async def _refuse(api: WireApi, exc: ChatError, send: Send) -> None:
    """A refusal: the whole answer, or, once a stream has begun, its last event."""
    if send.streaming:

        async def end() -> None:
            await send.event(api.stream_error(exc))
            await send.close_stream()

        try:  # bounded: a client that stopped reading must not hold the request (or the session's close)
            await asyncio.wait_for(end(), _ERROR_EVENT_S)
        except asyncio.TimeoutError:
            pass
    elif not send.started:
        await send.json(api.error_body(exc), exc.status)


class HttpSend:
    """`Send` over one aiohttp request. Written in the handler, not after it returns: the session
    keeps a turn only once its answer is on the client's connection (a client that left gets none,
    and the handler is cancelled, so the turn is undone)."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response: web.StreamResponse | None = None
        self.started = False  # an answer has begun
        self.streaming = False  # a stream is open: its headers sent, its end not yet

    async def json(self, data: JSON, status: int = 200) -> None:
        self.started = True
        # No refusal passes by itself: the SDKs must not retry one (see the module's docstring).
        headers = {"x-should-retry": "false"} if status >= 400 else None
        self.response = web.Response(
            body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
        )
        await self.response.prepare(self.request)
        await self.response.write_eof()

    async def open_stream(self) -> None:
        self.started = True
        self.response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await self.response.prepare(self.request)
        self.streaming = True

    async def event(self, payload: bytes) -> None:
        assert self.response is not None, "open_stream() first"
        await self.response.write(payload)

    async def close_stream(self) -> None:
        assert self.response is not None, "open_stream() first"
        self.streaming = False
        await self.response.write_eof()


# One server per event loop (slime runs its rollouts in one loop; tests may run several).
_servers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AgentServer] = weakref.WeakKeyDictionary()
_starting: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


async def server_for(host: str, port: int) -> AgentServer:
    """This loop's server, started on first use at `host:port` (port 0: a free one)."""
    loop = asyncio.get_running_loop()
    server = _servers.get(loop)
    if server is not None:
        return server
    lock = _starting.setdefault(loop, asyncio.Lock())
    async with lock:
        server = _servers.get(loop)
        if server is None:
            server = AgentServer(host, port)
            await server.start()
            _servers[loop] = server
    return server


async def close_server() -> None:
    """Stop this loop's server, if one was started (the Runtime's `aclose`)."""
    server = _servers.pop(asyncio.get_running_loop(), None)
    if server is not None:
        await server.aclose()
