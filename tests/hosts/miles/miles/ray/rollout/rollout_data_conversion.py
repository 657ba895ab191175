"""Stands in for `miles.ray.rollout.rollout_data_conversion`: checks and flattens a rollout's output.

- Every generate call's list of several samples (depth >= 2 in the output) must carry ONE shared,
  non-None `rollout_id` (AssertionError otherwise): that is how Miles keeps a multi-sample
  rollout together and counts it once.
- The nested groups are flattened into one list.
- Only when no sample has a `rollout_id` (and `--disable-rollout-trim-samples` is off) is the
  list cut down to a multiple of `--global-batch-size` samples (ValueError if that leaves none).
"""

from __future__ import annotations

import itertools
from typing import Any

from miles.utils.types import Sample


def postprocess_rollout_data(
    args: Any, data: list[Any], train_parallel_config: dict | None
) -> tuple[list[Sample], dict]:
    metadata: dict[str, Any] = {}
    validate_compact_rollout_ids(data)
    while data and isinstance(data[0], list):
        data = list(itertools.chain.from_iterable(data))
    compact = any(s.rollout_id is not None for s in data)
    if not args.disable_rollout_trim_samples and not compact and len(data) % args.global_batch_size:
        keep = len(data) // args.global_batch_size * args.global_batch_size
        if keep == 0:
            raise ValueError(f"Not enough samples {len(data)} for global_batch_size {args.global_batch_size}")
        data = data[:keep]
    return data, metadata


def validate_compact_rollout_ids(node: Any, depth: int = 0) -> None:
    if isinstance(node, Sample):
        return
    assert isinstance(node, list), f"unexpected rollout output node type: {type(node).__name__}"
    if node and isinstance(node[0], Sample):
        if depth >= 2 and len(node) > 1:
            ids = [s.rollout_id for s in node]
            missing = [i for i, r in enumerate(ids) if r is None]
            assert not missing, (
                f"Compact rollout returned {len(node)} samples but rollout_id is unset on positions {missing}"
            )
            assert len(set(ids)) == 1, (
                f"Sibling samples from one compact rollout must share rollout_id; got {ids}"
            )
        return
    for item in node:
        validate_compact_rollout_ids(item, depth + 1)
