"""Token-in/token-out calls to an SGLang engine (or router) over HTTP.

One `EngineClient` per URL per process, holding a pool of keep-alive connections per event loop
(see `mrlx_plugin.core.http`), so a rollout reuses its connections across thousands of calls. Every
call has a deadline and a cap on the size of the answer. Faults that may pass (connection
resets, timeouts, HTTP 5xx/429, an answer that is not valid HTTP, not the protocol's JSON or
larger than the cap) are retried a bounded number of times with exponential backoff and jitter;
the rest raise `EngineError` at once.

The generated token ids and their log-probs are read from `meta_info.output_token_logprobs`,
never re-tokenised from text, and checked before anyone trains on them: an answer whose values
cannot be right (ids that are not token ids, log-probs that are missing or not log-probabilities,
more tokens than the request allowed, counts that are not counts) raises `MalformedAnswer`, an
`EngineError` that is not retried. The agent's transcript then checks the ids against its
tokenizer's vocabulary (`Transcript.turn_from`).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import weakref
from dataclasses import dataclass
from typing import Any

import orjson

from mrlx_plugin.core.config import EngineSettings
from mrlx_plugin.core.http import MAX_BODY_BYTES, HTTPError, HTTPPool

RETRYABLE_STATUS = {429, 500, 502, 503, 504}
# Log-probs must be <= 0; a sampler's float arithmetic can land a hair above zero for a token of
# probability ~1. The coordinator accepts the same (coordinator.wire.LOG_PROB_EPSILON).
LOG_PROB_EPSILON = 1e-3
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32 (coordinator.wire)


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
    finite numbers <= 0, more ids than `max_new_tokens`, counts that are not integers.
    """
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
    if isinstance(finish, dict):
        finish_type = finish.get("type")
    else:
        finish_type = finish
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
        if max_new_tokens is not None and len(ids) > max_new_tokens:
            raise _Malformed(f"{len(ids)} tokens for a request of max_new_tokens {max_new_tokens}")
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
    text = data.get("text", "")
    if not isinstance(text, str):
        raise _BadResponse("text is not a string")
    version = meta.get("weight_version")
    return ids, logprobs, text, finish_type, (None if version is None else str(version)), meta


def _requested_max(sampling_params: dict[str, Any]) -> int | None:
    value = sampling_params.get("max_new_tokens") if isinstance(sampling_params, dict) else None
    return value if type(value) is int and value >= 0 else None


class EngineClient:
    """Calls one engine URL. Safe to share between tasks and event loops of one process."""

    def __init__(
        self,
        url: str,
        settings: EngineSettings | None = None,
        api_key: str | None = None,
        max_answer_bytes: int = MAX_BODY_BYTES,
    ):
        self.url = url.rstrip("/")
        self.settings = settings or EngineSettings()
        self.max_answer_bytes = max_answer_bytes  # a larger (or endless) answer is cut off: retryable
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, HTTPPool] = weakref.WeakKeyDictionary()
        self._last: tuple[asyncio.AbstractEventLoop, HTTPPool] | None = None

    def _pool(self) -> HTTPPool:
        loop = asyncio.get_running_loop()
        last = self._last
        if last is not None and last[0] is loop:
            return last[1]  # the common case: one loop for the whole process
        pool = self._pools.get(loop)
        if pool is None:
            s = self.settings
            pool = self._pools[loop] = HTTPPool(self.url, s.max_connections, s.connect_timeout_s, self.max_answer_bytes)
        self._last = (loop, pool)
        return pool

    async def close(self) -> None:
        """Close this event loop's idle connections."""
        loop = asyncio.get_running_loop()
        pool = self._pools.pop(loop, None)
        if self._last is not None and self._last[0] is loop:
            self._last = None
        if pool is not None:
            pool.close()

    # --- calls -----------------------------------------------------------------------------

    def _backoff(self, attempt: int) -> float:
        s = self.settings
        base = min(s.max_backoff_s, s.backoff_s * (2**attempt))
        return base * (0.5 + random.random() / 2)

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
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True}
        if extra:
            body.update(extra)
        # orjson's result keeps the capacity of its growing buffer (~512 KiB for a 2k-token prompt)
        # until freed; a right-sized copy keeps thousands of requests in flight affordable.
        payload = bytes(memoryview(orjson.dumps(body)))
        n_input = len(input_ids)
        max_new = _requested_max(sampling_params)
        del body, input_ids  # the caller's list need not live while the engine works
        s = self.settings
        where = self.url + "/generate"
        attempt = 0
        last = "no attempt made"
        while True:
            now = time.monotonic()
            timeout = s.request_timeout_s if deadline is None else min(s.request_timeout_s, deadline - now)
            if timeout <= 0:
                raise EngineError(where, f"deadline passed; last error: {last}", attempt)
            try:
                status, raw = await self._pool().request("POST", "/generate", payload, timeout, self._headers)
                if status == 200:
                    ids, logprobs, text, finish, version, meta = parse_generate_response(raw, max_new)
                    return GenerateResult(
                        token_ids=ids,
                        logprobs=logprobs,
                        text=text,
                        finish_reason=finish,
                        weight_version=version,
                        prompt_tokens=_count(meta, "prompt_tokens", n_input),
                        cached_tokens=_count(meta, "cached_tokens", 0),
                        retries=attempt,
                    )
                snippet = raw[:200].decode(errors="replace")
                last = f"HTTP {status}: {snippet}"
                if status not in RETRYABLE_STATUS:
                    raise EngineError(where, last, attempt + 1, retryable=False)
            except _Malformed as exc:
                raise MalformedAnswer(where, str(exc), attempt + 1) from None
            except _BadResponse as exc:
                last = f"bad response: {exc}"
            except asyncio.TimeoutError:
                last = f"no answer within {timeout:.1f}s"
            except HTTPError as exc:
                last = str(exc)
            attempt += 1
            if attempt > s.max_retries:
                raise EngineError(where, last, attempt)
            wait = self._backoff(attempt - 1)
            if deadline is not None and time.monotonic() + wait >= deadline:
                raise EngineError(where, f"deadline passed; last error: {last}", attempt)
            await asyncio.sleep(wait)

    async def _call(self, method: str, path: str, body: bytes | None, timeout: float | None) -> Any:
        try:
            status, raw = await self._pool().request(
                method, path, body, timeout or self.settings.connect_timeout_s * 3, self._headers
            )
        except asyncio.TimeoutError:
            raise EngineError(self.url + path, "no answer in time") from None
        except HTTPError as exc:
            raise EngineError(self.url + path, str(exc)) from None
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
