"""A recording reverse proxy for an engine, run on its own thread: every `/generate` it forwards
is kept (the ids sent, the ids and log-probs returned). A streamed answer is passed on chunk by
chunk as it comes, and kept once it has ended, read as the engine client reads one
(`StreamedAnswer`), in the shape of a plain call's record. When the engine behind it is down it
answers 502, as a router with no live worker does."""

from __future__ import annotations

import asyncio
import threading

import orjson
from aiohttp import ClientError, ClientResponse, ClientSession, ClientTimeout, web

from mrlx_plugin.core.sglang import StreamedAnswer


class RecordingProxy:
    def __init__(self, target: str):
        self.target = target.rstrip("/")
        self.calls: list[dict] = []
        self.failed = 0
        self.streamed = 0  # calls in `calls` that were streamed
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            async with self._session.post(
                self.target + "/generate", data=body, headers={"Content-Type": "application/json"}
            ) as r:
                if r.status == 200 and r.content_type == "text/event-stream":
                    return await self._relay(request, orjson.loads(body), r)
                raw, status = await r.read(), r.status
        except (ClientError, asyncio.TimeoutError, ConnectionError):
            self.failed += 1
            return web.Response(status=502, text="engine unreachable")
        if status == 200:
            req, out = orjson.loads(body), orjson.loads(raw)
            entries = out["meta_info"].get("output_token_logprobs") or []
            self.calls.append(
                {
                    "input_ids": req["input_ids"],
                    "ids": [e[1] for e in entries],
                    "logprobs": [e[0] for e in entries],
                    "version": out["meta_info"].get("weight_version"),
                    "finish": out["meta_info"]["finish_reason"]["type"],
                }
            )
        return web.Response(body=raw, status=status, content_type="application/json")

    async def _relay(self, request: web.Request, req: dict, r: ClientResponse) -> web.StreamResponse:
        """Pass a streamed answer on as its bytes come; keep it once it has ended whole. A client
        that closes the stream closes the engine's too; a stream the engine cuts off is cut off."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        answer: StreamedAnswer | None = StreamedAnswer(None, len(req["input_ids"]), 1 << 26)
        try:
            async for chunk in r.content.iter_any():
                try:
                    for _ in answer.feed(chunk) if answer is not None else ():
                        pass
                except Exception:  # a malformed stream is passed on as it is, and not kept
                    answer = None
                await resp.write(chunk)
            await resp.write_eof()
        except ConnectionError:  # the client went away
            r.close()
            return resp
        except (ClientError, asyncio.TimeoutError):  # the engine's stream broke: so does this one
            if request.transport is not None:
                request.transport.close()
            return resp
        try:
            result = answer.result() if answer is not None else None
        except Exception:
            result = None
        if result is not None:
            self.streamed += 1
            self.calls.append(
                {
                    "input_ids": req["input_ids"],
                    "ids": result.token_ids,
                    "logprobs": result.logprobs,
                    "version": result.weight_version,
                    "finish": result.finish_reason,
                }
            )
        return resp

    async def _passthrough(self, request: web.Request) -> web.Response:
        try:
            async with self._session.request(
                request.method,
                self.target + request.path_qs,
                data=await request.read(),
                headers={"Content-Type": "application/json"},
            ) as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except (ClientError, asyncio.TimeoutError, ConnectionError):
            return web.Response(status=502, text="engine unreachable")

    async def _main(self) -> None:
        self._session = ClientSession(timeout=ClientTimeout(total=60))
        app = web.Application(client_max_size=1 << 26)
        app.router.add_post("/generate", self._generate)
        app.router.add_route("*", "/{tail:.*}", self._passthrough)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._ready.set()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._main())
        self._loop.run_forever()

    def start(self) -> RecordingProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            await self._runner.cleanup()
            await self._session.close()

        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
