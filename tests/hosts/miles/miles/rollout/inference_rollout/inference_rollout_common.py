"""Stands in for `miles.rollout.inference_rollout.inference_rollout_common`: Miles' default,
class-based rollout (`InferenceRolloutFn`) and the per-sample call of the generate function.

`GenerateState` is one object per rollout function instance (NOT a singleton): `args`, the
`aborted` flag (set by `abort()`, cleared by `reset()` at the end of each train rollout), the
semaphore that bounds concurrent generate calls (`--sglang-server-concurrency` x engines), the
rollout's sampling params and the loaded generate function. Miles also loads the tokenizer and
processor of `--hf-checkpoint` here; the fake does not (it has no built-in generate function).

`generate_and_rm`: a sample already COMPLETED/TRUNCATED is returned as is; a sample that gets
the semaphore after `aborted` is set comes back ABORTED without a call; otherwise the generate
function is awaited with a GenerateFnInput (its own copy of the sampling params) and
`output.samples` taken. Then rewards: a list with any ABORTED sample is returned as is;
otherwise the samples whose `reward` is None go to `batched_async_rm` (once, as a list). A
single sample is graded by `async_rm` unless ABORTED or already rewarded.
`generate_and_rm_group` returns the group untouched when the state is already aborted.
"""

from __future__ import annotations

import asyncio
from copy import deepcopy
from typing import Any

from miles import _test_seams
from miles.rollout.base_types import (
    GenerateFnInput,
    RolloutFnConstructorInput,
    RolloutFnEvalOutput,
    RolloutFnTrainOutput,
)
from miles.rollout.inference_rollout.compatibility import load_generate_function
from miles.rollout.rm_hub import async_rm, batched_async_rm
from miles.utils.types import Sample


async def _no_builtin_generate(input: GenerateFnInput) -> Any:
    raise NotImplementedError(
        "the fake Miles has no built-in generate function; set --custom-generate-function-path"
    )


class GenerateState:
    def __init__(self, args: Any) -> None:
        self.args = args
        self.tokenizer = None  # Miles: load_tokenizer(args.hf_checkpoint, ...)
        self.generate_fn_semaphore = asyncio.Semaphore(
            args.sglang_server_concurrency * args.rollout_num_gpus // args.rollout_num_gpus_per_engine
        )
        self.sampling_params = compute_sampling_params(
            args,
            temperature=args.rollout_temperature,
            top_p=args.rollout_top_p,
            top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len,
        )
        self.generate_function = (
            load_generate_function(args.custom_generate_function_path) or _no_builtin_generate
        )
        self.reset()

    def reset(self) -> None:
        self.aborted = False


def compute_sampling_params(
    args: Any, *, temperature: Any, top_p: Any, top_k: Any, max_new_tokens: Any
) -> dict[str, Any]:
    return dict(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        stop=args.rollout_stop,
        stop_token_ids=args.rollout_stop_token_ids,
        skip_special_tokens=args.rollout_skip_special_tokens,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
    )


async def generate_and_rm(
    state: GenerateState, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Any:
    args = state.args
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample
    async with state.generate_fn_semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        generate_fn = load_generate_function(sample.generate_function_path) or state.generate_function
        with _test_seams.counting_generate_call():
            output = await generate_fn(
                GenerateFnInput(
                    state=state,
                    sample=sample,
                    sampling_params=deepcopy(sampling_params),
                    evaluation=evaluation,
                )
            )
        result = output.samples
    if args.group_rm:
        return result
    if isinstance(result, list):
        if any(s.status == Sample.Status.ABORTED for s in result):
            return result
        await batched_async_rm(args, [s for s in result if s.reward is None], inplace_set_reward_field=True)
        return result
    if result.status != Sample.Status.ABORTED and result.reward is None:
        result.reward = await async_rm(args, result)
    return result


async def generate_and_rm_group(
    state: GenerateState, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Any]:
    if state.aborted:
        return group
    tasks = [
        asyncio.create_task(generate_and_rm(state, sample, sampling_params.copy(), evaluation=evaluation))
        for sample in group
    ]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # let the siblings settle before the error leaves the group
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if not state.aborted and state.args.group_rm:
        await batched_async_rm(state.args, results, inplace_set_reward_field=True)
    return list(results)


class InferenceRolloutFn:
    """`--rollout-function-path` default: train rollouts with over-sampling, and evaluation."""

    def __init__(self, input: RolloutFnConstructorInput):
        self.data_source = input.data_source
        self.state = GenerateState(input.args)
        self.eval_prompt_dataset_cache: dict[Any, Any] = {}

    async def __call__(self, input: Any) -> Any:
        return await (self._call_eval(input) if input.evaluation else self._call_train(input))

    async def _call_train(self, input: Any) -> RolloutFnTrainOutput:
        from miles.rollout.inference_rollout.inference_rollout_train import generate_rollout_async

        output, aborted_samples = await generate_rollout_async(
            self.state, input.rollout_id, self.data_source.get_samples
        )
        self.data_source.add_samples(aborted_samples)
        return output

    async def _call_eval(self, input: Any) -> RolloutFnEvalOutput:
        from miles.rollout.inference_rollout.inference_rollout_eval import run_eval_datasets

        state = input.generate_state or self.state
        return RolloutFnEvalOutput(data=await run_eval_datasets(state, self.eval_prompt_dataset_cache))
