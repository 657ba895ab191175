"""Stands in for `miles.rollout.base_types`: what flows in and out of generate and rollout functions.

- A new-form generate function is `async fn(input: GenerateFnInput) -> GenerateFnOutput`;
  `input.state` is the rollout's GenerateState (its `aborted` flag included), `input.args` reads
  `state.args`.
- A class-based rollout function is constructed once with a `RolloutFnConstructorInput` and
  called with a `RolloutFnTrainInput` or `RolloutFnEvalInput` (sync or async).
- `call_rollout_fn` is how the legacy (v1) path calls `fn(args, rollout_id, data_source,
  evaluation=...)`; a bare return value is wrapped into the output type.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass
from typing import Any

from miles.utils.types import Sample


@dataclass(frozen=True)
class RolloutFnConstructorInput:
    args: Namespace
    data_source: Any


@dataclass(frozen=True)
class RolloutFnBaseInput:
    rollout_id: int

    @property
    def evaluation(self) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class RolloutFnTrainInput(RolloutFnBaseInput):
    weight_version: int | None = None  # the engines' weight version, None before the first update

    @property
    def evaluation(self) -> bool:
        return False


@dataclass(frozen=True)
class RolloutFnEvalInput(RolloutFnBaseInput):
    generate_state: Any = None  # a dedicated eval fleet's GenerateState, else the rollout's own
    weight_version: str | None = None
    hf_dir: str | None = None

    @property
    def evaluation(self) -> bool:
        return True


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


RolloutFnInput = RolloutFnTrainInput | RolloutFnEvalInput
RolloutFnOutput = RolloutFnTrainOutput | RolloutFnEvalOutput


@dataclass(frozen=True)
class GenerateFnInput:
    state: Any  # GenerateState of the rollout that made this call
    sample: Sample
    sampling_params: dict[str, Any]
    evaluation: bool

    @property
    def args(self) -> Namespace:
        return self.state.args


@dataclass(frozen=True)
class GenerateFnOutput:
    samples: Sample | list[Sample]  # several for multi-agent or tree-shaped generation


def call_rollout_fn(fn: Any, *args: Any, evaluation: bool, **kwargs: Any) -> RolloutFnOutput:
    output = fn(*args, **kwargs, evaluation=evaluation)
    if not isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        output = RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)
    return output
