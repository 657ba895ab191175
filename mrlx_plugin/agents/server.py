"""The endpoints of a rollout process's agents, one aiohttp server per event loop, started with the
first episode of agent code: each API (`mrlx_plugin.agents.wire.WireApi`; today OpenAI's chat
completions, `POST /v1/chat/completions`) on its route, and `GET /v1/models`.

The key is the session: each episode gives each agent a fresh random key (slime's agent adapters
use the same convention), sent as a bearer token or as `x-api-key`; it selects the
`AgentSession`, and an unknown or finished key is a 404 with a message. The server listens on
loopback unless the system's settings say otherwise; a key is 192 random bits, so knowing one is
the only way into an episode.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import weakref

import orjson
from aiohttp import web

from mrlx_plugin.agents.chat import AgentSession
from mrlx_plugin.agents.openai_chat import ChatCompletions
from mrlx_plugin.agents.request import ChatError, parse_body
from mrlx_plugin.agents.wire import WireApi
from mrlx_plugin.core.values import JSON, JSONObject

logger = logging.getLogger(__name__)

# A request past this is answered 413 before it is read whole. Its messages and tools may bring
# 4 MiB of text (request.MAX_REQUEST_BYTES): this leaves room for JSON's escapes (non-ASCII text
# written as \uXXXX, as Python's json writes it by default, takes twice its UTF-8 bytes).
MAX_BODY_BYTES = 16 * 1024 * 1024


class AgentServer:
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.sessions: dict[str, AgentSession] = {}
        self._inflight: dict[str, set[asyncio.Task]] = {}
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", functools.partial(self._serve, ChatCompletions()))
        app.router.add_get("/v1/models", self._models)
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

    def _session(self, request: web.Request) -> tuple[str, AgentSession]:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        key = key or request.headers.get("x-api-key", "").strip()  # Anthropic's clients send this one
        session = self.sessions.get(key) if key else None
        if session is None:
            raise ChatError(
                404,
                "no open session has this key (the episode it belonged to has ended, or the key is wrong); "
                "use the api_key the episode gave this agent",
                "session_not_found",
            )
        return key, session

    # --- handlers --------------------------------------------------------------------------

    async def _serve(self, api: WireApi, request: web.Request) -> web.StreamResponse:
        """One request of `api`: the session's answer through `send`, or a refusal in the API's
        error shape."""
        send = HttpSend(request)
        try:
            key, session = self._session(request)
            try:
                body = await parse_body(await request.read())  # large bodies: their items counted first
            except orjson.JSONDecodeError as exc:
                raise ChatError(400, f"the body is not JSON: {exc}") from None
            except web.HTTPRequestEntityTooLarge:
                raise ChatError(
                    413, f"the request is over {MAX_BODY_BYTES // 2**20} MiB; shorten its messages"
                ) from None
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
            if send.response is not None and send.response.prepared:  # the answer had begun: no other
                return send.response
            return _json(api.error_body(exc), exc.status)
        except ConnectionError:  # the client left while its answer was written: nothing to answer
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here answers with its message, in the API's shape
            logger.exception("agent endpoint: a request failed")
            error = ChatError(500, f"the endpoint failed: {type(exc).__name__}: {exc}", "internal_error")
            return _json(api.error_body(error), 500)
        assert send.response is not None  # complete() answers or raises
        return send.response

    async def _models(self, request: web.Request) -> web.Response:
        try:
            _, session = self._session(request)
        except ChatError as exc:
            return _json(exc.body(), exc.status)
        model: JSONObject = {"id": session.agent, "object": "model", "created": 0, "owned_by": "mrlx"}
        return _json({"object": "list", "data": [model]}, 200)


class HttpSend:
    """`Send` over one aiohttp request. Written in the handler, not after it returns: the session
    keeps a turn only once its answer is on the client's connection (a client that left gets none,
    and the handler is cancelled, so the turn is undone)."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response: web.StreamResponse | None = None

    async def json(self, data: JSON, status: int = 200) -> None:
        self.response = _json(data, status)
        await self.response.prepare(self.request)
        await self.response.write_eof()

    async def open_stream(self) -> None:
        self.response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await self.response.prepare(self.request)

    async def event(self, payload: bytes) -> None:
        assert self.response is not None, "open_stream() first"
        await self.response.write(payload)

    async def close_stream(self) -> None:
        assert self.response is not None, "open_stream() first"
        await self.response.write_eof()


def _json(data: JSON, status: int) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


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
