"""Stands in for `miles.rollout.inference_rollout.inference_rollout_train`: one train rollout of
the class-based default, with over-sampling, and its end-of-rollout abort.

`generate_rollout_async` keeps drawing `--over-sampling-batch-size` groups while fewer groups are
pending than still needed, and keeps the first `--rollout-batch-size` groups that finish (each
must hold `n_samples_per_prompt` entries; an entry is a Sample or a generate call's list). A
group whose task raised is logged and DROPPED, and the loop goes on drawing groups (so a
generate function that always raises keeps this rollout spinning). Once enough groups are in,
`abort()` ends the rest, the kept groups are sorted by their first sample's index, and the state
is reset for the next rollout.

`abort(state, pendings, rollout_id)`, in Miles' order: set `state.aborted`; POST
`/abort_request {"abort_all": true}` to every engine (Miles asks its router for the workers; here
the router address IS the engine); await the optional agent abort hook; then wait for EVERY
pending group task (an exception from one propagates). Partial groups are collected only with
`--partial-rollout`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from miles import _test_seams
from miles.rollout.base_types import RolloutFnTrainOutput
from miles.rollout.inference_rollout.inference_rollout_common import GenerateState, generate_and_rm_group
from miles.utils.http_utils import post
from miles.utils.misc import as_completed_async, call_agent_abort_hook, load_function
from miles.utils.types import Sample

logger = logging.getLogger(__name__)


def first_sample(group: list[Any]) -> Sample:
    return group[0][0] if isinstance(group[0], list) else group[0]


async def get_worker_urls(args: Any) -> list[str]:
    return [f"http://{args.sglang_router_ip}:{args.sglang_router_port}"]


async def abort(state: GenerateState, pendings: set, rollout_id: int) -> list[list[Sample]]:
    args = state.args
    assert not state.aborted
    state.aborted = True
    await _test_seams.notify_abort("aborted", pending_groups=len(pendings))
    urls = await get_worker_urls(args)
    await asyncio.gather(*[post(f"{url}/abort_request", {"abort_all": True}) for url in urls])
    await call_agent_abort_hook(args)
    aborted_samples = []
    async for group in as_completed_async(pendings):
        if args.partial_rollout:
            for sample in group:
                if sample.response and "start_rollout_id" not in sample.metadata:
                    sample.metadata["start_rollout_id"] = rollout_id
            aborted_samples.append(group)
    await _test_seams.notify_abort("drained", pending_groups=0)
    return aborted_samples


def submit_generate_tasks(state: GenerateState, groups: list[list[Sample]]) -> list[asyncio.Task]:
    return [
        asyncio.create_task(
            generate_and_rm_group(state, group, state.sampling_params.copy(), evaluation=False)
        )
        for group in groups
    ]


async def generate_rollout_async(
    state: GenerateState, rollout_id: int, get_samples: Any
) -> tuple[RolloutFnTrainOutput, list]:
    args = state.args
    assert args.rollout_global_dataset
    dynamic_filter = load_function(args.dynamic_sampling_filter_path)
    target = args.rollout_batch_size
    pendings: set[asyncio.Task] = set()
    data: list[list[Any]] = []
    while len(data) < target:
        while len(pendings) < target - len(data):
            pendings.update(submit_generate_tasks(state, get_samples(args.over_sampling_batch_size)))
        done, pendings = await asyncio.wait(pendings, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            try:
                group = task.result()
            except Exception as exc:  # Miles logs it and drops the group
                _test_seams.dropped_group_errors.append(exc)
                if len(_test_seams.dropped_group_errors) <= 3:
                    logger.error("[rollout] task raised exception: %r", exc, exc_info=exc)
                continue
            assert len(group) == args.n_samples_per_prompt
            if dynamic_filter is not None and not _keep(dynamic_filter(args, group)):
                continue
            if len(data) < target:
                data.append(group)
    aborted_samples = await abort(state, pendings, rollout_id)
    assert len(data) == args.rollout_batch_size, (
        f"Got {len(data)} samples, expected {args.rollout_batch_size}"
    )
    data.sort(key=lambda group: first_sample(group).index)
    state.reset()
    if f := load_function(args.rollout_sample_filter_path):
        f(args, data)
    return RolloutFnTrainOutput(samples=data, metrics={}), aborted_samples


def _keep(filter_output: Any) -> bool:
    return bool(getattr(filter_output, "keep", filter_output))
