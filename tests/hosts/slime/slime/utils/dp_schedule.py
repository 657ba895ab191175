"""Fake of `slime.utils.dp_schedule`: `build_dp_schedule`, the data-parallel split of a rollout.

The rule (shared with Miles) lives in `tests/hosts/dp_split.py`: rollout ids grouped into steps
of `global_batch_size`, each step packed into micro-batches whose count must align with dp_size
(static path raises an AssertionError, dynamic path splits bins). The real function also returns
the per-rank micro-batch schedule; the fake returns only the per-rank sample positions.
"""

from __future__ import annotations

import argparse
from typing import Any

from dp_split import split_by_dp


def build_dp_schedule(
    args: Any,
    train_parallel_config: dict,
    total_lengths: list[int],
    *,
    global_batch_size: int,
    rollout_indices: list[Any],
) -> list[list[int]]:
    view = argparse.Namespace(**{**vars(args), "global_batch_size": global_batch_size})
    return split_by_dp(view, train_parallel_config, total_lengths, rollout_indices)
