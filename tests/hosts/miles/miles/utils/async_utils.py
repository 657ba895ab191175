"""Stands in for `miles.utils.async_utils`: one event loop on a daemon thread for all rollout code.

`run(coro)` blocks the calling thread until `coro` is done on that loop. Every rollout coroutine
(the rollout functions, every generate call) runs there, so the plugin's connections and tasks
live in one loop.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class AsyncLoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="miles-async-loop", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_loop: AsyncLoopThread | None = None


def get_async_loop() -> AsyncLoopThread:
    global _loop
    if _loop is None:
        _loop = AsyncLoopThread()
    return _loop


def run(coro: Any) -> Any:
    """Run `coro` on the shared background loop and return its result."""
    return get_async_loop().run(coro)
