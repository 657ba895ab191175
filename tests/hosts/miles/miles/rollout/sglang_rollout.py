"""Stands in for `miles.rollout.sglang_rollout`: Miles' deprecated function-based rollout (v1),
used only with `MILES_USE_LEGACY_ROLLOUT_V1=1` (`generate_rollout(args, rollout_id, data_source,
evaluation=False)`).

Differences from the class-based path that a plugin meets:
- `GenerateState` is a process-wide SINGLETON (SingletonMeta), created on first use with the args
  of that call; it also holds the pending group tasks and `remaining_batch_size`.
- The generate function is loaded per call with `load_generate_function` and called with a
  GenerateFnInput whose `state` is this singleton (so a new-form function sees `aborted` here
  too; a legacy-form one goes through the adapter and does not).
- A group task that raises is NOT caught: the exception ends the rollout.
- Groups drawn: `--over-sampling-batch-size` at a time while fewer than `--rollout-batch-size`
  are outstanding. `abort()` has the same order as the class-based one, and a failed
  `/abort_request` is only logged.
"""

from __future__ import annotations

import asyncio
import logging
from copy import deepcopy
from typing import Any

from miles import _test_seams
from miles.rollout.base_types import GenerateFnInput, RolloutFnEvalOutput, RolloutFnTrainOutput
from miles.rollout.inference_rollout.compatibility import load_generate_function
from miles.rollout.inference_rollout.inference_rollout_eval import (
    eval_dataset_samples,
    eval_result,
    eval_sampling_params,
)
from miles.rollout.rm_hub import async_rm, batched_async_rm
from miles.utils.async_utils import run
from miles.utils.http_utils import post
from miles.utils.misc import SingletonMeta, call_agent_abort_hook, load_function
from miles.utils.types import Sample

logger = logging.getLogger(__name__)


class GenerateState(metaclass=SingletonMeta):
    def __init__(self, args: Any) -> None:
        self.args = args
        self.tokenizer = None  # Miles: load_tokenizer(args.hf_checkpoint, ...)
        self.semaphore = asyncio.Semaphore(
            args.sglang_server_concurrency * args.rollout_num_gpus // args.rollout_num_gpus_per_engine
        )
        self.sampling_params: dict[str, Any] = dict(
            temperature=args.rollout_temperature,
            top_p=args.rollout_top_p,
            top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len,
            stop=args.rollout_stop,
            stop_token_ids=args.rollout_stop_token_ids,
            skip_special_tokens=args.rollout_skip_special_tokens,
            no_stop_trim=True,
            spaces_between_special_tokens=False,
        )
        self.reset()

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()
        self.aborted = False

    def submit_generate_tasks(self, groups: list[list[Sample]]) -> None:
        for group in groups:
            self.pendings.add(
                asyncio.create_task(
                    generate_and_rm_group(self.args, group, self.sampling_params.copy(), evaluation=False)
                )
            )
        self.remaining_batch_size += len(groups)


async def generate_and_rm(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Any:
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample
    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        path = getattr(sample, "generate_function_path", None) or args.custom_generate_function_path
        generate_fn = load_generate_function(path) if path else None
        if generate_fn is None:
            raise NotImplementedError(
                "the fake Miles has no built-in generate function; set --custom-generate-function-path"
            )
        with _test_seams.counting_generate_call():
            output = await generate_fn(
                GenerateFnInput(
                    state=state, sample=sample, sampling_params=sampling_params, evaluation=evaluation
                )
            )
        result = output.samples
    if args.group_rm:
        return result
    if isinstance(result, list):
        if any(s.status == Sample.Status.ABORTED for s in result):
            return result
        need = [s for s in result if s.reward is None]
        for s, reward in zip(need, await batched_async_rm(args, need), strict=False):
            s.reward = reward
        return result
    if result.status != Sample.Status.ABORTED and result.reward is None:
        result.reward = await async_rm(args, result)
    return result


async def generate_and_rm_group(
    args: Any, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Any]:
    state = GenerateState(args)
    if state.aborted:
        return group
    tasks = [
        asyncio.create_task(generate_and_rm(args, s, deepcopy(sampling_params), evaluation=evaluation))
        for s in group
    ]
    results = list(await asyncio.gather(*tasks))
    if not state.aborted and args.group_rm:
        for s, reward in zip(results, await batched_async_rm(args, results), strict=False):
            s.reward = reward
    return results


async def abort(args: Any, rollout_id: int) -> list[list[Sample]]:
    state = GenerateState(args)
    assert not state.aborted
    state.aborted = True
    await _test_seams.notify_abort("aborted", pending_groups=len(state.pendings))
    urls = [f"http://{args.sglang_router_ip}:{args.sglang_router_port}"]
    for url, result in zip(
        urls,
        await asyncio.gather(
            *[post(f"{u}/abort_request", {"abort_all": True}) for u in urls], return_exceptions=True
        ),
    ):
        if isinstance(result, Exception):
            logger.warning("failed to abort worker at %s: %s", url, result)
    await call_agent_abort_hook(args)
    aborted_samples = []
    while state.pendings:
        done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
        if args.partial_rollout:
            for task in done:
                group = task.result()
                for sample in group:
                    if sample.response and "start_rollout_id" not in sample.metadata:
                        sample.metadata["start_rollout_id"] = rollout_id
                aborted_samples.append(group)
    await _test_seams.notify_abort("drained", pending_groups=0)
    return aborted_samples


async def generate_rollout_async(
    args: Any, rollout_id: int, get_samples: Any
) -> tuple[RolloutFnTrainOutput, list]:
    assert args.rollout_global_dataset
    state = GenerateState(args)
    dynamic_filter = load_function(args.dynamic_sampling_filter_path)
    target = args.rollout_batch_size
    data: list[list[Any]] = []
    while len(data) < target:
        while state.remaining_batch_size < target:
            state.submit_generate_tasks(get_samples(args.over_sampling_batch_size))
        done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            group = task.result()  # an exception ends the rollout
            assert len(group) == args.n_samples_per_prompt
            if dynamic_filter is not None and not bool(
                getattr(keep := dynamic_filter(args, group), "keep", keep)
            ):
                state.remaining_batch_size -= 1
                continue
            if len(data) < target:
                data.append(group)
    aborted_samples = await abort(args, rollout_id)
    assert len(data) == args.rollout_batch_size, (
        f"Got {len(data)} samples, expected {args.rollout_batch_size}"
    )
    data.sort(key=lambda g: g[0][0].index if isinstance(g[0], list) else g[0].index)
    state.reset()
    if (path := args.rollout_sample_filter_path) is not None:
        load_function(path)(args, data)
    return RolloutFnTrainOutput(samples=data, metrics={}), aborted_samples


async def eval_rollout(args: Any, rollout_id: int) -> tuple[RolloutFnEvalOutput, list]:
    assert not args.group_rm, "Group RM is not supported for eval rollout"
    results = await asyncio.gather(*[_eval_one(args, cfg) for cfg in args.eval_datasets or []])
    return RolloutFnEvalOutput(data={name: value for r in results for name, value in r.items()}), []


_EVAL_PROMPT_DATASET: dict[Any, Any] = {}


async def _eval_one(args: Any, cfg: Any) -> dict[str, dict[str, Any]]:
    params = eval_sampling_params(args, cfg)
    samples = eval_dataset_samples(args, cfg, _EVAL_PROMPT_DATASET)
    # (sic) Miles hands every eval call the same sampling-params dict
    results = await asyncio.gather(*[generate_and_rm(args, s, params, evaluation=True) for s in samples])
    return eval_result(args, cfg, list(results))


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    assert args.rollout_global_dataset
    if evaluation:
        output, _ = run(eval_rollout(args, rollout_id))
        return output
    output, aborted_samples = run(generate_rollout_async(args, rollout_id, data_source.get_samples))
    data_source.add_samples(aborted_samples)
    return output
