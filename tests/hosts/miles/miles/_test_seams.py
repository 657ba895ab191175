"""Not part of Miles: the points where the fake lets a test driver look inside a rollout.

- `abort_observers`: async callables `fn(stage, info)` awaited by both `abort()`s, with stage
  "aborted" (right after the rollout state's `aborted` flag is set, before the engines are told)
  and "drained" (every pending generate task has finished).
- `generate_calls_running`: generate-function calls in progress (entered, not yet returned).
- `dropped_group_errors`: exceptions the class-based rollout logged and dropped (Miles keeps going).
"""

from __future__ import annotations

from typing import Any

abort_observers: list[Any] = []
generate_calls_running = 0
dropped_group_errors: list[BaseException] = []


async def notify_abort(stage: str, **info: Any) -> None:
    for observer in abort_observers:
        await observer(stage, {"generate_calls_running": generate_calls_running, **info})


class counting_generate_call:
    """`with counting_generate_call():` around one generate-function call."""

    def __enter__(self) -> None:
        global generate_calls_running
        generate_calls_running += 1

    def __exit__(self, *exc: Any) -> None:
        global generate_calls_running
        generate_calls_running -= 1
