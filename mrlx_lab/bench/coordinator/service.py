"""The coordinator's side of `mrlx bench coordinator`: the coordinator process, the producer and
consumer processes that commit and lease a step through it, and the barrier's wake-up latency
(a waiter long-polls `wait_version`, a reporter reports the version)."""

from __future__ import annotations

import asyncio
import os
import queue
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, TypedDict

from mrlx_lab.bench.coordinator.steps import ConsumerNumbers, StepLink, check_alive, checksum_of, make_samples
from mrlx_plugin.core import processes
from mrlx_plugin.core.retry import Deadline, wait_until
from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnContext
    from multiprocessing.queues import Queue

    from mrlx_plugin.link.client import CoordinatorClient
    from mrlx_plugin.link.wire import QueueItem

AGENTS = ("producer", "consumer")
RUN_ID = "bench"


def start_coordinator(
    workdir: str, token: str, synchronous: str, max_depth: int
) -> tuple[subprocess.Popen[bytes], str]:
    port_file = os.path.join(workdir, "coordinator.port")
    env = dict(os.environ, MRLX_BENCH_TOKEN=token)
    command = [
        sys.executable,
        "-m",
        "mrlx_plugin.coordinator.server",
        "--db",
        os.path.join(workdir, "coordinator.sqlite"),
    ]
    command += ["--run-id", RUN_ID, "--agents", ",".join(AGENTS), "--port", "0", "--port-file", port_file]
    command += [
        "--token-env",
        "MRLX_BENCH_TOKEN",
        "--synchronous",
        synchronous,
        "--max-depth",
        str(max_depth),
    ]
    proc = processes.start(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def started() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the coordinator exited: {proc.stderr.read().decode() if proc.stderr else ''}"
            )
        return os.path.exists(port_file)

    try:
        wait_until(started, Deadline(60), what="the coordinator's port file")
    except BaseException:
        processes.stop(proc)
        raise
    with open(port_file) as handle:
        port = int(handle.read())
    return proc, f"http://127.0.0.1:{port}"


def producer_main(
    url: str, token: str, samples: int, tokens: int, group_size: int, steps: int, link: StepLink
) -> None:
    from mrlx_plugin.link.client import CoordinatorClient
    from mrlx_plugin.link.wire import QueueItem

    response_length = max(1, tokens // 2)
    tail = samples // group_size * group_size  # a last group of fewer samples is sealed short

    async def run() -> None:
        client = CoordinatorClient(url, run_id=RUN_ID, agent="producer", token=token)
        await client.heartbeat()
        for step in range(steps):
            data = make_samples(samples, tokens, response_length, seed=step + 1)
            checksum = checksum_of(data)
            items = [
                QueueItem(
                    key=f"s{step}:ep{i}:consumer",
                    group=f"s{step}:g{i // group_size}",
                    group_size=group_size,
                    producer="producer",
                    step=step,
                    tokens=d["tokens"],
                    response_length=response_length,
                    loss_mask=d["loss_mask"],
                    rollout_log_probs=d["rollout_log_probs"],
                    fields={
                        "reward": 1.0,
                        "status": "completed",
                        "index": i,
                        "group_index": i // group_size,
                        "weight_versions": [str(step)],
                    },
                )
                for i, d in enumerate(data)
            ]
            await link.start("producer", step)
            t0 = time.time()
            cpu0 = time.process_time()
            result = await client.commit("consumer", items)
            if tail < samples:
                await client.seal("consumer", f"s{step}:g{tail // group_size}", samples - tail)
            done = time.time()
            cpu = time.process_time() - cpu0
            link.results.put(
                (
                    "producer",
                    step,
                    {
                        "t0": t0,
                        "commit_done": done,
                        "accepted": result.accepted,
                        "checksum": checksum,
                        "cpu_s": cpu,
                    },
                )
            )
            del items, data
        await client.close()

    asyncio.run(run())


def consumer_main(
    url: str, token: str, samples: int, lease_groups: int, workers: int, steps: int, link: StepLink
) -> None:
    from mrlx_plugin.link.client import CoordinatorClient

    async def run() -> None:
        client = CoordinatorClient(url, run_id=RUN_ID, agent="consumer", token=token)
        await client.heartbeat()
        for step in range(steps):
            await link.start("consumer", step)
            received: list[QueueItem] = []
            acks: list[asyncio.Task[JSONObject]] = []
            marks: list[tuple[float, int]] = []
            cpu0 = time.process_time()
            await asyncio.gather(
                *(
                    _lease_step(client, step, samples, lease_groups, received, acks, marks)
                    for _ in range(workers)
                )
            )
            cpu = time.process_time() - cpu0
            await asyncio.gather(*acks)
            numbers: ConsumerNumbers = {
                "t_end": marks[-1][0] if marks else 0.0,
                "received": len(received),
                "checksum": checksum_of(received),
                "cpu_s": cpu,
                "marks": marks,
            }
            link.results.put(("consumer", step, numbers))
            del received  # the trainer is done with the step's samples
        await client.close()

    asyncio.run(run())


async def _lease_step(
    client: CoordinatorClient,
    step: int,
    samples: int,
    lease_groups: int,
    received: list[QueueItem],
    acks: list[asyncio.Task[JSONObject]],
    marks: list[tuple[float, int]],
) -> None:
    """One lease loop of the consumer: lease, decode (inside `lease`), ack in the background."""
    while len(received) < samples:
        lease = await client.lease(lease_groups, lease_s=600, wait_s=5, step=step)
        if lease.end:
            return
        for group in lease.groups:
            received.extend(group)
        if lease.groups:
            marks.append((time.time(), len(received)))
            acks.append(asyncio.create_task(client.ack(lease.lease_id)))


def _waiter_main(
    url: str, token: str, trials: int, pipe: Connection, results: Queue[tuple[str, list[float]]]
) -> None:
    from mrlx_plugin.link.client import CoordinatorClient

    async def run() -> list[float]:
        client = CoordinatorClient(url, run_id=RUN_ID, agent="consumer", token=token)
        received = []
        for version in range(1, trials + 1):
            pipe.send(version)  # "about to wait for this version"
            await client.wait_version("producer", version, deadline_s=30)
            received.append(time.time())
        await client.close()
        return received

    results.put(("waiter", asyncio.run(run())))


def _reporter_main(
    url: str, token: str, trials: int, pipe: Connection, results: Queue[tuple[str, list[float]]]
) -> None:
    from mrlx_plugin.link.client import CoordinatorClient

    async def run() -> list[float]:
        client = CoordinatorClient(url, run_id=RUN_ID, agent="producer", token=token)
        await client.heartbeat()
        sent = []
        loop = asyncio.get_running_loop()
        for _ in range(trials):
            version = await loop.run_in_executor(None, pipe.recv)
            await asyncio.sleep(0.02)  # let the waiter's long poll reach the coordinator
            sent.append(time.time())
            await client.report_version(version)
        await client.close()
        return sent

    results.put(("reporter", asyncio.run(run())))


class WakeUp(TypedDict):
    """The barrier's wake-up latency (ms): from a version's report to its waiter's return."""

    trials: int
    p50: float
    p99: float
    max: float


def wake_up_latency(ctx: SpawnContext, url: str, token: str, trials: int, timeout_s: float) -> WakeUp:
    results = ctx.Queue()
    waiter_end, reporter_end = ctx.Pipe()
    procs = [
        ctx.Process(
            target=_waiter_main, args=(url, token, trials, waiter_end, results), name="waiter", daemon=True
        ),
        ctx.Process(
            target=_reporter_main,
            args=(url, token, trials, reporter_end, results),
            name="reporter",
            daemon=True,
        ),
    ]
    for proc in procs:
        proc.start()
    deadline = time.time() + timeout_s
    got: dict[str, list[float]] = {}
    try:
        while len(got) < len(procs):
            try:
                name, value = results.get(timeout=0.2)
                got[name] = value
            except queue.Empty:
                check_alive(procs, deadline)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    latencies = sorted((received - sent) * 1000 for received, sent in zip(got["waiter"], got["reporter"]))
    return {
        "trials": len(latencies),
        "p50": round(statistics.median(latencies), 3),
        "p99": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
        "max": round(latencies[-1], 3),
    }
