"""Fake of `slime.observability.rollout_data_utils`: `validate_rollout_id_annotated`.

The rollout function's output is walked before flattening. A list of samples found two or more
levels deep (prompt group -> one execution -> its samples: a generate function that returned
several) must carry one shared, non-None `rollout_id` on every sibling; shallower lists (the
default one-sample-per-execution shape) are not checked.
"""

from __future__ import annotations

from typing import Any

from slime.utils.types import Sample


def validate_rollout_id_annotated(node: Any, depth: int = 0) -> None:
    if isinstance(node, Sample):
        return
    assert isinstance(node, list), f"unexpected rollout output node type: {type(node).__name__}"
    if node and isinstance(node[0], Sample):
        if depth >= 2 and len(node) > 1:
            ids = [s.rollout_id for s in node]
            missing = [i for i, rid in enumerate(ids) if rid is None]
            assert not missing, f"{len(node)} sibling samples have no rollout_id at positions {missing}"
            assert len(set(ids)) == 1, f"sibling samples of one execution must share rollout_id; got {ids}"
        return
    for item in node:
        validate_rollout_id_annotated(item, depth + 1)
