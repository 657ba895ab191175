"""Connection limits: how many connections the coordinator holds open (the open-file limit
raised, or the cap lowered, to fit) and what a connection that sends nothing may hold
(`ConnectionGuard`)."""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, cast

from aiohttp import web

if TYPE_CHECKING:
    from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("mrlx.coordinator")

LISTEN_BACKLOG = 128
# Descriptors kept free of connections: the database's files, the log, the listening socket, and
# the sockets in flight. asyncio accepts up to LISTEN_BACKLOG sockets per wake-up of the listener,
# and a socket is counted (and an idle one closed to make room) two loop iterations after its
# accept, its descriptor freed one iteration after that: under a flood of connections, three
# batches are open beyond the counted ones. One more batch is margin.
FD_RESERVE = 64 + 4 * LISTEN_BACKLOG


def connection_cap(wanted: int) -> int:
    """How many connections may be open at once: `wanted`, with the soft RLIMIT_NOFILE raised (up
    to the hard limit) to hold them and FD_RESERVE more, or lowered to fit the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError) as exc:
                log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted
    cap = max(1, soft - FD_RESERVE)
    log.warning(
        "the open-file limit (RLIMIT_NOFILE %d, hard %s) holds %d connections, not %d: serving at most %d",
        soft,
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
        cap,
        wanted,
        cap,
    )
    return cap


class _ServerHooks(Protocol):
    """The calls an aiohttp `web.Server`'s connections make to it, as attributes a guard replaces."""

    connection_made: Callable[[RequestHandler, asyncio.Transport], None]
    connection_lost: Callable[[RequestHandler, BaseException | None], None]
    request_handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class ConnectionGuard:
    """Bounds what connections that send nothing can hold (file descriptors above all):

    - at most `cap` connections are open; past it, the one idle the longest (no request in
      progress, least recently active) is closed, so that a call coming in is still served (the
      new connection itself is closed only when every other one has a request in progress);
    - a connection that has not sent a complete first request header within `header_timeout_s`
      is closed. (Between requests aiohttp's `keepalive_timeout` does the same; older aiohttp
      versions did not time out a connection's first request.)

    It hooks an aiohttp `web.Server` through the calls that server's connections make to it:
    `connection_made`, `connection_lost` and `request_handler` (wrap it before the site starts).
    """

    REPORT_EVERY_S = 10.0

    def __init__(self, server: web.Server, cap: int, header_timeout_s: float) -> None:
        self.cap = cap
        self.header_timeout_s = header_timeout_s
        self._loop = asyncio.get_running_loop()
        # Open connections, least recently active first -> the timer of their first header (None
        # once a request has started); and the requests in progress per connection.
        self._conns: dict[RequestHandler, asyncio.TimerHandle | None] = {}
        self._busy: dict[RequestHandler, int] = {}
        self._closed = {"cap": 0, "header": 0}
        self._reported = 0.0
        hooks = cast(_ServerHooks, server)
        made, lost, handle = hooks.connection_made, hooks.connection_lost, hooks.request_handler

        def connection_made(protocol: RequestHandler, transport: asyncio.Transport) -> None:
            made(protocol, transport)
            self._opened(protocol)

        def connection_lost(protocol: RequestHandler, exc: BaseException | None = None) -> None:
            self._forget(protocol)
            lost(protocol, exc)

        async def request_handler(request: web.BaseRequest) -> web.StreamResponse:
            protocol = request.protocol
            self._started(protocol)
            try:
                return await handle(request)
            finally:
                self._finished(protocol)

        hooks.connection_made = connection_made
        hooks.connection_lost = connection_lost
        hooks.request_handler = request_handler
        log.info(
            "at most %d connections; one without a complete request header for %g s is closed",
            cap,
            header_timeout_s,
        )

    def _opened(self, protocol: RequestHandler) -> None:
        self._conns[protocol] = self._loop.call_later(self.header_timeout_s, self._header_due, protocol)
        if len(self._conns) > self.cap:
            # The oldest idle one; the new one (last, never busy yet) when all others are busy.
            self._close(next(p for p in self._conns if p not in self._busy), "cap")

    def _header_due(self, protocol: RequestHandler) -> None:
        if self._conns.get(protocol) is not None and protocol not in self._busy:
            self._close(protocol, "header")

    def _started(self, protocol: RequestHandler) -> None:
        if protocol in self._conns:
            timer = self._conns.pop(protocol)
            if timer is not None:
                timer.cancel()
            self._conns[protocol] = None  # now the most recently active
        self._busy[protocol] = self._busy.get(protocol, 0) + 1

    def _finished(self, protocol: RequestHandler) -> None:
        count = self._busy.pop(protocol, 0) - 1
        if count > 0:
            self._busy[protocol] = count
        if protocol in self._conns:
            self._conns[protocol] = self._conns.pop(protocol)

    def _forget(self, protocol: RequestHandler) -> None:
        timer = self._conns.pop(protocol, None)
        if timer is not None:
            timer.cancel()

    def _close(self, protocol: RequestHandler, reason: str) -> None:
        self._forget(protocol)
        protocol.force_close()
        self._closed[reason] += 1
        now = time.monotonic()
        if now - self._reported >= self.REPORT_EVERY_S:
            self._reported = now
            log.warning(
                "closed idle connections (so far: %d past the cap of %d open "
                "connections, the longest idle first; %d without a request header within %g s)",
                self._closed["cap"],
                self.cap,
                self._closed["header"],
                self.header_timeout_s,
            )
