"""Benchmark of the coordinator: training steps end to end, wake-up latency, and a baseline.

Three measurements, side by side in one run (every party in its own process):

1. Throughput: a producer process commits a step of `samples` samples x `tokens` tokens (token ids,
   loss mask and log-probs as Python lists, response = half the tokens) to the coordinator
   (SQLite, synchronous=FULL by default) while a consumer process leases, decodes to Python lists
   and acks. The clock starts when the producer calls `commit` (its samples are Python lists, so
   encoding is inside) and stops when the consumer has decoded the last sample of the step. A
   checksum over every token id, mask value and log-prob proves nothing changed on the way.
   `steps` steps run one after another with `step_gap_s` of idle time between them, as between
   training steps; the first step pays for cold caches and fresh memory in every process, the
   last one shows the steady state. Both are reported.
2. Wake-up latency: a waiter process long-polls `wait_version`; a reporter process reports the
   awaited version ~20 ms later; latency = waiter's receive time - reporter's send time.
3. Baseline: a plain in-memory HTTP queue (a minimal aiohttp app in its own process, part of this
   benchmark only) taking one JSON item per request from 16 concurrent producer tasks and handing
   one JSON item per request to 16 concurrent consumer tasks (stdlib json, as a plain client
   would use). The baseline server keeps request bodies as bytes and returns them unchanged, the
   most favourable plain queue. Same steps, clock and checksum.

`python -m mrlx_plugin.bench.coordinator` (or the `mrlx` CLI) prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from mrlx_plugin.core import processes
from mrlx_plugin.core.retry import Deadline, wait_until
from mrlx_plugin.local.procstat import cpu_seconds

AGENTS = ("producer", "consumer")
RUN_ID = "bench"


# --------------------------------------------------------------------------- data


def _make_samples(samples: int, tokens: int, response_length: int, seed: int) -> list[dict[str, Any]]:
    """Sample-shaped dicts with Python lists, as a generate function leaves them."""
    rng = np.random.default_rng(seed)
    out = []
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


def _checksum(samples: list[Any]) -> tuple[int, float, int]:
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


# --------------------------------------------------------------------------- processes


class _StepLink:
    """How a benchmark process takes part in steps: it says it is ready for a step on `ready`,
    starts when `go[step]` is set, and hands its numbers in on `results`."""

    def __init__(self, ctx: Any, steps: int) -> None:
        self.ready = ctx.Queue()
        self.results = ctx.Queue()
        self.go = [ctx.Event() for _ in range(steps)]

    async def start(self, name: str, step: int) -> None:
        self.ready.put((name, step))
        await asyncio.get_running_loop().run_in_executor(None, self.go[step].wait)


def _start_coordinator(
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


def _server_cpu(pid: int | None) -> float | None:
    """CPU seconds of the server so far (None where /proc cannot say)."""
    try:
        return cpu_seconds(pid) if pid else None
    except (OSError, ValueError, IndexError):
        return None


def _producer_main(
    url: str, token: str, samples: int, tokens: int, group_size: int, steps: int, link: _StepLink
) -> None:
    from mrlx_plugin.link.client import CoordinatorClient
    from mrlx_plugin.link.wire import QueueItem

    response_length = max(1, tokens // 2)
    tail = samples // group_size * group_size  # a last group of fewer samples is sealed short

    async def run() -> None:
        client = CoordinatorClient(url, run_id=RUN_ID, agent="producer", token=token)
        await client.heartbeat()
        for step in range(steps):
            data = _make_samples(samples, tokens, response_length, seed=step + 1)
            checksum = _checksum(data)
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


def _consumer_main(
    url: str, token: str, samples: int, lease_groups: int, workers: int, steps: int, link: _StepLink
) -> None:
    from mrlx_plugin.link.client import CoordinatorClient

    async def run() -> None:
        client = CoordinatorClient(url, run_id=RUN_ID, agent="consumer", token=token)
        await client.heartbeat()
        for step in range(steps):
            await link.start("consumer", step)
            received: list[Any] = []
            acks: list[asyncio.Task[Any]] = []
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
            result = {
                "t_end": marks[-1][0] if marks else 0.0,
                "received": len(received),
                "checksum": _checksum(received),
                "cpu_s": cpu,
                "marks": marks,
            }
            link.results.put(("consumer", step, result))
            del received  # the trainer is done with the step's samples
        await client.close()

    asyncio.run(run())


async def _lease_step(
    client: Any,
    step: int,
    samples: int,
    lease_groups: int,
    received: list[Any],
    acks: list[asyncio.Task[Any]],
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


def _waiter_main(url: str, token: str, trials: int, pipe: Any, results: Any) -> None:
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


def _reporter_main(url: str, token: str, trials: int, pipe: Any, results: Any) -> None:
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


# --------------------------------------------------------------------------- baseline queue


def _write_text_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as handle:
        handle.write(text)
    os.replace(path + ".tmp", path)


def _baseline_server_main(port_file: str) -> None:
    from aiohttp import web

    items: deque[bytes] = deque()

    async def push(request: web.Request) -> web.Response:
        items.append(await request.read())
        return web.json_response({"ok": True})

    async def pop(request: web.Request) -> web.Response:
        if not items:
            return web.Response(status=204)
        return web.Response(body=items.popleft(), content_type="application/json")

    async def run() -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/push", push)
        app.router.add_get("/pop", pop)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        await asyncio.to_thread(_write_text_atomically, port_file, str(port))
        await asyncio.Event().wait()

    asyncio.run(run())


def _baseline_producer_main(
    url: str, samples: int, tokens: int, producers: int, steps: int, link: _StepLink
) -> None:
    import aiohttp

    response_length = max(1, tokens // 2)

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            for step in range(steps):
                data = _make_samples(samples, tokens, response_length, seed=step + 1)
                checksum = _checksum(data)
                await link.start("producer", step)
                t0 = time.time()
                cpu0 = time.process_time()
                todo = iter(enumerate(data))
                await asyncio.gather(
                    *(
                        _baseline_push_loop(session, url, step, response_length, todo)
                        for _ in range(producers)
                    )
                )
                result = {
                    "t0": t0,
                    "commit_done": time.time(),
                    "checksum": checksum,
                    "cpu_s": time.process_time() - cpu0,
                }
                link.results.put(("producer", step, result))
                del data

    asyncio.run(run())


async def _baseline_push_loop(session: Any, url: str, step: int, response_length: int, todo: Any) -> None:
    """One of the baseline's concurrent producers: POST one JSON item per request."""
    for i, d in todo:
        item = {
            "key": f"s{step}:ep{i}:consumer",
            "group": f"s{step}:g{i // 8}",
            "tokens": d["tokens"],
            "response_length": response_length,
            "loss_mask": d["loss_mask"],
            "rollout_log_probs": d["rollout_log_probs"],
            "reward": 1.0,
            "status": "completed",
        }
        async with session.post(f"{url}/push", json=item) as resp:  # stdlib json, as a plain client does
            resp.raise_for_status()


async def _baseline_pop_loop(
    session: Any, url: str, samples: int, received: list[Any], marks: list[tuple[float, int]]
) -> None:
    """One of the baseline's concurrent consumers: GET one JSON item per request."""
    while len(received) < samples:
        async with session.get(f"{url}/pop") as resp:
            if resp.status == 204:
                await asyncio.sleep(0.005)
                continue
            received.append(await resp.json())  # stdlib json, as a plain client does
            marks.append((time.time(), len(received)))


def _baseline_consumer_main(url: str, samples: int, workers: int, steps: int, link: _StepLink) -> None:
    import aiohttp

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            for step in range(steps):
                await link.start("consumer", step)
                received: list[dict[str, Any]] = []
                marks: list[tuple[float, int]] = []
                cpu0 = time.process_time()
                await asyncio.gather(
                    *(_baseline_pop_loop(session, url, samples, received, marks) for _ in range(workers))
                )
                cpu = time.process_time() - cpu0
                result = {
                    "t_end": marks[-1][0],
                    "received": len(received),
                    "checksum": _checksum(received),
                    "cpu_s": cpu,
                    "marks": marks,
                }
                link.results.put(("consumer", step, result))
                del received

    asyncio.run(run())


# --------------------------------------------------------------------------- orchestration


def _check_alive(procs: list[Any], deadline: float) -> None:
    failed = [p for p in procs if p.exitcode not in (None, 0)]
    if failed:
        raise RuntimeError(f"benchmark process {failed[0].name} exited with code {failed[0].exitcode}")
    if time.time() > deadline:
        raise RuntimeError("the benchmark timed out")


def _run_steps(
    ctx: Any,
    producer: tuple[Callable[..., None], tuple[Any, ...]],
    consumer: tuple[Callable[..., None], tuple[Any, ...]],
    steps: int,
    gap_s: float,
    timeout_s: float,
    server_pid: int | None = None,
) -> list[dict[str, Any]]:
    """Run producer and consumer processes through `steps` steps, releasing both together for
    each step after `gap_s` of idle time; returns each step's results."""
    link = _StepLink(ctx, steps)
    procs = [
        ctx.Process(target=producer[0], args=(*producer[1], steps, link), name="producer", daemon=True),
        ctx.Process(target=consumer[0], args=(*consumer[1], steps, link), name="consumer", daemon=True),
    ]
    for proc in procs:
        proc.start()
    deadline = time.time() + timeout_s
    out: list[dict[str, Any]] = []

    def collect(source: Any, count: int) -> list[Any]:
        got = []
        while len(got) < count:
            try:
                got.append(source.get(timeout=0.2))
            except queue.Empty:
                _check_alive(procs, deadline)
        return got

    try:
        for step in range(steps):
            collect(link.ready, len(procs))
            time.sleep(gap_s)  # idle, as between training steps (the coordinator checkpoints then)
            server_cpu0 = _server_cpu(server_pid)
            link.go[step].set()
            result = {name: value for name, _, value in collect(link.results, len(procs))}
            server_cpu1 = _server_cpu(server_pid)
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


def _throughput(result: dict[str, Any], samples: int, tokens: int) -> dict[str, Any]:
    producer, consumer = result["producer"], result["consumer"]
    seconds = consumer["t_end"] - producer["t0"]
    row = {
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


def _wake_up_latency(ctx: Any, url: str, token: str, trials: int, timeout_s: float) -> dict[str, Any]:
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
                _check_alive(procs, deadline)
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


def run_coordinator_bench(
    out_json: str | None,
    samples: int = 2048,
    tokens: int = 8192,
    *,
    steps: int = 2,
    step_gap_s: float = 2.0,
    group_size: int = 8,
    lease_groups: int = 16,
    consumer_workers: int = 2,
    wake_trials: int = 200,
    baseline: bool = True,
    baseline_producers: int = 16,
    synchronous: str = "full",
    workdir: str | None = None,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Run the three measurements; return (and write to `out_json`) their numbers.

    `report["coordinator"]` and `report["baseline"]` are the last step (steady state);
    `..._steps` hold every step, the first being the cold one.
    """
    if steps < 1 or samples < 1 or tokens < 2:
        raise ValueError("need steps >= 1, samples >= 1 and tokens >= 2")
    ctx = mp.get_context("spawn")
    token = secrets.token_hex(16)
    report: dict[str, Any] = {
        "config": {
            "samples": samples,
            "tokens": tokens,
            "response_length": max(1, tokens // 2),
            "steps": steps,
            "step_gap_s": step_gap_s,
            "group_size": group_size,
            "lease_groups": lease_groups,
            "consumer_workers": consumer_workers,
            "synchronous": synchronous,
            "wake_trials": wake_trials,
            "baseline_producers": baseline_producers,
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
        }
    }
    if workdir:
        os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mrlx-coord-bench-", dir=workdir) as tmp:
        proc, url = _start_coordinator(tmp, token, synchronous, max_depth=max(65536, 2 * samples))
        try:
            results = _run_steps(
                ctx,
                (_producer_main, (url, token, samples, tokens, group_size)),
                (_consumer_main, (url, token, samples, lease_groups, consumer_workers)),
                steps,
                step_gap_s,
                timeout_s,
                server_pid=proc.pid,
            )
            report["coordinator_steps"] = [_throughput(result, samples, tokens) for result in results]
            report["coordinator"] = report["coordinator_steps"][-1]
            if wake_trials > 0:
                report["wake_up_ms"] = _wake_up_latency(ctx, url, token, wake_trials, timeout_s)
        finally:
            processes.stop(proc, timeout=20)
        if baseline:
            port_file = os.path.join(tmp, "baseline.port")
            server = ctx.Process(
                target=_baseline_server_main, args=(port_file,), name="baseline-queue", daemon=True
            )
            server.start()
            try:

                def listening() -> bool:
                    if not server.is_alive():
                        raise RuntimeError("the baseline queue exited at start")
                    return os.path.exists(port_file)

                wait_until(listening, Deadline(60), what="the baseline queue's port file")
                with open(port_file) as handle:
                    base_url = f"http://127.0.0.1:{int(handle.read())}"
                results = _run_steps(
                    ctx,
                    (_baseline_producer_main, (base_url, samples, tokens, baseline_producers)),
                    (_baseline_consumer_main, (base_url, samples, baseline_producers)),
                    steps,
                    step_gap_s,
                    timeout_s,
                    server_pid=server.pid,
                )
            finally:
                server.kill()
                server.join(timeout=10)
            report["baseline_steps"] = [_throughput(result, samples, tokens) for result in results]
            report["baseline"] = report["baseline_steps"][-1]
            report["speedup_vs_baseline"] = round(
                report["coordinator"]["tokens_per_s"] / report["baseline"]["tokens_per_s"], 2
            )
            report["speedup_vs_baseline_first_step"] = round(
                report["coordinator_steps"][0]["tokens_per_s"] / report["baseline_steps"][0]["tokens_per_s"],
                2,
            )
    print(format_table(report))
    if out_json:
        from mrlx_plugin.bench.report import write_report

        write_report(out_json, report)
    return report


def format_table(report: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    cfg = report["config"]
    lines = [
        (
            f"coordinator benchmark: {cfg['samples']} samples x {cfg['tokens']} tokens "
            f"(response {cfg['response_length']}), groups of {cfg['group_size']}, {cfg['steps']} steps, "
            f"synchronous={cfg['synchronous']}, {cfg['cpus']} CPUs"
        ),
        f"{'path':<48} {'step':>5} {'seconds':>8} {'Mtok/s':>7} {'samples/s':>9} {'first':>6} "
        f"{'cpu p/s/c':>16} {'ok':>3}",
    ]
    for name, label in (
        ("coordinator_steps", "coordinator (Arrow frames, SQLite, lease/ack)"),
        ("baseline_steps", "baseline (1 JSON item/request, in memory)"),
    ):
        for step, row in enumerate(report.get(name, [])):
            cpu = (
                f"{row['producer_cpu_s']:.2f}/{row.get('server_cpu_s', float('nan')):.2f}/"
                f"{row['consumer_cpu_s']:.2f}"
            )
            lines.append(
                f"{label:<48} {step:>5} {row['seconds']:>8.3f} {row['tokens_per_s'] / 1e6:>7.2f} "
                f"{row['samples_per_s']:>9.1f} "
                f"{row['consumer_timeline_s'].get('first', float('nan')):>6.3f} {cpu:>16} "
                f"{'yes' if row['checksum_ok'] else 'NO':>3}"
            )
    if "speedup_vs_baseline" in report:
        lines.append(
            f"speed-up vs baseline: {report['speedup_vs_baseline']:.2f}x (last step), "
            f"{report['speedup_vs_baseline_first_step']:.2f}x (first step)"
        )
    if "wake_up_ms" in report:
        wake = report["wake_up_ms"]
        lines.append(
            f"wait_version wake-up after report ({wake['trials']} trials): p50 {wake['p50']:.2f} ms, "
            f"p99 {wake['p99']:.2f} ms, max {wake['max']:.2f} ms"
        )
    lines.append(
        "first = seconds until the consumer held its first samples; cpu = producer/server/consumer CPU "
        "seconds"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m mrlx_plugin.bench.coordinator [--samples N --tokens N ...]`."""
    parser = argparse.ArgumentParser(
        prog="mrlx bench coordinator", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--samples", type=int, default=2048, help="samples per step")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per sample (half of them response)")
    parser.add_argument("--steps", type=int, default=2, help="steps to run; the last one is the headline")
    parser.add_argument("--step-gap-s", type=float, default=2.0, help="idle seconds between steps")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lease-groups", type=int, default=16, help="groups per lease call")
    parser.add_argument(
        "--consumer-workers", type=int, default=2, help="concurrent lease loops in the consumer"
    )
    parser.add_argument("--wake-trials", type=int, default=200)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--baseline-producers", type=int, default=16)
    parser.add_argument("--synchronous", choices=("full", "normal"), default="full")
    parser.add_argument(
        "--workdir", default=None, help="where the database goes (a local disk; default: the temp dir)"
    )
    parser.add_argument("--out", default="runs/bench/coordinator.json", help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    run_coordinator_bench(
        args.out,
        args.samples,
        args.tokens,
        steps=args.steps,
        step_gap_s=args.step_gap_s,
        group_size=args.group_size,
        lease_groups=args.lease_groups,
        consumer_workers=args.consumer_workers,
        wake_trials=args.wake_trials,
        baseline=not args.no_baseline,
        baseline_producers=args.baseline_producers,
        synchronous=args.synchronous,
        workdir=args.workdir,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
