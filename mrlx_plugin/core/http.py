"""The HTTP plumbing of the package's clients (the engine client and the coordinator client).

- One aiohttp session per event loop (`HttpClient`): a pool of keep-alive connections, bounded in
  number, reused across calls; sessions of loops that have ended are closed on the next call.
  Answers come uncompressed (`Accept-Encoding: identity`, no decompression): a body cap counts
  the bytes on the wire, and a small compressed answer cannot expand past it.
- The one policy of which failures may pass (`Passing`, retried by `mrlx_plugin.core.retry`
  until the call's deadline or retry budget) and which fail at once:
  * may pass: no connection, a connection closed or reset, no answer within the attempt's
    timeout, an answer that is not valid HTTP or is cut off, an answer over the client's cap,
    and the statuses in RETRYABLE_STATUS;
  * fail at once: every other status (the server refused the request itself: the caller must
    change something before a retry can succeed).
- Retry-After (`retry_after`): honoured up to MAX_RETRY_AFTER_S, by the clients that read it.
- Bounded body reads (`read_capped`): an answer is refused by its declared length before it is
  read, and an endless one once past the cap, so that an answer costs at most its cap in memory.
"""

from __future__ import annotations

import ast
import asyncio
import math
import re
import weakref
from collections.abc import Mapping

import aiohttp

# 429: backpressure. 502, 503, 504: a proxy or server that is starting, restarting or overloaded.
# 500: the server failed on this request without saying the request is wrong (a 4xx would). It is
# retried: every call of both clients is safe to repeat (a generation is stateless; coordinator
# calls are idempotent: commits by item key, acks by lease, each attempt signed afresh), the
# retries are bounded (the engine client's by `engine.max_retries`, the coordinator client's by
# its deadline), and an SGLang engine answers 500 for failures of one request that pass (a
# request caught in a weight update or a memory spike). The coordinator answers 500 only for an
# unexpected error in its own code, which a retry may well repeat: such a call ends, at its
# deadline, as `CoordinatorUnavailable` with the coordinator's message.
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
# Retry-After is honoured up to this many seconds: a longer wait (or a hostile value) would hold a
# call past any sensible deadline, and the coordinator's answer proof does not cover the header.
MAX_RETRY_AFTER_S = 60.0
USER_AGENT = "mrlx-plugin"
# aiohttp's own default: a connection idle this long is closed.
DEFAULT_KEEPALIVE_S = 15.0


class Passing(Exception):
    """A failed attempt that may pass (retried): `problem` says what failed (the message of the
    error raised once the retries end), `status` the HTTP status if an answer came, and
    `retry_after_s` the wait the server asked for (0: the backoff's)."""

    def __init__(self, problem: str, status: int | None = None, retry_after_s: float = 0.0) -> None:
        super().__init__(problem)
        self.problem, self.status, self.retry_after_s = problem, status, retry_after_s


class AnswerTooLarge(Passing):
    """An answer over the cap: `length` is its declared length, or None when it was cut off while
    being read (no length declared)."""

    def __init__(self, cap: int, length: int | None) -> None:
        super().__init__(
            f"the answer is over the {cap}-byte limit"
            if length is None
            else f"the answer is {length} bytes, over the {cap}-byte limit"
        )
        self.cap, self.length = cap, length


def is_passing(exc: BaseException) -> bool:
    """The `retryable` of `mrlx_plugin.core.retry.retry` for calls that raise `Passing`."""
    return isinstance(exc, Passing)


def retry_after(value: str | None) -> float:
    """Seconds of a Retry-After header (0 when absent or not a number of seconds), at most
    MAX_RETRY_AFTER_S."""
    try:
        seconds = float(value or 0)
    except ValueError:
        return 0.0
    return min(max(0.0, seconds), MAX_RETRY_AFTER_S) if math.isfinite(seconds) else 0.0


# What an HTTP exchange raises for a failure of the connection or of the answer (asyncio's
# TimeoutError is an OSError); `as_passing` says which it was.
TRANSPORT_ERRORS = (aiohttp.ClientError, OSError)


def as_passing(exc: BaseException, address: str, timeout: float) -> Passing:
    """The `Passing` of a TRANSPORT_ERRORS failure of one exchange with `address` (host:port)
    whose answer was given `timeout` seconds, its message naming the cause."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return Passing(f"connect to {address} timed out")
    if isinstance(exc, asyncio.TimeoutError):
        return Passing(f"no answer within {timeout:.1f}s")
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = getattr(exc, "os_error", None)  # certificate errors carry none
        why = getattr(os_error, "strerror", None) or _first_line(str(os_error or exc))
        return Passing(f"cannot connect to {address}: {why}")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return Passing("connection closed before the answer (by the server)")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return Passing(f"the answer was cut off ({_first_line(str(exc))})")
    if isinstance(exc, aiohttp.ClientResponseError):  # the response parser refused the answer
        return Passing(_not_http(exc.message))
    return Passing(f"{type(exc).__name__}: {_first_line(str(exc))}")


async def read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The answer's body, at most `cap` bytes: refused by its declared length before a byte of it
    is read, else read in chunks and refused once past the cap, so that an endless body costs one
    chunk of memory beyond the cap, not the bytes the server keeps sending (AnswerTooLarge)."""
    length = resp.content_length
    if length is not None and length > cap:
        raise AnswerTooLarge(cap, length)
    content = resp.content
    chunks: list[bytes] = []
    size = 0
    while chunk := await content.readany():
        size += len(chunk)
        if size > cap:
            chunks.clear()
            raise AnswerTooLarge(cap, None)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class HttpClient:
    """A client's aiohttp sessions, one per event loop: safe to share between the tasks and the
    event loops of one process (the host may run `asyncio.run` again with the same client).

    `headers` go with every request from the session itself (headers given per request are merged
    into a new set on every call: measurable at thousands of calls per second); at most
    `max_connections` are open at once, an idle one is closed after `keepalive_s`, and opening one
    may take at most `connect_timeout_s` (None: within the request's own timeout)."""

    def __init__(
        self,
        headers: Mapping[str, str],
        *,
        max_connections: int,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        connect_timeout_s: float | None = None,
    ) -> None:
        # Naming Accept-Encoding here rather than in `skip_auto_headers` keeps aiohttp on its fast
        # path (no per-call copy of the headers).
        self._headers = {"Accept-Encoding": "identity", "User-Agent": USER_AGENT, **headers}
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._connect_timeout_s = connect_timeout_s
        self._sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
            weakref.WeakKeyDictionary()
        )
        self._last: tuple[asyncio.AbstractEventLoop, aiohttp.ClientSession] | None = None
        self._closing: set[asyncio.Task] = set()

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        """One exchange's timeout: `total` seconds for all of it, the connect timeout to connect."""
        return aiohttp.ClientTimeout(total=total, sock_connect=self._connect_timeout_s)

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        last = self._last
        if last is not None and last[0] is loop:
            return last[1]  # the common case: one loop for the whole process
        session = self._sessions.get(loop)
        if session is None or session.closed:
            self._forget_closed_loops(loop)
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, limit_per_host=0, keepalive_timeout=self._keepalive_s
            )
            session = self._sessions[loop] = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),  # the servers set no cookies: skip the jar's work
                auto_decompress=False,  # whatever comes, the capped bytes are what is read
                headers=self._headers,
            )
        self._last = (loop, session)
        return session

    def _forget_closed_loops(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the sessions of event loops that have ended (the host ran `asyncio.run` again).

        Nothing of a closed loop can be awaited, and closing such a session awaits nothing of
        it: it only marks the session closed and drops its pool, so no "unclosed client
        session" report comes when it is collected."""
        for stale in self._pop_closed_loops():
            task = loop.create_task(stale.close())
            self._closing.add(task)  # the loop holds tasks weakly
            task.add_done_callback(self._closing.discard)

    def _pop_closed_loops(self) -> list[aiohttp.ClientSession]:
        return [self._sessions.pop(other) for other in list(self._sessions) if other.is_closed()]

    async def close(self) -> None:
        """Close this event loop's connections (and the sessions of loops that have ended)."""
        loop = asyncio.get_running_loop()
        sessions = self._pop_closed_loops()
        mine = self._sessions.pop(loop, None)
        if mine is not None:
            sessions.append(mine)
        if self._last is not None and (self._last[0] is loop or self._last[0].is_closed()):
            self._last = None
        for session in sessions:
            await session.close()


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0][:200]


# The response parser quotes the offending line: b'HTTP/1.1 2OO OK' (C parser) or 'HTTP/1.1 2OO OK'.
_QUOTED = re.compile(r"b?'(?:[^'\\]|\\.)*'" + r'|b?"(?:[^"\\]|\\.)*"')


def _quoted_line(message: str) -> str | None:
    match = _QUOTED.search(message)
    if match is None:
        return None
    try:
        value = ast.literal_eval(match.group(0))
    except (ValueError, SyntaxError):
        return None
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _not_http(message: str) -> str:
    """Why an answer is not HTTP/1.1, from the response parser's message."""
    line = _quoted_line(message)
    if message.startswith("Bad status line"):
        return f"not an HTTP/1.1 status line: {(line or _first_line(message))[:80]!r}"
    if "content-length" in message.lower():
        name, sep, value = (line or "").partition(":")
        if sep and name.strip().lower() == "content-length":
            return f"bad Content-Length in the answer: {value.strip()[:40]!r}"
        return f"bad Content-Length in the answer ({_first_line(message)})"
    what = _first_line(message).rstrip(":")
    return (
        f"not a valid HTTP/1.1 answer ({what}: {line[:80]!r})"
        if line
        else f"not a valid HTTP/1.1 answer ({what})"
    )
