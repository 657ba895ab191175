"""Fake of `slime.observability.logging_utils`: `log(args, metrics, step_key)`.

The real one sends `metrics` to wandb and/or TensorBoard (`step_key` names the entry of
`metrics` that is the x-axis). The fake appends one JSON line `{"step_key": ..., "metrics": ...}`
to the file named by the environment variable `FAKE_HOST_LOG` (nothing when it is unset), so a
test can read what reached the host's logger.
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
    line = json.dumps({"step_key": step_key, "metrics": metrics}, default=str)
    with _lock, open(path, "a") as f:
        f.write(line + "\n")
