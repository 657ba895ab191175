"""The processes of `mrlx bench load` besides the services: the rollout process (job a of a
two-model run, `rollout_worker`) and the consumer (agent b's trainer reduced to lease -> decode
-> ack, `consumer_worker`). Each is `python -c ... main(["--worker", ...])` of this benchmark."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from mrlx_lab.procstat import memory_mib, open_fds
from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    from mrlx_plugin.core.host import HostSample, RolloutFnTrainOutput

RUN_ID = "load"
PRODUCER, CONSUMER = "a", "b"
TOKEN_ENV = "MRLX_LOAD_BENCH_TOKEN"


class LoadEvent(TypedDict, total=False):
    """One line of the rollout process's events file: `ready` (its memory and open files once
    set up), each `round` (its phase, episodes, times, statuses and what the coordinator took),
    `soak_start` and `soak_end`."""

    event: str
    t: float
    rss_mib: float
    hwm_mib: float
    fds: int
    phase: str
    round: int
    episodes: int
    t_start: float
    t_end: float
    wall_s: float
    episodes_s: float
    drain_wait_s: float
    max_in_flight: int
    statuses: dict[str, int]
    items_sent: int
    groups_sent: int
    duplicates: int
    barrier_wait_s: float
    staleness: float | None
    rss_before_mib: float
    rss_after_mib: float


class ConsumerStats(TypedDict, total=False):
    """What the consumer leased, trained (acked) and reported, written to its result file."""

    items: int
    groups: int
    leases: int
    redelivered_groups: int
    bad_groups: int
    version: int
    wall_s: float
    items_per_step: dict[str, int]  # producer step -> items


# ---------------------------------------------------------------------------------------------
# The rollout process
# ---------------------------------------------------------------------------------------------


class _Flight:
    """Episodes inside the generate function right now, the most at once, and when the last ended."""

    now = 0
    peak = 0
    last_end = 0.0

    @classmethod
    def reset(cls) -> None:
        cls.now, cls.peak, cls.last_end = 0, 0, 0.0


async def counted_generate(
    args: argparse.Namespace,
    sample: HostSample,
    sampling_params: Mapping[str, object] | None = None,
    evaluation: bool = False,
) -> object:
    """`mrlx_plugin.rollout.generate`, counting the episodes in flight (the benchmark's
    `--custom-generate-function-path`; the count costs two integer updates per episode)."""
    from mrlx_plugin.rollout import generate

    _Flight.now += 1
    _Flight.peak = max(_Flight.peak, _Flight.now)
    try:
        return await generate(args, sample, sampling_params, evaluation=evaluation)
    finally:
        _Flight.now -= 1
        _Flight.last_end = time.time()


def job_settings(
    engine_url: str, coordinator_url: str, response_tokens: int, max_connections: int, latency: float
) -> JSONObject:
    """The `mrlx:` settings of job a: a 2-turn dialogue a -> b; b is another job's agent."""
    sampling: JSONObject = {"max_new_tokens": response_tokens}
    return {
        "run_id": RUN_ID,
        "system": "dialogue",
        "self": PRODUCER,
        "agents": {
            PRODUCER: {"url": "self", "sampling": sampling},
            CONSUMER: {"url": engine_url, "trainable": True, "sampling": sampling},
        },
        "dialogue": {"first": PRODUCER, "order": [PRODUCER, CONSUMER], "max_turns": 2},
        # One pool slot per concurrent episode: turns are sequential, so an episode holds at most one.
        "engine": {
            "max_connections": max_connections,
            "request_timeout_s": 60 + 2 * latency,
            "max_retries": 2,
        },
        "coordinator": {
            "url": coordinator_url,
            "token_env": TOKEN_ENV,
            "max_staleness": 1,
            "wait_deadline_s": 900,
            "lease_s": 120,
            "request_timeout_s": 60,
        },
    }


def host_args(
    engine_url: str, tokenizer: str, mrlx: JSONObject, response_tokens: int, n_samples_per_prompt: int
) -> argparse.Namespace:
    """What slime hands the rollout function: its flags (slime's names) plus the `mrlx` key."""
    from mrlx_plugin.local.trainer.fake_host import add_host_arguments, set_router
    from mrlx_plugin.local.trainer.fake_host import host_args as build

    parser = argparse.ArgumentParser()
    add_host_arguments(parser)
    ns = parser.parse_args([])
    ns.hf_checkpoint = tokenizer
    args = build(ns, None)
    set_router(args, engine_url)
    args.mrlx = mrlx
    args.n_samples_per_prompt = n_samples_per_prompt
    args.rollout_max_response_len = 4 * response_tokens
    args.custom_generate_function_path = "mrlx_lab.bench.load.workers.counted_generate"
    return args


def _emit(path: str, event: LoadEvent) -> None:
    """Append one event line; the driver reads them as they come (progress) and at the end (results)."""
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def _count(output: RolloutFnTrainOutput) -> dict[str, int]:
    """Samples the host got back, by status (groups -> episodes -> samples)."""
    counts: dict[str, int] = {}
    for group in output.samples:
        for episode in group:
            for s in episode if isinstance(episode, list) else [episode]:
                status = getattr(s.status, "value", str(s.status))
                counts[status] = counts.get(status, 0) + 1
    return counts


def rollout_worker(ns: argparse.Namespace) -> int:
    """Job a: a warm-up round, the load round, then soak rounds until the soak time is up."""
    from mrlx_plugin.core.host import run_in_host_loop
    from mrlx_plugin.local.trainer.fake_host import LocalDataSource
    from mrlx_plugin.rollout import initiator_rollout
    from mrlx_plugin.runtime import runtime_for

    n = ns.n_samples_per_prompt
    problems = json.loads(Path(ns.problems).read_text())
    source = LocalDataSource([([{"role": "user", "content": p}], "42") for p in problems], n)
    mrlx = job_settings(
        ns.engine_url, ns.coordinator_url, ns.response_tokens, max(ns.episodes, ns.soak_episodes), ns.latency
    )
    args = host_args(ns.engine_url, ns.tokenizer, mrlx, ns.response_tokens, n)
    runtime = runtime_for(args)  # settings, plugins, tokenizers: before any clock starts
    rss, hwm = memory_mib()
    _emit(ns.events, {"event": "ready", "t": time.time(), "rss_mib": rss, "hwm_mib": hwm, "fds": open_fds()})

    def one_round(rollout_id: int, phase: str, episodes: int) -> LoadEvent:
        groups = max(1, episodes // n)
        args.rollout_batch_size = groups
        args.sglang_server_concurrency = groups * n  # slime's semaphore: every episode may run at once
        _Flight.reset()
        rss_before, _ = memory_mib()
        t0 = time.time()
        output = initiator_rollout(args, rollout_id, source)
        t1 = time.time()
        rss_after, hwm_after = memory_mib()
        metrics = {
            k: float(v)
            for k, v in (output.metrics or {}).items()
            if k.startswith(("coordinator/", "staleness/"))
        }
        statuses = _count(output)
        del output
        event: LoadEvent = {
            "event": "round",
            "phase": phase,
            "round": rollout_id,
            "episodes": groups * n,
            "t_start": t0,
            "t_end": t1,
            "wall_s": t1 - t0,
            "episodes_s": max(0.0, _Flight.last_end - t0),  # until the last episode returned
            "drain_wait_s": max(0.0, t1 - _Flight.last_end),  # then: waiting for the coordinator to accept
            "max_in_flight": _Flight.peak,
            "statuses": statuses,
            "items_sent": int(metrics.get("coordinator/samples_sent", 0)),
            "groups_sent": int(metrics.get("coordinator/groups_sent", 0)),
            "duplicates": int(metrics.get("coordinator/duplicates", 0)),
            "barrier_wait_s": metrics.get(f"coordinator/wait_seconds/{CONSUMER}", 0.0),
            "staleness": metrics.get(f"staleness/{CONSUMER}"),
            "rss_before_mib": rss_before,
            "rss_after_mib": rss_after,
            "hwm_mib": hwm_after,
            "fds": open_fds(),
        }
        _emit(ns.events, event)
        return event

    rollout_id = 0
    one_round(rollout_id, "warmup", ns.warmup_episodes)  # connections, grader worker, caches
    rollout_id += 1
    one_round(rollout_id, "load", ns.episodes)
    soak_end = time.time() + ns.soak_s
    _emit(ns.events, {"event": "soak_start", "t": time.time()})
    while time.time() < soak_end:
        rollout_id += 1
        one_round(rollout_id, "soak", ns.soak_episodes)
    _emit(ns.events, {"event": "soak_end", "t": time.time()})
    run_in_host_loop(runtime.aclose())
    return 0


# ---------------------------------------------------------------------------------------------
# The consumer process (agent b's trainer, reduced to lease -> decode -> ack)
# ---------------------------------------------------------------------------------------------


async def _consume(ns: argparse.Namespace) -> ConsumerStats:
    from mrlx_plugin.link.client import CoordinatorClient
    from mrlx_plugin.link.codec import sample_from_item

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    client = CoordinatorClient(
        ns.coordinator_url, run_id=RUN_ID, agent=CONSUMER, token=os.environ.get(TOKEN_ENV)
    )
    stats: ConsumerStats = {
        "items": 0,
        "groups": 0,
        "leases": 0,
        "redelivered_groups": 0,
        "bad_groups": 0,
        "version": 0,
    }
    steps: dict[int, int] = {}
    started = time.monotonic()
    stopped_at: float | None = None
    try:
        while True:
            if stop.is_set() and stopped_at is None:
                stopped_at = time.monotonic()
            # After the stop signal: drain at full speed until a lease comes back empty.
            lease = await client.lease(ns.lease_groups, lease_s=120.0, wait_s=0.5 if stopped_at else 2.0)
            received = time.monotonic()
            if not lease.groups:
                if stopped_at is not None:
                    break
                continue
            for info, group in zip(lease.group_info, lease.groups):
                samples = [sample_from_item(item) for item in group]  # what a responder's trainer gets
                if len(samples) != info["size"] or any(s.tokens is None for s in samples):
                    stats["bad_groups"] += 1
                stats["redelivered_groups"] += bool(info.get("redelivered"))
                steps[int(info["step"])] = steps.get(int(info["step"]), 0) + len(samples)
                stats["items"] += len(samples)
                stats["groups"] += 1
            stats["leases"] += 1
            if stopped_at is None and ns.rate > 0:  # a trainer's pace: each lease takes items / rate seconds
                busy = sum(len(g) for g in lease.groups) / ns.rate - (time.monotonic() - received)
                if busy > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), busy)
                    except asyncio.TimeoutError:
                        pass
            await client.ack(lease.lease_id)
            # Trained on step s: this job's weights are now version s + 1 (what the barrier waits for).
            version = max(int(i["step"]) for i in lease.group_info) + 1
            if version > stats["version"]:
                stats["version"] = await client.report_version(version)
    finally:
        await client.close()
    stats["wall_s"] = time.monotonic() - started
    stats["items_per_step"] = {str(k): v for k, v in sorted(steps.items())}
    return stats


def consumer_worker(ns: argparse.Namespace) -> int:
    result = asyncio.run(_consume(ns))
    Path(ns.result).write_text(json.dumps(result))
    return 0
