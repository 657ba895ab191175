"""Fake of `slime.utils.misc`: `load_function`, `SingletonMeta`, `should_run_periodic_action`.

`SingletonMeta` keeps its instances in the class attribute `_instances` (one dict keyed by
class), as the real one does: the plugin reads `SingletonMeta._instances.get(GenerateState)` to
see whether the host aborted a rollout without creating the state itself.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, ClassVar


@functools.cache
def load_function(path: str) -> Any:
    """`package.module.attr` -> the attribute (cached, like the host's)."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


class SingletonMeta(type):
    _instances: ClassVar[dict] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]


def should_run_periodic_action(rollout_id: int, interval: int | None, num_rollout: int | None = None) -> bool:
    """After step `rollout_id`: every `interval` steps, and after the last one."""
    if interval is None:
        return False
    if num_rollout is not None and rollout_id == num_rollout - 1:
        return True
    return (rollout_id + 1) % interval == 0
