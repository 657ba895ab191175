"""Stands in for `miles.rollout.inference_rollout.compatibility`: how Miles loads plugin functions.

Generate functions (`load_generate_function`):
- a class is instantiated (no arguments) and the instance is called;
- a function with 3 or more parameters whose first is NOT named `input` is the legacy form
  `fn(args, sample, sampling_params[, evaluation])`: it is wrapped in `LegacyGenerateFnAdapter`,
  which passes `input.args` (NOT the rollout state: a legacy function cannot see `aborted`) and
  `evaluation` only when the signature names it, and wraps the result in a GenerateFnOutput;
- anything else is called as `await fn(GenerateFnInput)` and must return a GenerateFnOutput.

Rollout functions (`load_rollout_function`): a class is constructed with a
RolloutFnConstructorInput; a function is wrapped in `LegacyRolloutFnAdapter`, which calls
`fn(args, rollout_id, data_source, evaluation=...)` and wraps a bare return value.
`call_rollout_function` runs a coroutine result on the shared loop (`async_utils.run`).
"""

from __future__ import annotations

import inspect
from typing import Any

from miles.rollout.base_types import (
    GenerateFnInput,
    GenerateFnOutput,
    RolloutFnConstructorInput,
    RolloutFnEvalOutput,
    RolloutFnTrainOutput,
)
from miles.utils.async_utils import run
from miles.utils.misc import load_function


class LegacyRolloutFnAdapter:
    def __init__(self, input: RolloutFnConstructorInput, fn: Any):
        self.args = input.args
        self.data_source = input.data_source
        self.fn = fn

    def __call__(self, input: Any) -> Any:
        output = self.fn(self.args, input.rollout_id, self.data_source, evaluation=input.evaluation)
        if not isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
            output = (
                RolloutFnEvalOutput(data=output) if input.evaluation else RolloutFnTrainOutput(samples=output)
            )
        return output


def load_rollout_function(input: RolloutFnConstructorInput, path: str) -> Any:
    fn = load_function(path)
    return fn(input) if inspect.isclass(fn) else LegacyRolloutFnAdapter(input, fn)


def call_rollout_function(fn: Any, input: Any) -> Any:
    output = fn(input)
    if inspect.iscoroutine(output):
        output = run(output)
    return output


class LegacyGenerateFnAdapter:
    def __init__(self, fn: Any):
        self.fn = fn
        self._has_evaluation_param = "evaluation" in inspect.signature(fn).parameters

    async def __call__(self, input: GenerateFnInput) -> GenerateFnOutput:
        if self._has_evaluation_param:
            output = await self.fn(
                input.args, input.sample, input.sampling_params, evaluation=input.evaluation
            )
        else:
            output = await self.fn(input.args, input.sample, input.sampling_params)
        return output if isinstance(output, GenerateFnOutput) else GenerateFnOutput(samples=output)


def load_generate_function(path: str | None) -> Any:
    fn = load_function(path)
    if fn is None:
        return None
    if inspect.isclass(fn):
        return fn()
    if _is_legacy_generate_fn(fn):
        return LegacyGenerateFnAdapter(fn)
    return fn


def _is_legacy_generate_fn(fn: Any) -> bool:
    params = list(inspect.signature(fn).parameters)
    return len(params) >= 3 and params[0] != "input"
