"""Stands in for `miles.utils.misc`: `load_function`, `SingletonMeta`, `call_agent_abort_hook`."""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Any

logger = logging.getLogger(__name__)


def load_function(path: str | None) -> Any:
    """The object named by a dotted path `package.module.attr`; None for an empty path."""
    if not path:
        return None
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


class SingletonMeta(type):
    """One instance per class, kept in `SingletonMeta._instances` (later constructor args ignored)."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in SingletonMeta._instances:
            SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
        return SingletonMeta._instances[cls]

    @staticmethod
    def clear_all_instances() -> None:
        SingletonMeta._instances.clear()


async def call_agent_abort_hook(args: Any) -> None:
    """Await `abort(args)` from the module of `--custom-agent-function-path`, if it has one.

    A module without `abort` is skipped; an exception from the hook is logged, never raised.
    """
    path = getattr(args, "custom_agent_function_path", None)
    module = path.rpartition(".")[0] if path else ""
    if not module:
        return
    try:
        hook = load_function(f"{module}.abort")
    except (AttributeError, ModuleNotFoundError):
        return
    try:
        await hook(args)
    except Exception as exc:  # noqa: BLE001 - Miles only warns
        logger.warning("agent abort hook %s.abort failed: %s", module, exc)


async def as_completed_async(tasks: Any):
    """Yield the results of `tasks` as they finish (an exception propagates)."""
    for next_done in asyncio.as_completed(tasks):
        yield await next_done


def should_run_periodic_action(
    rollout_id: int, interval: int | None, num_rollout_per_epoch: int | None = None
) -> bool:
    if interval is None:
        return False
    step = rollout_id + 1
    return step % interval == 0 or (num_rollout_per_epoch is not None and step % num_rollout_per_epoch == 0)
