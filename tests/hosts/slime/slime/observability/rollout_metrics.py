"""Fake of `slime.observability.rollout_metrics`: the rollout and evaluation log functions.

The order is the host's: the custom function (`--custom-rollout-log-function-path`,
`--custom-eval-rollout-log-function-path`) is called first with the host's own metrics dict, and
returning True skips the host's logging. Then the rollout log is built from a COPY of
`rollout_extra_metrics` (`{**(extra or {})}`), the evaluation log from `extra_metrics or {}`
itself; the host adds its own keys (a few here) and the step under `rollout/step` or `eval/step`,
and hands the dict to `logging_utils.log`.
"""

from __future__ import annotations

from typing import Any

from slime.observability import logging_utils
from slime.observability.metric_utils import compute_rollout_step
from slime.utils.misc import load_function
from slime.utils.types import Sample


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def log_rollout_data(
    rollout_id: int, args: Any, samples: list[Sample], rollout_extra_metrics: dict | None, rollout_time: float
) -> None:
    custom = args.custom_rollout_log_function_path
    if custom is not None and load_function(custom)(
        rollout_id, args, samples, rollout_extra_metrics, rollout_time
    ):
        return
    log_dict = {**(rollout_extra_metrics or {})}
    log_dict["rollout/response_len/mean"] = _mean([s.response_length for s in samples])
    log_dict["rollout/truncated_ratio"] = _mean([float(s.status == Sample.Status.TRUNCATED) for s in samples])
    log_dict["perf/rollout_time"] = rollout_time
    log_dict["rollout/step"] = compute_rollout_step(args, rollout_id)
    logging_utils.log(args, log_dict, step_key="rollout/step")


def log_eval_rollout_data(
    rollout_id: int, args: Any, data: dict, extra_metrics: dict | None = None
) -> dict | None:
    custom = args.custom_eval_rollout_log_function_path
    if custom is not None and load_function(custom)(rollout_id, args, data, extra_metrics):
        return None
    log_dict = extra_metrics or {}
    for name, entry in data.items():
        log_dict[f"eval/{name}"] = _mean(entry["rewards"])
        if "truncated" in entry:
            log_dict[f"eval/{name}-truncated_ratio"] = _mean([float(t) for t in entry["truncated"]])
    log_dict["eval/step"] = compute_rollout_step(args, rollout_id)
    logging_utils.log(args, log_dict, step_key="eval/step")
    return log_dict
