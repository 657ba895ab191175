"""Fake of `slime.utils.types`: the `Sample` dataclass.

Same field names, defaults and status values as the real one, for every field that the rollout
code, the train-data conversion and the plugin read. Tensor-typed fields of the real class are
plain lists or None here; the speculative-decoding and prefix-cache statistics are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    # Shared by all samples produced from one execution; None means "use index" downstream.
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)  # prompt ids followed by response ids
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: list[list[int]] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["status"] = self.status.value
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        data = dict(data)
        data["status"] = Sample.Status(data["status"])
        names = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():  # extra attributes survive the round trip
            if key not in names:
                setattr(sample, key, value)
        return sample

    def get_reward_value(self, args: Any) -> Any:
        return self.reward[args.reward_key] if args.reward_key else self.reward
