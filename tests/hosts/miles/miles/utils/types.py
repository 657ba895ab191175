"""Stands in for `miles.utils.types`: Miles' `Sample`.

A plain dataclass, so extra attributes may be set on it. Like Miles' (since #1927, 2026-08-04,
and in v0.1.0) it HAS a `rollout_id` field: None means "the sample's `index`" wherever Miles
counts rollouts, and siblings returned together by one generate call must share a non-None one
(`rollout_data_conversion.validate_compact_rollout_ids`). Fields a plugin does not meet (LoRA
adapter, routed experts, OPD, speculative-decoding and prefix-cache statistics) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict | None = None
    non_generation_time: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        value = self.__dict__.copy()
        value["status"] = self.status.value
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        data = dict(data)
        data["status"] = Sample.Status(data["status"])
        names = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

    def get_reward_value(self, args: Any) -> Any:
        return self.reward[args.reward_key] if args.reward_key else self.reward

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    @property
    def oldest_weight_version(self) -> int | None:
        versions = [int(v) for v in self.weight_versions if str(v).isdigit()]
        return min(versions) if versions else None

    def reset_for_retry(self) -> None:
        """Forget everything generated, keep the prompt and identity (fully-async recycling)."""
        self.tokens = []
        self.multimodal_train_inputs = None
        self.response = ""
        self.response_length = 0
        self.reward = None
        self.loss_mask = None
        self.weight_versions = []
        self.rollout_log_probs = None
        self.status = Sample.Status.ABORTED  # (sic) Miles marks a recycled prompt ABORTED
        self.non_generation_time = 0.0
        self.remove_sample = False
        self.train_metadata = None
