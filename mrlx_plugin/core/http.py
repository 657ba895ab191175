"""A small HTTP/1.1 client for the engine calls on the rollout's hot path.

A rollout process makes thousands of `/generate` calls per second to a handful of URLs. A
general-purpose client spends more CPU per call than the rest of the plugin together (aiohttp's,
measured with `mrlx bench rollout`: +0.2 ms per call, and a critical path over its goal), so
the engine client uses this one: keep-alive connections pooled per event loop and bounded,
requests written in one piece, responses read with Content-Length or chunked encoding, a
deadline per request. It speaks only what SGLang servers and the sglang-router answer with.

Whatever a server sends, a request ends at once with `HTTPError` (retryable) when the answer is
not HTTP/1.1 (a status line, a header or a chunk size that does not parse), and when its body
grows past `max_body` bytes (a Content-Length over it is refused before any body is read; a
chunked or unbounded body is cut off there), so memory per call stays bounded.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections import deque
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 32 * 1024 * 1024  # a 32k-token answer with its log-probs is about 1.2 MB
_MAX_CHUNK_LINE = 1024


class HTTPError(ConnectionError):
    """The connection failed or the answer was not valid HTTP/1.1 (retryable)."""


class _ClosedBeforeAnswer(HTTPError):
    """The server closed the connection before sending a byte of the answer."""


class _Response(asyncio.Protocol):
    """One keep-alive connection; reads one response at a time into a future."""

    def __init__(self, max_body: int = MAX_BODY_BYTES) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self.max_body = max_body
        self._head: tuple[int, bool, bool] | None = None  # status, chunked, close
        self._length = -1
        self._body = bytearray()  # a chunked body decoded so far
        self._chunk_left = 0  # bytes of the current chunk still to come (+2 for its CRLF), or 0
        self._trailers = False  # the last chunk was read; its trailers and empty line follow

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is None or self.waiter.done():
            return
        try:
            result = self._parse()  # a body that runs to the end of the connection is complete now
        except HTTPError as err:
            self.buf.clear()
            self._body.clear()
            self.waiter.set_exception(err.with_traceback(None))
            return
        if result is not None:
            self.waiter.set_result(result)
        else:
            error = _ClosedBeforeAnswer if self._head is None and not self.buf else HTTPError
            self.waiter.set_exception(error(f"connection closed before the answer ({exc or 'by the server'})"))

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():  # nobody asked: a server out of step is not reused
            self.buf.clear()
            self.close()
            return
        self.buf += data
        try:
            result = self._parse()
        except HTTPError as exc:
            self.close()
            self.waiter.set_exception(exc.with_traceback(None))  # no frames (and their buffers) kept
            return
        if result is not None:
            self.waiter.set_result(result)

    def _parse(self) -> tuple[int, bytes, bool] | None:
        try:
            return self._parse_unchecked()
        except HTTPError:
            raise
        except (ValueError, IndexError, OverflowError) as exc:  # never leave the waiter hanging
            raise HTTPError(f"not a valid HTTP/1.1 answer ({type(exc).__name__}: {exc})") from None

    def _parse_unchecked(self) -> tuple[int, bytes, bool] | None:
        if self._head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEADER_BYTES:
                    raise HTTPError("response headers too large")
                return None
            if end > MAX_HEADER_BYTES:
                raise HTTPError("response headers too large")
            head = bytes(self.buf[:end]).decode("latin-1")
            lines = head.split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not (
                len(parts[1]) == 3 and parts[1].isdigit() and parts[1].isascii()
            ):
                raise HTTPError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
            status = int(parts[1])
            length, chunked, close = -1, False, parts[0] == "HTTP/1.0"
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    value = value.strip()
                    if not (value.isdigit() and value.isascii()) or (length >= 0 and int(value) != length):
                        raise HTTPError(f"bad Content-Length in the answer: {value[:40]!r}")
                    length = int(value)
                elif name == "transfer-encoding" and "chunked" in value.lower():
                    chunked = True
                elif name == "connection":
                    close = "close" in value.lower()
            if not chunked and length > self.max_body:
                raise HTTPError(f"the answer is {length} bytes, over the {self.max_body}-byte limit")
            del self.buf[: end + 4]
            self._head = (status, chunked, close)
            self._length = length
            self._body = bytearray()
            self._chunk_left = 0
            self._trailers = False
        status, chunked, close = self._head
        if chunked:
            body = self._dechunk()
            if body is None:
                return None
            self._head = None
            return status, body, close
        if self._length < 0:  # no length: the body runs to the end of the connection
            if len(self.buf) > self.max_body:
                raise HTTPError(f"the answer is over the {self.max_body}-byte limit")
            if not self.closed:
                return None
            body = bytes(self.buf)
            del self.buf[:]
            self._head = None
            return status, body, True
        if len(self.buf) < self._length:
            return None
        body = bytes(self.buf[: self._length])
        del self.buf[: self._length]
        self._head = None
        return status, body, close

    def _dechunk(self) -> bytes | None:
        """Decode the chunks received so far (each byte once); the body when the last has come."""
        buf, out = self.buf, self._body
        while True:
            if self._trailers:  # optional trailer lines, then an empty line
                if buf[:2] == b"\r\n":
                    del buf[:2]
                    body = bytes(out)
                    self._body = bytearray()
                    return body
                t = buf.find(b"\r\n\r\n")
                if t < 0:
                    if len(buf) > MAX_HEADER_BYTES:
                        raise HTTPError("chunked answer trailers too large")
                    return None
                del buf[: t + 2]  # leave the empty line for the check above
                continue
            if self._chunk_left:
                if len(buf) < self._chunk_left:
                    take = max(0, min(len(buf), self._chunk_left - 2))
                    out += buf[:take]
                    del buf[:take]
                    self._chunk_left -= take
                    return None
                if buf[self._chunk_left - 2 : self._chunk_left] != b"\r\n":
                    raise HTTPError("a chunk of the chunked answer does not end with CRLF")
                out += buf[: self._chunk_left - 2]
                del buf[: self._chunk_left]
                self._chunk_left = 0
                if len(out) > self.max_body:
                    raise HTTPError(f"the answer is over the {self.max_body}-byte limit")
                continue
            eol = buf.find(b"\r\n", 0, _MAX_CHUNK_LINE)
            if eol < 0:
                if len(buf) >= _MAX_CHUNK_LINE:
                    raise HTTPError("bad chunk size line in a chunked answer")
                return None
            text = bytes(buf[:eol]).split(b";")[0].strip()
            if not text or any(c not in b"0123456789abcdefABCDEF" for c in text):
                raise HTTPError(f"bad chunk size in a chunked answer: {bytes(buf[:eol])[:40]!r}")
            size = int(text, 16)
            del buf[: eol + 2]
            if size == 0:
                self._trailers = True
                continue
            if len(out) + size > self.max_body:
                raise HTTPError(f"the answer is over the {self.max_body}-byte limit")
            self._chunk_left = size + 2

    def close(self) -> None:
        self.closed = True
        # A cut-off answer's bytes go now (cleared in place: a traceback may still hold them).
        self.buf.clear()
        self._body.clear()
        if self.transport is not None:
            self.transport.close()


class HTTPPool:
    """Keep-alive connections to one origin, for one event loop, at most `limit` at once."""

    def __init__(self, url: str, limit: int, connect_timeout: float, max_body: int = MAX_BODY_BYTES):
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
        self.max_body = max_body

    async def _connection(self) -> tuple[_Response, bool]:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Response(self.max_body), self.host, self.port, ssl=self.ssl),
                self.connect_timeout,
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
                except _ClosedBeforeAnswer:
                    conn.close()
                    # A kept-alive connection the server had already closed: try once on a new one.
                    if reused and fresh_retry:
                        continue
                    raise
                except HTTPError:
                    conn.close()
                    raise
                except BaseException:  # timeout or cancellation: the connection is in an unknown state
                    conn.close()
                    raise
                conn.waiter = None
                if close or conn.closed or conn.buf:  # bytes past the answer: out of step, not reused
                    conn.close()
                else:
                    self.idle.append(conn)
                return status, data
        raise HTTPError("unreachable")  # pragma: no cover

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()
