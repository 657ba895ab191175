"""The real `sglang-router` in front of embedded engines: its command line, and an engine's
registration with it (and removal on shutdown), which the stub engine of the lab uses too."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

import aiohttp

from mrlx_plugin.core.netutil import free_port
from mrlx_plugin.core.retry import Backoff, Deadline, retry

log = logging.getLogger("mrlx.engine")


def router_command(
    host: str,
    port: int,
    worker_urls: Sequence[str] = (),
    *,
    prometheus_port: int | None = None,
    log_level: str = "warn",
    python: str | None = None,
) -> list[str]:
    """The argv that starts the real `sglang-router` in front of engines of this module.

    Checked against sglang-router 0.3.x:
    - `--worker-urls` may be empty: engines then register themselves (`mrlx engine
      --router-url`; sglang-router 0.3 takes `POST /workers {"url": ...}`, older ones
      `POST /add_worker?url=...`; `register_with_router` tries both).
    - The router always starts a Prometheus exporter (default 0.0.0.0:29000, which clashes
      between routers and listens beyond loopback): it is bound next to the router on `host`
      and a free port.
    - The circuit breaker is disabled (as slime does): a slow CPU engine must not be taken
      out of rotation for being slow. The router's own health checks stay on, at a short
      interval, and workers given with `--worker-urls` are polled every second at startup.
    - On registration the router reads the worker's `/server_info` and `/model_info` and
      loads the tokenizer from the `model_path` found there (a local directory here).
    """
    if prometheus_port is None:
        prometheus_port = free_port(host)
    argv = [
        python or sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--disable-circuit-breaker",
        "--health-check-interval-secs",
        "5",
        "--worker-startup-timeout-secs",
        "120",
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        log_level,
    ]
    if worker_urls:
        argv += ["--worker-urls", *worker_urls]
    return argv


class _Refused(Exception):
    pass


async def register_with_router(
    router_url: str,
    worker_url: str,
    stop: asyncio.Event,
    timeout_s: float = 5.0,
    backoff: Backoff = Backoff(base_s=0.25, max_s=5.0),
) -> bool:
    """Add `worker_url` to the router, retrying with backoff until the router takes it.

    Uses `POST /add_worker?url=...` (sglang-router 0.2/0.3); falls back to `POST /workers`
    with a JSON body (newer routers). Returns False only if `stop` was set first.
    """

    async def attempt(session: aiohttp.ClientSession) -> None:
        async with session.post(f"{router_url}/add_worker", params={"url": worker_url}) as resp:
            status, text = resp.status, await resp.text()
        if status == 404:
            async with session.post(f"{router_url}/workers", json={"url": worker_url}) as resp:
                status, text = resp.status, await resp.text()
        if not 200 <= status < 300:
            raise _Refused(f"HTTP {status}: {text[:200]}")

    def on_retry(n: int, exc: BaseException, wait: float) -> None:
        if isinstance(exc, _Refused):
            log.warning("router %s refused registration (%s); retrying in %.1fs", router_url, exc, wait)
        elif n == 1 or n % 10 == 0:
            log.warning("router %s not reachable yet (%s); retrying", router_url, exc)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        registering = asyncio.ensure_future(
            retry(
                lambda _: attempt(session),
                deadline=Deadline(None),
                backoff=backoff,
                on_retry=on_retry,
                retryable=lambda e: isinstance(e, (_Refused, aiohttp.ClientError, asyncio.TimeoutError)),
            )
        )
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({registering, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not registering.done():
            registering.cancel()
            await asyncio.gather(registering, return_exceptions=True)
            return False
    registering.result()
    log.info("registered %s with router %s", worker_url, router_url)
    return True


async def deregister_from_router(router_url: str, worker_url: str, timeout_s: float = 5.0) -> bool:
    """Remove `worker_url` from the router (best effort, bounded by `timeout_s`)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.post(f"{router_url}/remove_worker", params={"url": worker_url}) as resp:
                await resp.read()
                if 200 <= resp.status < 300:
                    return True
            async with session.get(f"{router_url}/workers") as resp:
                data = await resp.json(content_type=None)
            for w in (data or {}).get("workers", []):
                if w.get("url") == worker_url and w.get("id"):
                    async with session.delete(f"{router_url}/workers/{w['id']}") as resp:
                        await resp.read()
                        return 200 <= resp.status < 300
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        log.warning("could not deregister %s from router %s: %s", worker_url, router_url, exc)
    return False
