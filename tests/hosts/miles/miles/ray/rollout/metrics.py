"""Stands in for `miles.ray.rollout.metrics`: how the rollout manager logs a rollout.

Both functions call the custom log function FIRST and stop if it returns True. What they log
afterwards starts from the metrics dict they passed it, read after the call: keys a custom
function adds to that dict (an empty one included) are logged with Miles' own, at Miles' step.

- `log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time)`: `samples`
  is the flat, post-processed list; `rollout_extra_metrics` is the rollout output's `metrics`
  (a dict, often empty, from Miles' own rollouts). Logged as `{**extra, rollout/...}` on
  `rollout/step`.
- `log_eval_rollout_data(rollout_id, args, data, extra_metrics)`: `extra_metrics` is the eval
  output's `metrics` (None from Miles' own rollouts); logged as `extra_metrics or {}` plus
  `eval/<name>` (mean reward, None counted as 0.0) and `eval/<name>-truncated_ratio`, on
  `eval/step`.
Miles also computes response-length, zero-std, pass-rate and perf statistics; the fake logs a few.
"""

from __future__ import annotations

from typing import Any

from miles.utils.metric_utils import compute_rollout_step
from miles.utils.misc import load_function
from miles.utils.tracking_utils import tracking
from miles.utils.types import Sample


def log_rollout_data(
    rollout_id: int, args: Any, samples: list[Sample], rollout_extra_metrics: dict | None, rollout_time: float
) -> None:
    custom = load_function(args.custom_rollout_log_function_path)
    if custom is not None and custom(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
        return
    log_dict = {**(rollout_extra_metrics or {})}
    lengths = [s.effective_response_length for s in samples]
    log_dict["rollout/response_len/mean"] = sum(lengths) / len(lengths) if lengths else 0.0
    truncated = [s.status == Sample.Status.TRUNCATED for s in samples]
    log_dict["rollout/truncated_ratio"] = sum(truncated) / max(len(truncated), 1)
    log_dict["perf/rollout_time"] = rollout_time
    log_dict["rollout/step"] = compute_rollout_step(args, rollout_id)
    tracking.log(args, log_dict, step_key="rollout/step")


def log_eval_rollout_data(
    rollout_id: int, args: Any, data: dict, extra_metrics: dict | None = None
) -> dict | None:
    custom = load_function(args.custom_eval_rollout_log_function_path)
    if custom is not None and custom(rollout_id, args, data, extra_metrics):
        return None
    log_dict = extra_metrics or {}
    for name, entry in data.items():
        rewards = [0.0 if r is None else r for r in entry["rewards"]]
        log_dict[f"eval/{name}"] = sum(rewards) / len(rewards) if rewards else 0.0
        if (truncated := entry.get("truncated")) is not None:
            log_dict[f"eval/{name}-truncated_ratio"] = sum(truncated) / max(len(truncated), 1)
    log_dict["eval/step"] = compute_rollout_step(args, rollout_id)
    tracking.log(args, log_dict, step_key="eval/step")
    return log_dict
