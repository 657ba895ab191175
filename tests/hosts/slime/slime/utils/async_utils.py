"""Fake of `slime.utils.async_utils`: `run(coro)` on one persistent background event loop.

The rollout functions are synchronous; every coroutine they start runs on this one loop, which
lives on a daemon thread for the whole process.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def get_async_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="slime-async-loop", daemon=True).start()
        return _loop


def run(coro: Any) -> Any:
    """Run `coro` on the background loop and block until it is done."""
    return asyncio.run_coroutine_threadsafe(coro, get_async_loop()).result()
