"""Stands in for `miles.utils.environ`: the switch to Miles' deprecated function-based rollout."""

from __future__ import annotations

import os


def use_legacy_rollout_v1() -> bool:
    """`MILES_USE_LEGACY_ROLLOUT_V1=1` selects `miles.rollout.sglang_rollout.generate_rollout`."""
    return bool(int(os.environ.get("MILES_USE_LEGACY_ROLLOUT_V1", "0")))
