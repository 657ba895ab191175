"""Waiting in tests: on a condition, with a deadline, never for a fixed time.

CI runs on shared, loaded machines, where "sleep long enough for X to happen" is sometimes not
long enough. A test polls the condition it needs instead, and fails at the deadline naming what
it waited for. `wait_until` blocks the calling thread; `async_wait_until` is the same for code
on an event loop (whose other tasks must keep running while it waits).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def _timed_out(
    what: str | None, predicate: Callable[[], Any], timeout: float, details: Callable[[], str] | None
) -> TimeoutError:
    name = what or getattr(predicate, "__name__", "the condition")
    message = f"waited {timeout:g} s for {name}; it never held"
    if details is not None:
        message += "\n" + details()
    return TimeoutError(message)


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 60.0,
    *,
    every: float = 0.05,
    what: str | None = None,
    details: Callable[[], str] | None = None,
) -> Any:
    """Call `predicate` every `every` seconds until it returns something true, and return that;
    raise TimeoutError (with `what` and `details()`) once `timeout` seconds have passed.
    A predicate may raise to stop the wait early (say, the process it watches has died)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(what, predicate, timeout, details)
        time.sleep(every)


async def async_wait_until(
    predicate: Callable[[], Any],
    timeout: float = 60.0,
    *,
    every: float = 0.05,
    what: str | None = None,
    details: Callable[[], str] | None = None,
) -> Any:
    """`wait_until` on an event loop: the loop runs its other tasks between checks. `predicate`
    may be a plain function or return an awaitable."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(what, predicate, timeout, details)
        await asyncio.sleep(every)
