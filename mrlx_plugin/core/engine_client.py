"""Token-in/token-out calls to an SGLang engine (or router) over HTTP.

One `EngineClient` per URL per process, holding an aiohttp session (a pool of keep-alive
connections) per event loop, so a rollout reuses its connections across thousands of calls.
Every call has a deadline and a cap on the size of the answer. Faults that may pass (the
package's one policy, `mrlx_plugin.core.http`: connection resets, timeouts, HTTP 429/500/502/
503/504, an answer that is not valid HTTP or larger than the cap; and here an answer that is not
the protocol's JSON) are retried a bounded number of times with exponential backoff and jitter
(`mrlx_plugin.core.retry`); the rest raise `EngineError` at once. An answer larger than its
request's `max_new_tokens` allows, in bytes or in JSON values (`answer_limits`), is malformed, and
refused before it is read in full or parsed: one answer cannot hold the event loop or the
process's memory for long.

The generated token ids and their log-probs are read from `meta_info.output_token_logprobs`,
never re-tokenised from text, and checked before anyone trains on them: an answer whose values
cannot be right (ids that are not token ids, log-probs that are missing or not log-probabilities,
more tokens than the request allowed, counts that are not counts) raises `MalformedAnswer`, an
`EngineError` that is not retried. The agent's transcript then checks the ids against its
tokenizer's vocabulary (`Transcript.turn_from`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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
    is_passing,
    read_capped,
)
from mrlx_plugin.core.retry import Backoff, Deadline, RetriesExhausted, retry
from mrlx_plugin.core.values import LOG_PROB_EPSILON, MAX_TOKEN_ID, MIN_LOG_PROB

MAX_BODY_BYTES = 32 * 1024 * 1024  # a 32k-token answer with its log-probs is about 1.4 MB
# What an answer to a request for N new tokens may take: N x ANSWER_BYTES_PER_TOKEN +
# ANSWER_BYTES_FIXED bytes (never more than the client's `max_answer_bytes`). A token costs its
# log-prob entry (`[-0.0001234567890123,151643,null],` is 35 bytes), its id where the engine also
# lists ids, and its text (a few bytes; a vocabulary's longest tokens are about 128; twice with
# `return_text_in_logprobs`); the fixed part is the meta info (finish reason, counts, latency).
ANSWER_BYTES_PER_TOKEN = 512
ANSWER_BYTES_FIXED = 64 * 1024
# And the JSON values (Python objects, once parsed) it may hold, counted by their delimiters
# (`_check_values`): a token's entry has 5 (`[`, `]`, two commas and the one after it), the
# quotes, commas, brackets and colons of its text count too. Bytes alone do not bound the parse:
# tiny entries (`[0,0],` repeated) make 3 objects of 6 bytes, and building them holds the event
# loop (orjson keeps the GIL, so parsing in a worker thread would not free it): seconds and over
# 1 GiB for 32 MiB. Within this allowance a parse builds at most a few times the objects of a
# real answer of N tokens (mrlx_plugin/bench/answer_stall.py measures the stall).
ANSWER_VALUES_PER_TOKEN = 32
ANSWER_VALUES_FIXED = 4096
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
        self.retryable = retryable  # False: the engine refused the request itself (HTTP 4xx)


class MalformedAnswer(EngineError):
    """An answer in the protocol's shape whose values cannot be right (not retried)."""

    def __init__(self, url: str, reason: str, attempts: int = 1):
        super().__init__(url, f"malformed answer: {reason}", attempts, retryable=False)
        self.detail = reason


class _BadResponse(Exception):
    """A response that does not follow the SGLang protocol (retryable)."""


class _Malformed(Exception):
    """Values no engine can have sampled (becomes MalformedAnswer)."""


@dataclass
class GenerateResult:
    token_ids: list[int]
    logprobs: list[float]
    text: str  # the engine's text; transcripts use what the ids spell instead
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str | None
    prompt_tokens: int
    cached_tokens: int
    retries: int  # retried attempts behind this result


def _count(meta: dict, key: str, default: int) -> int:
    value = meta.get(key)
    if value is None:
        return default
    if type(value) is not int or value < 0:
        raise _Malformed(f"meta_info.{key} is {value!r}; expected a count (an integer >= 0)")
    return value


def parse_generate_response(
    body: bytes, max_new_tokens: int | None = None
) -> tuple[list[int], list[float], str, str, str | None, dict]:
    """Read ids, log-probs, text, finish reason and weight version from a `/generate` body.

    Raises _BadResponse for a body that is not the protocol's shape (retried) and _Malformed for
    values that cannot be right: ids that are not integers in [0, 2**31), log-probs that are not
    finite numbers in [MIN_LOG_PROB, 0], more ids than `max_new_tokens`, more JSON values than an
    answer of `max_new_tokens` tokens holds (checked before parsing), counts that are not integers.
    """
    if max_new_tokens is not None:
        _check_values(body, max_new_tokens)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _BadResponse(f"response is not JSON ({exc}); starts {body[:80]!r}") from None
    if isinstance(data, list) and len(data) == 1:  # batched form with one request
        data = data[0]
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise _BadResponse(f"response has no meta_info; starts {body[:80]!r}")
    meta = data["meta_info"]
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    if finish_type not in ("stop", "length", "abort"):
        raise _BadResponse(f"unknown finish_reason {finish!r}")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        if finish_type != "abort":
            raise _BadResponse("meta_info.output_token_logprobs is missing; was return_logprob sent?")
        entries = []
    if not isinstance(entries, list):
        raise _BadResponse("meta_info.output_token_logprobs is not a list")
    ids: list[Any] = []
    logprobs: list[Any] = []
    if max_new_tokens is not None and len(entries) > max_new_tokens:
        raise _Malformed(f"{len(entries)} tokens for a request of max_new_tokens {max_new_tokens}")
    if entries:
        try:
            columns = list(zip(*entries))  # [(logprob, ...), (token_id, ...), ...] in one C-level pass
        except TypeError:
            columns = []
        if len(columns) < 2:
            raise _BadResponse("meta_info.output_token_logprobs entries are not [logprob, token_id, ...]")
        ids, logprobs = list(columns[1]), list(columns[0])
        # The checks are C-level passes: they run over every generated token of every call.
        if set(map(type, ids)) != {int}:
            bad = next(i for i in ids if type(i) is not int)
            raise _Malformed(f"token id {bad!r} is not an integer")
        low, high = min(ids), max(ids)
        if low < 0 or high > MAX_TOKEN_ID:
            raise _Malformed(f"token id {low if low < 0 else high} is not a token id")
        kinds = set(map(type, logprobs))
        if kinds != {float}:
            if not kinds <= {float, int}:
                bad = next(x for x in logprobs if type(x) not in (float, int))
                raise _Malformed(f"log-prob {bad!r} is not a number")
            try:
                logprobs = [float(x) for x in logprobs]
            except OverflowError:
                raise _Malformed("a log-prob is not a finite number") from None
        top, bottom = max(logprobs), min(logprobs)
        if top > LOG_PROB_EPSILON:
            raise _Malformed(f"log-prob {top!r} is positive (log-probabilities are <= 0)")
        if not math.isfinite(bottom):
            raise _Malformed(f"log-prob {bottom!r} is not a finite number")
        if bottom < MIN_LOG_PROB:
            raise _Malformed(
                f"log-prob {bottom!r} is below {MIN_LOG_PROB:g}, lower than a sampled token's can be"
            )
    text = data.get("text", "")
    if not isinstance(text, str):
        raise _BadResponse("text is not a string")
    version = meta.get("weight_version")
    return ids, logprobs, text, finish_type, (None if version is None else str(version)), meta


def answer_limits(max_new_tokens: int) -> tuple[int, int]:
    """(bytes, JSON values) an answer to a request for `max_new_tokens` new tokens may have."""
    return (
        ANSWER_BYTES_FIXED + ANSWER_BYTES_PER_TOKEN * max_new_tokens,
        ANSWER_VALUES_FIXED + ANSWER_VALUES_PER_TOKEN * max_new_tokens,
    )


_DELIMITERS = b'"[]{},:'


def _check_values(body: bytes, max_new_tokens: int) -> None:
    """Refuse a body that holds more JSON values than an answer of `max_new_tokens` tokens,
    before any is built. Every value is a string (two quotes), an array or object (its brackets
    or braces) or a scalar after `[`, `,` or `:`, so the count of these delimiters bounds the
    values a parse builds (nesting aside, which orjson stops at depth 1024). A body of at most
    twice the limit in bytes cannot hold more (a value and its separator take two bytes), so most
    real answers (about 45 bytes a token) are not counted; a count is one C-level pass."""
    limit = answer_limits(max_new_tokens)[1]
    if len(body) <= 2 * limit:
        return
    count = len(body) - len(body.translate(None, _DELIMITERS))
    if count > limit:
        raise _Malformed(
            f"the answer holds up to {count} JSON values, more than an answer of max_new_tokens "
            f"{max_new_tokens} holds ({limit})"
        )


def _requested_max(sampling_params: dict[str, Any]) -> int | None:
    value = sampling_params.get("max_new_tokens") if isinstance(sampling_params, dict) else None
    return value if type(value) is int and value >= 0 else None


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

    # --- one HTTP exchange -----------------------------------------------------------------

    async def _request(
        self, method: str, url: URL, body: bytes | None, timeout: float, max_new_tokens: int | None = None
    ) -> tuple[int, bytes]:
        """Send one request and return (status, body).

        Raises Passing for whatever may pass (`mrlx_plugin.core.http`): no connection, no answer
        within `timeout`, an answer that is not HTTP/1.1, or one over `max_answer_bytes`;
        _Malformed for a 200 answer larger than a request for `max_new_tokens` new tokens allows
        (as an answer of more tokens than asked is; refused by its declared length before a byte
        of it is read)."""
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
                    return resp.status, await read_capped(resp, cap)
                except BaseException as exc:
                    resp.close()  # a cut-off or abandoned answer: the connection is not reused
                    if allowed is not None and isinstance(exc, AnswerTooLarge):
                        raise _too_many_bytes(exc, max_new_tokens) from None
                    raise
        except TRANSPORT_ERRORS as exc:
            raise as_passing(exc, self._address, timeout) from None

    # --- calls -----------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        deadline: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> GenerateResult:
        """POST `/generate` with `input_ids` and return what the engine sampled.

        `deadline` is a `time.monotonic()` instant after which no new attempt starts.
        Raises EngineError when the call cannot succeed (MalformedAnswer for an answer whose
        values cannot be right).
        """
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "return_logprob": True,
        }
        if extra:
            body.update(extra)
        # orjson's result keeps the capacity of its growing buffer (~512 KiB for a 2k-token prompt)
        # until freed; a right-sized copy keeps thousands of requests in flight affordable.
        payload = bytes(memoryview(orjson.dumps(body)))
        n_input = len(input_ids)
        max_new = _requested_max(sampling_params)
        del body, input_ids  # the caller's list need not live while the engine works
        request_timeout = self.settings.request_timeout_s
        where = self.url + "/generate"
        until = Deadline.until(deadline)
        last = "no attempt made"

        async def attempt(n: int) -> GenerateResult:
            nonlocal last
            timeout = until.clip(request_timeout)  # one attempt never runs past the call's deadline
            if timeout <= 0:
                raise EngineError(where, f"deadline passed; last error: {last}", n)
            try:
                status, raw = await self._request("POST", self._generate_url, payload, timeout, max_new)
                if status == 200:
                    try:
                        ids, logprobs, text, finish, version, meta = parse_generate_response(raw, max_new)
                        return GenerateResult(
                            token_ids=ids,
                            logprobs=logprobs,
                            text=text,
                            finish_reason=finish,
                            weight_version=version,
                            prompt_tokens=_count(meta, "prompt_tokens", n_input),
                            cached_tokens=_count(meta, "cached_tokens", 0),
                            retries=n,
                        )
                    except _BadResponse as exc:
                        raise Passing(f"bad response: {exc}") from None
                reason = f"HTTP {status}: {raw[:200].decode(errors='replace')}"
                if status not in RETRYABLE_STATUS:
                    raise EngineError(where, reason, n + 1, retryable=False)
                raise Passing(reason, status)
            except _Malformed as exc:  # values that cannot be right, or more bytes than the request allows
                raise MalformedAnswer(where, str(exc), n + 1) from None
            except Passing as exc:
                last = str(exc)
                raise

        try:
            return await retry(
                attempt,
                retryable=is_passing,
                deadline=until,
                backoff=self._backoff,
                max_retries=self.settings.max_retries,
            )
        except RetriesExhausted as exc:
            reason = f"deadline passed; last error: {exc.last}" if exc.deadline_passed else str(exc.last)
            raise EngineError(where, reason, exc.attempts) from None

    async def _call(self, method: str, path: str, body: bytes | None, timeout: float | None) -> Any:
        try:
            status, raw = await self._request(
                method, URL(self.url + path), body, timeout or self.settings.connect_timeout_s * 3
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

    async def get_json(self, path: str, timeout: float | None = None) -> Any:
        """GET an endpoint and decode its JSON (health checks, model info, weight version)."""
        return await self._call("GET", path, None, timeout)


def _too_many_bytes(exc: AnswerTooLarge, max_new_tokens: int | None) -> _Malformed:
    if exc.length is not None:
        return _Malformed(
            f"the answer is {exc.length} bytes, more than an answer of max_new_tokens "
            f"{max_new_tokens} may take ({exc.cap} bytes)"
        )
    return _Malformed(
        f"the answer is over {exc.cap} bytes, more than an answer of max_new_tokens {max_new_tokens} may take"
    )
