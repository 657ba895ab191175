"""The baseline of `mrlx bench coordinator`: a plain in-memory HTTP queue (a minimal aiohttp app in a
process of its own) taking one JSON item per request from concurrent producer tasks and handing one
JSON item per request to concurrent consumer tasks, run through the same steps, clock and checksum
as the coordinator."""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

from mrlx_lab.bench.coordinator.steps import (
    ConsumerNumbers,
    ProducerNumbers,
    SampleArrays,
    StepLink,
    StepResult,
    checksum_of,
    make_samples,
    run_steps,
)
from mrlx_plugin.core.retry import Deadline, wait_until
from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    from multiprocessing.context import SpawnContext

    import aiohttp


def run_baseline(
    ctx: SpawnContext,
    workdir: str,
    samples: int,
    tokens: int,
    producers: int,
    steps: int,
    step_gap_s: float,
    timeout_s: float,
) -> list[StepResult]:
    """The baseline queue's server, then its producer and consumer through `steps` steps; each
    step's results."""
    port_file = os.path.join(workdir, "baseline.port")
    server = ctx.Process(target=_baseline_server_main, args=(port_file,), name="baseline-queue", daemon=True)
    server.start()
    try:

        def listening() -> bool:
            if not server.is_alive():
                raise RuntimeError("the baseline queue exited at start")
            return os.path.exists(port_file)

        wait_until(listening, Deadline(60), what="the baseline queue's port file")
        with open(port_file) as handle:
            base_url = f"http://127.0.0.1:{int(handle.read())}"
        return run_steps(
            ctx,
            (_baseline_producer_main, (base_url, samples, tokens, producers)),
            (_baseline_consumer_main, (base_url, samples, producers)),
            steps,
            step_gap_s,
            timeout_s,
            server_pid=server.pid,
        )
    finally:
        server.kill()
        server.join(timeout=10)


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
        port = cast("asyncio.Server", site._server).sockets[0].getsockname()[1]  # a TCPSite's server
        await asyncio.to_thread(_write_text_atomically, port_file, str(port))
        await asyncio.Event().wait()

    asyncio.run(run())


def _baseline_producer_main(
    url: str, samples: int, tokens: int, producers: int, steps: int, link: StepLink
) -> None:
    import aiohttp

    response_length = max(1, tokens // 2)

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            for step in range(steps):
                data = make_samples(samples, tokens, response_length, seed=step + 1)
                checksum = checksum_of(data)
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
                result: ProducerNumbers = {
                    "t0": t0,
                    "commit_done": time.time(),
                    "checksum": checksum,
                    "cpu_s": time.process_time() - cpu0,
                }
                link.results.put(("producer", step, result))
                del data

    asyncio.run(run())


async def _baseline_push_loop(
    session: aiohttp.ClientSession,
    url: str,
    step: int,
    response_length: int,
    todo: Iterator[tuple[int, SampleArrays]],
) -> None:
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
    session: aiohttp.ClientSession,
    url: str,
    samples: int,
    received: list[JSONObject],
    marks: list[tuple[float, int]],
) -> None:
    """One of the baseline's concurrent consumers: GET one JSON item per request."""
    while len(received) < samples:
        async with session.get(f"{url}/pop") as resp:
            if resp.status == 204:
                await asyncio.sleep(0.005)
                continue
            received.append(await resp.json())  # stdlib json, as a plain client does
            marks.append((time.time(), len(received)))


def _baseline_consumer_main(url: str, samples: int, workers: int, steps: int, link: StepLink) -> None:
    import aiohttp

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            for step in range(steps):
                await link.start("consumer", step)
                received: list[JSONObject] = []
                marks: list[tuple[float, int]] = []
                cpu0 = time.process_time()
                await asyncio.gather(
                    *(_baseline_pop_loop(session, url, samples, received, marks) for _ in range(workers))
                )
                cpu = time.process_time() - cpu0
                numbers: ConsumerNumbers = {
                    "t_end": marks[-1][0],
                    "received": len(received),
                    "checksum": checksum_of(received),
                    "cpu_s": cpu,
                    "marks": marks,
                }
                link.results.put(("consumer", step, numbers))
                del received

    asyncio.run(run())
