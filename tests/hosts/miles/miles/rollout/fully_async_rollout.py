"""Stands in for `miles.rollout.fully_async_rollout` (`--fully-async`): generation that never stops.

`FullyAsyncRolloutFn` builds, on its first train call, its data buffer (the class named by
`--custom-async-data-buffer-path`, else `DefaultDataBuffer`; see `fully_async_data_buffer`),
constructed with the args and the unused-group handler of `--async-unused-samples-handler`
(`retry`: each prompt sample is `reset_for_retry` (which leaves status ABORTED and keeps the
metadata) and the group handed back to the data source; `drop`, Miles' default: nothing), and
starts a worker task on the shared loop. The worker keeps up to `--rollout-batch-size` groups (or
`--async-max-concurrent-samples` worth) in flight ACROSS training steps, one group
(`get_samples(1)`) at a time, and `put`s every finished group into the buffer (a put may block
while the buffer is full, holding the worker back). A train call `get`s groups one at a time,
passing `current_version=input.weight_version`, until it has `--rollout-batch-size`, sorts them
by their first sample's index, applies `--rollout-sample-filter-path`, and returns the buffer's
`get_metrics()` as the step's metrics; if the worker died, its exception is raised there. There
is no end-of-rollout abort: the rollout state is never marked aborted. Evaluation pauses new
submissions while it runs.
Not modelled: Miles' submission scheduler (it paces per sample by default under `--fully-async`;
the fake submits whole groups as they finish), its no-progress warnings and its log previews.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from miles.rollout.base_types import RolloutFnConstructorInput, RolloutFnEvalOutput, RolloutFnTrainOutput
from miles.rollout.fully_async_data_buffer import (
    DataBuffer,
    DataBufferConstructorInput,
    DataBufferInput,
    DefaultDataBuffer,
    first_sample,
)
from miles.rollout.inference_rollout.inference_rollout_common import GenerateState, generate_and_rm_group
from miles.rollout.inference_rollout.inference_rollout_eval import run_eval_datasets
from miles.utils.misc import load_function
from miles.utils.types import Sample

logger = logging.getLogger(__name__)


class FullyAsyncRolloutFn:
    def __init__(self, input: RolloutFnConstructorInput):
        self.args = input.args
        self.data_source = input.data_source
        self.state = GenerateState(input.args)
        assert self.args.async_unused_samples_handler in ("retry", "drop")
        retry = self.args.async_unused_samples_handler == "retry"
        self._handle_unused = self._recycle if retry else (lambda prompt_group: None)
        self._sample_filter = load_function(self.args.rollout_sample_filter_path)
        self._worker: asyncio.Task | None = None
        self._output: DataBuffer | None = None
        self._producer_resumed = asyncio.Event()
        self._producer_resumed.set()
        self._eval_cache: dict[Any, Any] = {}

    async def __call__(self, input: Any) -> Any:
        if input.evaluation:
            return await self._call_eval(input)
        if self._worker is None:
            buffer_cls = load_function(self.args.custom_async_data_buffer_path) or DefaultDataBuffer
            self._output = buffer_cls(
                DataBufferConstructorInput(args=self.args, unused_handler_fn=self._handle_unused)
            )
            self._worker = asyncio.create_task(self._worker_loop())
        return await self._drain(input)

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

    async def _generate_group(self, prompt_group: list[Sample]) -> DataBufferInput:
        result = await generate_and_rm_group(
            self.state, prompt_group, self.state.sampling_params.copy(), evaluation=False
        )
        return DataBufferInput(prompt_group=prompt_group, group=result)

    async def _worker_loop(self) -> None:
        active: set[asyncio.Task] = set()
        while True:
            await self._producer_resumed.wait()
            while len(active) < self._max_in_flight_groups():
                [prompt_group] = self.data_source.get_samples(1)
                active.add(asyncio.create_task(self._generate_group(prompt_group)))
            done, active = await asyncio.wait(active, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                await self._output.put(task.result())  # an exception kills the worker

    async def _next_group(self, current_version: int | None) -> DataBufferInput:
        getter = asyncio.create_task(self._output.get(current_version=current_version))
        try:
            done, _ = await asyncio.wait({getter, self._worker}, return_when=asyncio.FIRST_COMPLETED)
            if self._worker in done:  # checked first: a dead worker fails the step at once
                self._worker.result()
                raise RuntimeError("fully-async rollout worker exited without an exception")
            return getter.result()
        finally:
            if not getter.done():
                getter.cancel()

    async def _drain(self, input: Any) -> RolloutFnTrainOutput:
        assert self.args.rollout_global_dataset
        data = []
        while len(data) < self.args.rollout_batch_size:
            entry = await self._next_group(input.weight_version)
            assert len(entry.group) == self.args.n_samples_per_prompt
            data.append(entry.group)
        data.sort(key=lambda g: first_sample(g).index)
        if self._sample_filter is not None:
            self._sample_filter(self.args, data)
        return RolloutFnTrainOutput(samples=data, metrics=self._output.get_metrics())

    def _recycle(self, prompt_group: list[Sample]) -> None:
        for sample in prompt_group:
            sample.reset_for_retry()
        self.data_source.add_samples([prompt_group])
