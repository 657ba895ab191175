"""Stands in for `miles.rollout.fully_async_rollout` (`--fully-async`): generation that never stops.

`FullyAsyncRolloutFn` starts, on its first train call, a worker task on the shared loop that
keeps up to `--rollout-batch-size` groups (or `--async-max-concurrent-samples` worth) in flight,
ACROSS training steps, one group (`get_samples(1)`) at a time, and puts each finished group into
a bounded FIFO buffer (`--async-data-buffer-capacity-factor` x rollout batch size groups; a full
buffer blocks the worker). A finished group holding any ABORTED sample is not trained on: with
`--async-unused-samples-handler retry` its prompt group is reset (`Sample.reset_for_retry`, which
leaves status ABORTED) and handed back to the data source; with `drop` (Miles' default) it is
discarded. A train call takes the first `--rollout-batch-size` buffered groups, sorted by index;
if the worker died, its exception is raised there. There is no end-of-rollout abort: the
rollout state is never marked aborted. Evaluation pauses new submissions while it runs.
Miles paces submission per sample and can bound staleness (`--max-weight-staleness`); the fake
paces per group and does not model staleness.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from miles.rollout.base_types import RolloutFnConstructorInput, RolloutFnEvalOutput, RolloutFnTrainOutput
from miles.rollout.inference_rollout.inference_rollout_common import GenerateState, generate_and_rm_group
from miles.rollout.inference_rollout.inference_rollout_eval import run_eval_datasets
from miles.utils.misc import load_function
from miles.utils.types import Sample

logger = logging.getLogger(__name__)


def _first_sample(group: list[Any]) -> Sample:
    return group[0][0] if isinstance(group[0], list) else group[0]


def _leaves(group: list[Any]) -> list[Sample]:
    return [s for item in group for s in (item if isinstance(item, list) else [item])]


class FullyAsyncRolloutFn:
    def __init__(self, input: RolloutFnConstructorInput):
        self.args = input.args
        self.data_source = input.data_source
        self.state = GenerateState(input.args)
        assert self.args.async_unused_samples_handler in ("retry", "drop")
        self._sample_filter = load_function(self.args.rollout_sample_filter_path)
        self._worker: asyncio.Task | None = None
        self._buffer: asyncio.Queue | None = None
        self._producer_resumed = asyncio.Event()
        self._producer_resumed.set()
        self._eval_cache: dict[Any, Any] = {}
        self.recycled_groups = 0

    async def __call__(self, input: Any) -> Any:
        if input.evaluation:
            return await self._call_eval(input)
        if self._worker is None:
            capacity = int(self.args.async_data_buffer_capacity_factor * self.args.rollout_batch_size)
            assert capacity >= 1
            self._buffer = asyncio.Queue(maxsize=capacity)
            self._worker = asyncio.create_task(self._worker_loop())
        return await self._drain()

    async def _call_eval(self, input: Any) -> RolloutFnEvalOutput:
        if input.generate_state is not None:
            return RolloutFnEvalOutput(data=await run_eval_datasets(input.generate_state, self._eval_cache))
        self._producer_resumed.clear()
        try:
            return RolloutFnEvalOutput(data=await run_eval_datasets(self.state, self._eval_cache))
        finally:
            self._producer_resumed.set()

    def _max_in_flight_groups(self) -> int:
        if (x := self.args.async_max_concurrent_samples) is not None:
            return max(1, x // self.args.n_samples_per_prompt)
        return self.args.rollout_batch_size

    async def _generate_group(self, prompt_group: list[Sample]) -> tuple[list[Sample], list[Any]]:
        result = await generate_and_rm_group(
            self.state, prompt_group, self.state.sampling_params.copy(), evaluation=False
        )
        return prompt_group, result

    async def _worker_loop(self) -> None:
        active: set[asyncio.Task] = set()
        while True:
            await self._producer_resumed.wait()
            while len(active) < self._max_in_flight_groups():
                [prompt_group] = self.data_source.get_samples(1)
                active.add(asyncio.create_task(self._generate_group(prompt_group)))
            done, active = await asyncio.wait(active, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                prompt_group, group = task.result()  # an exception kills the worker
                if any(s.status == Sample.Status.ABORTED for s in _leaves(group)):
                    if self.args.async_unused_samples_handler == "retry":
                        for sample in prompt_group:
                            sample.reset_for_retry()
                        self.data_source.add_samples([prompt_group])
                        self.recycled_groups += 1
                    continue
                await self._buffer.put(group)

    async def _next_group(self) -> list[Any]:
        getter = asyncio.create_task(self._buffer.get())
        try:
            done, _ = await asyncio.wait({getter, self._worker}, return_when=asyncio.FIRST_COMPLETED)
            if self._worker in done:
                self._worker.result()
                raise RuntimeError("fully-async rollout worker exited without an exception")
            return getter.result()
        finally:
            if not getter.done():
                getter.cancel()

    async def _drain(self) -> RolloutFnTrainOutput:
        assert self.args.rollout_global_dataset
        data = []
        while len(data) < self.args.rollout_batch_size:
            group = await self._next_group()
            assert len(group) == self.args.n_samples_per_prompt
            data.append(group)
        data.sort(key=lambda g: _first_sample(g).index)
        if self._sample_filter is not None:
            self._sample_filter(self.args, data)
        return RolloutFnTrainOutput(
            samples=data, metrics={"fully_async/recycled_groups": self.recycled_groups}
        )
