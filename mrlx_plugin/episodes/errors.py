"""The exceptions of an episode: how a system, a turn or a hook's answer ends one, and which of
what a user's code raises may leave its episode."""

from __future__ import annotations

import asyncio


class EpisodeAborted(Exception):
    """Raised inside a system when its episode cannot go on; `run_episode` turns it into samples."""


class HookResultError(ValueError):
    """A hook implementation returned something its contract does not allow (names the plugin)."""


def stops_the_rollout(exc: BaseException) -> bool:
    """Whether `exc`, raised while a user's code ran (agent code, a hook), must leave the episode:
    a KeyboardInterrupt (the process was sent SIGINT), or the cancellation of the task running the
    episode (the host's abort, a deadline). Anything else, `SystemExit`, a `CancelledError` of the
    code's own making and any other `BaseException` included, ends that episode only.

    A cancellation is the task's own when `Task.cancelling()` counts one (Python 3.11+); on 3.10,
    which cannot tell, every CancelledError is taken for the task's own."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)
        return cancelling is None or cancelling() > 0
    return False


def described(exc: BaseException) -> str:
    """`exc` as an abort reason shows it: its type, and its message when it has one."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
