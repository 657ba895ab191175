"""slime's checkpoint schedule, as a responder job needs to know it.

A responder acknowledges a step's groups only once a job resumed from its checkpoints would not
train them again, and slime has no hook after a save: these functions read, from slime's flags
(`--save`, `--save-interval`, `--async-save`, `--num-rollout`, `--num-rollout-per-epoch`), which
steps its loop saves, the last step that is durable at the top of a step (`durable_step_before`),
and how many steps a responder may therefore hold unacknowledged (`save_window`).
"""

from __future__ import annotations

import argparse


def save_window(args: argparse.Namespace) -> tuple[int, str]:
    """How many of the producer's steps a responder may hold unacknowledged at once: the steps
    since the last durable save, plus the one it waits for. (1, ...) without saves to wait for."""
    interval = getattr(args, "save_interval", None)
    if not getattr(args, "save", None) or not interval:
        return 1, "no --save: every step is acknowledged when the next begins"
    interval = int(interval)
    if getattr(args, "async_save", False):
        return 2 * interval, f"--save-interval {interval} with --async-save"
    return interval, f"--save-interval {interval}"


def _saves_at(args: argparse.Namespace, rollout_id: int) -> bool:
    """slime's `should_run_periodic_action(rollout_id, args.save_interval, num_rollout_per_epoch,
    args.num_rollout)`: whether its loop saves after training `rollout_id`."""
    interval = getattr(args, "save_interval", None)
    if interval is None:
        return False
    num_rollout = getattr(args, "num_rollout", None)
    if num_rollout is not None and rollout_id == int(num_rollout) - 1:
        return True
    step = rollout_id + 1
    per_epoch = getattr(args, "num_rollout_per_epoch", None)
    return step % int(interval) == 0 or (per_epoch is not None and step % int(per_epoch) == 0)


def durable_step_before(args: argparse.Namespace, rollout_id: int) -> int:
    """The last step whose training a job resumed now would not repeat, seen from the top of its
    step `rollout_id` (-1: none). slime's loop per step is rollout -> train -> save (every
    `--save-interval` steps and the last) -> weight push, and a resumed job continues after the
    checkpoint it loads:
    - without `--save` (or `--save-interval`) nothing is ever resumed: every step before this one;
    - otherwise the last step saved before this one;
    - with `--async-save` that save may still be in flight: the save before it."""
    if not getattr(args, "save", None) or not getattr(args, "save_interval", None):
        return rollout_id - 1
    skip = 1 if getattr(args, "async_save", False) else 0
    for step in range(rollout_id - 1, -1, -1):
        if _saves_at(args, step):
            if not skip:
                return step
            skip -= 1
    return -1
