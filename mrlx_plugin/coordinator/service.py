"""The coordinator service: its aiohttp application (`Coordinator.build_app`), the middlewares
every request goes through (errors as one JSON message, signatures, size and encoding limits,
heartbeats), and the routes of health, the OpenAPI document, agents and metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import cast

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST

from mrlx_plugin.coordinator.access import CHALLENGE, CONTENT_KEY
from mrlx_plugin.coordinator.bodies import HeartbeatBody, HttpProblem, VersionBody, WaitBody
from mrlx_plugin.coordinator.config import RETRY_AFTER_S
from mrlx_plugin.coordinator.database import StoreError
from mrlx_plugin.coordinator.openapi import openapi_document
from mrlx_plugin.coordinator.queues import QueueHandlers
from mrlx_plugin.coordinator.routes import ENDPOINT_NAMES, ROUTES
from mrlx_plugin.coordinator.state import pulse, seen_phrase
from mrlx_plugin.coordinator.storage import QueueStats
from mrlx_plugin.link.auth import content_sha256

log = logging.getLogger("mrlx.coordinator")


class Coordinator(QueueHandlers):
    """The service's state and handlers; `build_app()` gives the aiohttp application."""

    def build_app(self) -> web.Application:
        max_bytes = int(self.config.max_request_mb * (1 << 20))
        app = web.Application(client_max_size=max_bytes, middlewares=[self._errors, self._auth])
        for route in ROUTES:
            name = ENDPOINT_NAMES.get(route.handler, route.handler)
            app.router.add_route(route.method, route.path, getattr(self, route.handler), name=name)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._flusher = asyncio.create_task(self._flush_heartbeats_forever())

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            try:
                await self._flusher
            except asyncio.CancelledError:
                pass
        await self._flush_heartbeats()
        self._cpu.shutdown(wait=False)

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every failure becomes a JSON error with one message; every request is counted."""
        route = request.match_info.route
        endpoint = route.name if route is not None and route.name else "unmatched"
        try:
            response = await handler(request)
        except HttpProblem as exc:
            response = self._error_response(exc.status, exc.message, exc.headers)
        except StoreError as exc:
            headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None
            if exc.status >= 500:
                log.error("%s %s: %s", request.method, request.path, exc.message)
            response = self._error_response(exc.status, exc.message, headers)
        except web.HTTPException as exc:
            message = exc.text or exc.reason
            if exc.status == 413:
                message = (
                    f"request body is over the coordinator's limit of {self.config.max_request_mb:g} MB "
                    "(--max-request-mb); send fewer items per request"
                )
            elif exc.status == 404:
                message = f"no route {request.method} {request.path}; see /openapi.json"
            elif exc.status == 405:
                message = f"method {request.method} is not allowed on {request.path}; see /openapi.json"
            response = self._error_response(exc.status, message, None)
        except RequestPayloadError as exc:  # a body that cannot be read as sent (bad compression, cut chunks)
            message = str(exc).replace("\n", " ").strip()
            response = self._error_response(
                400, f"{request.method} {request.path}: the request body could not be read: {message}", None
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug, not bad input: say so and keep serving
            log.exception("unexpected error on %s %s", request.method, request.path)
            response = self._error_response(500, f"internal error: {type(exc).__name__}: {exc}", None)
        self.metrics.inc("mrlx_coordinator_requests_total", endpoint=endpoint, status=str(response.status))
        if isinstance(response, web.Response) and not response.prepared:
            # the handlers' answers hold bytes (never a streamed payload)
            self.signing.prove(request, response, content_sha256(cast("bytes | None", response.body)))
        return response

    @staticmethod
    def _error_response(status: int, message: str, headers: dict[str, str] | None) -> web.Response:
        return web.Response(
            status=status,
            body=orjson.dumps({"error": message}),
            content_type="application/json",
            headers=headers,
        )

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """A signed request on everything but /health and /openapi.json; size limit; heartbeats."""
        problem = self.signing.authenticate(request)
        if problem is None and request.method == "GET" and request.get(CONTENT_KEY) is not None:
            # The handlers of GET routes read no body: its hash is checked here (POST handlers check theirs).
            try:
                await self.signing.check_content(request, await request.read())
            except HttpProblem as exc:
                problem = exc.status, exc.message
                del request[CONTENT_KEY]
        if request.path in ("/health", "/openapi.json"):
            return await handler(request)  # open: a signed request gets the details, others do not
        if problem is not None:
            status, message = problem
            raise HttpProblem(
                status,
                message,
                {"Retry-After": "0"} if status == 503 else {"WWW-Authenticate": CHALLENGE},
            )
        for param, what in (("consumer", "consumer"), ("agent", "agent")):
            # an unknown path is 404 whatever the body (checked again by the handler)
            if param in request.match_info and "run" in request.match_info:
                self._check_run(request.match_info["run"])
                self._known_agent(request.match_info[param], what)
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            # Bodies are taken as sent (the server does not decompress): a compressed body could
            # unpack far past the size limit, and the client never compresses.
            raise HttpProblem(
                415,
                f"{request.method} {request.path}: Content-Encoding {encoding!r} is not accepted; send the "
                "body uncompressed",
            )
        length = request.content_length
        if length is not None and length > self.config.max_request_mb * (1 << 20):
            raise web.HTTPRequestEntityTooLarge(
                max_size=int(self.config.max_request_mb * (1 << 20)), actual_size=length
            )
        if "run" in request.match_info:
            self._check_run(request.match_info["run"])
            self._record_identity(request)
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        if not self.signing.authenticated(request):
            return self._json({"ok": True})  # alive, and nothing about the run
        return self._json(
            {
                "ok": True,
                "status": "ok",
                "run_id": self.config.run_id,
                "uptime_s": round(time.time() - self.started, 3),
                "db": self.config.db,
            }
        )

    async def openapi(self, request: web.Request) -> web.Response:
        if not self.signing.authenticated(request):
            return self._json(openapi_document())
        return self._json(openapi_document(self.config.run_id, self.agents))

    def _agent_json(self, agent: str) -> dict[str, object]:
        now = time.time()
        version = self.versions.get(agent)
        beat = self.heartbeats.get(agent)
        return {
            "agent": agent,
            "version": None if version is None else version[0],
            "version_updated_s_ago": None if version is None else round(now - version[1], 3),
            "last_seen_s_ago": None if beat is None else round(now - beat[0], 3),
            "pid": None if beat is None else beat[1],
            "host": None if beat is None else beat[2],
        }

    async def run_info(self, request: web.Request) -> web.Response:
        stats = await self.store.queue_stats(time.time())
        return self._json(
            {
                "run_id": self.config.run_id,
                "agents": {agent: self._agent_json(agent) for agent in self.agents},
                "queues": {
                    agent: self._queue_json(agent, stats.get(agent, QueueStats())) for agent in self.agents
                },
            }
        )

    async def heartbeat(self, request: web.Request) -> web.Response:
        agent = self._known_agent(request.match_info["agent"], "agent")
        body = await self._read_json(request, HeartbeatBody)
        self._beat(agent, body.pid, body.host)
        return self._json(self._agent_json(agent))

    async def report_version(self, request: web.Request) -> web.Response:
        agent = self._known_agent(request.match_info["agent"], "agent")
        body = await self._read_json(request, VersionBody)
        version = body.version
        current = self.versions.get(agent)
        if current is not None and version <= current[0]:
            # Monotonic: an older (or repeated) report is not an error, it just changes nothing.
            return self._json({"agent": agent, "version": current[0], "accepted": version == current[0]})
        now = time.time()
        self.versions[agent] = (version, now)
        pulse(self._version_events, agent)  # wake waiters first; the fsync below takes milliseconds
        await self.store.save_version(agent, version, now)
        return self._json({"agent": agent, "version": version, "accepted": True})

    async def get_version(self, request: web.Request) -> web.Response:
        agent = self._known_agent(request.match_info["agent"], "agent")
        return self._json(self._agent_json(agent))

    async def wait_version(self, request: web.Request) -> web.Response:
        agent = self._known_agent(request.match_info["agent"], "agent")
        body = await self._read_json(request, WaitBody)
        wanted = body.min_version
        loop = asyncio.get_running_loop()
        deadline = loop.time() + body.timeout_s
        self._wait_started("version")
        timed_out = False
        try:
            while True:
                event = self._version_events.setdefault(agent, asyncio.Event())
                current = self.versions.get(agent)
                if current is not None and current[0] >= wanted:
                    return self._json(
                        {"agent": agent, "reached": True, "version": current[0], "message": None}
                    )
                remaining = deadline - loop.time()
                if remaining <= 0:
                    timed_out = True
                    now = time.time()
                    where = (
                        "has reported no version yet" if current is None else f"is at version {current[0]}"
                    )
                    message = (
                        f"agent {agent!r} {where}, waiting for >= {wanted}; "
                        f"{seen_phrase(self.heartbeats.get(agent), now)}"
                    )
                    return self._json(
                        {
                            "agent": agent,
                            "reached": False,
                            "version": None if current is None else current[0],
                            "message": message,
                            "last_seen_s_ago": self._agent_json(agent)["last_seen_s_ago"],
                        }
                    )
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._wait_ended("version", timed_out)

    # ----------------------------------------------------------------- metrics

    async def metrics_text(self, request: web.Request) -> web.Response:
        now = time.time()
        stats = await self.store.queue_stats(now)
        put = self.metrics.set
        put("mrlx_coordinator_uptime_seconds", now - self.started)
        for consumer in self.agents:
            queue = stats.get(consumer, QueueStats())
            put("mrlx_coordinator_queue_items", queue.queued_items, consumer=consumer, state="queued")
            put("mrlx_coordinator_queue_items", queue.leased_items, consumer=consumer, state="leased")
            put("mrlx_coordinator_queue_ready_groups", queue.ready_groups, consumer=consumer)
            put("mrlx_coordinator_queue_dead_items", queue.dead_items, consumer=consumer)
            put("mrlx_coordinator_queue_incomplete_groups", queue.incomplete_groups, consumer=consumer)
            oldest = 0.0 if queue.oldest_created is None else max(0.0, now - queue.oldest_created)
            put("mrlx_coordinator_queue_oldest_item_age_seconds", oldest, consumer=consumer)
            put("mrlx_coordinator_queue_ended", 1.0 if consumer in self.ended else 0.0, consumer=consumer)
        for agent in self.agents:
            version = float(self.versions[agent][0]) if agent in self.versions else -1.0
            put("mrlx_coordinator_agent_version", version, agent=agent)
            seen = now - self.heartbeats[agent][0] if agent in self.heartbeats else -1.0
            put("mrlx_coordinator_agent_last_seen_seconds", seen, agent=agent)
        for kind, count in self._waits.items():
            put("mrlx_coordinator_waits_in_progress", float(count), kind=kind)
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": CONTENT_TYPE_LATEST, "X-Content-Type-Options": "nosniff"},
        )
