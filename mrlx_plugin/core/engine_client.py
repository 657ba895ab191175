"""Token-in/token-out calls to an SGLang engine (or router) over HTTP: `EngineClient.generate`.

One `EngineClient` per URL per process, holding an aiohttp session (a pool of keep-alive
connections) per event loop, so a rollout reuses its connections across thousands of calls.
Every call has a deadline and a cap on the size of the answer. What the request holds and how
the answer is read and checked is the protocol's (`mrlx_plugin.core.sglang`); which failures may
pass is the package's one policy (`mrlx_plugin.core.http`: connection resets, timeouts, HTTP
429/500/502/503/504, an answer that is not valid HTTP or larger than the cap; and here an answer
that is not the protocol's JSON).

One call is one retry loop (`generate`), written out below: a failure that may pass is retried
at most `engine.max_retries` times with exponential backoff and jitter (`core.retry.Backoff`),
none whose wait would cross the call's deadline; other failures raise `EngineError` at once, and
an answer whose values cannot be right raises `MalformedAnswer`, never retried. A call to a
peer's engine (`PeerRetry`) also retries an `abort` answer and a fault that outlived those
retries, after a fixed wait, until its deadline: the peer updates its weights meanwhile
(docs/guarantees.md, "Engine faults and retries").

A call with `on_tokens` streams: the answer comes as chunks (`StreamedAnswer`), each chunk's new
ids are awaited in `on_tokens` as it arrives, and the result is the one the same answer gives
unstreamed. Such a call is retried like any other until `on_tokens` has first been called; a
failure after that ends it (`EngineError`, `retryable` False): the caller has shown tokens of an
answer that will not be the one returned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import orjson
from yarl import URL

from mrlx_plugin.core.config import EngineSettings
from mrlx_plugin.core.http import (
    RETRYABLE_STATUS,
    TRANSPORT_ERRORS,
    AnswerTooLarge,
    HttpClient,
    Passing,
    as_passing,
    read_capped,
)
from mrlx_plugin.core.retry import Backoff, Deadline
from mrlx_plugin.core.sglang import (
    GenerateResult,
    Malformed,
    NotTheProtocol,
    StreamedAnswer,
    StreamRefused,
    answer_limits,
    generate_body,
    read_answer,
    requested_max,
    too_many_bytes,
)
from mrlx_plugin.core.values import JSON

MAX_BODY_BYTES = 32 * 1024 * 1024  # a 32k-token answer with its log-probs is about 1.4 MB
# Idle connections are dropped before SGLang's HTTP server (uvicorn, 5 s keep-alive) drops them,
# so a call rarely lands on a connection the server is closing at that moment.
KEEPALIVE_S = 4.0


class EngineError(RuntimeError):
    """An engine call that failed for good (after retries, or with a non-retryable answer)."""

    def __init__(self, url: str, reason: str, attempts: int = 1, retryable: bool = True):
        super().__init__(f"{url}: {reason} (after {attempts} attempt{'s' if attempts != 1 else ''})")
        self.url = url
        self.reason = reason
        self.attempts = attempts
        # False: the engine refused the request itself (HTTP 4xx, an error event in a stream), or a
        # stream failed after tokens of it were passed on: a retry cannot help, or must not happen.
        self.retryable = retryable


class MalformedAnswer(EngineError):
    """An answer in the protocol's shape whose values cannot be right (not retried)."""

    def __init__(self, url: str, reason: str, attempts: int = 1):
        super().__init__(url, f"malformed answer: {reason}", attempts, retryable=False)
        self.detail = reason


@dataclass(frozen=True)
class PeerRetry:
    """How a call to a peer agent's engine is retried beyond its faults: the peer aborts calls
    (`finish_reason: abort`) and drops connections while it updates its weights, so an `abort`
    answer, or a fault that outlived the call's `max_retries`, is tried again after `wait_s`
    (fixed: the update takes what it takes), with a fresh set of retries, until the deadline.

    `alive()` runs before every attempt and `failed(error)` before each such wait (error None: an
    `abort` answer); either raises to end the call. What ends the call (an answer, the last
    `abort` answer before the deadline, the error raised) is not passed to `failed`."""

    wait_s: float
    alive: Callable[[], None]
    failed: Callable[[EngineError | None], Awaitable[None]]


class EngineClient(HttpClient):
    """Calls one engine URL. Safe to share between tasks and event loops of one process."""

    def __init__(
        self,
        url: str,
        settings: EngineSettings | None = None,
        api_key: str | None = None,
        max_answer_bytes: int = MAX_BODY_BYTES,
    ):
        self.url = url.rstrip("/")
        base = URL(self.url)
        if base.scheme not in ("http", "https") or not base.host:
            raise ValueError(f"engine URL {url!r} is not an http(s) URL; give one like http://host:30000")
        self.settings = settings or EngineSettings()
        s = self.settings
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        super().__init__(
            headers,
            max_connections=s.max_connections,
            keepalive_s=KEEPALIVE_S,
            connect_timeout_s=s.connect_timeout_s,
        )
        self.max_answer_bytes = max_answer_bytes  # a larger (or endless) answer is cut off: retryable
        self._generate_url = URL(self.url + "/generate")
        self._address = f"{base.host}:{base.port}"
        self._backoff = Backoff(base_s=s.backoff_s, max_s=s.max_backoff_s)

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: Mapping[str, object],
        *,
        deadline: float | None = None,
        extra: Mapping[str, object] | None = None,
        peer: PeerRetry | None = None,
        on_tokens: Callable[[list[int]], Awaitable[object]] | None = None,
    ) -> GenerateResult:
        """POST `/generate` with `input_ids` and return what the engine sampled.

        `deadline` is a `time.monotonic()` instant after which no attempt starts. Raises
        EngineError when the call cannot succeed (MalformedAnswer for an answer whose values
        cannot be right). Without `peer` an `abort` answer is returned as it came; with it, see
        `PeerRetry`. The result's `retries` counts the attempts retried behind it.

        With `on_tokens` the request asks for a stream, and the new ids of each chunk (as the
        engine sampled them, a matched stop token included) are awaited in `on_tokens` as they
        arrive: a slow `on_tokens` holds the stream back. The ids passed on add up to the
        result's `token_ids`. Once it has been called, a failure is not retried (EngineError,
        `retryable` False). What `on_tokens` raises ends the call as it is (the stream is
        closed; the engine aborts the request). An engine that answers with a whole answer
        instead is read as one, and `on_tokens` is not called. Not with `peer`, whose calls are
        retried after an `abort` answer.
        """
        if on_tokens is not None and peer is not None:
            raise ValueError(
                "on_tokens cannot be given with peer: a peer's call is retried after an abort answer, "
                "so the tokens passed on would not be those of the answer returned"
            )
        payload = generate_body(input_ids, sampling_params, extra, stream=on_tokens is not None)
        n_input, max_new = len(input_ids), requested_max(sampling_params)
        del input_ids  # the caller's list need not live while the engine works
        where = self.url + "/generate"
        until = Deadline.until(deadline)
        attempts = faults = 0  # faults: failures that may pass since the last fresh set of retries
        last = "no attempt made"
        while True:
            if peer is not None:
                peer.alive()
            timeout = until.clip(self.settings.request_timeout_s)  # no attempt runs past the deadline
            if timeout <= 0:
                raise EngineError(where, f"deadline passed; last error: {last}", attempts)
            attempts += 1
            stream = None if on_tokens is None else StreamedAnswer(max_new, n_input, self.max_answer_bytes)
            try:
                try:
                    status, raw = await self._request(
                        "POST", self._generate_url, payload, timeout, max_new, stream, on_tokens
                    )
                    if status != 200:
                        reason = f"HTTP {status}: {raw[:200].decode(errors='replace')}"
                        if status not in RETRYABLE_STATUS:
                            raise EngineError(where, reason, attempts, retryable=False)
                        raise Passing(reason, status)
                    if stream is not None and stream.streamed:
                        result = stream.result()
                    else:
                        result = read_answer(raw, max_new, n_input)
                except NotTheProtocol as exc:
                    raise Passing(f"bad response: {exc}") from None
            except Malformed as exc:  # values that cannot be right, or more bytes than the request allows
                raise MalformedAnswer(where, str(exc), attempts) from None
            except StreamRefused as exc:
                raise EngineError(where, str(exc), attempts, retryable=False) from None
            except Passing as exc:
                last, faults = str(exc), faults + 1
                if stream is not None and stream.passed_on:  # the caller has shown part of this answer
                    reason = f"{last}, after {len(stream.ids)} streamed tokens were passed on (not retried)"
                    raise EngineError(where, reason, attempts, retryable=False) from None
                if faults <= self.settings.max_retries:
                    wait = max(self._backoff.delay(faults), exc.retry_after_s)
                    if wait >= until.remaining():
                        raise EngineError(where, f"deadline passed; last error: {last}", attempts) from None
                    await asyncio.sleep(wait)
                    continue
                error = EngineError(where, last, attempts)
                if peer is None or peer.wait_s >= until.remaining():
                    raise error from None
            else:
                if result.finish_reason != "abort" or peer is None or peer.wait_s >= until.remaining():
                    result.retries = attempts - 1
                    return result
                error = None
            # A peer's `abort` answer, or a fault that outlived the call's retries: once more, later.
            await peer.failed(error)
            await asyncio.sleep(peer.wait_s)
            faults = 0

    async def _request(
        self,
        method: str,
        url: URL,
        body: bytes | None,
        timeout: float,
        max_new_tokens: int | None = None,
        stream: StreamedAnswer | None = None,
        on_tokens: Callable[[list[int]], Awaitable[object]] | None = None,
    ) -> tuple[int, bytes]:
        """Send one request and return (status, body).

        Raises Passing for whatever may pass (`mrlx_plugin.core.http`): no connection, no answer
        within `timeout`, an answer that is not HTTP/1.1, or one over `max_answer_bytes`;
        Malformed for a 200 answer larger than a request for `max_new_tokens` new tokens allows
        (as an answer of more tokens than asked is; refused by its declared length before a byte
        of it is read). A 200 answer that is an event stream is read into `stream` instead, each
        chunk's new ids awaited in `on_tokens` (the body returned is empty); what `on_tokens`
        raises passes through as it is."""
        relaying = False  # inside on_tokens: what it raises is the caller's, not the engine's
        try:
            async with self._session().request(
                method, url, data=body, timeout=self._timeout(timeout), allow_redirects=False
            ) as resp:
                cap = self.max_answer_bytes
                allowed = None
                if max_new_tokens is not None and resp.status == 200:
                    allowed = answer_limits(max_new_tokens)[0]
                    if allowed < cap:
                        cap = allowed
                    else:
                        allowed = None
                try:
                    if stream is None or on_tokens is None or resp.content_type != "text/event-stream":
                        return resp.status, await read_capped(resp, cap)
                    stream.streamed = True
                    while chunk := await resp.content.readany():
                        for ids in stream.feed(chunk):
                            stream.passed_on += 1
                            relaying = True
                            await on_tokens(ids)
                            relaying = False
                    return resp.status, b""
                except BaseException as exc:
                    resp.close()  # a cut-off or abandoned answer: the connection is not reused
                    if allowed is not None and isinstance(exc, AnswerTooLarge):
                        raise too_many_bytes(exc.length, exc.cap, max_new_tokens) from None
                    raise
        except TRANSPORT_ERRORS as exc:
            if relaying:  # e.g. the caller's own client went away while it wrote the tokens on
                raise
            raise as_passing(exc, self._address, timeout) from None

    async def get_json(self, path: str, timeout: float | None = None) -> JSON:
        """GET an endpoint and decode its JSON (health checks, model info, weight version)."""
        try:
            status, raw = await self._request(
                "GET", URL(self.url + path), None, timeout or self.settings.connect_timeout_s * 3
            )
        except Passing as exc:
            reason = str(exc)
            raise EngineError(
                self.url + path, "no answer in time" if reason.startswith("no answer") else reason
            ) from None
        if status != 200:
            raise EngineError(self.url + path, f"HTTP {status}: {raw[:200].decode(errors='replace')}")
        if not raw.strip():
            return None
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw.decode(errors="replace")
