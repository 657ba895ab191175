"""An HTTP client for agent code that runs in the rollout process: its requests reach the agents'
endpoints without a socket (`local_http_client()`, for the official SDKs' `http_client=`).

    client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0,
                                http_client=local_http_client())

A request through it is answered by the same `AgentServer.answer` as one over HTTP, so the same
checks, sessions and answers apply; what it saves is the two socket crossings and the HTTP
parsing on both sides. A turn is delivered once its answer is handed to the client (a streamed
one, once the client has read its last event); a client that closes a stream midway, or is
cancelled while it waits, undoes its turn, as over HTTP. Only this event loop's endpoints are
reached through it: any other URL is refused (use a normal client for other services).

The SDKs are built on httpx (`httpx2` in their newest releases): the transport is that library's.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from collections.abc import AsyncIterator

import orjson
from aiohttp import web

from mrlx_plugin.agents.server import MAX_BODY_BYTES, AgentServer, _servers

# The SDKs' newest releases ship their HTTP library as httpx2, older ones use httpx.
httpx = importlib.import_module("httpx2" if importlib.util.find_spec("httpx2") else "httpx")

_END = b""  # the stream's end, in the queue of events


class LocalSend:
    """`Send` into the transport: the answer's head, then (a stream) its events through a queue."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.head: asyncio.Future[tuple[int, bytes | None]] = loop.create_future()
        self.taken = asyncio.Event()  # the transport handed the answer to the client
        # Unbounded: what is written waits for the client here (one turn's events at most); the
        # writer does not wait for a client that reads slowly, as a socket's buffer does not.
        self.events: asyncio.Queue[bytes] = asyncio.Queue()
        self.started = self.streaming = False
        self.ended = False  # the stream's last event is queued

    async def json(self, data: object, status: int = 200) -> None:
        self.started = True
        self.head.set_result((status, orjson.dumps(data)))
        await self.taken.wait()

    async def open_stream(self) -> None:
        self.started = self.streaming = True
        self.head.set_result((200, None))
        await self.taken.wait()

    async def event(self, payload: bytes) -> None:
        await self.events.put(payload)

    async def close_stream(self) -> None:
        self.streaming = False
        self.ended = True
        await self.events.put(_END)
        await self.events.join()  # every event read by the client


class _Events(httpx.AsyncByteStream):
    def __init__(self, send: LocalSend, task: asyncio.Task[None]):
        self.send, self.task = send, task

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            payload = await self.send.events.get()
            self.send.events.task_done()
            if payload == _END:
                # the session's bookkeeping of the turn is done before the client's next request;
                # shielded: the client cancelled now has still read the whole answer
                await asyncio.shield(self.task)
                return
            yield payload

    async def aclose(self) -> None:
        if self.send.ended:  # the answer is whole: what is left unread is its end
            while not self.send.events.empty():
                self.send.events.get_nowait()
                self.send.events.task_done()
            await asyncio.gather(asyncio.shield(self.task), return_exceptions=True)
        elif not self.task.done():  # the client left the stream midway: the turn is undone
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


class LocalTransport(httpx.AsyncBaseTransport):
    """Answers requests to this event loop's agent endpoints in-process."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        server = _servers.get(asyncio.get_running_loop())
        url = str(request.url)
        if server is None or not url.startswith(server.base_url.removesuffix("/v1") + "/"):
            where = server.base_url if server is not None else "no endpoint in this event loop"
            raise httpx.ConnectError(
                f"{url}: the local client reaches only this process's agent endpoints ({where})"
            )
        return await _answer(server, request)


async def _answer(server: AgentServer, request: httpx.Request) -> httpx.Response:
    send = LocalSend()

    async def read() -> bytes:  # the limit a body over HTTP has (answered 413)
        body = await request.aread()
        if len(body) > MAX_BODY_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=len(body))
        return body

    task = asyncio.create_task(server.answer(request.method, request.url.path, request.headers, read, send))
    try:
        await asyncio.wait({send.head, task}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the client was cancelled while it waited: the turn is undone
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    if not send.head.done():  # answer() ended without an answer: it raised
        task.result()
        raise httpx.RemoteProtocolError("the endpoint gave no answer")
    status, body = send.head.result()
    send.taken.set()
    if body is not None:
        await task
        extra = {"x-should-retry": "false"} if status >= 400 else {}
        return httpx.Response(status, headers={"content-type": "application/json", **extra}, content=body)
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Events(send, task))


def local_http_client(**kwargs: object) -> httpx.AsyncClient:
    """An `AsyncClient` whose requests reach this rollout process's agent endpoints in-process
    (give it to `openai.AsyncOpenAI(http_client=...)` or `anthropic.AsyncAnthropic(http_client=...)`)."""
    return httpx.AsyncClient(transport=LocalTransport(), timeout=None, **kwargs)
