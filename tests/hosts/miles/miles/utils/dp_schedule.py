"""Stands in for `miles.utils.dp_schedule`: the rollout-side micro-batch schedule of a step.

`global_batch_size` counts ROLLOUTS (distinct rollout ids), not samples: every sample of one
rollout lands in the same optimizer step. The packing and its alignment rule (static
micro-batches: the count per step must be a multiple of dp_size x micro-batch group, else an
AssertionError) are the shared model in `tests/hosts/dp_split.py`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dp_split import split_by_dp

SCHEDULE_CONFIG_KEYS = ("dp_size", "cp_size", "vpp_size", "microbatch_group_size_per_vp_stage")


def has_full_schedule_config(train_parallel_config: dict | None) -> bool:
    return bool(train_parallel_config) and all(k in train_parallel_config for k in SCHEDULE_CONFIG_KEYS)


def build_dp_schedule(
    args: Any,
    train_parallel_config: dict,
    total_lengths: list[int],
    *,
    global_batch_size: int,
    rollout_indices: list[Any],
) -> list[list[int]]:
    """Sample positions per data-parallel rank (Miles also returns the micro-batch layout)."""
    step_args = SimpleNamespace(**{**vars(args), "global_batch_size": global_batch_size})
    return split_by_dp(step_args, train_parallel_config, total_lengths, rollout_indices)
