"""Fully asynchronous rollouts: episodes keep running while the trainer trains, within a staleness bound.

A synchronous step waits for the slowest episode of its batch. Here a producer keeps prompt groups
in flight ACROSS steps and each step takes groups that have already finished. Two hosts' ways in:

- slime and the embedded trainer: `mrlx_plugin.rollout.async_rollout` is the rollout function.
  Its producer (one per process, a task on the host's rollout loop, started by the first call)
  keeps `async_rollout.max_in_flight_groups` groups generating, one `get_samples(1)` at a time, and
  holds finished groups in a bounded queue (`async_rollout.queue_groups`; a full queue stops new
  groups). slime's own `fully_async_rollout` cannot take mrlx episodes (it orders groups by
  `getattr(item, "index")`, which for a list is the list's method, THUDM/slime#2344); this keeps its
  model (background loop, bounded queue, the data buffer) and orders by each group's first sample.
- Miles `--fully-async`: Miles' own `FullyAsyncRolloutFn` runs the producer; the plugin's
  `AsyncDataBuffer` (`--custom-async-data-buffer-path mrlx_plugin.rollout.AsyncDataBuffer`) is the
  buffer between it and training. Miles' default buffer refuses every group holding an ABORTED
  sample, and every episode that ends early holds ABORTED fillers (zero loss mask, training
  nothing) by design; this buffer keeps them, as a synchronous step does.

Staleness. `generate` stamps every episode when it starts (`born`): the job's current step, and in a
multi-model run each peer's version as last reported to the coordinator. When a step k takes a
group, its staleness is k minus the step it was born in, and for another agent's samples k minus
that agent's version at birth (the peer trains the group at its own step k). A group beyond
`async_rollout.max_staleness` is not trained: it goes back to the data source to be generated
again, counted (`multi_agent/stale_groups`). The stamp is the step current when the episode began;
the engine may have received the next weights before the step's rollout call, so the count is
never below the weights' true age and at most one above it.

In a multi-model run the initiator's step still waits for its peers at its top (the barrier of
`initiator_rollout`), and commits each kept group's peer samples under the step that trains it, so
the responders' step k trains the initiator's step k as in a synchronous run, and exactly once
holds as there.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from mrlx_plugin.core.host import HOST_PROCESS, HostSample, Status, host_generate_group

if TYPE_CHECKING:
    from mrlx_plugin.runtime import Runtime

logger = logging.getLogger(__name__)

BORN_KEY = "mrlx_born"  # the input sample's metadata key of an episode's birth stamp (copied to its samples)


# --------------------------------------------------------------------------------------------
# Birth stamps and staleness


def stamp_birth(sample: HostSample, step: int | None, peer_versions: Mapping[str, int]) -> None:
    """Record on the host's input sample (its metadata, which every sample of the episode copies)
    the step current when its episode starts and the peers' versions then."""
    if step is None:
        return
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    metadata[BORN_KEY] = {"step": int(step), "peers": {a: int(v) for a, v in peer_versions.items()}}
    sample.metadata = metadata


def clear_birth(sample: HostSample) -> None:
    """Forget an input sample's birth stamp (its group is given back, to be generated again)."""
    if isinstance(sample.metadata, dict):
        sample.metadata.pop(BORN_KEY, None)


def leaves(group: Sequence[object]) -> list[HostSample]:
    """The samples of one group of a rollout output (items are samples or lists of them)."""
    out: list[HostSample] = []
    for item in group:
        out.extend(cast("list[HostSample]", item) if isinstance(item, list) else [cast(HostSample, item)])
    return out


def birth(samples: Sequence[HostSample]) -> tuple[int | None, dict[str, int]]:
    """The oldest birth step of these samples and, per peer, the oldest version at birth."""
    steps: list[int] = []
    peers: dict[str, int] = {}
    for s in samples:
        stamp = (s.metadata or {}).get(BORN_KEY) if isinstance(s.metadata, dict) else None
        if not isinstance(stamp, dict) or type(stamp.get("step")) is not int:
            continue
        steps.append(stamp["step"])
        for agent, version in (stamp.get("peers") or {}).items():
            if type(version) is int:
                peers[agent] = min(version, peers.get(agent, version))
    return (min(steps) if steps else None), peers


def staleness(samples: Sequence[HostSample], step: int) -> tuple[int | None, dict[str, int]]:
    """How many versions older than their trainers at step `step` these samples are: this job's
    own (step minus the oldest birth step; None when none is stamped) and each peer's."""
    born, peers = birth(samples)
    return (None if born is None else max(0, step - born)), {a: max(0, step - v) for a, v in peers.items()}


def trainable(samples: Sequence[HostSample]) -> bool:
    """Whether any sample has a token to train (not ABORTED, a loss-mask 1)."""
    return any(s.status != Status.ABORTED and any(s.loss_mask or []) for s in samples)


@dataclass
class StepStats:
    """What one step's taking of groups saw: the staleness of each group kept, per agent."""

    staleness: dict[str, list[int]] = field(default_factory=dict)
    stale_groups: int = 0
    empty_groups: int = 0
    wait_s: float = 0.0
    given_back_calls: float = 0.0  # engine calls of the groups given back

    def record(self, own_agent: str, own: int | None, peers: Mapping[str, int]) -> None:
        if own is not None:
            self.staleness.setdefault(own_agent, []).append(own)
        for agent, value in peers.items():
            self.staleness.setdefault(agent, []).append(value)

    def metrics(self) -> dict[str, float]:
        out = {
            "multi_agent/stale_groups": float(self.stale_groups),
            "multi_agent/empty_groups": float(self.empty_groups),
            "multi_agent/rollout_wait_seconds": self.wait_s,
            "multi_agent/engine_calls_given_back": self.given_back_calls,
        }
        every = [v for values in self.staleness.values() for v in values]
        if every:
            out["multi_agent/staleness"] = sum(every) / len(every)
            out["multi_agent/staleness_max"] = float(max(every))
            for value in sorted(set(every)):
                out[f"multi_agent/staleness_count/{value}"] = float(every.count(value))
        for agent, values in self.staleness.items():
            out[f"multi_agent/staleness/{agent}"] = sum(values) / len(values)
            out[f"multi_agent/staleness_max/{agent}"] = float(max(values))
        return out


def too_stale(own: int | None, peers: Mapping[str, int], bound: int) -> str | None:
    """Why a group is beyond `bound` (None when it is within it)."""
    if own is not None and own > bound:
        return f"{own} versions behind this job's trainer"
    worst = max(peers.items(), key=lambda kv: kv[1], default=None)
    if worst is not None and worst[1] > bound:
        return f"{worst[1]} versions behind {worst[0]!r}'s trainer"
    return None


# --------------------------------------------------------------------------------------------
# The producer (slime, the embedded trainer)


@dataclass
class Finished:
    """One finished prompt group: the data source's samples (to give back) and what came of them."""

    prompt_group: list[HostSample]
    group: list[Any]


class Producer:
    """Keeps prompt groups generating across steps; finished ones wait in a bounded queue.

    One per (host args, data source), living on the host's rollout loop. Generation pauses while
    the host evaluates (`paused`), as evaluation shares the engines.
    """

    def __init__(self, args: argparse.Namespace, data_source: Any, in_flight: int, capacity: int):
        self.args = args
        self.data_source = data_source
        self.in_flight = in_flight
        self.capacity = capacity
        self.done: deque[Finished] = deque()
        self.active: set[asyncio.Task[Finished]] = set()
        self.ready = asyncio.Event()  # a group finished (the consumer waits on it)
        self.room = asyncio.Event()  # a group was taken or given back (the producer waits on it)
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.ensure_future(self._run())

    async def _one(self, prompt_group: list[HostSample]) -> Finished:
        return Finished(prompt_group, list(await host_generate_group(self.args, prompt_group)))

    async def _run(self) -> None:
        try:
            while True:
                await self.resumed.wait()
                empty = False
                while len(self.active) < self.in_flight and len(self.done) + len(self.active) < self.capacity:
                    groups = self.data_source.get_samples(1)
                    if not groups:
                        empty = True
                        break
                    self.active.add(asyncio.ensure_future(self._one(groups[0])))
                self.room.clear()
                room = asyncio.ensure_future(self.room.wait())
                # A data source that has nothing now has no event to wait on: ask it again in a second.
                done, _ = await asyncio.wait(
                    {*self.active, room}, timeout=1.0 if empty else None, return_when=asyncio.FIRST_COMPLETED
                )
                room.cancel()
                finished = done & self.active
                for task in finished:
                    self.active.discard(task)
                    self.done.append(task.result())  # a group whose generate raised ends the producer
                if finished:
                    self.ready.set()
        finally:  # ended (an error, or the loop closing): no group keeps generating unowned
            for task in self.active:
                task.cancel()

    async def next(self) -> Finished:
        """The oldest finished group, waiting for one; raises what ended the producer."""
        self.start()
        while not self.done:
            assert self.task is not None
            if self.task.done():
                self.task.result()
                raise RuntimeError("the asynchronous rollout's producer ended without an error")
            self.ready.clear()
            waiter = asyncio.ensure_future(self.ready.wait())
            await asyncio.wait({waiter, self.task}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        finished = self.done.popleft()
        self.room.set()
        return finished

    def give_back(self, finished: Finished) -> None:
        """Return a group's prompts to the data source, to be generated again."""
        for sample in finished.prompt_group:
            clear_birth(sample)
        self.data_source.add_samples([finished.prompt_group])
        self.room.set()


def producer_for(args: argparse.Namespace, data_source: Any, settings: Any) -> Producer:
    """The process's producer for `args` (built on first use, on the host's loop)."""
    batch = int(args.rollout_batch_size)
    section = settings.async_rollout
    in_flight = section.max_in_flight_groups or batch
    capacity = section.queue_groups or max(2 * batch, in_flight)

    def build() -> Producer:
        # Episodes now outlive steps, so this job's engines are paused for a weight push while turns
        # are in flight (slime's default pause aborts them): such a turn is asked again, as a
        # peer's is, unless the agent says otherwise. Without this every episode spanning a push
        # would end aborted, and the long ones, which this mode is for, would never train.
        for agent in settings.agents.values():
            if agent.url == "self" and "retry_on_abort" not in agent.model_fields_set:
                agent.retry_on_abort = True
        return Producer(args, data_source, in_flight, capacity)

    return cast(Producer, HOST_PROCESS.for_args(args, "producer", build))


def _engine_calls(samples: list[HostSample]) -> float:
    """The engine calls the episodes of these samples made (as a step's count has them)."""
    from mrlx_plugin.core.metrics import compute_metrics

    metrics = compute_metrics(samples)
    return (metrics.get("multi_agent/episodes") or 0.0) * (metrics.get("multi_agent/engine_calls") or 0.0)


def _first_index(finished: Finished) -> int:
    samples = leaves(finished.group)
    index = samples[0].index if samples else None
    return index if isinstance(index, int) else 0


async def take_step(
    runtime: Runtime, args: argparse.Namespace, rollout_id: int, data_source: Any
) -> tuple[list[list[Any]], dict[str, float]]:
    """Take `--rollout-batch-size` finished groups within the staleness bound for step
    `rollout_id` (a group beyond it goes back to be generated again), in the order of their first
    sample's index; in a multi-model run, commit their peer samples under their places in the step."""
    settings = runtime.settings
    producer = producer_for(args, data_source, settings)
    producer.start()
    bound = settings.async_rollout.max_staleness
    own_agent = settings.self_agent or "self"
    stats = StepStats()
    kept: list[Finished] = []
    started = time.monotonic()
    while len(kept) < int(args.rollout_batch_size):
        finished = await producer.next()
        samples = leaves(finished.group)
        group_index = samples[0].group_index if samples else None
        own, peers = staleness(samples, rollout_id)
        why = too_stale(own, peers, bound)
        if why is not None:
            stats.stale_groups += 1
            logger.info("group %s is not trained at step %d: %s", group_index, rollout_id, why)
            if runtime.outbox is not None:
                runtime.outbox.discard(group_index)
            stats.given_back_calls += _engine_calls(samples)  # spent all the same (the call budget)
            producer.give_back(finished)
            continue
        # A group with nothing to train (every episode aborted) is kept, as a synchronous step
        # keeps it: generating it again could loop on a prompt that always fails.
        stats.empty_groups += 0 if trainable(samples) else 1
        stats.record(own_agent, own, peers)
        kept.append(finished)
    stats.wait_s = time.monotonic() - started
    kept.sort(key=_first_index)
    metrics = stats.metrics()
    metrics["multi_agent/queued_groups"] = float(len(producer.done))
    metrics["multi_agent/in_flight_groups"] = float(len(producer.active))
    if runtime.outbox is not None:
        # Named after their places in the step (as AsyncDataBuffer names them): which groups fill
        # a step is a matter of timing, so a process resumed from its last save may fill a step
        # its predecessor committed with other groups, or regenerate a committed group into a
        # later step; by place, the first commits again only what is there (duplicates) and the
        # second adds a whole group to a step that needs it.
        agent = settings.self_agent
        places = {leaves(f.group)[0].group_index: f"{agent}:step{rollout_id}:{j}" for j, f in enumerate(kept)}
        try:
            await runtime.outbox.commit_groups(runtime.coordinator, rollout_id, set(places), places)
        finally:
            metrics.update(runtime.outbox.take_stats())
    return [f.group for f in kept], metrics


# --------------------------------------------------------------------------------------------
# Miles' `--fully-async`: the buffer between its producer and training


class AsyncDataBuffer:
    """Miles' `DataBuffer` for `--custom-async-data-buffer-path mrlx_plugin.rollout.AsyncDataBuffer`.

    Miles builds it with a `DataBufferConstructorInput` (`args`, `unused_handler_fn`: the
    `--async-unused-samples-handler`, which recycles or drops a group not trained). Its worker
    `put`s every finished group; each step `get`s `--rollout-batch-size` of them.
    - put: every group is kept, fillers and aborted episodes included (their zero loss masks train
      nothing, as in a synchronous step); at most `--async-data-buffer-capacity-factor` x the batch
      wait (a full buffer holds the worker back).
    - get: the first get of each step reports the step to the plugin (episodes then born are
      stamped with it) and, in a multi-model run, waits for the peers (the barrier of
      `initiator_rollout`). A group beyond `async_rollout.max_staleness` (and Miles'
      `--max-weight-staleness`, when given, on its engine versions) is unused; a kept group's peer
      samples are committed under this step before it is handed to training, keyed by the
      group's place in the step: a process resumed from its last checkpoint commits again the
      steps its predecessor committed after it, and those commits are then duplicates.
    - steps are counted from `--start-rollout-id` (see hostcheck: a resumed multi-model run must
      give it, as Miles resolves the resumed step on its trainer only).
    """

    def __init__(self, input: Any):
        self.args = input.args
        self.unused = input.unused_handler_fn
        self.capacity = max(
            1, int(self.args.async_data_buffer_capacity_factor * self.args.rollout_batch_size)
        )
        self.buffer: deque[Any] = deque()
        self.cond = asyncio.Condition()
        self.taken = 0  # groups handed to training by this process
        self.first_step = int(getattr(self.args, "start_rollout_id", 0) or 0)
        self.stats = StepStats()
        self.miles_stale = 0
        self._runtime: Runtime | None = None
        self._step_open: int | None = None
        self.step_metrics: dict[str, float] = {}

    async def _runtime_ready(self) -> Runtime:
        if self._runtime is None:
            from mrlx_plugin.runtime import get_runtime

            self._runtime = await get_runtime(self.args)
            open_step(self._runtime, self.first_step)
        return self._runtime

    def _unused(self, entry: Any, runtime: Runtime | None) -> None:
        if runtime is not None and runtime.outbox is not None:
            samples = leaves(entry.group)
            runtime.outbox.discard(samples[0].group_index if samples else None)
        self.unused(entry.prompt_group)

    async def put(self, input: Any) -> None:
        await self._runtime_ready()
        # Kept even with nothing to train (every episode aborted): a synchronous step keeps such a
        # group too, and recycling it could loop on a prompt that always fails.
        async with self.cond:
            while len(self.buffer) >= self.capacity:
                await self.cond.wait()
            self.buffer.append(input)
            self.cond.notify_all()

    async def get(self, current_version: int | None = None, **_: object) -> Any:
        runtime = await self._runtime_ready()
        batch = int(self.args.rollout_batch_size)
        step = self.first_step + self.taken // batch
        if self._step_open != step:
            self.step_metrics.update(await start_step(runtime, self.args, step))
            self._step_open = step  # after the barrier: a barrier that failed is waited on again
        bound = runtime.settings.async_rollout.max_staleness
        miles_bound = getattr(self.args, "max_weight_staleness", None)
        while True:
            async with self.cond:
                while not self.buffer:
                    await self.cond.wait()
                entry = self.buffer.popleft()
                self.cond.notify_all()
            samples = leaves(entry.group)
            own, peers = staleness(samples, step)
            why = too_stale(own, peers, bound)
            if why is None and miles_bound is not None and current_version is not None:
                versions = [int(v) for s in samples for v in (s.weight_versions or []) if str(v).isdigit()]
                if versions and current_version - min(versions) > miles_bound:
                    why = f"{current_version - min(versions)} engine versions old (--max-weight-staleness)"
            if why is not None:
                self.stats.stale_groups += 1
                logger.info("group %s is not trained at step %d: %s", samples[0].group_index, step, why)
                self._unused(entry, runtime)
                continue
            self.stats.record(runtime.settings.self_agent or "self", own, peers)
            self.stats.empty_groups += 0 if trainable(samples) else 1
            if runtime.outbox is not None:
                # Named after its place in the step: which groups fill a step is a matter of timing,
                # so a process resumed from a checkpoint older than steps its predecessor committed
                # fills those steps with other groups; their places' keys are then taken already.
                place = f"{runtime.settings.self_agent}:step{step}:{self.taken % batch}"
                index = samples[0].group_index
                await runtime.outbox.commit_groups(runtime.coordinator, step, {index}, {index: place})
            self.taken += 1
            return entry

    def get_metrics(self) -> dict[str, float]:
        """The step's metrics (Miles calls this once per step, after its last get)."""
        metrics = {
            **self.stats.metrics(),
            **self.step_metrics,
            "multi_agent/queued_groups": float(len(self.buffer)),
        }
        if self._runtime is not None and self._runtime.outbox is not None:
            metrics.update(self._runtime.outbox.take_stats())
        self.stats = StepStats()
        self.step_metrics = {}
        return metrics


# --------------------------------------------------------------------------------------------
# Steps


def open_step(runtime: Runtime, step: int) -> None:
    """Step `step` has begun: episodes starting now are born in it."""
    runtime.step = step
    if runtime.outbox is not None:
        runtime.outbox.open_step(step)


async def start_step(runtime: Runtime, args: argparse.Namespace, step: int) -> dict[str, float]:
    """The top of step `step`: open it and, in a multi-model run, report this job's version and
    wait for the peers to be within `coordinator.max_staleness` (their versions are then the
    ones episodes born in this step are stamped with)."""
    from mrlx_plugin.link.outbox import initiator_barrier

    open_step(runtime, step)
    if runtime.outbox is None:
        return {}
    if not runtime.outbox.limits:  # blocking file reads, once
        await asyncio.to_thread(runtime.outbox.load_limits, args, runtime.tokenizers)
    return await initiator_barrier(
        runtime.coordinator, runtime.outbox, args, step, runtime.samples_per_episode
    )
