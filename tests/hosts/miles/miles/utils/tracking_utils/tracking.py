"""Stands in for `miles.utils.tracking_utils.tracking`, where Miles sends every metric.

`log(args, metrics, step_key)` appends one JSON line `{"step_key": ..., "metrics": {...}}` to the
file named by the environment variable `FAKE_HOST_LOG` (nothing when it is unset), where Miles
would fan out to wandb/tensorboard/... with `metrics[step_key]` as the step.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

_lock = threading.Lock()


def log(args: Any, metrics: dict[str, Any], step_key: str) -> None:
    path = os.environ.get("FAKE_HOST_LOG")
    if not path:
        return
    line = json.dumps({"step_key": step_key, "metrics": metrics}, default=float)
    with _lock, open(path, "a") as f:
        f.write(line + "\n")
