"""Stands in for `miles.rollout.fully_async_data_buffer`: the store between `--fully-async`
generation and training, and the contract a `--custom-async-data-buffer-path` class meets.

`FullyAsyncRolloutFn` builds the buffer once with a `DataBufferConstructorInput` (`args`, and
`unused_handler_fn`: what `--async-unused-samples-handler` does with a group not trained, given
the group's prompt samples), `put`s every finished group as a `DataBufferInput` (its prompt
samples and the finished group), `get`s one group at a time (`current_version`: the engines'
weight version the step's rollout call was given) and calls `get_metrics()` once per step.

`DefaultDataBuffer`, as Miles' own:
- put: a group holding any ABORTED leaf sample goes to the unused handler (counted); a group the
  `--dynamic-sampling-filter-path` does not keep is dropped (counted by reason); any other waits in
  a FIFO of floor(`--async-data-buffer-capacity-factor` x `--rollout-batch-size`) groups, a put
  into a full one blocking until a get makes room.
- get: the oldest group; its staleness is `current_version` minus the oldest engine weight
  version of its samples (`Sample.oldest_weight_version`; none when either is unknown); a group
  beyond `--max-weight-staleness` (when set) goes to the unused handler and the next is taken.
- get_metrics: `rollout/fully_async/` queue size, aborted and stale groups filtered, the average and
  maximum staleness of the groups consumed and of those still buffered; counters reset per call.
Not modelled: Miles' `MetricGatherer` (the dynamic filter's drops are a plain count per reason).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from argparse import Namespace
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from miles.utils.misc import load_function
from miles.utils.types import Sample

logger = logging.getLogger(__name__)

Group = list[Any]  # samples, or lists of samples (a generate function returning several per input)


def iter_samples(group: Group) -> Iterator[Sample]:
    for item in group:
        if isinstance(item, list):
            yield from item
        else:
            yield item


def first_sample(group: Group) -> Sample:
    return group[0][0] if isinstance(group[0], list) else group[0]


def group_oldest_weight_version(group: Group) -> int | None:
    versions = [v for s in iter_samples(group) if (v := s.oldest_weight_version) is not None]
    return min(versions) if versions else None


@dataclass(frozen=True)
class DataBufferConstructorInput:
    args: Namespace
    unused_handler_fn: Callable[[list[Sample]], None]


@dataclass
class DataBufferInput:
    prompt_group: list[Sample]  # the data source's samples, to hand back for another try
    group: Group  # what generating them gave


class DataBuffer(ABC):
    @abstractmethod
    async def put(self, input: DataBufferInput) -> None: ...

    @abstractmethod
    async def get(self, **context: Any) -> DataBufferInput: ...

    @abstractmethod
    def get_metrics(self) -> dict[str, float]: ...


class DefaultDataBuffer(DataBuffer):
    def __init__(self, input: DataBufferConstructorInput):
        args = input.args
        self._args = args
        self._buffer: list[DataBufferInput] = []
        assert args.async_data_buffer_capacity_factor > 0
        self._capacity = int(args.async_data_buffer_capacity_factor * args.rollout_batch_size)
        assert self._capacity >= 1
        self._unused_handler_fn = input.unused_handler_fn
        self._dynamic_filter = load_function(args.dynamic_sampling_filter_path)
        self._cond = asyncio.Condition()
        self._current_version: int | None = None
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._aborted_groups = 0
        self._stale_groups = 0
        self._consumed_staleness: list[int] = []
        self._filter_drops: dict[str, int] = {}

    async def put(self, input: DataBufferInput) -> None:
        if any(s.status == Sample.Status.ABORTED for s in iter_samples(input.group)):
            self._aborted_groups += 1
            self._unused_handler_fn(input.prompt_group)
            return
        if self._dynamic_filter is not None:
            verdict = self._dynamic_filter(self._args, input.group)
            if not bool(getattr(verdict, "keep", verdict)):
                reason = str(getattr(verdict, "reason", None) or "filtered")
                self._filter_drops[reason] = self._filter_drops.get(reason, 0) + 1
                return
        async with self._cond:
            while len(self._buffer) >= self._capacity:
                await self._cond.wait()
            self._buffer.append(input)
            self._cond.notify_all()

    async def get(self, current_version: int | None = None, **_: Any) -> DataBufferInput:
        if current_version is not None:
            self._current_version = current_version
        async with self._cond:
            while True:
                while not self._buffer:
                    await self._cond.wait()
                entry = self._buffer.pop(0)
                self._cond.notify_all()  # a put waiting for room
                staleness = self._staleness(entry.group, current_version)
                if staleness is None:
                    return entry
                self._consumed_staleness.append(staleness)
                limit = self._args.max_weight_staleness
                if limit is None or staleness <= limit:
                    return entry
                logger.info("filtered a stale group (staleness %d > max %d)", staleness, limit)
                self._stale_groups += 1
                self._unused_handler_fn(entry.prompt_group)

    def get_metrics(self) -> dict[str, float]:
        prefix = "rollout/fully_async/"
        metrics: dict[str, float] = {
            f"{prefix}queue_size": len(self._buffer),
            f"{prefix}aborted_groups_filtered": self._aborted_groups,
            f"{prefix}stale_groups_filtered": self._stale_groups,
            **{f"{prefix}dynamic_filter_drops/{r}": n for r, n in self._filter_drops.items()},
        }
        if consumed := self._consumed_staleness:
            metrics[f"{prefix}avg_staleness"] = sum(consumed) / len(consumed)
            metrics[f"{prefix}max_staleness"] = max(consumed)
        buffered = [
            s for e in self._buffer if (s := self._staleness(e.group, self._current_version)) is not None
        ]
        if buffered:
            metrics[f"{prefix}buffer_avg_staleness"] = sum(buffered) / len(buffered)
            metrics[f"{prefix}buffer_max_staleness"] = max(buffered)
        self._reset_counters()
        return metrics

    @staticmethod
    def _staleness(group: Group, current_version: int | None) -> int | None:
        oldest = group_oldest_weight_version(group)
        if oldest is None or current_version is None:
            return None
        return current_version - oldest
