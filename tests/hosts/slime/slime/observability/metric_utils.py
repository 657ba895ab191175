"""Fake of `slime.observability.metric_utils`: `compute_rollout_step`, the x-axis of rollout logs."""

from __future__ import annotations

from typing import Any


def compute_rollout_step(args: Any, rollout_id: int) -> int:
    if getattr(args, "wandb_always_use_train_step", False):
        return rollout_id * args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size
    return rollout_id
