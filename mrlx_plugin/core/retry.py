"""Deadlines and backoff: the one retry policy of every client in the package (engine calls,
coordinator calls, weight pushes, readiness waits).

A call is retried only for failures that may pass (`retryable(exc)` says which), with
exponential backoff and jitter, until its deadline: no attempt starts once the deadline is
near enough that the next wait would cross it, and `max_retries` (when set) bounds the count.
A failure may ask for a longer wait (HTTP `Retry-After`) through a `retry_after_s` attribute.
How the engine client's retries nest inside an episode's turn retries: docs/guarantees.md.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
_DEADLINE_PASSED = "deadline passed"


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: the n-th retry waits `base_s * 2**(n-1)`, capped at `max_s`, scaled by
    a random factor in [0.5, 1] so that many clients failing together do not retry together."""

    base_s: float = 0.05
    max_s: float = 2.0

    def delay(self, retry: int) -> float:
        return min(self.max_s, self.base_s * 2 ** min(max(retry, 1) - 1, 30)) * random.uniform(0.5, 1.0)


class Deadline:
    """A point on the monotonic clock after which no new attempt starts (None: no deadline)."""

    def __init__(self, seconds: float | None):
        self.at = None if seconds is None else time.monotonic() + max(0.0, seconds)

    @classmethod
    def until(cls, instant: float | None) -> Deadline:
        """The deadline at a `time.monotonic()` instant a caller already holds (None: none)."""
        deadline = cls(None)
        deadline.at = instant
        return deadline

    def remaining(self) -> float:
        return math.inf if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def clip(self, seconds: float) -> float:
        """`seconds`, or less when the deadline comes first (a per-attempt timeout)."""
        return min(seconds, self.remaining())


class RetriesExhausted(Exception):
    """Raised by `retry` when a retryable failure outlived the deadline or the retry budget;
    `last` is that failure and `attempts` the attempts made."""

    def __init__(self, last: BaseException, attempts: int, why: str):
        super().__init__(f"{why} after {attempts} attempt(s); last error: {last}")
        self.last, self.attempts, self.why = last, attempts, why

    @property
    def deadline_passed(self) -> bool:
        """True when the deadline, not the retry budget, ended the retries."""
        return self.why == _DEADLINE_PASSED


async def retry(
    call: Callable[[int], Awaitable[T]],
    *,
    retryable: Callable[[BaseException], bool],
    deadline: Deadline,
    backoff: Backoff = Backoff(),
    max_retries: int | None = None,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """Await `call(attempt)` (attempt counts from 0) until it returns, a failure is not
    `retryable`, or the deadline or `max_retries` ends the retries (`RetriesExhausted`)."""
    attempt = 0
    while True:
        try:
            return await call(attempt)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - sorted by `retryable`
            if not retryable(exc):
                raise
            attempt += 1
            if max_retries is not None and attempt > max_retries:
                raise RetriesExhausted(exc, attempt, f"{max_retries} retries used") from exc
            wait = max(backoff.delay(attempt), float(getattr(exc, "retry_after_s", 0.0) or 0.0))
            if wait >= deadline.remaining():
                raise RetriesExhausted(exc, attempt, _DEADLINE_PASSED) from exc
            if on_retry is not None:
                on_retry(attempt, exc, wait)
            await asyncio.sleep(wait)


def wait_until(
    ready: Callable[[], bool],
    deadline: Deadline,
    *,
    what: str,
    backoff: Backoff = Backoff(base_s=0.05, max_s=0.5),
) -> None:
    """Block until `ready()` is true, polling with backoff; TimeoutError naming `what` at the
    deadline. For start-up waits outside any event loop (a process to listen, a file to appear)."""
    retry_n = 0
    while not ready():
        retry_n += 1
        wait = backoff.delay(retry_n)
        if deadline.remaining() <= 0.0:
            raise TimeoutError(f"{what}: not ready by the deadline")
        time.sleep(min(wait, deadline.remaining()))


async def async_wait_until(
    ready: Callable[[], Awaitable[bool]],
    deadline: Deadline,
    *,
    what: str,
    backoff: Backoff = Backoff(base_s=0.05, max_s=0.5),
) -> None:
    """`wait_until` for code on an event loop: `ready` is awaited, the waits do not block."""
    retry_n = 0
    while not await ready():
        retry_n += 1
        if deadline.remaining() <= 0.0:
            raise TimeoutError(f"{what}: not ready by the deadline")
        await asyncio.sleep(min(backoff.delay(retry_n), deadline.remaining()))
