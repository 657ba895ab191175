"""Stands in for `miles.rollout.inference_rollout.inference_rollout_eval`: evaluation datasets.

For each `--eval-prompt-data NAME PATH` dataset, every prompt is generated
`n_samples_per_eval_prompt` times (evaluation=True, the dataset's sampling params), each copy
numbered by `index` and given the dataset's generate-function override; list results are
flattened. The result per dataset: `{"rewards": [...], "truncated": [...], "samples": [...]}`
sorted by index (`--eval-reward-key`/`--reward-key` picks from dict rewards).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from miles.rollout.data_source import read_prompt_samples
from miles.rollout.inference_rollout.inference_rollout_common import (
    GenerateState,
    compute_sampling_params,
    generate_and_rm,
)
from miles.utils.misc import as_completed_async
from miles.utils.types import Sample


def eval_dataset_samples(args: Any, cfg: Any, cache: dict) -> list[Sample]:
    """The dataset's samples, one copy per eval sample, numbered by `index`."""
    if cfg.path not in cache:
        cache[cfg.path] = read_prompt_samples(cfg.path, cfg.input_key, cfg.label_key, cfg.metadata_key)
    samples = []
    for prompt in cache[cfg.path]:
        for _ in range(cfg.n_samples_per_eval_prompt):
            sample = copy.deepcopy(prompt)
            sample.index = len(samples)
            sample.generate_function_path = cfg.custom_generate_function_path
            samples.append(sample)
    return samples


def eval_sampling_params(args: Any, cfg: Any) -> dict[str, Any]:
    return compute_sampling_params(
        args,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.max_response_len,
    )


def eval_result(args: Any, cfg: Any, results: list[Any]) -> dict[str, dict[str, Any]]:
    data: list[Sample] = []
    for result in results:
        data.extend(result if isinstance(result, list) else [result])
    data.sort(key=lambda s: s.index)
    key = args.eval_reward_key or args.reward_key
    return {
        cfg.name: {
            "rewards": [s.reward[key] if key else s.reward for s in data],
            "truncated": [s.status == Sample.Status.TRUNCATED for s in data],
            "samples": data,
        }
    }


async def run_eval_datasets(state: GenerateState, prompt_dataset_cache: dict) -> dict[str, dict[str, Any]]:
    args = state.args
    assert not args.group_rm, "Group RM is not supported for eval rollout"
    results = await asyncio.gather(
        *[_eval_one(state, cfg, prompt_dataset_cache) for cfg in args.eval_datasets]
    )
    return {name: value for r in results for name, value in r.items()}


async def _eval_one(state: GenerateState, cfg: Any, cache: dict) -> dict[str, dict[str, Any]]:
    params = eval_sampling_params(state.args, cfg)
    tasks = [
        asyncio.create_task(generate_and_rm(state, s, sampling_params=params, evaluation=True))
        for s in eval_dataset_samples(state.args, cfg, cache)
    ]
    return eval_result(state.args, cfg, [r async for r in as_completed_async(tasks)])
