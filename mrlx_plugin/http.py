"""A small HTTP/1.1 client for the engine calls on the rollout's hot path.

A rollout process makes thousands of `/generate` calls per second to a handful of URLs. A
general-purpose client spends more CPU per call than the rest of the plugin together, so the
engine client uses this one: keep-alive connections pooled per event loop and bounded, requests
written in one piece, responses read with Content-Length or chunked encoding, a deadline per
request. It speaks only what SGLang servers and the sglang-router answer with.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections import deque
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024


class HTTPError(ConnectionError):
    """The connection failed or the answer was not valid HTTP/1.1 (retryable)."""


class _Response(asyncio.Protocol):
    """One keep-alive connection; reads one response at a time into a future."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self._head: tuple[int, int, bool, bool] | None = None  # status, header end, chunked, close
        self._length = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is None or self.waiter.done():
            return
        try:
            result = self._parse()  # a body that runs to the end of the connection is complete now
        except HTTPError as err:
            self.waiter.set_exception(err)
            return
        if result is not None:
            self.waiter.set_result(result)
        else:
            self.waiter.set_exception(HTTPError(f"connection closed before the answer ({exc or 'by the server'})"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is None or self.waiter.done():
            return
        try:
            result = self._parse()
        except HTTPError as exc:
            self.waiter.set_exception(exc)
            self.close()
            return
        if result is not None:
            self.waiter.set_result(result)

    def _parse(self) -> tuple[int, bytes, bool] | None:
        if self._head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEADER_BYTES:
                    raise HTTPError("response headers too large")
                return None
            head = bytes(self.buf[:end]).decode("latin-1")
            lines = head.split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
                raise HTTPError(f"not an HTTP/1.1 response: {lines[0][:80]!r}")
            status = int(parts[1])
            length, chunked, close = -1, False, parts[0] == "HTTP/1.0"
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value.strip())
                elif name == "transfer-encoding" and "chunked" in value.lower():
                    chunked = True
                elif name == "connection":
                    close = "close" in value.lower()
            self._head = (status, end + 4, chunked, close)
            self._length = length
        status, start, chunked, close = self._head
        if chunked:
            body = self._dechunk(start)
            if body is None:
                return None
            return status, body, close
        if self._length < 0:  # no length: the body runs to the end of the connection
            if not self.closed:
                return None
            body = bytes(self.buf[start:])
            del self.buf[:]
            self._head = None
            return status, body, True
        if len(self.buf) - start < self._length:
            return None
        body = bytes(self.buf[start : start + self._length])
        del self.buf[: start + self._length]
        self._head = None
        return status, body, close

    def _dechunk(self, start: int) -> bytes | None:
        out = bytearray()
        pos, buf = start, self.buf
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            try:
                size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
            except ValueError:
                raise HTTPError("bad chunk size in a chunked response") from None
            if size == 0:  # last chunk, then optional trailers, then an empty line
                if len(buf) < eol + 4:
                    return None
                if buf[eol + 2 : eol + 4] == b"\r\n":
                    end = eol + 4
                else:
                    t = buf.find(b"\r\n\r\n", eol + 2)
                    if t < 0:
                        return None
                    end = t + 4
                del buf[:end]
                self._head = None
                return bytes(out)
            if len(buf) < eol + 2 + size + 2:
                return None
            out += buf[eol + 2 : eol + 2 + size]
            pos = eol + 2 + size + 2

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class HTTPPool:
    """Keep-alive connections to one origin, for one event loop, at most `limit` at once."""

    def __init__(self, url: str, limit: int, connect_timeout: float):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl_module.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        host_header = self.host if ":" not in self.host else f"[{self.host}]"
        self.host_header = f"{host_header}:{self.port}".encode()
        self.idle: deque[_Response] = deque()
        self.slots = asyncio.Semaphore(limit)
        self.connect_timeout = connect_timeout

    async def _connection(self) -> tuple[_Response, bool]:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Response, self.host, self.port, ssl=self.ssl), self.connect_timeout
            )
        except asyncio.TimeoutError:
            raise HTTPError(f"connect to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise HTTPError(f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        return conn, False

    async def request(
        self, method: str, path: str, body: bytes | None, timeout: float, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        """Send one request and return (status, body). Raises HTTPError or asyncio.TimeoutError."""
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method.encode(), (self.prefix + path).encode(), self.host_header)
        for name, value in (headers or {}).items():
            head += f"{name}: {value}\r\n".encode("latin-1")
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        head += b"\r\n"
        async with self.slots:
            for fresh_retry in (True, False):
                conn, reused = await self._connection()
                conn.waiter = asyncio.get_running_loop().create_future()
                assert conn.transport is not None
                conn.transport.write(head)
                if body:
                    conn.transport.write(body)  # no joined copy of a large body
                try:
                    status, data, close = await asyncio.wait_for(conn.waiter, timeout)
                except HTTPError:
                    conn.close()
                    # A kept-alive connection the server had already closed: try once on a new one.
                    if reused and fresh_retry:
                        continue
                    raise
                except BaseException:  # timeout or cancellation: the connection is in an unknown state
                    conn.close()
                    raise
                conn.waiter = None
                if close or conn.closed:
                    conn.close()
                else:
                    self.idle.append(conn)
                return status, data
        raise HTTPError("unreachable")  # pragma: no cover

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()
