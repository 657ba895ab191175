"""The steps of `mrlx bench coordinator`, for the coordinator and the baseline alike: the samples of
a step and their checksum, the link that releases a producer and a consumer process step by step,
running them through the steps, and a step's throughput."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypedDict, TypeVar, cast

import numpy as np

from mrlx_lab.procstat import cpu_seconds
from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    from multiprocessing.context import SpawnContext
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

    from mrlx_plugin.link.wire import QueueItem

T = TypeVar("T")


# Sums over every token id, log-prob and mask value of a step's samples (`checksum_of`).
Checksum = tuple[int, float, int]


class ProducerNumbers(TypedDict, total=False):
    """What a producer process reports of one step: when it started and was done committing."""

    t0: float
    commit_done: float
    accepted: int  # (the coordinator's producer)
    checksum: Checksum
    cpu_s: float


class ConsumerNumbers(TypedDict):
    """What a consumer process reports of one step: when it held every sample, and how many when."""

    t_end: float
    received: int
    checksum: Checksum
    cpu_s: float
    marks: list[tuple[float, int]]  # (time, samples held by then)


class StepResult(TypedDict, total=False):
    """One step of `run_steps`: each process's numbers, and the server's CPU time over it."""

    producer: ProducerNumbers
    consumer: ConsumerNumbers
    server_cpu_s: float


class Throughput(TypedDict, total=False):
    """One step's throughput (`throughput`), a row of the benchmark's report."""

    seconds: float
    tokens_per_s: float
    samples_per_s: float
    producer_commit_s: float
    received: int
    checksum_ok: bool
    producer_cpu_s: float
    consumer_cpu_s: float
    consumer_timeline_s: dict[str, float]
    server_cpu_s: float


class SampleArrays(TypedDict):
    """A sample's arrays as a generate function leaves them (Python lists), and its index."""

    tokens: list[int]
    loss_mask: list[int]
    rollout_log_probs: list[float]
    index: int


def make_samples(samples: int, tokens: int, response_length: int, seed: int) -> list[SampleArrays]:
    """Sample-shaped dicts with Python lists, as a generate function leaves them."""
    rng = np.random.default_rng(seed)
    out: list[SampleArrays] = []
    for index in range(samples):
        out.append(
            {
                "tokens": rng.integers(0, 151_000, tokens, dtype=np.int32).tolist(),
                "loss_mask": rng.integers(0, 2, response_length, dtype=np.uint8).tolist(),
                # float32 values widened to Python floats, as a sampler reports them
                "rollout_log_probs": (-rng.random(response_length, dtype=np.float32) * 5)
                .astype(np.float64)
                .tolist(),
                "index": index,
            }
        )
    return out


def checksum_of(samples: Sequence[SampleArrays | JSONObject | QueueItem]) -> Checksum:
    """Sums over every token id, log-prob (as float32) and mask value."""
    token_sum = 0
    log_prob_sum = 0.0
    mask_sum = 0
    for sample in samples:
        if isinstance(sample, dict):
            tokens, log_probs, mask = sample["tokens"], sample["rollout_log_probs"], sample["loss_mask"]
        else:
            tokens, log_probs, mask = sample.tokens, sample.rollout_log_probs, sample.loss_mask
        token_sum += int(np.asarray(tokens, dtype=np.int64).sum())
        log_prob_sum += float(np.asarray(log_probs, dtype=np.float32).astype(np.float64).sum())
        mask_sum += int(np.asarray(mask, dtype=np.int64).sum())
    return token_sum, round(log_prob_sum, 3), mask_sum


class StepLink:
    """How a benchmark process takes part in steps: it says it is ready for a step on `ready`,
    starts when `go[step]` is set, and hands its numbers in on `results`."""

    def __init__(self, ctx: SpawnContext, steps: int) -> None:
        self.ready: Queue[tuple[str, int]] = ctx.Queue()  # (process, step)
        # (process, step, its numbers)
        self.results: Queue[tuple[str, int, ProducerNumbers | ConsumerNumbers]] = ctx.Queue()
        self.go = [ctx.Event() for _ in range(steps)]

    async def start(self, name: str, step: int) -> None:
        self.ready.put((name, step))
        await asyncio.get_running_loop().run_in_executor(None, self.go[step].wait)


def server_cpu(pid: int | None) -> float | None:
    """CPU seconds of the server so far (None where /proc cannot say)."""
    try:
        return cpu_seconds(pid) if pid else None
    except (OSError, ValueError, IndexError):
        return None


def check_alive(procs: Sequence[BaseProcess], deadline: float) -> None:
    failed = [p for p in procs if p.exitcode not in (None, 0)]
    if failed:
        raise RuntimeError(f"benchmark process {failed[0].name} exited with code {failed[0].exitcode}")
    if time.time() > deadline:
        raise RuntimeError("the benchmark timed out")


def run_steps(
    ctx: SpawnContext,
    producer: tuple[Callable[..., None], tuple[object, ...]],
    consumer: tuple[Callable[..., None], tuple[object, ...]],
    steps: int,
    gap_s: float,
    timeout_s: float,
    server_pid: int | None = None,
) -> list[StepResult]:
    """Run producer and consumer processes through `steps` steps, releasing both together for
    each step after `gap_s` of idle time; returns each step's results."""
    link = StepLink(ctx, steps)
    procs = [
        ctx.Process(target=producer[0], args=(*producer[1], steps, link), name="producer", daemon=True),
        ctx.Process(target=consumer[0], args=(*consumer[1], steps, link), name="consumer", daemon=True),
    ]
    for proc in procs:
        proc.start()
    deadline = time.time() + timeout_s
    out: list[StepResult] = []

    def collect(source: Queue[T], count: int) -> list[T]:
        got: list[T] = []
        while len(got) < count:
            try:
                got.append(source.get(timeout=0.2))
            except queue.Empty:
                check_alive(procs, deadline)
        return got

    try:
        for step in range(steps):
            collect(link.ready, len(procs))
            time.sleep(gap_s)  # idle, as between training steps (the coordinator checkpoints then)
            server_cpu0 = server_cpu(server_pid)
            link.go[step].set()
            result = cast(StepResult, {name: value for name, _, value in collect(link.results, len(procs))})
            server_cpu1 = server_cpu(server_pid)
            if server_cpu0 is not None and server_cpu1 is not None:
                result["server_cpu_s"] = server_cpu1 - server_cpu0
            out.append(result)
        return out
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _timeline(marks: list[tuple[float, int]], t0: float, samples: int) -> dict[str, float]:
    """Seconds from the first commit until the consumer held its first, 25, 50, 75 and 100 % of the
    samples."""
    out = {}
    for label, fraction in (("first", 0.0), ("25%", 0.25), ("50%", 0.5), ("75%", 0.75), ("100%", 1.0)):
        need = max(1, int(fraction * samples))
        for when, count in marks:
            if count >= need:
                out[label] = round(when - t0, 4)
                break
    return out


def throughput(result: StepResult, samples: int, tokens: int) -> Throughput:
    producer, consumer = result["producer"], result["consumer"]
    seconds = consumer["t_end"] - producer["t0"]
    row: Throughput = {
        "seconds": round(seconds, 4),
        "tokens_per_s": round(samples * tokens / seconds, 1),
        "samples_per_s": round(samples / seconds, 1),
        "producer_commit_s": round(producer["commit_done"] - producer["t0"], 4),
        "received": consumer["received"],
        "checksum_ok": consumer["received"] == samples and consumer["checksum"] == producer["checksum"],
        "producer_cpu_s": round(producer["cpu_s"], 3),
        "consumer_cpu_s": round(consumer["cpu_s"], 3),
        "consumer_timeline_s": _timeline(consumer["marks"], producer["t0"], samples),
    }
    if "server_cpu_s" in result:
        row["server_cpu_s"] = round(result["server_cpu_s"], 3)
    return row
