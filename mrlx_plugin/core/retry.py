"""Deadlines and backoff: the one retry policy of every client in the package (engine calls,
coordinator calls, weight pushes, readiness waits).

A call is retried only for failures that may pass (`retryable(exc)` says which), with
exponential backoff and jitter, until its deadline: no attempt starts once the deadline is
near enough that the next wait would cross it, and `max_retries` (when set) bounds the count.
A failure may ask for a longer wait (HTTP `Retry-After`) through a `retry_after_s` attribute.
An engine call writes this policy out in its own loop (`EngineClient.generate`, with `Backoff`
and `Deadline`), so that a peer engine's aborts are retried in the same loop, not around it
(docs/guarantees.md, "Engine faults and retries").

Waiting for a condition (a process to listen, a file to appear, a test's state) is `wait_until`
(blocking) or `async_wait_until` (on an event loop): the package's and its tests' one way to
wait, polling until a deadline, never for a fixed time.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar, cast

T = TypeVar("T")
_DEADLINE_PASSED = "deadline passed"


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: the n-th retry waits `base_s * 2**(n-1)`, capped at `max_s`, scaled by
    a random factor in [0.5, 1] so that many clients failing together do not retry together."""

    base_s: float = 0.05
    max_s: float = 2.0
    jitter: bool = True  # False: the waits as computed (a peer's weight update, not a crowd, is waited on)

    def delay(self, retry: int) -> float:
        wait = min(self.max_s, self.base_s * 2 ** min(max(retry, 1) - 1, 30))
        return wait * random.uniform(0.5, 1.0) if self.jitter else wait


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


# How a wait polls by default: soon at first, then every 0.1 s at most. What is polled is cheap (a
# file, a port, a local HTTP answer), and a caller that acts on the condition (stops a process
# once it has made one step) must see it soon after it holds, not up to half a second later.
POLL = Backoff(base_s=0.02, max_s=0.1)


def wait_until(
    ready: Callable[[], T],
    deadline: Deadline | float = 60.0,
    *,
    what: str | None = None,
    every: float | Backoff = POLL,
    details: Callable[[], str] | None = None,
) -> T:
    """Block until `ready()` returns something true, and return that; TimeoutError naming `what`
    (and adding `details()`) at the `deadline` (a Deadline, or seconds from now). Polls every
    `every` seconds, or with a Backoff's waits. `ready` may raise to end the wait early (say, the
    process it watches has died). For waits outside any event loop (a process to listen, a file
    to appear, a test's condition); `async_wait_until` is the same on an event loop."""
    deadline, started, polls = _deadline(deadline), time.monotonic(), 0
    while not (value := ready()):
        if deadline.expired():
            raise _not_ready(what, ready, started, details)
        polls += 1
        time.sleep(min(_poll_wait(every, polls), deadline.remaining()))
    return value


async def async_wait_until(
    ready: Callable[[], T | Awaitable[T]],
    deadline: Deadline | float = 60.0,
    *,
    what: str | None = None,
    every: float | Backoff = POLL,
    details: Callable[[], str] | None = None,
) -> T:
    """`wait_until` for code on an event loop: the loop runs its other tasks between checks, and
    `ready` may be a plain function or return an awaitable (awaited)."""
    deadline, started, polls = _deadline(deadline), time.monotonic(), 0
    while True:
        value = ready()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return cast(T, value)  # awaited if it was an awaitable
        if deadline.expired():
            raise _not_ready(what, ready, started, details)
        polls += 1
        await asyncio.sleep(min(_poll_wait(every, polls), deadline.remaining()))


def _deadline(deadline: Deadline | float) -> Deadline:
    return deadline if isinstance(deadline, Deadline) else Deadline(deadline)


def _poll_wait(every: float | Backoff, polls: int) -> float:
    return every.delay(polls) if isinstance(every, Backoff) else every


def _not_ready(
    what: str | None, ready: Callable[..., object], started: float, details: Callable[[], str] | None
) -> TimeoutError:
    name = what or getattr(ready, "__name__", "the condition")
    message = f"waited {time.monotonic() - started:.1f} s for {name}; it never held"
    if details is not None:
        message += "\n" + details()
    return TimeoutError(message)
